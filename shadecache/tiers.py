"""The tier chain: the one path of a node-cache miss, through the tiers below the cache.

    chain = TierChain([("peer", HomePeerTier(cluster)), ("ssd", ssd)], store, cache=cache)
    values = chain.fetch(ids)          # distinct ids the cache missed: their bytes, in order

Every tier answers the protocol of shadecache/store/protocol.py (a batched read_many, lengths,
fingerprint, close). The chain knows nothing else of them: whoever composes it passes the tiers
in, in the order they are read. CachedDataset: the home peer, the SSD tier, the store; the peer
server: the SSD tier, the store; the Prefetcher: what its data set reads. So this module imports
none of the tiers, and no tier (the peer layer included) imports it.

One batch, fetch(ids) = read(ids), then admit(read):
  read    each tier in order is asked, in one batched call, for the ids no tier above it had and
          that it serves (a tier with serves(ids), the home peer, is asked only for the ids whose
          home is another node); then the store for every id still missing. Each value comes
          back checked against the checksum recorded with it (protocol.py), and leaves the chain
          as bytes; an answer that is not one bytes-like value (or None, above the store) per id
          is refused, naming the tier, before anything of the batch is admitted.
  admit   the values of the ids this node keeps are offered to the cache, which admits each by its
          policy (no scores are passed: the importance policy compares the sample's score in the
          shared table); what a copying tier served, only into the cache's free pages. A node
          keeps every id, or, when a tier partitions the ids (serves) and keep_remote is False,
          only the ids no such tier serves: each node keeps what it is home to, so the cluster
          caches the sum of its nodes. What the cache refused goes to each tier
          that keeps copies (put_many) and lies above the tier it came from (exclusive tiers: RAM
          and SSD together hold RAM + SSD worth of samples, not the larger of the two).
Under whole-extent reads (the store's extent_layout, set by the sampler's extent order) a read
first takes what this process staged (MateStage), asks a copying tier only for the store extents
the node holds whole, with the tier's other samples of them (whole_extents: one read per extent,
and the store is not asked for that extent at all), and reads the other misses' whole extents
from the store; admit() then offers the mates too, in disk order, to the copying tiers.
reader() runs the same read for a pipeline of batches (the prefetcher): the tiers above the store
at submit, the store's share in flight until take().

Counts: each Read carries, per tier asked, a TierCount of its batch; the composer adds them to its
own counters (CachedDataset's, the peer server's published status).

Threads: a chain holds no lock. fetch() may run in several threads at once only when its tiers
may (the Cluster's connections may not: CachedDataset serialises its misses per process).
"""
from __future__ import annotations

import os
import time
from collections import deque
from typing import NamedTuple, Sequence

import numpy as np

from .errors import ValueTooLargeError

STORE = "store"   # the store's name in a Read's counts


class TierCount(NamedTuple):
    """One tier's share of one batch: ids asked, values it had, their bytes, ns in its call."""
    asked: int
    hits: int
    bytes: int
    ns: int


class Read:
    """One batch read through a chain. values[k]: the bytes of ids[k], or None when no tier had
    it; source[k]: the index of the tier it came from (len(tiers) for the store, -1 for none);
    keep[k]: whether this node keeps ids[k]; counts: {tier name: TierCount} of the tiers asked.
    The first `asked` positions are the ids asked for; positions after them are extent mates:
    samples the store read along with the extents of the asked ones (store.extent_mates), which
    admit() offers like the others so that they are not read again when their turn comes."""

    __slots__ = ("ids", "values", "source", "keep", "counts", "asked", "staged", "offered")

    def __init__(self, ids: np.ndarray, keep: np.ndarray):
        self.ids = ids
        self.values = [None] * ids.size
        self.source = np.full(ids.size, -1, dtype=np.int16)
        self.keep = keep
        self.counts = {}
        self.asked = ids.size
        self.staged = None    # bool mask of the positions taken from the stage (None: none)
        self.offered = None   # bool mask of the positions admit() offered to the cache

    @property
    def asked_values(self) -> list:
        """The values of the ids asked for, in their order (the mates left out)."""
        return self.values if len(self.values) == self.asked else self.values[:self.asked]

    def add_mates(self, ids: np.ndarray, values: list, keep: np.ndarray, source: int) -> None:
        if self.staged is not None:
            self.staged = np.concatenate([self.staged, np.zeros(ids.size, dtype=bool)])
        self.ids = np.concatenate([self.ids, ids])
        self.values = self.values + list(values)
        self.source = np.concatenate([self.source, np.full(ids.size, source, dtype=np.int16)])
        self.keep = np.concatenate([self.keep, keep])

    def missing(self) -> np.ndarray:
        """Positions no tier had (so far)."""
        return np.flatnonzero(self.source < 0)

    def part(self, positions) -> "Read":
        """A Read of these positions of this one (ids, values, sources, keep; no counts): the
        prefetcher offers a batch to the cache a few ids at a time."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        r = Read(self.ids[pos], self.keep[pos])
        r.values = [self.values[k] for k in pos.tolist()]
        r.source = self.source[pos]
        return r


class MateStage:
    """Extent mates the cache refused, kept in this process until their turn (first in, first
    out, within `capacity` bytes): the extent order asks for them within its window, so a full
    cache that admits by score (equal scores: nothing new) does not make them be read again.
    Each value keeps the index of the tier that read it (Read.source)."""

    def __init__(self, capacity: int):
        from collections import OrderedDict
        self.capacity = int(capacity)
        self._d = OrderedDict()   # id -> (value, source)
        self._bytes = 0
        self.turn = None          # the sampler's pass the staged values were read in

    def put(self, ids, values, sources) -> None:
        for i, v, src in zip(ids, values, sources):
            if i in self._d or v is None:
                continue
            self._d[i] = (v, src)
            self._bytes += len(v)
        while self._bytes > self.capacity and self._d:
            _, (v, _) = self._d.popitem(last=False)
            self._bytes -= len(v)

    def take(self, ids) -> list:
        """The staged (value, source) of each id (None where there is none), removed from the
        stage."""
        out = []
        for i in ids:
            got = self._d.pop(i, None)
            if got is not None:
                self._bytes -= len(got[0])
            out.append(got)
        return out

    def mask(self, ids: np.ndarray) -> np.ndarray:
        """Bool mask: which of `ids` are staged."""
        d = self._d
        return np.fromiter((i in d for i in ids.tolist()), dtype=bool, count=ids.size)

    def clear(self) -> None:
        self._d.clear()
        self._bytes = 0

    @property
    def room(self) -> int:
        """Bytes the stage takes before it drops its oldest values."""
        return max(0, self.capacity - self._bytes)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, i) -> bool:
        return i in self._d


class TierChain:
    """The tiers below a node cache, read in order, and the admission of what they return.

    tiers        [(name, tier), ...] read in this order before the store (protocol.py's Tier)
    store        the last tier, which holds every id (protocol.py's Store), or None: what no tier
                 holds stays None (a peer server without a store)
    cache        the node cache values are offered to (an sc.Cache), or None
    admit        offer values to the cache (False: read-through; the tiers that keep copies still
                 get what was read below them)
    keep_remote  also keep the ids that a partitioning tier serves (another node is their home)

    Picklable when its tiers are (a DataLoader worker, the prefetcher's process).
    """

    def __init__(self, tiers: Sequence = (), store=None, cache=None, admit: bool = True,
                 keep_remote: bool = False):
        self.tiers = [(str(name), tier) for name, tier in tiers]
        self.store = store
        self.cache = cache
        self.admit_to_cache = bool(admit)
        self.keep_remote = bool(keep_remote)
        self._stage = None   # (pid, MateStage): per process, made on the first extent mates

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_stage"] = None   # a stage belongs to the process that read its values
        return state

    @property
    def reads_extents(self) -> bool:
        """Whether the store reads whole extents now (store.read_whole_extents: the sampler's
        extent order): a read brings mates, and this process's stage keeps what the cache
        refuses, one caller at a time."""
        return getattr(self.store, "extent_layout", None) is not None

    def stage(self) -> MateStage | None:
        """This process's stage of extent mates (None while the store reads no whole extents):
        room for 32 extents, the sampler's default window twice."""
        layout = getattr(self.store, "extent_layout", None)
        if layout is None:
            self._stage = None   # the reads stopped: what was staged for them is not kept
            return None
        if self._stage is None or self._stage[0] != os.getpid():
            self._stage = (os.getpid(), MateStage(min(256 << 20, 32 * layout.extent_bytes)))
        stage = self._stage[1]
        if layout.epoch_pid == os.getpid() and stage.turn != layout.turn:
            # a new pass of the sampler in this process: what the last one staged and did not
            # ask for is not due in this one's windows, and would hold the stage's room
            stage.clear()
            stage.turn = layout.turn
        return stage

    @classmethod
    def for_node(cls, store, cache=None, peer=None, ssd=None, admit: bool = True,
                 keep_remote: bool = False) -> "TierChain":
        """The chain of a node's readers: the home peer (a tier that partitions the ids, e.g.
        peer/tier.py's HomePeerTier), the SSD tier, then the store; any of the first two may be
        None. CachedDataset and the Prefetcher compose theirs with it."""
        tiers = [(name, t) for name, t in (("peer", peer), ("ssd", ssd)) if t is not None]
        return cls(tiers, store, cache=cache, admit=admit, keep_remote=keep_remote)

    def _copying(self) -> list:
        return [j for j, (_, t) in enumerate(self.tiers) if callable(getattr(t, "put_many", None))]

    def keeps(self, ids) -> np.ndarray:
        """Bool mask of the ids this node keeps (offers to its cache and its copying tiers)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        keep = np.ones(ids.size, dtype=bool)
        if not self.keep_remote:
            for _, served in self._served(ids):
                keep &= ~served
        return keep

    def _served(self, ids: np.ndarray) -> list:
        """[(tier index, bool mask of the ids it serves)] of the tiers that partition the ids."""
        out = []
        for j, (_, tier) in enumerate(self.tiers):
            serves = getattr(tier, "serves", None)
            if serves is not None:
                out.append((j, np.asarray(serves(ids), dtype=bool)))
        return out

    def held(self, ids) -> np.ndarray:
        """Bool mask: the ids a tier that keeps copies (the SSD tier) holds now, by its index."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.zeros(ids.size, dtype=bool)
        for j in self._copying():
            holds = getattr(self.tiers[j][1], "holds", None)
            if holds is not None:
                out |= np.asarray(holds(ids), dtype=bool)
        return out

    def held_locally(self, ids) -> np.ndarray:
        """Bool mask: the ids a read of this chain serves from this node's own copies: held by a
        tier that keeps copies (held) and not asked first of a tier that partitions the ids (the
        home peer: read_tiers asks it for the ids it serves, whatever this node holds)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = self.held(ids)
        if out.any():
            for _, served in self._served(ids):
                out &= ~served
        return out

    @property
    def partitions(self) -> bool:
        """Whether a tier partitions the ids (serves: the home peer), so that reads below the
        cache may come from another node instead of the store."""
        return any(getattr(t, "serves", None) is not None for _, t in self.tiers)

    @property
    def keeps_copies(self) -> bool:
        """Whether a tier below the cache keeps copies (an SSD tier)."""
        return bool(self._copying())

    # ---- one batch --------------------------------------------------------------------------
    def read(self, ids) -> Read:
        """Reads distinct ids through the tiers, then the store (no admission); with a store that
        reads whole extents, their other samples come along as mates (Read)."""
        r = self.read_tiers(ids)
        rest = r.missing()
        stage = self.stage()
        if stage is not None:
            self.store.extent_layout.asked(r.ids[:r.asked])
        if rest.size and self.store is not None:
            mates = self.extent_mates(r.ids[rest])
            t0 = time.perf_counter_ns()
            got = self.store.read_many(np.concatenate([r.ids[rest], mates]) if mates.size else r.ids[rest])
            self.took_from_store(r, rest, got, time.perf_counter_ns() - t0, mates)
        return r

    def take_staged(self, r: Read) -> None:
        """Fills the positions no tier had yet from this process's stage of extent mates (with
        the source that read them)."""
        stage = self.stage()
        rest = r.missing()
        if stage is None or not len(stage) or not rest.size:
            return
        staged = np.zeros(r.ids.size, dtype=bool)
        for k, got in zip(rest.tolist(), stage.take(r.ids[rest].tolist())):
            if got is not None:
                r.values[k] = got[0]
                r.source[k] = got[1]
                staged[k] = True
        r.staged = staged

    def extent_mates(self, ids: np.ndarray) -> np.ndarray:
        """The samples a read of `ids`' extents brings besides them (store.extent_mates: empty
        unless the store reads whole extents, for the sampler's extent order) that this node would
        keep and its cache does not hold yet; in the sampler's process only those its pass still
        still asks for (ExtentLayout.due), and no more than the stage has room for."""
        mates_of = getattr(self.store, "extent_mates", None)
        mates = np.empty(0, np.int64) if mates_of is None else np.asarray(mates_of(ids), np.int64)
        if mates.size and self.cache is not None and self.admit_to_cache:
            mates = mates[~np.asarray(self.cache.cached_mask(), dtype=bool)[mates]]
        if mates.size:
            mates = mates[self.keeps(mates)]
        stage = self.stage() if mates.size else None
        if stage is not None and len(stage):
            mates = mates[~stage.mask(mates)]
        if stage is not None and mates.size:
            # Only what this pass still asks for (ExtentLayout.due): not what it asked for already
            # (a sample asked again in its extent's window, one cached when its extent was read
            # and evicted since by the mates admitted after it, is read with the extent's
            # samples still due, not with the whole extent), nor what it does not ask for at all
            # (another rank's share, a sample the draw left out: staged, it would fill the stage
            # for good). And no more than the stage has room for: what the cache refuses waits
            # there, and a stage that overflows drops mates still due, whose reads bring more
            # mates, which push out more (measured: each warm epoch read 6-21x the data; the
            # prefetcher's early admissions started it). The rest of an extent cut off here is
            # read when its samples are asked for. (The mates' lengths only: a cast of the
            # whole array is a copy of the data set's.)
            mates = mates[self.store.extent_layout.due(mates)]
            fits = np.cumsum(np.asarray(self.store.lengths)[mates], dtype=np.int64) <= stage.room
            mates = mates[fits]
        return mates

    def _offers(self, r: Read, insert=None) -> np.ndarray:
        """Bool mask: the positions of `r` that admit(r, insert) offers to the cache (when it
        has one and admits); admit() keeps it as r.offered, so that a caller tells a refusal from
        a value not offered."""
        have = r.keep & (r.source >= 0)
        # Values taken from the stage were offered when they were staged (the cache refused them,
        # the copying tiers had them in disk order): the loaders' path does not offer them again,
        # a batch at a time; a caller with its own insert (the prefetcher, which counts what the
        # cache refuses) offers them to the cache as before.
        offer = have if insert is not None or r.staged is None else have & ~r.staged
        if r.ids.size:
            # What a copying tier (the SSD tier) served stays there, and is offered to the cache
            # only while the cache has free room for it: a copy moved up into a full cache
            # displaces a cached sample that no tier keeps, and leaves the same sample on both
            # tiers, so the node holds fewer samples with every such hit (RAM 20% + SSD 30% of
            # 100 KB samples: the two held 1,562-1,663 of 2,048 distinct samples after each warm
            # epoch, 2,040-2,048 without; under the extent order the extents held whole shrank
            # from 85 to 51-75 of 169). An empty cache beside a warm SSD tier (a restart) fills.
            served = offer & np.isin(r.source, self._copying())
            if served.any():
                offer = offer & ~served
                room = self._free_room()
                if room > 0:
                    pos = np.flatnonzero(served)
                    sizes = np.fromiter((len(r.values[k]) for k in pos.tolist()), np.int64, pos.size)
                    offer[pos[np.cumsum(sizes) <= room]] = True
        return offer

    def _free_room(self) -> int:
        """Bytes the cache can take without evicting anything: its pages not yet given to any
        size class (a cache whose byte count looks 68-99% used may have none left: values take
        whole slots of their class, and the engine evicts from the first insert it cannot place;
        measured, free pages were 0 at each cache's first eviction). 0 without a cache."""
        if self.cache is None or not self.admit_to_cache:
            return 0
        st = self.cache.stats()
        return int(st["free_pages"]) * int(st["page_size"])

    def admit(self, r: Read, insert=None) -> np.ndarray:
        """Offers the values of the ids this node keeps to the cache (insert(ids, values) -> bool
        mask; default cache.put_many: the engine admits each by its policy; a value too large
        for the cache is refused like any other), then gives what it refused to the copying tiers
        above the tier it came from. Returns the admitted mask."""
        admitted = np.zeros(r.ids.size, dtype=bool)
        have = r.keep & (r.source >= 0)
        fresh = have if r.staged is None else have & ~r.staged
        offer = r.offered = self._offers(r, insert)
        layout = getattr(self.store, "extent_layout", None)
        if self.cache is not None and self.admit_to_cache and offer.any():
            pos = np.flatnonzero(offer)
            if layout is not None and r.ids.size > r.asked:
                # in disk order, asked ids among their mates: a cache that fills up holds whole
                # extents and at most one in part (its rest goes to the copying tiers), so that
                # the extents the node holds whole are as many as its room allows
                pos = pos[np.argsort(layout.position[r.ids[pos]], kind="stable")]
            put = self.cache.put_many if insert is None else insert
            try:
                admitted[pos] = np.asarray(put(r.ids[pos], [r.values[k] for k in pos.tolist()]),
                                           dtype=bool)
            except ValueTooLargeError:
                # a value larger than the cache takes (its max_item_bytes) is refused, not the
                # reader's error: the others are offered one by one
                for k in pos.tolist():
                    try:
                        admitted[k] = bool(np.asarray(put(r.ids[k:k + 1], [r.values[k]]))[0])
                    except ValueTooLargeError:
                        pass
        for j in self._copying():
            # the extent mates too, in disk order: the samples of one store extent then lie in
            # neighbouring slots and come back in one read (the tier drops what it holds, and
            # when full what scores no higher than what it holds, without per-sample work)
            below = np.flatnonzero(fresh & ~admitted & (r.source > j))
            if below.size and layout is not None and r.ids.size > r.asked:
                below = below[np.argsort(layout.position[r.ids[below]], kind="stable")]
            if below.size:
                self.tiers[j][1].put_many(r.ids[below], [r.values[k] for k in below.tolist()])
        if r.ids.size > r.asked:   # mates the cache refused wait in this process for their turn
            refused = np.flatnonzero(~admitted[r.asked:] & have[r.asked:]) + r.asked
            stage = self.stage()
            if stage is not None and refused.size:
                stage.put(r.ids[refused].tolist(), [r.values[k] for k in refused.tolist()],
                          r.source[refused].tolist())
        return admitted

    def fetch(self, ids) -> list:
        """The bytes of every id (distinct; None where nothing holds it and there is no store),
        read through the tiers and admitted: the miss path of every reader."""
        r = self.read(ids)
        self.admit(r)
        return r.asked_values

    def reader(self, batches: int = 4, queue_depth: int = 32, lanes: int = 2) -> "ChainReader":
        """A pipeline of up to `batches` batches in flight (see ChainReader)."""
        return ChainReader(self, batches, queue_depth, lanes)

    # ---- the two halves of a read (ChainReader runs them apart) ----------------------------
    def read_tiers(self, ids) -> Read:
        """A Read of distinct ids with what the tiers above the store hold."""
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        served = dict(self._served(a)) if a.size else {}
        keep = np.ones(a.size, dtype=bool)
        if not self.keep_remote:
            for mask in served.values():
                keep &= ~mask
        r = Read(a, keep)
        self.take_staged(r)
        copying = self._copying()
        for j, (name, tier) in enumerate(self.tiers):
            pending = r.missing()
            if j in served:
                pending = pending[served[j][pending]]
            mates = None
            if j in copying:
                pending, mates = self.whole_extents(r, tier, pending)
            if not pending.size:
                continue
            t0 = time.perf_counter_ns()
            want = pending.size + (0 if mates is None else mates.size)
            got = _answer(tier.read_many(a[pending] if want == pending.size
                                         else np.concatenate([a[pending], mates])),
                          want, f"tier {name!r}", tier)
            ns = time.perf_counter_ns() - t0
            hits = nbytes = 0
            for k, v in zip(pending.tolist(), got):
                if v is not None:
                    if type(v) is not bytes:
                        v = _as_bytes(v, f"tier {name!r}", tier, a[k])
                    r.values[k] = v
                    r.source[k] = j
                    hits += 1
                    nbytes += len(v)
            if mates is not None and mates.size:
                extra = got[pending.size:]
                ok = np.fromiter((v is not None for v in extra), dtype=bool, count=len(extra))
                if ok.any():
                    values = [v if type(v) is bytes else _as_bytes(v, f"tier {name!r}", tier, i)
                              for v, i in zip(extra, mates.tolist()) if v is not None]
                    nbytes += sum(len(v) for v in values)
                    r.add_mates(mates[ok], values, self.keeps(mates[ok]), j)
            r.counts[name] = TierCount(int(pending.size), hits, nbytes, ns)
        return r

    def whole_extents(self, r: Read, tier, pending: np.ndarray):
        """Which of the `pending` positions to ask of a copying tier (the SSD tier), and which of
        its other samples to read with them. Without whole-extent reads of the store: all of them,
        no others. With them (the extent order): only the positions whose store extent the node
        holds whole (each of its samples cached, held by this tier, or staged), and with them the
        tier's other samples of those extents that are neither cached nor staged, so that an
        extent comes back from the tier in one read and the store is not asked for it at all;
        the rest are left to the store, whose read of their extents brings them anyway (a read of
        this tier for them would be one more read and save the shared storage nothing)."""
        layout = getattr(self.store, "extent_layout", None)
        holds = getattr(tier, "holds", None)
        none = np.empty(0, np.int64)
        if layout is None or holds is None or not pending.size:
            return pending, none
        ids = r.ids[pending]
        members = layout.widen(ids)                    # disk order: grouped by extent
        ext = layout.extent_of[members]
        held = np.asarray(holds(members), dtype=bool)
        other = np.zeros(members.size, dtype=bool)      # cached or staged: not this tier's to read
        if self.cache is not None:
            other |= np.asarray(self.cache.cached_mask(), dtype=bool)[members]
        stage = self.stage()
        if stage is not None and len(stage):
            other |= stage.mask(members)
        starts = np.flatnonzero(np.concatenate([[True], ext[1:] != ext[:-1]]))
        whole = ext[starts][np.logical_and.reduceat(held | other, starts)]
        if not whole.size:
            return pending[:0], none
        in_whole = np.isin(ext, whole)
        mates = members[in_whole & held & ~other & ~np.isin(members, r.ids)]
        return pending[np.isin(layout.extent_of[ids], whole)], mates

    def took_from_store(self, r: Read, rest: np.ndarray, got: list, ns: int,
                        mates: np.ndarray | None = None) -> None:
        """Records the store's values `got` for positions `rest` of `r`, then those of the extent
        mates read with them (the values after rest's, in the order of `mates`); ValueError or
        TypeError naming the store and the id when they are not one value, bytes-like, per id."""
        nmates = 0 if mates is None else mates.size
        got = _answer(got, rest.size + nmates, "store", self.store)
        ids = r.ids[rest] if not nmates else np.concatenate([r.ids[rest], mates])
        for k, v in enumerate(got):
            if type(v) is not bytes:
                if v is None:
                    raise ValueError(f"{_who(STORE, self.store)} has no value for sample id "
                                     f"{int(ids[k])} (a store holds every id: "
                                     "shadecache/store/protocol.py)")
                got[k] = _as_bytes(v, "store", self.store, ids[k])
        nbytes = 0
        for k, v in zip(rest.tolist(), got):
            r.values[k] = v
            nbytes += len(v)
        r.source[rest] = len(self.tiers)
        if nmates:
            extra = got[rest.size:]
            nbytes += sum(len(v) for v in extra)
            r.add_mates(mates, extra, np.ones(mates.size, dtype=bool), len(self.tiers))
        r.counts[STORE] = TierCount(int(rest.size), int(rest.size), nbytes, ns)


def _who(what: str, tier) -> str:
    """A tier for messages: "tier 'ssd' (SSDTier)", "store PackedStore"."""
    return f"store {type(tier).__name__}" if what == "store" else f"{what} ({type(tier).__name__})"


def _answer(got, asked: int, what: str, tier) -> list:
    """A read_many answer as a list of one value per id asked; ValueError naming the tier when it
    holds another number of values (zip would drop or misplace them silently)."""
    if not isinstance(got, list):
        got = list(got)
    if len(got) != asked:
        raise ValueError(f"{_who(what, tier)} answered {len(got)} values for {asked} ids: read_many answers one "
                         "value per id, in order (shadecache/store/protocol.py)")
    return got


def _as_bytes(v, what: str, tier, i) -> bytes:
    """The bytes of a bytes-like value (bytearray, memoryview, numpy array: its buffer, as a
    copy), so every reader gets bytes whatever a tier answers; TypeError naming the tier and the
    id for anything else (a str, an int: bytes(5) would be five zero bytes)."""
    try:
        return memoryview(v).tobytes()
    except TypeError:
        raise TypeError(f"{_who(what, tier)} answered a {type(v).__name__} for sample id {int(i)}: read_many "
                        "answers bytes (shadecache/store/protocol.py)") from None


class ChainReader:
    """Batches in flight through a chain: submit(ids) reads the tiers above the store now and
    starts the store's share; take() -> the oldest batch's Read, once its store share is in (ns
    in its count: from submit to take). The store's share goes to its stream(queue_depth, lanes)
    when it has one (a PackedStore: reads stay in flight across batch boundaries), else to its
    read_many on one of `batches` threads (read_many releases the GIL while it waits)."""

    def __init__(self, chain: TierChain, batches: int, queue_depth: int, lanes: int):
        self.chain = chain
        self._stream = self._pool = None
        store = chain.store
        stream = getattr(store, "stream", None)
        if callable(stream):
            self._stream = stream(queue_depth, lanes)
        elif store is not None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max_workers=batches, thread_name_prefix="sc-tier")
        self._inflight = deque()     # (Read, store positions, ns at submit, future or None)

    def submit(self, ids) -> np.ndarray:
        """Starts the read of `ids`; returns the extent mates the store reads with them (empty
        unless the store reads whole extents): a caller that reads ahead must not ask for those
        again while this read is in flight."""
        r = self.chain.read_tiers(ids)
        rest = r.missing() if self.chain.store is not None else np.empty(0, np.int64)
        mates = self.chain.extent_mates(r.ids[rest]) if rest.size else np.empty(0, np.int64)
        wanted = np.concatenate([r.ids[rest], mates]) if mates.size else r.ids[rest]
        fut = None
        if rest.size:
            if self._stream is not None:
                self._stream.submit(wanted)
            else:
                fut = self._pool.submit(self.chain.store.read_many, wanted)
        self._inflight.append((r, rest, mates, time.perf_counter_ns(), fut))
        return mates

    def take(self) -> Read:
        r, rest, mates, t0, fut = self._inflight.popleft()
        if rest.size:
            got = self._stream.take() if fut is None else fut.result()
            self.chain.took_from_store(r, rest, got, time.perf_counter_ns() - t0, mates)
        return r

    def __len__(self) -> int:
        return len(self._inflight)

    def close(self) -> None:
        """Stops the store's share of the batches not taken (their values are dropped)."""
        if self._stream is not None:
            self._stream.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
