"""The miss path: what every reader of a node calls for the samples the node cache missed.

The data set (in the training process and in every DataLoader worker), CachedLoader's assembly
threads, the peer server and the prefetcher all read below the cache through one MissPath, built
by the node from its one tier chain (tiers.py). It owns what those readers used to wrap around
the chain each in its own way:

  - the hand-over with the prefetcher (the order board's flags): a miss the prefetcher is reading
    or holds is waited for (ON_WAY_WAIT_S at most, while it lives) instead of read twice, and a
    sample it brought counts as a prefetch hit when a reader takes it;
  - the per-process lock: a chain whose callers must take turns (needs_turns: the home peer's
    connections take one request at a time, the extent plan's stage of mates is one per process)
    is read by one thread at a time, and a caller that waited looks in the cache again first, so
    that it does not read again what another's extent read admitted;
  - the counters (hits, misses, the wait on the tiers, and per tier its calls, hits, bytes and
    time), shared by every process that reads the node's data set (node/counters.py), and the
    board's per-epoch rows.

Lock order: the miss path's lock, then the cache's (inside put_many / get_many), then the SSD tier's
own; nothing is held across a wait for the prefetcher.
"""
from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

from .counters import SharedCounters
from ..tiers import STORE

ON_WAY_WAIT_S = 2.0   # the longest a miss waits for the same sample on its way from the prefetcher
TIERS = ("peer", "ssd", STORE)   # the tiers below the cache, in a node's order
_SHARED_TIERS = ("peer", STORE)  # ... those that keep no copy on this node
FIELDS = (("hits", "misses", "samples", "prefetch_hits", "wait_ns")
          + tuple(f"{t}_{c}" for t in TIERS for c in ("calls", "hits", "bytes", "ns")))


class MissPath:
    """The node's miss path in this process (see the module docstring).

    chain     the node's TierChain
    boards    the node's BoardLink to its order board (lookahead/board.py), or None (no
              hand-over with a prefetcher)
    counters  SharedCounters to add to (None: this process counts nothing, as the peer server
              and the prefetcher, which publish their own)
    """

    def __init__(self, chain, boards=None, counters=None):
        self.chain = chain
        self.boards = boards
        self.counters = counters
        self._lock, self._lock_pid = threading.Lock(), os.getpid()

    @classmethod
    def counted(cls, chain, boards=None) -> "MissPath":
        """A miss path with new shared counters (the node's, created in its first process)."""
        return cls(chain, boards, SharedCounters(FIELDS))

    @property
    def board(self):
        """The node's order board now (None while there is none)."""
        return None if self.boards is None else self.boards.get()

    @property
    def cache(self):
        return self.chain.cache

    @property
    def needs_turns(self) -> bool:
        """Whether callers of this process take turns on the chain: a home peer tier (its
        connections take one request at a time) or the extent plan (one stage per process)."""
        return self.chain.partitions or self.chain.reads_extents

    def turn(self):
        """The per-process lock when callers take turns, else nothing. A forked child (a
        DataLoader worker) inherits the lock as it was at the fork: taken, if a thread of the
        parent was reading misses then, by a thread the child does not have."""
        if not self.needs_turns:
            return contextlib.nullcontext()
        if self._lock_pid != os.getpid():
            self._lock, self._lock_pid = threading.Lock(), os.getpid()
        return self._lock

    # ---- a batch of misses ---------------------------------------------------------------------
    def fetch(self, ids: list) -> list:
        """The bytes of every id (distinct, in range) that the node cache missed: what the
        node's prefetcher is reading or holds is waited for and taken from the cache (read once);
        the rest through the tier chain, admitted by the node's rule."""
        board = self.board
        if board is None or not board.control.prefetcher_pid:
            return self.fetch_now(ids)
        a = np.asarray(ids, dtype=np.int64)
        waited = board.flags.wait_for(a, ON_WAY_WAIT_S)   # flags them WANTED: the prefetcher offers them
        coming = waited | board.flags.prefetched(a)        # ... and what it put in the cache meanwhile
        if not coming.any():
            return self.fetch_now(ids)
        look = a[coming].tolist()
        got = {i: v for i, v in zip(look, self.cache.get_many(look)) if v is not None}
        if got:
            self._used_prefetched(board, list(got))
        # The cache refused those it did not take when the prefetcher offered them: they are read
        # from the tier that took them (the SSD tier) and not offered again, as a miss of this
        # reader's own is offered once.
        refused = [i for i in a[waited].tolist() if i not in got]
        skip = set(got).union(refused)
        rest = [i for i in ids if i not in skip]
        values = dict(zip(rest, self.fetch_now(rest)))
        values.update(zip(refused, self.fetch_now(refused, admit=False)))
        return [got[i] if i in got else values[i] for i in ids]

    def fetch_now(self, ids: list, admit: bool = True) -> list:
        """fetch without waiting for the prefetcher: the tier chain, in turn (needs_turns);
        admit=False: read only (nothing offered to the cache or given to the SSD tier)."""
        if not ids:
            return []
        asked, found, r = ids, {}, None
        with self.turn():
            if self.needs_turns:
                # another caller's read may have brought some of these meanwhile (an extent read
                # admits its mates): taken from the cache, not read again
                found = self._cached_now(ids)
                if found:
                    ids = [i for i in ids if i not in found]
            if ids:
                board = self.board
                # under the extent plan, a mate the prefetcher is reading is not read again here
                on_way = board.flags.on_way if board is not None and board.control.prefetcher_pid else None
                r = self.chain.read(ids, on_way, mates=admit)
                if admit:
                    self.chain.admit(r)
        if found:
            self._claim_prefetched(list(found))
        if r is not None:
            self.count_tiers(r)
        if not found:
            return r.asked_values
        got = dict(zip(ids, r.asked_values)) if r is not None else {}
        return [found[i] if i in found else got[i] for i in asked]

    def read(self, ids: list):
        """One read of distinct ids through the chain, in turn, without admission (the peer
        server offers a chunk's reads to the cache only once the chunk is sealed: admit)."""
        with self.turn():
            return self.chain.read(ids)

    def admit(self, read) -> np.ndarray:
        """The admission of a Read from read(), in turn."""
        with self.turn():
            return self.chain.admit(read)

    # ---- counting ------------------------------------------------------------------------------
    def count_tiers(self, r) -> None:
        """Adds one chain read's per-tier counts (calls, hits, bytes, ns), and what it read from
        the store to the job's totals (the board's)."""
        if self.counters is not None:
            self.counters.add(**{f"{name}_{field}": v for name, c in r.counts.items()
                                 for field, v in (("calls", 1), ("hits", c.hits),
                                                  ("bytes", c.bytes), ("ns", c.ns))})
        store = r.counts.get(STORE)
        board = self.board
        if board is not None and store is not None and store.hits:
            board.counters.count_job(store_reads=store.hits, store_bytes=store.bytes)

    def count_batch(self, ids: np.ndarray, hits: int, hit, wait_ns: int = 0) -> None:
        """Counts one batch (ids: int64) of which `hits` were cache hits, `hit()` their bool mask
        (called only when the batch holds a sample the prefetcher brought), wait_ns the time spent
        on the tiers below: hits, misses, samples, prefetch hits (claimed on the order board) and
        the wait. Every reader counts here: a data set per batch, sc.CachedLoader per native call."""
        board = self.board
        pf = board.flags.claim_prefetched(ids, hit) if board is not None and hits else 0
        if self.counters is not None:
            self.counters.add(hits=hits, misses=ids.size - hits, samples=ids.size,
                              prefetch_hits=pf, wait_ns=wait_ns)
        if board is not None:   # per epoch, for stats() and `shadecache stats`; the job's totals
            board.counters.count_reads(_reader_stream(board), ids.size, hits, pf, wait_ns)
            board.counters.count_job(samples=ids.size, hits=hits, prefetch_hits=pf, wait_ns=wait_ns)

    def _claim_prefetched(self, ids: list) -> None:
        """The ids found in the cache on a second look that the prefetcher brought: used now."""
        board = self.board
        if board is None:
            return
        a = np.asarray(ids, dtype=np.int64)
        flagged = a[board.flags.prefetched(a)]
        if flagged.size:
            self._used_prefetched(board, flagged.tolist())

    def _used_prefetched(self, board, ids: list) -> None:
        """Samples the prefetcher brought that a reader took from the cache: their flags are
        cleared (neither unused nor wasted) and they count as prefetch hits."""
        board.flags.unmark(ids)
        if self.counters is not None:
            self.counters.add(prefetch_hits=len(ids))
        board.counters.count_reads(_reader_stream(board), 0, 0, len(ids), 0)
        board.counters.count_job(prefetch_hits=len(ids))

    def _cached_now(self, ids: list) -> dict:
        """{id: value} of the ids the cache holds now. The look-up that finds them counts
        nothing (the engine counted these ids' misses already); only those found are read, and
        counted as the hits they are."""
        if self.cache is None:
            return {}
        a = np.asarray(ids, dtype=np.int64)
        here = np.ones(a.size, dtype=bool)
        here[np.asarray(self.cache.missed(a), dtype=np.int64)] = False
        if not here.any():
            return {}
        look = a[here].tolist()
        return {i: v for i, v in zip(look, self.cache.get_many(look)) if v is not None}

    def totals(self) -> dict:
        """The counters' totals (zeros when this process counts nothing)."""
        if self.counters is None:
            return {f: 0 for f in FIELDS}
        return self.counters.totals()

    def loader_totals(self):
        """(samples read from the tiers below the cache that keep no copy of their own (the home
        peer, the store), seconds those tiers' calls took, seconds the loaders waited on misses,
        samples not cached when a loader asked for them) summed over every process so far: what
        ShadeSampler's stall budget measures the store's pace and the training step by. The SSD
        tier's reads are left out of the first two: its samples are local, and the stall budget
        counts them as held (stalls.StallView.hold), not as misses that wait on the store. The
        last counts every miss: the pace's fallback (a loader that waited on the prefetcher)
        divides the wait by them."""
        c = self.totals()
        read = sum(c[f"{t}_hits"] for t in _SHARED_TIERS)
        tier_ns = sum(c[f"{t}_ns"] for t in _SHARED_TIERS)
        return read, tier_ns / 1e9, c["wait_ns"] / 1e9, c["misses"]

    def stats(self, notes: dict | None = None) -> dict:
        """Counts over every process that used this miss path: hits, misses, bytes_read (from the
        store), samples, store_reads (distinct ids read), hit_ratio; per tier below the cache
        (`tiers`: peer, ssd, store): samples served, bytes, seconds spent in that tier's batched
        calls, the number of those calls and their mean latency; wait_s (time the loop waited on
        the tiers below the cache for misses), prefetch_hits (hits on samples the prefetcher
        brought); with an order board also prefetched, prefetch_wasted and `per_epoch` (alias
        `prefetch_per_epoch`): one row per epoch (the board keeps the last 32) with the
        prefetcher's counters (prefetched, prefetch_wasted, prefetched_bytes, reads_issued), what
        the loaders of every process on the node read in it (samples, hits, prefetch_hits,
        wait_s) and what the samplers' orders held (accuracy_repeats, stall_deferrals,
        stall_repeats). Without a board, `per_epoch` has the samplers' counts `notes` alone."""
        c = self.totals()
        d = {"hits": c["hits"], "misses": c["misses"], "bytes_read": c["store_bytes"],
             "samples": c["samples"], "store_reads": c["store_hits"],
             "peer_hits": c["peer_hits"], "peer_bytes": c["peer_bytes"],
             "ssd_hits": c["ssd_hits"], "ssd_bytes": c["ssd_bytes"],
             "prefetch_hits": c["prefetch_hits"]}
        d["hit_ratio"] = d["hits"] / d["samples"] if d["samples"] else 0.0
        d["tiers"] = {}
        for t in TIERS:
            seconds, calls = c[f"{t}_ns"] / 1e9, c[f"{t}_calls"]
            d["tiers"][t] = {"hits": c[f"{t}_hits"], "bytes": c[f"{t}_bytes"], "calls": calls,
                             "seconds": seconds, "mean_latency_s": seconds / calls if calls else 0.0}
        d["wait_s"] = c["wait_ns"] / 1e9
        board = self.board
        if board is not None:
            t, rows = board.counters.totals(), board.counters.epoch_counters()
            d.update(prefetched=t["prefetched"], prefetch_wasted=t["prefetch_wasted"],
                     per_epoch=rows, prefetch_per_epoch=rows)
        elif notes:
            d["per_epoch"] = [{"epoch": e, "accuracy_repeats": 0, "stall_deferrals": 0,
                               "stall_repeats": 0, **notes[e]} for e in sorted(notes)]
        return d

    def reset(self) -> None:
        """Zero the counters (call it while no reader is fetching)."""
        if self.counters is not None:
            self.counters.reset()

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_lock"], state["_lock_pid"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock, self._lock_pid = threading.Lock(), os.getpid()


def _reader_stream(board) -> int:
    from ..lookahead.publish import reader_stream
    return reader_stream(board)
