"""The extent order: an epoch drawn so that its misses are read as large sequential extents.

A packed store lays its samples out in a seeded shuffle of their ids (docs/store_format.md), so a
run of neighbours on disk (an extent) is a random handful of the data set. The extent order keeps
the epoch's draw (which ids, how often: importance, the coverage floor, the cache's substitutions
are unchanged) and changes only the sequence: the draw's extents are shuffled, and the samples of
each window of `window` consecutive extents are shuffled together. So the loader asks for the
samples of a few extents at a time, and a read of a whole extent (csrc/io/extent_read.h) serves
many of them; the idea of Streaming's py1e shuffle and LitData's chunk order, over a placement
that is already random.

What a batch sees: `window` x (samples per extent) candidates instead of the whole data set, a
different mix every epoch (extents are shuffled, windows regrouped); bench/fidelity.py measures what
that costs in accuracy. Memory on the reading side: about window x extent_bytes of samples read
ahead of their turn, which the cache keeps (the prefetch window covers it).

  layout = ExtentLayout.of_store(store)            # extent of each id, from the placement
  order  = arrange(ids, layout, window=16, rng)    # the same ids, in extent order
"""
from __future__ import annotations

import os

import numpy as np

from ..ids import check_ids

DEFAULT_WINDOW = 16          # extents shuffled together
MIN_EXTENT_BYTES = 64 << 10
MAX_EXTENT_BYTES = 8 << 20
REQUESTS_PER_EXTENT = 16     # an extent is this many gaps long: a request costs <= 1/16 of its bytes


def extent_bytes_for(store) -> int:
    """An extent long enough that its request costs the device at most 1/16 of its transfer:
    16 x the store's gap threshold (bandwidth / IOPS), within [64 KiB, 8 MiB]."""
    gap = int(getattr(store, "gap_bytes", 0) or 0)
    return int(min(MAX_EXTENT_BYTES, max(MIN_EXTENT_BYTES, REQUESTS_PER_EXTENT * gap)))


class ExtentLayout:
    """Which extent each sample id lies in: consecutive runs of about `extent_bytes` bytes of the
    store's disk order (a sample belongs to the extent its first byte falls in)."""

    def __init__(self, disk_order, lengths, extent_bytes: int):
        disk_order = np.asarray(disk_order, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        n = lengths.size
        if disk_order.size != n or (n and not np.array_equal(np.sort(disk_order), np.arange(n))):
            raise ValueError("disk_order must be a permutation of the ids 0..N-1 "
                             f"(N = {n}, the number of lengths)")
        if int(extent_bytes) < 1:
            raise ValueError(f"extent_bytes must be >= 1, not {extent_bytes!r}")
        self.extent_bytes = int(extent_bytes)
        starts = np.cumsum(lengths[disk_order]) - lengths[disk_order]
        self.extent_of = np.empty(n, dtype=np.int64)
        self.extent_of[disk_order] = starts // self.extent_bytes
        self.extents = int(self.extent_of.max()) + 1 if n else 0
        # the members of extent e are by_extent[first[e]:first[e + 1]] (disk order is extent order)
        self.by_extent = disk_order
        self.position = np.empty(n, dtype=np.int64)   # each id's place in the disk order
        self.position[disk_order] = np.arange(n, dtype=np.int64)
        self.first = np.searchsorted(self.extent_of[disk_order], np.arange(self.extents + 1))
        # The pass over an order that the sampler which drew this layout is in (a number, one
        # more for each pass: begin_pass), and that sampler's process: in that process the tier
        # chain knows which ids the pass still asks for (due). A copy in another process (a
        # DataLoader worker, the prefetcher) is not told, and its pid differs.
        self.turn = 0
        self.epoch_pid = None
        self._due = None          # bool per id: the current pass asks for it and has not yet

    def begin_pass(self, order=None) -> None:
        """The sampler starts a pass over its order in this process (ShadeSampler.__iter__: a
        new epoch, the same epoch iterated again, a resume), whichever way the epoch moved
        (set_epoch, end_epoch, load_state_dict). order: the ids the pass will ask for (this
        rank's share, from a resume's position on; None: every id); only those are worth reading
        as extent mates in this process, until the chain is asked for them (asked)."""
        self.turn += 1
        self.epoch_pid = os.getpid()
        if order is None:
            self._due = np.ones(self.extent_of.size, dtype=bool)
        else:
            self._due = np.zeros(self.extent_of.size, dtype=bool)
            self._due[np.asarray(order, dtype=np.int64)] = True

    def asked(self, ids) -> None:
        """The chain of the sampler's process was asked for `ids` in this pass: they are not due
        as mates any more (a sample asked again in its extent's window, one cached when its
        extent was read and evicted since, is read with the extent's samples still due, not
        with the whole extent). Elsewhere nothing is recorded."""
        if self._due is not None and self.epoch_pid == os.getpid():
            self._due[np.asarray(ids, dtype=np.int64)] = False

    def due(self, ids) -> np.ndarray:
        """Bool mask: which of `ids` the current pass still asks for. Only in the sampler's
        process (epoch_pid) once a pass began; elsewhere every id counts as due."""
        ids = np.asarray(ids, dtype=np.int64)
        if self._due is None or self.epoch_pid != os.getpid():
            return np.ones(ids.size, dtype=bool)
        return self._due[ids]

    def widen(self, ids) -> np.ndarray:
        """Every id of the extents that `ids` touch (distinct, in disk order): what one read of
        those extents brings."""
        ext = np.unique(self.extent_of[check_ids(ids, self.extent_of.size)])
        if ext.size == 0:
            return np.empty(0, dtype=np.int64)
        lo, hi = self.first[ext], self.first[ext + 1]
        counts = hi - lo
        starts = np.repeat(lo - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        return self.by_extent[starts + np.arange(int(counts.sum()))]

    def shared_scores(self, ids, scores, cached=None) -> tuple:
        """(members, their scores): every id of the extents that `ids` touch, each with the mean
        of `scores` (one per id of the data set) over its extent. Under the extent order a miss
        reads its whole extent, so a cached sample saves a read only while all of its extent is
        held: the cache and the SSD tier are given one score per extent (its samples' mean), and
        keep, evict and admit whole extents by it.

        cached (a bool per id, the cache's content): the extents it holds whole score one
        standard deviation of the extents' means higher, so that another extent takes the place
        of one held only where it scores clearly higher. An extent is a random handful of
        samples, and the means of most extents differ by less than their noise: swapping them on
        every difference read an extent for each swap."""
        members = self.widen(ids)
        if members.size == 0:
            return members, np.empty(0, dtype=np.float64)
        # by bincount: an extent index a sample larger than extent_bytes skipped has no members
        counts = np.bincount(self.extent_of, minlength=self.extents)
        means = (np.bincount(self.extent_of, weights=np.asarray(scores, dtype=np.float64),
                             minlength=self.extents) / np.maximum(counts, 1))
        if cached is not None and self.extents > 1:
            some = counts > 0
            held = some & (np.bincount(self.extent_of, weights=np.asarray(cached, dtype=np.float64),
                                       minlength=self.extents) == counts)
            means = means + float(np.std(means[some])) * held
        return members, means[self.extent_of[members]]

    @classmethod
    def of_store(cls, store, extent_bytes: int | None = None) -> "ExtentLayout":
        return cls(store.disk_order(), store.lengths,
                   extent_bytes_for(store) if extent_bytes is None else extent_bytes)

    def __len__(self) -> int:
        return self.extent_of.size


def arrange(ids, layout: ExtentLayout, window: int, rng: np.random.Generator) -> np.ndarray:
    """`ids` (with repeats, any subset) in extent order: their extents in a random sequence,
    the samples of each `window` consecutive extents of it shuffled together."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return ids.copy()
    ext = layout.extent_of[ids]
    present = np.unique(ext)
    rank = np.empty(layout.extents, dtype=np.int64)
    rank[present] = rng.permutation(present.size)
    win = rank[ext] // max(1, int(window))
    return ids[np.lexsort((rng.random(ids.size), win))]


def store_of(data_source):
    """The packed store behind a data source (a PackedStore itself, or a CachedDataset's), or
    None when there is none (a FolderStore, a tensor data set, a size)."""
    for candidate in (data_source, getattr(data_source, "store", None)):
        if candidate is not None and hasattr(candidate, "disk_order") and hasattr(candidate, "lengths"):
            return candidate
    return None
