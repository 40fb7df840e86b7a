"""The tier chain: the one path of a node-cache miss, through the tiers below the cache.

    chain = TierChain([("peer", HomePeerTier(cluster)), ("ssd", ssd)], store, cache=cache)
    values = chain.fetch(ids)          # distinct ids the cache missed: their bytes, in order

Every tier answers the protocol of shadecache/store/protocol.py (a batched read_many, lengths,
fingerprint, close). The chain knows nothing else of them: the node (shadecache/node/) composes it once, from the
tiers it was given, in the order they are read: the home peer, the SSD tier, the store (the peer
server's chain leaves out the home peer: it answers for the ids it is home to). So this module
imports none of the tiers.

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
Under the extent plan (read_plan.py, given by the node) a read first takes what this process
staged, asks a copying tier only for the store extents the node holds whole, with the tier's other
samples of them, and reads the other misses' whole extents from the store; admit() then offers the
mates too, in disk order (extent_reads.py holds all of that).
reader() runs the same read for a pipeline of batches (the prefetcher): the tiers above the store
at submit, the store's share in flight until take().

Admission: what is offered to the cache, and the put itself, are the node's Admission
(admission.py), the one rule every reader follows.

Counts: each Read carries, per tier asked, a TierCount of its batch; the miss path adds them to its
counters (node/miss_path.py), the peer server to its published status.

Threads: a chain holds no lock. fetch() may run in several threads at once only when its tiers
may (the Cluster's connections may not) and no extent stage is in use: the miss path serialises
the callers of such a chain (node/miss_path.py, needs_turns).
"""
from __future__ import annotations

import os
import time
from collections import deque
from typing import NamedTuple, Sequence

import numpy as np

from .admission import Admission

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


class TierChain:
    """The tiers below a node cache, read in order, and the admission of what they return.

    tiers        [(name, tier), ...] read in this order before the store (protocol.py's Tier)
    store        the last tier, which holds every id (protocol.py's Store), or None: what no tier
                 holds stays None (a peer server without a store)
    cache        the node cache values are offered to (an sc.Cache), or None
    keep_remote  also keep the ids that a partitioning tier serves (another node is their home)
    plan         the node's ReadPlan (read_plan.py; None: samples): under the extent plan the
                 store's misses are read as whole extents (extent_reads.py)
    admission    the node's Admission (admission.py; None: the engine's policy alone)

    Picklable when its tiers are (a DataLoader worker, the prefetcher's process).
    """

    def __init__(self, tiers: Sequence = (), store=None, cache=None, keep_remote: bool = False,
                 plan=None, admission=None):
        self.tiers = [(str(name), tier) for name, tier in tiers]
        self.store = store
        self.cache = cache
        self.keep_remote = bool(keep_remote)
        self.plan = plan
        self.admission = Admission() if admission is None else admission
        self._extents = None   # this process's ExtentReads (extents(): made on first use)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_extents"] = None   # a stage belongs to the process that read its values
        return state

    @property
    def reads_extents(self) -> bool:
        """Whether misses are read as whole extents (the node's extent plan): a read brings
        mates, and this process's stage keeps what the cache refuses, one caller at a time."""
        return self.plan is not None and self.plan.extents

    @classmethod
    def for_node(cls, store, cache=None, peer=None, ssd=None, keep_remote: bool = False,
                 plan=None, admission=None) -> "TierChain":
        """A node's chain, in the node's order: the home peer (a tier that partitions the ids,
        peer/tier.py's HomePeerTier), the SSD tier, then the store; any of the first two may be
        None. sc.Node composes its chain with it (node/node.py)."""
        tiers = [(name, t) for name, t in (("peer", peer), ("ssd", ssd)) if t is not None]
        return cls(tiers, store, cache=cache, keep_remote=keep_remote, plan=plan,
                   admission=admission)

    def extents(self):
        """This process's ExtentReads (extent_reads.py), or None under the samples plan."""
        if not self.reads_extents:
            return None
        if self._extents is None or self._extents.pid != os.getpid():
            from .extent_reads import ExtentReads
            self._extents = ExtentReads(self.plan.layout, self.store.lengths)
        return self._extents

    def begin_pass(self, order=None) -> None:
        """The sampler of this process starts a pass over `order` (extent_reads.py: which ids are
        still due as mates); nothing under the samples plan."""
        ext = self.extents()
        if ext is not None:
            ext.begin_pass(order)

    def describe(self) -> list:
        """[(name, what)] of the tiers a read goes through, in order, the store last: what every
        process of a node reports it reads through (node.tiers())."""
        out = [(name, _what(t)) for name, t in self.tiers]
        if self.store is not None:
            out.append((STORE, _what(self.store)))
        return out

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

    def _cached(self):
        """The cache's cached mask when values are offered to it (None otherwise)."""
        if self.cache is None:
            return None
        return np.asarray(self.cache.cached_mask(), dtype=bool)

    # ---- one batch --------------------------------------------------------------------------
    def read(self, ids, on_way=None, mates: bool = True) -> Read:
        """Reads distinct ids through the tiers, then the store (no admission); under the extent
        plan their extents' other samples come along as mates (Read), but none on its way from
        the node's prefetcher (on_way(ids) -> mask: the board's flags), and none at all with
        mates=False (a read whose values are not offered: nothing would keep them)."""
        r = self.read_tiers(ids)
        rest = r.missing()
        ext = self.extents()
        if ext is not None:
            ext.asked(r.ids[:r.asked])
        if rest.size and self.store is not None:
            mates = self.extent_mates(r.ids[rest], on_way) if mates else np.empty(0, np.int64)
            t0 = time.perf_counter_ns()
            got = self.store.read_many(np.concatenate([r.ids[rest], mates]) if mates.size else r.ids[rest])
            self.took_from_store(r, rest, got, time.perf_counter_ns() - t0, mates)
        return r

    def extent_mates(self, ids: np.ndarray, on_way=None) -> np.ndarray:
        """The samples a read of `ids`' extents brings besides them that this node would keep
        and does not hold nor has on its way (extent_reads.py: ExtentReads.mates); empty under
        the samples plan."""
        ext = self.extents()
        if ext is None:
            return np.empty(0, np.int64)
        return ext.mates(ids, self._cached(), self.keeps, on_way)

    def admit(self, r: Read, make_room=None, staged_again: bool = False) -> np.ndarray:
        """Offers the values of the ids this node keeps to the cache through the node's
        Admission (the engine admits each by its policy), then gives what it refused to the
        copying tiers above the tier it came from, and stages the refused extent mates.
        make_room: see Admission.offer; staged_again: offer what the read took from the stage
        too (the prefetcher, which hands samples over one by one). Returns the admitted mask."""
        admitted = np.zeros(r.ids.size, dtype=bool)
        have = r.keep & (r.source >= 0)
        fresh = have if r.staged is None else have & ~r.staged
        ext = self.extents()
        offer = np.zeros(r.ids.size, dtype=bool)
        if self.cache is not None:
            offer = self.admission.offered(self.cache, r, self._copying(), staged_again)
        r.offered = offer
        if offer.any():
            pos = np.flatnonzero(offer)
            if ext is not None:
                pos = ext.in_disk_order(r, pos)
            admitted[pos] = self.admission.offer(self.cache, r.ids[pos],
                                                 [r.values[k] for k in pos.tolist()], make_room)
        for j in self._copying():
            below = np.flatnonzero(fresh & ~admitted & (r.source > j))
            if ext is not None:
                below = ext.in_disk_order(r, below)
            if below.size:
                self.tiers[j][1].put_many(r.ids[below], [r.values[k] for k in below.tolist()])
        if ext is not None:
            ext.stage_refused(r, admitted, have)
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
        ext = self.extents()
        if ext is not None:
            ext.take_staged(r)
        copying = self._copying()
        for j, (name, tier) in enumerate(self.tiers):
            pending = r.missing()
            if j in served:
                pending = pending[served[j][pending]]
            mates = None
            if j in copying and ext is not None:
                pending, mates = ext.whole(r, tier, pending, None if self.cache is None else
                                           np.asarray(self.cache.cached_mask(), dtype=bool))
            if pending.size:
                self._read_tier(r, j, name, tier, pending, mates)
        return r

    def _read_tier(self, r: Read, j: int, name: str, tier, pending: np.ndarray, mates) -> None:
        """Asks tier j (`name`) for the ids at `pending` and the extent `mates` with them, in one
        batched read; records what it had in `r` and its TierCount."""
        a, what = r.ids, f"tier {name!r}"
        t0 = time.perf_counter_ns()
        want = pending.size + (0 if mates is None else mates.size)
        got = _answer(tier.read_many(a[pending] if want == pending.size
                                     else np.concatenate([a[pending], mates])), want, what, tier)
        ns = time.perf_counter_ns() - t0
        hits = nbytes = 0
        for k, v in zip(pending.tolist(), got):
            if v is not None:
                if type(v) is not bytes:
                    v = _as_bytes(v, what, tier, a[k])
                r.values[k] = v
                r.source[k] = j
                hits += 1
                nbytes += len(v)
        if mates is not None and mates.size:
            extra = got[pending.size:]
            ok = np.fromiter((v is not None for v in extra), dtype=bool, count=len(extra))
            if ok.any():
                values = [v if type(v) is bytes else _as_bytes(v, what, tier, i)
                          for v, i in zip(extra, mates.tolist()) if v is not None]
                nbytes += sum(len(v) for v in values)
                r.add_mates(mates[ok], values, self.keeps(mates[ok]), j)
        r.counts[name] = TierCount(int(pending.size), hits, nbytes, ns)

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


def _what(tier) -> str:
    """A tier or store as a process reports it (TierChain.describe): its type and where it
    reads from (a path, a directory, the peers)."""
    where = getattr(tier, "describe", None)
    if callable(where):
        return str(where())
    for attr in ("path", "directory", "root"):
        v = getattr(tier, attr, None)
        if isinstance(v, (str, os.PathLike)):
            return f"{type(tier).__name__}({os.fspath(v)})"
    return type(tier).__name__


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

    def submit(self, ids, on_way=None) -> np.ndarray:
        """Starts the read of `ids`; returns the extent mates the store reads with them (empty
        unless the store reads whole extents): a caller that reads ahead must not ask for those
        again while this read is in flight."""
        r = self.chain.read_tiers(ids)
        rest = r.missing() if self.chain.store is not None else np.empty(0, np.int64)
        mates = self.chain.extent_mates(r.ids[rest], on_way) if rest.size else np.empty(0, np.int64)
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
