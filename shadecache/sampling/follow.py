"""Following the node: with other jobs on its cache, a job takes first what the node holds.

Several jobs on one cache draw their epochs independently (each its own seed and scores), so in a
given minute they want different samples: read as drawn, four jobs read the store four times. A
job that follows the node (ShadeSampler, while another job lives on its board) bends the part of
its epoch not taken yet before each batch: the next `window` positions take, in the order they
come in the epoch, first the samples the node holds, then those on their way from the prefetcher,
then the rest; the samples they move out of the window go to the places those came from. A
sample one job read is then taken by every other job while it is cached, and the store reads it
once for all of them; the cache keeps it until every job that still needs it in its epoch has
taken it (the "uses" merge, lookahead/job_scores.py).

The window is the prefetcher's reach, not the next batch: the prefetcher reads ahead what every
job's published order holds next, and bent one batch at a time, those orders held each job's own
draw beyond its next batch, which the prefetcher read for each of them (measured: three jobs read
2.3 times what one read alone; bent over the prefetcher's window, docs/jobs.md). And cached
first, not "cached or on its way" alike: a job's own next samples are on their way most of the
time, and taken as they came, what the others brought went unused.

What it keeps: the epoch holds the same samples as drawn, each as often (a trade of two
positions, both not taken yet), so a uniform epoch is still an exact permutation and the
coverage floor holds; only the order changes, and only through what is cached. Alone on a cache
a job does not follow: its epochs are what they were before jobs.
"""
from __future__ import annotations

import numpy as np

# How often and how far a job bends (ShadeSampler._follow). The window is bent again each time the
# job has taken 1/REBEND of it: in between, its head already holds the cached samples first, and a
# sample that lands meanwhile waits at most that long to be pulled in. The search for cached
# samples looks HORIZON windows ahead (at least HORIZON_MIN positions: under 1 ms of gathering),
# not the rest of the epoch. Bending the whole rest at every batch cost O(N) a batch: 0.65 s at
# 10 million samples (batch 256, a reach of 1 million); this way, about 1 ms.
REBEND = 16
HORIZON = 4
HORIZON_MIN = 1 << 16


def horizon(window: int) -> int:
    """How far ahead a bend over `window` positions looks for what the node holds."""
    return max(HORIZON * window, HORIZON_MIN)


def follow(order: np.ndarray, k: int, window: int, cached: np.ndarray, on_way: np.ndarray,
           horizon=None):
    """Bends order[k:] toward what the node holds (module docstring), in place: order[k:k+window]
    takes the cached samples of order[k:k+horizon] (None: the rest of the order) nearest first,
    then those on their way; cached and on_way are bool masks over the sample ids. Returns (the
    positions whose ids changed, the moves made in turn: [(places, sources)], order[places] now
    holding what order[sources] held). Costs O(horizon + window), whatever the order's length."""
    changed, moves = [], []
    end = order.size if horizon is None else min(order.size, k + max(int(horizon), 0))
    start, room = k, max(0, min(window, end - k))
    for wanted in (cached, on_way & ~cached):
        if room <= 0:
            break
        places, sources = _gather(order, start, end, room, wanted)
        if places.size:
            moved = order[sources] != order[places]
            order[places] = order[sources]
            changed.append(places[moved])
            moves.append((places, sources))
        filled = int(np.count_nonzero(wanted[order[start:start + room]]))
        start, room = start + filled, room - filled
    if not changed:
        return np.empty(0, np.int64), moves
    return np.unique(np.concatenate(changed)), moves


def _gather(order, start, end, room, wanted):
    """The move that gives order[start:start + m] the m (<= room) ids of order[start:end] that
    `wanted` marks, nearest first, in their order, and the places those left the ids that were
    there, in theirs: (places, sources), both int64. `at` is sorted, so the places (the head
    start..start+m and the wanted positions beyond it) come sorted without a sort."""
    at = start + np.flatnonzero(wanted[order[start:end]])[:room]
    m = at.size
    if not m:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    head = np.arange(start, start + m, dtype=np.int64)
    beyond = at[at >= start + m]                  # wanted ids outside the head: they move in
    in_head = np.zeros(m, bool)
    in_head[at[at < start + m] - start] = True    # wanted ids already in the head: they shift
    places = np.concatenate([head, beyond])
    sources = np.concatenate([at, head[~in_head]])   # the head's other ids go where those were
    return places.astype(np.int64), sources.astype(np.int64)
