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

  layout = node.read_plan.layout                   # extent of each id (read_plan.py)
  order  = arrange(ids, layout, window=16, rng)    # the same ids, in extent order
"""
from __future__ import annotations

import numpy as np

from ..read_plan import ExtentLayout  # noqa: F401  (the layout the order is arranged by)


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
