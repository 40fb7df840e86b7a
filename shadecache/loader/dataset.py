"""CachedDataset: a map-style torch Dataset over a node (shadecache/node/), read through its cache.

A DataLoader worker fetches a whole batch in one call (`__getitems__`, used by torch's fetcher
when the data set defines it):

  1. `cache.get_many(ids)`   hits are copied out of shared memory, no lock;
  2. `node.misses.fetch(..)` the misses through the node's one miss path (node/miss_path.py): the
                             tiers the node was composed with, each batched, then the node's
                             admission rule.

Items are (sample, target, index): the index travels with the batch so that the training loop can
give each loss to the sample that produced it (ShadeSampler.update).

Counters are the node's (node.stats(), also ds.stats()): every process reading it adds to them.
"""
import time

import numpy as np
import torch
from torch.utils.data import Dataset

from ..ids import check_ids


def raw_bytes(data) -> torch.Tensor:
    """The default decode: the sample's bytes as a uint8 tensor (a copy)."""
    if not data:  # torch.frombuffer refuses an empty buffer; the format allows 0-byte samples
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class CachedDataset(Dataset):
    """Items (decode(bytes) -> transform, target, index) of a node's store, read through its cache.

    node       an sc.Node (node.dataset() makes this); or a store, with `cache` (a node of the
               two alone: no tiers below the cache, no prefetcher of its own, misses read sample
               by sample)
    cache      with a store: a sc.Cache with num_samples == len(store), or None
    decode     bytes -> sample (default: a uint8 tensor of the bytes, raw_bytes)
    transform  sample -> sample, applied after decode (augmentation: the cache holds raw bytes)

    `raw` is True when items are the stored bytes as they are (no decode or transform given):
    sc.CachedLoader then assembles whole batches without a Python object per sample.

    Picklable: a DataLoader worker (fork or spawn) gets the node, which attaches the cache and the
    board by name and reopens the store; the shared counters travel with the worker when it is
    started.
    """

    def __init__(self, node, cache=None, decode=None, transform=None):
        from ..node import Node
        if not isinstance(node, Node):
            # the two alone, read sample by sample: the extent plan pays only where the order is
            # arranged by extents (the node's sampler), and this data set goes with any sampler
            node = Node(node, cache, read_ahead=False, read_plan="samples")
        elif cache is not None and cache is not node.cache:
            raise ValueError("CachedDataset(node, cache): the node has its own cache; give one or the other")
        self.node = node
        self.store, self.cache = node.store, node.cache
        self.raw = decode in (None, raw_bytes) and transform is None
        self.decode = decode or raw_bytes
        self.transform = transform
        self._n = len(node.store)

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
            got = dict(zip(uniq, self.node.misses.fetch(uniq)))
            wait_ns = time.perf_counter_ns() - t0   # the loop waits on every tier below the cache
            values = [got[i] if v is None else v for i, v in zip(ids, values)]
        self.node.misses.count_batch(a, hits, hit, wait_ns)
        return values

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

    # ---- counters: the node's --------------------------------------------------------------
    def stats(self) -> dict:
        """The node's counts (Node.stats; node/miss_path.py says what each means)."""
        return self.node.stats()

    def loader_totals(self):
        """The node's loader totals (MissPath.loader_totals): what the stall budget measures."""
        return self.node.misses.loader_totals()

    def note_epoch(self, epoch: int, **counts) -> None:
        self.node.note_epoch(epoch, **counts)

    def reset_stats(self):
        """Zero the counters (call it while no worker is fetching)."""
        self.node.misses.reset()
