"""CachedDataset: a map-style torch Dataset over a sample store, behind a shared-memory Cache.

A DataLoader worker fetches a whole batch in one call (`__getitems__`, used by torch's fetcher
when the data set defines it):

  1. `cache.get_many(ids)`        hits are copied out of shared memory, no lock;
  2. `fetch_missing(missed ids)`  the tier chain (shadecache/tiers.py), each tier batched: the
                                  peer node that is home to an id (cluster=), the local SSD tier
                                  (ssd=), then one store.read_many for what is left; then
                                  admission: the cache's put_many (one lock; the engine admits
                                  each sample by its importance score in the shared table), and
                                  what it refused to the SSD tier.

Items are (sample, target, index): the index travels with the batch so that the training loop can
give each loss to the sample that produced it (ShadeSampler.update).

Counters (hits, misses, samples, prefetch hits, the wait on the tiers, and per tier its calls,
hits, bytes and time) are named fields that every process reading this data set adds to
atomically (loader/counters.py): the main process, any number of DataLoader workers and the
threads of sc.CachedLoader. `stats()` reads them. The order board's per-epoch rows count the same
reads per epoch for the node (lookahead/board.py).
"""
import os
import threading
import time

import numpy as np
import torch
from torch.utils.data import Dataset

from ..ids import check_ids
from ..lookahead.publish import board_for, reader_stream
from ..peer.tier import HomePeerTier
from ..store.protocol import check_store
from ..tiers import STORE, TierChain
from .counters import SharedCounters

ON_WAY_WAIT_S = 2.0   # the longest a miss waits for the same sample on its way from the prefetcher
_TIERS = ("peer", "ssd", STORE)   # the tiers below the cache, as CachedDataset composes its chain
_SHARED_TIERS = ("peer", STORE)   # ... those that keep no copy on this node
_FIELDS = (("hits", "misses", "samples", "prefetch_hits", "wait_ns")
           + tuple(f"{t}_{c}" for t in _TIERS for c in ("calls", "hits", "bytes", "ns")))


def raw_bytes(data) -> torch.Tensor:
    """The default decode: the sample's bytes as a uint8 tensor (a copy)."""
    if not data:  # torch.frombuffer refuses an empty buffer; the format allows 0-byte samples
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _prefetch_stats(cache) -> dict:
    board = board_for(cache)
    if board is None:
        return {}
    t = board.totals()
    rows = board.epoch_counters()
    return {"prefetched": t["prefetched"], "prefetch_wasted": t["prefetch_wasted"],
            "per_epoch": rows, "prefetch_per_epoch": rows}


class CachedDataset(Dataset):
    """Items (decode(bytes) -> transform, target, index) of a store, read through a cache.

    store      a store (shadecache/store/protocol.py: len(), read_many(ids), labels or label(i);
               sc.PackedStore, sc.FolderStore, or one of your own)
    cache      a sc.Cache with num_samples == len(store), or None (every read goes to the store)
    decode     bytes -> sample (default: a uint8 tensor of the bytes, raw_bytes)
    transform  sample -> sample, applied after decode (augmentation: the cache holds raw bytes)
    admit      insert missed samples into the cache (False: read-through only)
    cluster    a sc.Cluster: a miss whose home is another node is asked of that node first
    ssd        a sc.SSDTier: consulted after the peers, before the store; filled behind reads;
               bound to the store's fingerprint (FingerprintError if it holds another data set)
    keep_remote  also offer samples whose home is another node to this node's cache and SSD
               tier (default: a node keeps what it is home to, so the cluster caches the sum)

    `raw` is True when items are the stored bytes as they are (no decode or transform given):
    sc.CachedLoader then assembles whole batches without a Python object per sample.

    Picklable: a spawned DataLoader worker re-attaches the cache by name and reopens the store
    (both pickle that way); the shared counters travel with the worker when it is started.
    """

    def __init__(self, store, cache=None, decode=None, transform=None, admit: bool = True,
                 cluster=None, ssd=None, keep_remote: bool = False):
        check_store(store)
        self.store = store
        self.cache = cache
        n = len(store)
        if cache is not None and cache.num_samples != n:
            raise ValueError(f"cache {cache.name!r} holds {cache.num_samples} sample ids but the "
                             f"store has {n} samples")
        self.raw = decode in (None, raw_bytes) and transform is None
        self.decode = decode or raw_bytes
        self.transform = transform
        self.admit = bool(admit)
        self.cluster = cluster
        if cluster is not None:   # the peers must serve this store's samples (checked at each handshake)
            cluster.bind(store)
        self.ssd = ssd
        if ssd is not None:   # the tier must hold this store's samples, not another's by the same ids
            ssd.bind_store(store)
        self.keep_remote = bool(keep_remote)
        self.chain = TierChain.for_node(store, cache, peer=None if cluster is None else HomePeerTier(cluster),
                                        ssd=ssd, admit=self.admit, keep_remote=self.keep_remote)
        self._n = n
        self.counters = SharedCounters(_FIELDS)
        self._miss_lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._notes = {}      # epoch -> a sampler's counts (note_epoch), this process only

    def __len__(self):
        return self._n

    def label(self, i: int) -> int:
        if callable(getattr(self.store, "label", None)):
            return int(self.store.label(i))
        return int(self.store.labels[i])

    def labels_of(self, ids: np.ndarray) -> np.ndarray:
        """Labels of checked ids, as an int64 array (one gather from the store's label array)."""
        labels = getattr(self.store, "labels", None)   # the store's in-memory label array
        if isinstance(labels, np.ndarray) and labels.shape == (self._n,):
            return labels.take(ids).astype(np.int64, copy=False)
        return np.array([self.label(i) for i in ids.tolist()], dtype=np.int64)

    # ---- the batched path --------------------------------------------------------------------
    def check_ids(self, ids) -> np.ndarray:
        """ids as a 1-D int64 array in 0..N-1 (shadecache/ids.py: the one rule; TypeError /
        IndexError naming the id)."""
        return check_ids(ids, self._n)

    def fetch_bytes(self, ids):
        """Raw bytes of each id, in order: cache first, then the tier chain for the misses. The
        ids are checked (check_ids) whatever their type: a store need not check them (a list
        would read -1 as its last sample)."""
        a = self.check_ids(ids)
        if self.cache is not None:
            values = self.cache.get_many(a)
        else:
            values = [None] * a.size
        ids = a.tolist()
        # `None in values` is one C-level scan: an all-hit batch (the common case once the cache
        # is warm) builds no Python list of misses.
        missed = [i for i, v in zip(ids, values) if v is None] if None in values else []
        hits = len(ids) - len(missed)
        found = values   # the cache's answers, before the misses are filled in below

        def hit():
            return np.fromiter((v is not None for v in found), bool, len(found))

        wait_ns = 0
        if missed:
            uniq = list(dict.fromkeys(missed))          # a batch may hold an id twice
            t0 = time.perf_counter_ns()
            got = dict(zip(uniq, self.fetch_missing(uniq)))
            wait_ns = time.perf_counter_ns() - t0   # the loop waits on every tier below the cache
            values = [got[i] if v is None else v for i, v in zip(ids, values)]
        self.count_batch(a, hits, hit, wait_ns)
        return values

    def count_batch(self, ids: np.ndarray, hits: int, hit, wait_ns: int = 0) -> None:
        """Counts one batch (ids: int64) of which `hits` were cache hits, `hit()` their bool mask
        (called only when the batch holds a sample the prefetcher brought), wait_ns the time spent
        on the tiers below: hits, misses, samples, prefetch hits (claimed on the order board) and
        the wait, with one look-up of the board (it stats the board's file). Every reader counts
        here: fetch_bytes per batch, sc.CachedLoader per native call."""
        board = board_for(self.cache)
        pf = board.claim_prefetched(ids, hit) if board is not None and hits else 0
        self.counters.add(hits=hits, misses=ids.size - hits, samples=ids.size, prefetch_hits=pf,
                          wait_ns=wait_ns)
        if board is not None:   # per epoch, for ds.stats() and `shadecache stats`
            board.count_reads(reader_stream(board), ids.size, hits, pf, wait_ns)

    def fetch_missing(self, ids: list) -> list:
        """The bytes of every id (distinct, in range) that the node cache missed, through the tier
        chain: the peer node that is home to the id (cluster=), the local SSD tier (ssd=), the
        store; what this node keeps is offered to the cache (admitted by its policy) and what the
        cache refused to the SSD tier (written behind, off this path). The one miss path of every
        reader (fetch_bytes, sc.CachedLoader); see fetch_missing_now for who may overlap."""
        board = board_for(self.cache)
        if board is not None and board.prefetcher_pid:
            # What the node's prefetcher is reading, or holds, is read once: wait for it to be
            # offered to the cache (the wait asks the prefetcher for it).
            a = np.asarray(ids, dtype=np.int64)
            waited = board.wait_for(a, ON_WAY_WAIT_S)
            # and what it put in the cache since this reader missed it there (flagged prefetched)
            coming = waited | board.prefetched(a)
            if coming.any():
                look = a[coming].tolist()
                got = {i: v for i, v in zip(look, self.cache.get_many(look)) if v is not None}
                if got:
                    self._used_prefetched(board, list(got))
                # The cache refused those it did not take when the prefetcher offered them, at
                # this request: they are read from the tier that took them (the SSD tier) and
                # not offered again, as a miss of this reader's own is offered once.
                refused = [i for i in a[waited].tolist() if i not in got]
                skip = set(got).union(refused)
                rest = [i for i in ids if i not in skip]
                values = dict(zip(rest, self.fetch_missing_now(rest)))
                values.update(zip(refused, self.fetch_missing_now(refused, admit=False)))
                return [got[i] if i in got else values[i] for i in ids]
        return self.fetch_missing_now(ids)

    def fetch_missing_now(self, ids: list, admit: bool = True) -> list:
        """fetch_missing without waiting for the prefetcher: the tier chain; admit=False: read
        only (nothing offered to the cache or given to the SSD tier). One caller at a time per
        process when there is a cluster (its connections, one per peer per process, take one
        request at a time) or the store reads whole extents (the process's stage of extent mates;
        a caller that waited looks in the cache again first, so that it does not read again what
        the other's extent read admitted); otherwise callers overlap (one thread's store
        read with another's SSD tier read and admission: the batched reads release the GIL)."""
        if not ids:
            return []
        asked, found = ids, {}
        if self.cluster is None and not self.chain.reads_extents:
            r = self.chain.read(ids)
            if admit:
                self.chain.admit(r)
        else:
            if self._lock_pid != os.getpid():
                # a forked child (a DataLoader worker) inherits the lock as it was at the fork:
                # taken, if a thread of the parent was reading misses then, by a thread it does
                # not have
                self._miss_lock, self._lock_pid = threading.Lock(), os.getpid()
            with self._miss_lock:
                # While this thread waited for the lock, another one's read may have brought
                # some of these ids (an extent read admits its mates): those are taken from the
                # cache, not read again with what is left of their extents.
                found = self._cached_now(ids)
                if found:
                    ids = [i for i in ids if i not in found]
                r = self.chain.read(ids) if ids else None
                if r is not None and admit:
                    self.chain.admit(r)
        if found:
            self._claim_prefetched(list(found))
        if r is not None:
            self.counters.add(**{f"{name}_{field}": v for name, c in r.counts.items()
                                 for field, v in (("calls", 1), ("hits", c.hits),
                                                  ("bytes", c.bytes), ("ns", c.ns))})
        if not found:
            return r.asked_values
        got = dict(zip(ids, r.asked_values)) if r is not None else {}
        return [found[i] if i in found else got[i] for i in asked]

    def _claim_prefetched(self, ids: list) -> None:
        """The ids found in the cache on a second look that the prefetcher brought: used now."""
        board = board_for(self.cache)
        if board is None:
            return
        a = np.asarray(ids, dtype=np.int64)
        flagged = a[board.prefetched(a)]
        if flagged.size:
            self._used_prefetched(board, flagged.tolist())

    def _used_prefetched(self, board, ids: list) -> None:
        """Samples the prefetcher brought that a reader took from the cache: their flags are
        cleared (neither unused nor wasted) and they count as prefetch hits."""
        board.unmark(ids)
        self.counters.add(prefetch_hits=len(ids))
        board.count_reads(reader_stream(board), 0, 0, len(ids), 0)

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

    def __getitems__(self, ids):
        a = self.check_ids(ids)
        values = self.fetch_bytes(a)   # checks the int64 array again: a min and a max
        decode, transform = self.decode, self.transform
        if transform is None:
            xs = [decode(v) for v in values]
        else:
            xs = [transform(decode(v)) for v in values]
        return list(zip(xs, self.labels_of(a).tolist(), a.tolist()))

    def __getitem__(self, i):
        return self.__getitems__([i])[0]

    # ---- pickling: a lock is per process ----------------------------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_miss_lock"], state["_lock_pid"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._miss_lock, self._lock_pid = threading.Lock(), os.getpid()

    # ---- counters ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counts over every process that used this data set: hits, misses, bytes_read (from the
        store), samples, store_reads (distinct ids read), hit_ratio; per tier below the cache
        (`tiers`: peer, ssd, store): samples served, bytes, seconds spent in that tier's batched
        calls, the number of those calls and their mean latency; wait_s (time the loop waited on
        the tiers below the cache for misses), prefetch_hits (hits on samples the prefetcher
        brought); with an order board also prefetched, prefetch_wasted and `per_epoch` (alias
        `prefetch_per_epoch`): one row per epoch (the board keeps the last 32) with the
        prefetcher's counters (prefetched, prefetch_wasted, prefetched_bytes, reads_issued), what
        the loaders of every process on the node read in it (samples, hits, prefetch_hits,
        wait_s) and what the samplers' orders held (accuracy_repeats, stall_deferrals,
        stall_repeats: ShadeSampler). Without a board, `per_epoch` has the sampler's counts
        alone, as noted in this process (note_epoch)."""
        c = self.counters.totals()
        d = {"hits": c["hits"], "misses": c["misses"], "bytes_read": c["store_bytes"],
             "samples": c["samples"], "store_reads": c["store_hits"],
             "peer_hits": c["peer_hits"], "peer_bytes": c["peer_bytes"],
             "ssd_hits": c["ssd_hits"], "ssd_bytes": c["ssd_bytes"],
             "prefetch_hits": c["prefetch_hits"]}
        d["hit_ratio"] = d["hits"] / d["samples"] if d["samples"] else 0.0
        d["tiers"] = {}
        for t in _TIERS:
            seconds = c[f"{t}_ns"] / 1e9
            calls = c[f"{t}_calls"]
            d["tiers"][t] = {"hits": c[f"{t}_hits"], "bytes": c[f"{t}_bytes"], "calls": calls,
                             "seconds": seconds, "mean_latency_s": seconds / calls if calls else 0.0}
        d["wait_s"] = c["wait_ns"] / 1e9
        d.update(_prefetch_stats(self.cache))
        if "per_epoch" not in d and self._notes:
            d["per_epoch"] = [{"epoch": e, "accuracy_repeats": 0, "stall_deferrals": 0,
                               "stall_repeats": 0, **self._notes[e]} for e in sorted(self._notes)]
        return d

    def loader_totals(self):
        """(samples read from the tiers below the cache that keep no copy of their own (the home
        peer, the store), seconds those tiers' calls took, seconds the loaders waited on misses,
        samples not cached when a loader asked for them) summed over every process of this data
        set so far: what ShadeSampler's stall budget measures the store's pace and the training
        step by. The SSD tier's reads are left out of the first two: its samples are local, and
        the stall budget counts them as held (stalls.StallView.hold), not as misses that wait on
        the store. The last counts every miss: the pace's fallback (a loader that waited on the
        prefetcher) divides the wait by them, and a sample the prefetcher read from the store
        and the loader then took from the SSD tier was waited for at the store's pace."""
        c = self.counters.totals()
        read = sum(c[f"{t}_hits"] for t in _SHARED_TIERS)
        tier_ns = sum(c[f"{t}_ns"] for t in _SHARED_TIERS)
        return read, tier_ns / 1e9, c["wait_ns"] / 1e9, c["misses"]

    def note_epoch(self, epoch: int, **counts) -> None:
        """Adds a sampler's per-epoch counts (accuracy_repeats, stall_deferrals, stall_repeats)
        to this process's record, which stats()["per_epoch"] shows when there is no order board
        (the board's rows hold them, node-wide, when there is one)."""
        row = self._notes.setdefault(int(epoch), {})
        for k, v in counts.items():
            row[k] = row.get(k, 0) + int(v)

    def reset_stats(self):
        """Zero the counters (call it while no worker is fetching)."""
        self.counters.reset()
