"""Following the node: with other jobs on its cache, a job takes first what the node holds.

Several jobs on one cache draw their epochs independently (each its own seed and scores), so in a
given minute they want different samples: read as drawn, four jobs read the store four times. A
job that follows the node (ShadeSampler, while another job lives on its board) bends the part of
its epoch not taken yet, batch by batch: each sample of the next batch that the node neither
holds nor is reading ("cold") trades places with the nearest sample after the batch that the node
holds or is reading for someone ("warm": cached, or on its way from the prefetcher). A sample one
job read is then taken by every other job while it is cached, and the store reads it once for all
of them; the cache keeps it until every job that still needs it in its epoch has taken it (the
"uses" merge, lookahead/job_scores.py).

What it keeps: the epoch holds the same samples as drawn, each as often (a trade of two
positions, both not taken yet), so a uniform epoch is still an exact permutation and the
coverage floor holds; only the order changes, and only through what is cached. Alone on a cache
a job does not follow: its epochs are what they were before jobs.
"""
from __future__ import annotations

import numpy as np


def follow(order: np.ndarray, k: int, end: int, warm: np.ndarray) -> tuple:
    """Trades each cold id of order[k:end] (warm: a bool per sample id) with the nearest warm id
    in order[end:], in place; returns (positions of the batch, positions after it) traded, pair by
    pair, nearest first."""
    batch = order[k:end]
    cold = np.flatnonzero(~warm[batch])
    if not cold.size or end >= order.size:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    later = np.flatnonzero(warm[order[end:]])[:cold.size]
    m = later.size
    near, far = (k + cold[:m]).astype(np.int64), (end + later).astype(np.int64)
    if m:
        order[near], order[far] = order[far], order[near].copy()
    return near, far
