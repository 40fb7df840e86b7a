"""What enters the node's cache: one rule, asked by every reader of the node.

The engine decides each put by the policy the cache was created with (csrc/cache/policies/), and
answers the same question ahead of a put (`Cache.admits`, csrc/cache/admission.cc): the
prefetcher asks it before it reads a sample that the cache would have to admit when it is due.
Around the engine this module decides, once for every caller (the data set and the loader in any
process, the prefetcher, the peer server), which values of a batch read below the cache are
offered to it at all:

  - only the ids this node keeps (the chain's `keep`: what it is home to, unless keep_remote);
  - a value a copying tier (the SSD tier) served only into the cache's free pages: the tiers are
    exclusive, and a copy moved up into a full cache would push out a sample no tier keeps;
  - extent mates a loader took from its process's stage were offered when they were staged.

A rule of your own goes on top of the engine's by overriding `allows(ids)`, and every path
follows it, because every path offers through `offer` and predicts through `would_admit`:

    class EvenIdsOnly(sc.Admission):
        def allows(self, ids):
            return ids % 2 == 0
    node = sc.Node(store, cache, admission=EvenIdsOnly())

An Admission is pickled into the node's processes (workers, prefetcher, peer server): its class
must be importable there.
"""
from __future__ import annotations

import numpy as np

from .errors import ValueTooLargeError


class Admission:
    """The node's admission rule (see the module docstring). Stateless: every call is given the
    cache it decides for."""

    def allows(self, ids: np.ndarray) -> np.ndarray:
        """Bool mask over `ids` (int64): the ids this rule lets the engine decide on at all. The
        default lets every id through: the engine's policy alone decides."""
        return np.ones(ids.size, dtype=bool)

    def offer(self, cache, ids, values, make_room=None, rounds: int = 4) -> np.ndarray:
        """Offers values to `cache` (put_many: one lock; the engine admits each by its policy)
        and returns the admitted mask. A value larger than the cache takes is refused like any
        other. make_room(ids) -> bool (optional): called with the ids a full cache refused; when it
        freed room, those are offered again, up to `rounds` times (the prefetcher frees samples
        needed later than these; a freed slot may be of another size class)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        admitted = np.zeros(ids.size, dtype=bool)
        ok = np.flatnonzero(self.allows(ids))
        if ok.size:
            admitted[ok] = _put(cache, ids[ok], [values[k] for k in ok.tolist()])
        for _ in range(rounds if make_room is not None else 0):
            rest = ok[~admitted[ok]]
            if not rest.size or not make_room(ids[rest]):
                break
            again = _put(cache, ids[rest], [values[k] for k in rest.tolist()])
            admitted[rest] = again
            if not again.any():
                break   # room of another size class does not help these
        return admitted

    def would_admit(self, cache, ids, displaced=0) -> np.ndarray:
        """Bool mask: whether a full `cache` would admit each id once `displaced` (an int, or one
        per id) of its values have given way: this rule, then the engine's policy."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.asarray(self.allows(ids), dtype=bool).copy()
        if out.any():
            k = np.broadcast_to(np.asarray(displaced, dtype=np.int64), ids.shape)
            out[out] = cache.admits(ids[out], k[out])
        return out

    def make_room(self, cache, next_use, count: int, latest_use: int) -> int:
        """Removes up to `count` cached samples whose next use (next_use(ids) -> global
        positions, -1 for none known: the order board's) is later than `latest_use` or unknown:
        the unknown ones first, lowest score first, then the known ones, farthest first; so a
        read ahead never displaces a sample needed sooner than itself (the prefetcher's room,
        without a copying tier). Returns how many were removed."""
        cached = np.flatnonzero(cache.cached_mask())
        if cached.size == 0 or count <= 0:
            return 0
        nu = np.asarray(next_use(cached), dtype=np.int64)
        later = (nu < 0) | (nu > latest_use)
        cand, nu = cached[later], nu[later]
        if cand.size == 0:
            return 0
        unknown = nu < 0
        scores = np.asarray(cache.scores(), dtype=np.float64)[cand]
        order = np.lexsort((np.where(unknown, scores, 0.0), -nu.astype(np.float64), ~unknown))
        return sum(bool(cache.remove(i)) for i in cand[order[:count]].tolist())

    def offered(self, cache, read, copying: list, staged_again: bool = False) -> np.ndarray:
        """Bool mask: the positions of a chain's Read (tiers.Read) to offer to `cache`: the ids
        this node keeps that some tier had; not those the reader took from its stage of extent
        mates (offered when staged) unless `staged_again`; and of the values a copying tier (index
        in `copying`) served, only what fits in the cache's free pages, in order."""
        offer = read.keep & (read.source >= 0)
        if read.staged is not None and not staged_again:
            offer &= ~read.staged
        if not read.ids.size:
            return offer
        served = offer & np.isin(read.source, copying)
        if served.any():
            offer &= ~served
            room = free_room(cache)
            if room > 0:
                pos = np.flatnonzero(served)
                sizes = np.fromiter((len(read.values[k]) for k in pos.tolist()), np.int64, pos.size)
                offer[pos[np.cumsum(sizes) <= room]] = True
        return offer

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReadThrough(Admission):
    """Nothing enters the cache: the node reads through it (the SSD tier still keeps what was
    read below it)."""

    def allows(self, ids: np.ndarray) -> np.ndarray:
        return np.zeros(ids.size, dtype=bool)


def free_room(cache) -> int:
    """Bytes `cache` takes without evicting anything: its pages not yet given to any size class.
    Not its bytes_used against its capacity: values take whole slots of their class, and the
    engine evicts from the first insert it cannot place, however many bytes look free."""
    st = cache.stats()
    return int(st["free_pages"]) * int(st["page_size"])


def _put(cache, ids: np.ndarray, values: list) -> np.ndarray:
    """put_many; a value too large for the cache (its max_item_bytes) is refused, not the
    reader's error: then the values are offered one by one."""
    try:
        return np.asarray(cache.put_many(ids, values), dtype=bool)
    except ValueTooLargeError:
        out = np.zeros(ids.size, dtype=bool)
        for k in range(ids.size):
            try:
                out[k] = bool(np.asarray(cache.put_many(ids[k:k + 1], [values[k]]))[0])
            except ValueTooLargeError:
                pass
        return out
