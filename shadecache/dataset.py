"""CachedDataset: a map-style torch Dataset over a sample store, behind a shared-memory Cache.

A DataLoader worker fetches a whole batch in one call (`__getitems__`, used by torch's fetcher
when the data set defines it):

  1. `cache.get_many(ids)`                   hits are copied out of shared memory, no lock;
  2. `store.read_many(unique missed ids)`    one batch of I/O for all the misses;
  3. `cache.put_many(ids, values)`           one lock; the engine admits each sample by its current
                                             importance score in the shared table, so admission
                                             compares like with like.

Items are (sample, target, index): the index travels with the batch so that the training loop can
give each loss to the sample that produced it (ShadeSampler.update).

Hits, misses, bytes read from the store and samples served are counted in a small shared array
(multiprocessing.RawArray, which travels to fork and spawn workers alike), one row per process:
row 0 for the main process and 1 + worker id for a DataLoader worker, so no process ever writes
another's row and no lock between processes is needed (no lock object could be shared between a
fork-context parent and spawn-context workers anyway); threads of one process (sc.CachedLoader's)
bump their row under a threading lock. `stats()` sums the rows. Two DataLoaders iterating the SAME
CachedDataset object at the same time would share worker rows; give each its own object.
"""
import multiprocessing as mp
import os
import threading

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

_FIELDS = ("hits", "misses", "bytes_read", "samples", "store_reads")
_ROWS = 65   # row 0: the main process; rows 1..64: DataLoader workers by worker id (mod 64)


def _default_decode(data):
    if not data:  # torch.frombuffer refuses an empty buffer; the format allows 0-byte samples
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class CachedDataset(Dataset):
    """Items (decode(bytes) -> transform, target, index) of a store, read through a cache.

    store      anything with len(), read_many(ids) -> list of bytes, label(i) (sc.PackedStore,
               sc.FolderStore)
    cache      a sc.Cache with num_samples == len(store), or None (every read goes to the store)
    decode     bytes -> sample (default: a uint8 tensor of the bytes)
    transform  sample -> sample, applied after decode (augmentation: the cache holds raw bytes)
    admit      insert missed samples into the cache (False: read-through only)

    Picklable: a spawned DataLoader worker re-attaches the cache by name and reopens the store
    (both pickle that way); the shared counters travel with the worker when it is started.
    """

    def __init__(self, store, cache=None, decode=None, transform=None, admit: bool = True):
        self.store = store
        self.cache = cache
        n = len(store)
        if cache is not None and cache.num_samples != n:
            raise ValueError(f"cache {cache.name!r} holds {cache.num_samples} sample ids but the "
                             f"store has {n} samples")
        self.decode = decode or _default_decode
        self.transform = transform
        self.admit = bool(admit)
        self._n = n
        self._counters = mp.RawArray("q", _ROWS * len(_FIELDS))
        self._view = None
        self._row_view = None
        self._row_pid = None
        self._count_lock = threading.Lock()

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
        nbytes = reads = 0
        if missed:
            uniq, data = self.read_misses(missed)
            reads = len(uniq)
            got = dict(zip(uniq, data))
            nbytes = sum(len(d) for d in data)
            values = [got[i] if v is None else v for i, v in zip(ids, values)]
        self.count(len(ids) - len(missed), len(missed), nbytes, len(ids), reads)
        return values

    def read_misses(self, missed):
        """(unique ids, their bytes) for the missed ids of one batch (a list of ints, an id may
        repeat): one batch read from the next tier (the store), then offered to the cache, where
        the engine admits each by its current importance score. The one miss path of every reader
        (fetch_bytes, sc.CachedLoader), so a tier added here serves them all. Counts nothing: the
        caller reports the batch through count()."""
        uniq = list(dict.fromkeys(missed))          # a batch may hold an id twice
        data = self.store.read_many(uniq)
        if self.cache is not None and self.admit:
            # No scores passed: the engine admits each sample by its current score in the
            # shared table (importance policy), so nothing is copied out of the table here.
            self.cache.put_many(np.asarray(uniq, dtype=np.int64), data)
        return uniq, data

    def count(self, hits: int, misses: int, nbytes: int, samples: int, reads: int) -> None:
        """Adds one batch to this process's counter row. Threads of one process share the row
        (CachedLoader's assembly threads), so the read-modify-write is done under a lock."""
        row = self._row()
        with self._count_lock:
            row[0] += hits
            row[1] += misses
            row[2] += nbytes
            row[3] += samples
            row[4] += reads

    def _row(self):
        """This process's counter row, as a memoryview of int64 (cheaper to bump than numpy)."""
        if self._row_view is None or self._row_pid != os.getpid():
            info = get_worker_info()
            r = 0 if info is None else 1 + info.id % (_ROWS - 1)
            self._row_view = memoryview(self._counters).cast("B").cast("q")[r * len(_FIELDS):(r + 1) * len(_FIELDS)]
            self._row_pid = os.getpid()
            self._count_lock = threading.Lock()   # a forked child must not inherit a held lock
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
        del state["_count_lock"]   # a lock does not pickle; each process gets its own
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._count_lock = threading.Lock()

    def stats(self) -> dict:
        """Counts over every process that used this data set: hits, misses, bytes_read (from the
        store), samples, store_reads (distinct ids read), and hit_ratio."""
        d = dict(zip(_FIELDS, (int(v) for v in self._table().sum(axis=0))))
        d["hit_ratio"] = d["hits"] / d["samples"] if d["samples"] else 0.0
        return d

    def reset_stats(self):
        """Zero the counters (call it while no worker is fetching)."""
        self._table()[:] = 0
