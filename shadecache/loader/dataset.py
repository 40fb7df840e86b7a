"""CachedDataset: a map-style torch Dataset over a sample store, behind a shared-memory Cache.

A DataLoader worker fetches a whole batch in one call (`__getitems__`, used by torch's fetcher
when the data set defines it):

  1. `cache.get_many(ids)`                   hits are copied out of shared memory, no lock;
  2. `fetch_missing(unique missed ids)`      the tiers, each batched: the peer node that is home
                                             to an id (cluster=), the local SSD tier (ssd=), then
                                             one store.read_many for what is left;
  3. `cache.put_many(ids, values)`           one lock; the engine admits each sample by its current
                                             importance score in the shared table, so admission
                                             compares like with like.

Items are (sample, target, index): the index travels with the batch so that the training loop can
give each loss to the sample that produced it (ShadeSampler.update).

Hits, misses, bytes read from the store and samples served are counted in a small shared array
(multiprocessing.RawArray, which travels to fork and spawn workers alike), one row per process:
row 0 for the main process and 1 + worker id for a DataLoader worker, so no process ever writes
another's row and no lock between processes is needed (no lock object could be shared between a
fork-context parent and spawn-context workers anyway). Threads of one process (sc.CachedLoader's)
share its row: the hit counts are bumped under one threading lock (count()), the tier counts under
another (fetch_missing), so each field has one lock. `stats()` sums the rows. Two DataLoaders
iterating the SAME CachedDataset object at the same time would share worker rows; give each its
own object.
"""
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ..lookahead.board import board_for

_FIELDS = ("hits", "misses", "bytes_read", "samples", "store_reads",
           "peer_hits", "peer_bytes", "peer_ns", "ssd_hits", "ssd_bytes", "ssd_ns", "store_ns",
           "prefetch_hits", "wait_ns", "peer_calls", "ssd_calls", "store_calls")
_ROWS = 65   # row 0: the main process; rows 1..64: DataLoader workers by worker id (mod 64)


def _default_decode(data):
    if not data:  # torch.frombuffer refuses an empty buffer; the format allows 0-byte samples
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _prefetch_hits(board, ids, hit) -> int:
    """Hits on samples the prefetcher brought and no read had used yet (their board flag is
    cleared here: shadecache/lookahead/board.py). hit(): the batch's bool mask of cache hits."""
    flags = board.flags[ids]
    if not flags.any():
        return 0
    used = ids[(flags != 0) & hit()]
    board.flags[used] = 0
    return int(np.unique(used).size)


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

    store      anything with len(), read_many(ids) -> list of bytes, label(i) (sc.PackedStore,
               sc.FolderStore)
    cache      a sc.Cache with num_samples == len(store), or None (every read goes to the store)
    decode     bytes -> sample (default: a uint8 tensor of the bytes)
    transform  sample -> sample, applied after decode (augmentation: the cache holds raw bytes)
    admit      insert missed samples into the cache (False: read-through only)
    cluster    a sc.Cluster: a miss whose home is another node is asked of that node first
    ssd        a sc.SSDTier: consulted after the peers, before the store; filled behind reads;
               bound to the store's fingerprint (FingerprintError if it holds another data set)
    keep_remote  also offer samples whose home is another node to this node's cache and SSD
               tier (default: a node keeps what it is home to, so the cluster caches the sum)

    Picklable: a spawned DataLoader worker re-attaches the cache by name and reopens the store
    (both pickle that way); the shared counters travel with the worker when it is started.
    """

    def __init__(self, store, cache=None, decode=None, transform=None, admit: bool = True,
                 cluster=None, ssd=None, keep_remote: bool = False):
        self.store = store
        self.cache = cache
        n = len(store)
        if cache is not None and cache.num_samples != n:
            raise ValueError(f"cache {cache.name!r} holds {cache.num_samples} sample ids but the "
                             f"store has {n} samples")
        self.decode = decode or _default_decode
        self.transform = transform
        self.admit = bool(admit)
        self.cluster = cluster
        self.ssd = ssd
        if ssd is not None:   # the tier must hold this store's samples, not another's by the same ids
            ssd.bind_store(store)
        self.keep_remote = bool(keep_remote)
        self._n = n
        self._counters = mp.RawArray("q", _ROWS * len(_FIELDS))
        self._view = None
        self._row_view = None
        self._row_pid = None
        self._count_lock = threading.Lock()
        self._miss_lock = threading.Lock()
        self._notes = {}      # epoch -> a sampler's counts (note_epoch), this process only

    def __len__(self):
        return self._n

    def label(self, i: int) -> int:
        return int(self.store.label(i))

    def labels_of(self, ids: np.ndarray) -> np.ndarray:
        """Labels of checked ids, as an int64 array (one gather from the store's label array)."""
        labels = getattr(self.store, "labels", None)   # the store's in-memory label array
        if isinstance(labels, np.ndarray) and labels.shape == (self._n,):
            return labels.take(ids).astype(np.int64, copy=False)
        return np.array([int(self.store.label(i)) for i in ids.tolist()], dtype=np.int64)

    # ---- the batched path --------------------------------------------------------------------
    def check_ids(self, ids) -> np.ndarray:
        """ids as an int64 array, every one in 0..N-1 (TypeError / IndexError naming the id)."""
        a = np.asarray(ids)
        if a.ndim != 1:
            a = a.reshape(-1)
        if a.size and a.dtype.kind not in "iu":
            for i in a.tolist():
                if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
                    raise TypeError(f"sample id must be an integer, got {i!r}")
            a = a.astype(np.int64)
        a = a.astype(np.int64, copy=False)
        if a.size and (a.min() < 0 or a.max() >= self._n):
            bad = np.flatnonzero((a < 0) | (a >= self._n))
            raise IndexError(f"sample id {int(a[bad[0]])} is out of range 0..{self._n - 1}")
        return a

    def fetch_bytes(self, ids):
        """Raw bytes of each id, in order: cache first, then one store read for the misses."""
        a = ids if isinstance(ids, np.ndarray) and ids.dtype == np.int64 else self.check_ids(ids)
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
        (called only when some id carries a prefetched flag), wait_ns the time spent on the tiers
        below: hits, misses, samples, prefetch hits (their board flags cleared) and the wait, with
        one look-up of the order board (it stats the board's file). Every reader counts here:
        fetch_bytes per batch, sc.CachedLoader per native call."""
        board = board_for(self.cache)
        pf = _prefetch_hits(board, ids, hit) if board is not None and hits else 0
        self._count(board, hits, ids.size - hits, ids.size, pf, wait_ns)

    def _count(self, board, hits, misses, samples, prefetch_hits, wait_ns) -> None:
        row = self._row()
        with self._count_lock:
            row[0] += hits
            row[1] += misses
            row[3] += samples
            row[12] += prefetch_hits
            row[13] += wait_ns
        if board is not None:   # per epoch, for ds.stats() and `shadecache stats`
            board.count_reads(samples, hits, prefetch_hits, wait_ns)

    def fetch_missing(self, ids: list) -> list:
        """The bytes of every id (distinct, in range) that the node cache missed, through the tiers
        (see _fetch_missing_locked). The one miss path of every reader (fetch_bytes,
        sc.CachedLoader). One caller at a time per process: the tier counters are bumped under
        this lock, and the store serialises its callers anyway."""
        self._row()   # first, so a forked child takes its own lock, never one inherited held
        with self._miss_lock:
            return self._fetch_missing_locked(ids)

    def _fetch_missing_locked(self, ids: list) -> list:
        """The bytes of every id (distinct, in range) that the node cache missed, through the
        tiers in order: the peer node that is home to the id (cluster=), the local SSD tier
        (ssd=), the store. What this node is home to is offered to the cache (admitted by its
        policy) and what the cache refused to the SSD tier (written behind, off this path); what another node is home
        to is kept only with keep_remote=True. Counts go to this process's counter row."""
        n = len(ids)
        values = [None] * n
        row = self._row()
        a = np.asarray(ids, dtype=np.int64)
        own = np.ones(n, dtype=bool)
        cluster = self.cluster
        if cluster is not None and cluster.num_nodes > 1:
            home = cluster.home_of(a)
            own = home == cluster.node
            remote = np.flatnonzero(~own)
            if remote.size:
                t0 = time.perf_counter_ns()
                got = cluster.fetch(a[remote], home[remote])
                hits = 0
                for k, v in zip(remote.tolist(), got):
                    if v is not None:
                        values[k] = v
                        hits += 1
                        row[6] += len(v)
                row[5] += hits
                row[7] += time.perf_counter_ns() - t0
                row[14] += 1
        from_ssd = []
        if self.ssd is not None:
            pending = [k for k in range(n) if values[k] is None]
            if pending:
                t0 = time.perf_counter_ns()
                got = self.ssd.get_many([ids[k] for k in pending])
                for k, v in zip(pending, got):
                    if v is not None:
                        values[k] = v
                        from_ssd.append(k)
                        row[9] += len(v)
                row[8] += len(from_ssd)
                row[10] += time.perf_counter_ns() - t0
                row[15] += 1
        pending = [k for k in range(n) if values[k] is None]
        if pending:
            t0 = time.perf_counter_ns()
            data = self.store.read_many([ids[k] for k in pending])
            row[11] += time.perf_counter_ns() - t0
            row[16] += 1
            for k, v in zip(pending, data):
                values[k] = v
            row[2] += sum(len(d) for d in data)
            row[4] += len(pending)
        admitted = None
        if self.cache is not None and self.admit:
            keep = np.flatnonzero(own) if not self.keep_remote else np.arange(n)
            if keep.size:
                # No scores passed: the engine admits each sample by its current score in the
                # shared table (importance policy), so nothing is copied out of the table here.
                admitted = dict(zip(keep.tolist(), self.cache.put_many(a[keep], [values[k] for k in keep.tolist()]).tolist()))
        if self.ssd is not None and pending:
            # The SSD tier keeps what the RAM cache refused (exclusive tiers: together they hold
            # RAM + SSD worth of samples, not the larger of the two).
            keep = [k for k in pending if (own[k] or self.keep_remote) and not (admitted or {}).get(k, False)]
            if keep:
                self.ssd.put_many([ids[k] for k in keep], [values[k] for k in keep])
        return values

    def _row(self):
        """This process's counter row, as a memoryview of int64 (cheaper to bump than numpy)."""
        if self._row_view is None or self._row_pid != os.getpid():
            info = get_worker_info()
            r = 0 if info is None else 1 + info.id % (_ROWS - 1)
            self._row_view = memoryview(self._counters).cast("B").cast("q")[r * len(_FIELDS):(r + 1) * len(_FIELDS)]
            self._row_pid = os.getpid()
            # a forked child must not inherit a lock held by a thread that did not come along
            self._count_lock = threading.Lock()
            self._miss_lock = threading.Lock()
        return self._row_view

    def __getitems__(self, ids):
        a = self.check_ids(ids)
        values = self.fetch_bytes(a)
        decode, transform = self.decode, self.transform
        if transform is None:
            xs = [decode(v) for v in values]
        else:
            xs = [transform(decode(v)) for v in values]
        return list(zip(xs, self.labels_of(a).tolist(), a.tolist()))

    def __getitem__(self, i):
        return self.__getitems__([i])[0]

    # ---- counters ----------------------------------------------------------------------------
    def _table(self) -> np.ndarray:
        if self._view is None:
            self._view = np.frombuffer(self._counters, dtype=np.int64).reshape(_ROWS, len(_FIELDS))
        return self._view

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_view"] = None      # rebuilt over the shared array in the receiving process
        state["_row_view"] = None
        state["_row_pid"] = None
        del state["_count_lock"], state["_miss_lock"]   # locks do not pickle; each process its own
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._count_lock = threading.Lock()
        self._miss_lock = threading.Lock()

    def stats(self) -> dict:
        """Counts over every process that used this data set: hits, misses, bytes_read (from the
        store), samples, store_reads (distinct ids read), hit_ratio; per tier below the cache
        (`tiers`: peer, ssd, store): samples served, bytes, seconds spent in that tier's batched
        calls, the number of those calls and their mean latency; wait_s (time the loop waited on the tiers below the cache for misses),
        prefetch_hits (hits on samples the prefetcher brought); with an order board also
        prefetched, prefetch_wasted and `per_epoch` (alias `prefetch_per_epoch`): one row per
        epoch (the board keeps the last 32) with the prefetcher's counters (prefetched,
        prefetch_wasted, prefetched_bytes, reads_issued), what the loaders of every process on
        the node read in it (samples, hits, prefetch_hits, wait_s) and what the samplers' orders
        held (accuracy_repeats, stall_deferrals, stall_repeats: ShadeSampler). Without a board,
        `per_epoch` has the sampler's counts alone, as noted in this process (note_epoch)."""
        d = dict(zip(_FIELDS, (int(v) for v in self._table().sum(axis=0))))
        d["hit_ratio"] = d["hits"] / d["samples"] if d["samples"] else 0.0
        d["tiers"] = {
            "peer": {"hits": d["peer_hits"], "bytes": d["peer_bytes"], "ns": d.pop("peer_ns"),
                     "calls": d.pop("peer_calls")},
            "ssd": {"hits": d["ssd_hits"], "bytes": d["ssd_bytes"], "ns": d.pop("ssd_ns"),
                    "calls": d.pop("ssd_calls")},
            "store": {"hits": d["store_reads"], "bytes": d["bytes_read"], "ns": d.pop("store_ns"),
                      "calls": d.pop("store_calls")},
        }
        for tier in d["tiers"].values():
            tier["seconds"] = tier.pop("ns") / 1e9
            tier["mean_latency_s"] = tier["seconds"] / tier["calls"] if tier["calls"] else 0.0
        d["wait_s"] = d.pop("wait_ns") / 1e9
        d.update(_prefetch_stats(self.cache))
        if "per_epoch" not in d and self._notes:
            d["per_epoch"] = [{"epoch": e, "accuracy_repeats": 0, "stall_deferrals": 0,
                               "stall_repeats": 0, **self._notes[e]} for e in sorted(self._notes)]
        return d

    def loader_totals(self):
        """(samples read from the tiers below the cache, seconds those tiers' calls took, seconds
        the loaders waited on misses) summed over every process of this data set so far: what
        ShadeSampler's stall budget measures the store's pace and the training step by."""
        t = self._table().sum(axis=0)
        f = _FIELDS.index
        read = int(t[f("peer_hits")] + t[f("ssd_hits")] + t[f("store_reads")])
        tier_ns = int(t[f("peer_ns")] + t[f("ssd_ns")] + t[f("store_ns")])
        return read, tier_ns / 1e9, int(t[f("wait_ns")]) / 1e9

    def note_epoch(self, epoch: int, **counts) -> None:
        """Adds a sampler's per-epoch counts (accuracy_repeats, stall_deferrals, stall_repeats)
        to this process's record, which stats()["per_epoch"] shows when there is no order board
        (the board's rows hold them, node-wide, when there is one)."""
        row = self._notes.setdefault(int(epoch), {})
        for k, v in counts.items():
            row[k] = row.get(k, 0) + int(v)

    def reset_stats(self):
        """Zero the counters (call it while no worker is fetching)."""
        self._table()[:] = 0
