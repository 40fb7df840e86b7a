"""The prefetcher's plan: from what the board and the cache say now to the next batch to read.

A pure function of its inputs (no board, no cache, no process): the loop around it
(read_ahead.py) takes a snapshot, asks next_reads, and acts on the answer. So the rule by which the
prefetcher reads ahead is written once, here, and tested without a process (tests/lookahead/
test_prefetch_plan.py); the rule's name is what the prefetcher publishes on the board for the
samplers' stall budget (board.READS_*).

One pass:
1. candidates: the window's ids (the next ids of every stream, by distance from the cursors) that
   are not cached, that this node keeps (another node is home to the rest), and that are neither
   on their way nor refused by the cache this epoch;
2. the rule, once the cache is full:
     READS_EVERY_MISS  (no copying tier) every candidate; room is made for it (step 4);
     READS_ADMITTED    (an SSD tier) only what the cache would admit when it is due and the SSD
                       tier does not hold: the rest the loader reads when it is due, from the SSD
                       tier or the store, as without a prefetcher. Each sample not cached that is
                       due before a candidate may displace the lowest cached one first (counted
                       twice: scores move meanwhile), so a candidate is read only if it outscores
                       what would be left;
     READS_UNTIL_FULL  (the extent plan) nothing: an extent read lands whole long before most of
                       its samples are due, and what it displaces may be due sooner;
3. the batch: the first candidates, at most `batch` of them and within the bytes left of
   `max_bytes` once what is in flight and held is counted;
4. room (READS_EVERY_MISS, a full cache): one out for one in, what the cache's free bytes take
   excepted until the engine has refused or evicted (then its free bytes say nothing: slots are
   rounded up to their size class).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from .board import READS_ADMITTED, READS_EVERY_MISS, READS_UNTIL_FULL


class Ahead(NamedTuple):
    """What the prefetcher has ahead of the loaders, and what it knows of the cache, now."""
    inflight: int         # batches submitted and not taken yet
    on_way: int           # samples read or held and not offered yet (their ids are skipped)
    pending_bytes: int    # their bytes
    full: bool            # the cache is full (refused, evicted, or 90% taken)
    engine_full: bool     # ... and the engine said so itself (refused or evicted)
    free: int             # the cache's bytes nothing cached, held or in flight takes


class Limits(NamedTuple):
    """The prefetcher's options that bound one pass."""
    batch: int            # samples per read batch
    max_batches: int      # batches in flight at most
    max_bytes: int        # bytes read ahead and not offered yet, at most
    item_bytes: int       # the size assumed for a sample of unknown length


class Reads(NamedTuple):
    """The next batch: ids, their global positions, their bytes, and how many cached samples
    needed later to remove first (READS_EVERY_MISS into a full cache)."""
    ids: np.ndarray
    places: np.ndarray
    nbytes: np.ndarray
    evict: int


NOTHING = Reads(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), 0)


def candidates(ids: np.ndarray, places: np.ndarray, cached: np.ndarray,
               kept: Callable[[np.ndarray], np.ndarray], skip: np.ndarray):
    """(ids, places) of the window's ids neither cached (cached: a bool per id of the data set),
    nor kept by another node (kept(ids) -> mask), nor in `skip` (on their way, refused)."""
    keep = ~cached[ids] if ids.size else np.zeros(0, dtype=bool)
    if keep.any():
        keep[keep] = kept(ids[keep])
    if skip.size and keep.any():
        keep[keep] = ~np.isin(ids[keep], skip)
    return ids[keep], places[keep]


def by_rule(ids: np.ndarray, places: np.ndarray, rule: int, ahead: Ahead,
            held: Callable[[np.ndarray], np.ndarray],
            would_admit: Callable[[np.ndarray, np.ndarray], np.ndarray]):
    """(ids, places) of the candidates the rule reads now (step 2 of the module docstring)."""
    if rule not in (READS_EVERY_MISS, READS_ADMITTED, READS_UNTIL_FULL):
        raise ValueError(f"unknown read rule {rule}")
    if not ids.size or not ahead.full or rule == READS_EVERY_MISS:
        return ids, places
    if rule == READS_UNTIL_FULL:
        return ids[:0], places[:0]
    due_before = 2 * (ahead.on_way + np.arange(ids.size))
    ok = ~np.asarray(held(ids), dtype=bool) & np.asarray(would_admit(ids, due_before), dtype=bool)
    return ids[ok], places[ok]


def next_reads(ids: np.ndarray, places: np.ndarray, lengths, rule: int, ahead: Ahead,
               limits: Limits, held, would_admit) -> Reads:
    """The next batch to read among the candidates (steps 2-4 of the module docstring);
    lengths: the store's sample lengths (an array) or None."""
    if ahead.inflight >= limits.max_batches:
        return NOTHING
    ids, places = by_rule(ids, places, rule, ahead, held, would_admit)
    if not ids.size:
        return NOTHING
    nbytes = (np.asarray(lengths)[ids].astype(np.int64) if lengths is not None
              else np.full(ids.size, limits.item_bytes, np.int64))
    cut = int(np.searchsorted(np.cumsum(nbytes), limits.max_bytes - ahead.pending_bytes,
                              side="right"))
    k = min(limits.batch, cut)
    evict = 0
    if k and ahead.full and rule == READS_EVERY_MISS:
        evict = k
        if not ahead.engine_full:
            evict -= int(np.searchsorted(np.cumsum(nbytes[:k]), ahead.free, side="right"))
    return Reads(ids[:k], places[:k], nbytes[:k], evict)
