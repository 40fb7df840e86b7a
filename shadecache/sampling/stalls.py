"""The stall budget: the epoch's order bends around a store that cannot keep up with training.

A miss stalls the training loop when it is not in the cache by the time its batch is assembled and
the store, at its measured speed, cannot deliver it in time. ShadeSampler calls `StallPlanner.plan`
before each batch's ids are taken (and, with a live prefetcher, for the batch LOOKAHEAD_BATCHES
ahead of it); the planner changes the order from that position on, in place:

1. defer: the miss moves later in the epoch, to the first position the store (the prefetcher,
   reading the published order) reaches in time, and the cached sample that was there moves
   forward into its slot. The epoch still holds every sample it held; only the order changes.
   Only with a live prefetcher: nothing else reads ahead of the loader.
2. repeat: when no position hides it, the miss is replaced by a cached sample chosen by importance
   (probability proportional to its score), within the stall budget: at most `budget` x the
   positions taken so far, so repeats spread over the epoch; never a sample the coverage floor
   protects this epoch, and only once scores exist (no scores, no repeats).
3. otherwise the loader reads it (a stall).

What "in time" means, from two speeds the planner measures (StallPace): step_s, the seconds of
one training step outside the loader's waits, and miss_s, the seconds the loader waits per missed
sample it reads. The store delivers step_s / miss_s samples during one step. At assembly, the
misses of a batch beyond that many would make the loop wait longer than a step; ahead (with a
prefetcher), a batch's misses beyond what the store can read before the loop gets there, after
the misses ahead of them, would not arrive. A store faster than training delivers more than a
batch per step, so nothing is ever moved or repeated on it. The stall budget does not replace
overlapping reads with compute (DataLoader workers, a prefetcher): it acts where the store is too
slow for any overlap to keep up.

Reproducible: the planner's random choices come from its own stream of the sampler's seed (seed,
epoch, rank); given the same sequence of stalls (which ids of which batch were not cached, at
which measured speeds) the order is the same. state() / load() carry the position planned up to,
the counts, the stream's state and the speeds, so a resumed epoch goes on exactly.
"""
import math
import time
from collections import deque

import numpy as np

LOOKAHEAD_BATCHES = 4     # with a prefetcher, batches are planned this far ahead of the loader
DEFER_HORIZON_BATCHES = 64   # a miss is deferred at most this many batches


class StallPace:
    """The two speeds the stall budget compares, each the median of its last WINDOW samples (one
    per batch, at least MIN_SAMPLES before it counts), so that one read the machine delayed
    (another process ran) moves nothing: step_s, the seconds between two batches minus what the
    loader waited for misses, and miss_s, the seconds the tiers below the cache took per sample
    they served (their own calls: the cache insert and the Python around them are the loader's
    cost, not the store's), from batches that read at least MIN_MISSES samples (a few stragglers
    measure a read's latency, not the store's pace). observe() takes the data set's running totals
    (CachedDataset.loader_totals) at each batch boundary; restart() forgets the last boundary (an
    epoch's end: the time until the next one is evaluation, not a step). fixed=(step_s, miss_s):
    these speeds, nothing measured."""

    WINDOW = 9
    MIN_SAMPLES = 3
    MIN_MISSES = 8

    def __init__(self, fixed=None):
        self.fixed = fixed is not None
        self.step_s, self.miss_s = (None, None) if fixed is None else map(float, fixed)
        self._steps, self._misses = deque(maxlen=self.WINDOW), deque(maxlen=self.WINDOW)
        self._last = None

    def restart(self):
        self._last = None

    def observe(self, now: float, read: int, tier_s: float, wait_s: float) -> None:
        if self.fixed:
            return
        if self._last is not None:
            t0, r0, s0, w0 = self._last
            dt, dr, ds, dw = now - t0, read - r0, tier_s - s0, max(wait_s - w0, 0.0)
            if dt > 0:
                self._steps.append(max(dt - dw, 0.0))
                if len(self._steps) >= self.MIN_SAMPLES:
                    self.step_s = float(np.median(self._steps))
                if dr >= self.MIN_MISSES and ds > 0:
                    self._misses.append(ds / dr)
                    if len(self._misses) >= self.MIN_SAMPLES:
                        self.miss_s = float(np.median(self._misses))
        self._last = (now, read, tier_s, wait_s)

    def per_step(self):
        """Samples the store delivers during one training step, or None before both speeds are
        measured."""
        if self.step_s is None or self.miss_s is None:
            return None
        return self.step_s / max(self.miss_s, 1e-12)

    def state(self) -> dict:
        return {"step_s": self.step_s, "miss_s": self.miss_s, "steps": list(self._steps),
                "misses": list(self._misses)}

    def load(self, state: dict) -> None:
        if not self.fixed:
            self.step_s, self.miss_s = state["step_s"], state["miss_s"]
            self._steps = deque(state.get("steps", []), maxlen=self.WINDOW)
            self._misses = deque(state.get("misses", []), maxlen=self.WINDOW)
        self._last = None


class StallPlanner:
    """One rank's stall budget over its epochs (see the module docstring).

    batch_size  the loader's batch size (plans act on batches of it)
    budget      the fraction of the epoch's positions stall repeats may take at most
    speeds      None: measured (StallPace); (step_s, miss_s): these, fixed
    """

    def __init__(self, batch_size: int, budget: float, speeds=None):
        self.batch_size = int(batch_size)
        self.budget = float(budget)
        self.pace = StallPace(speeds)
        self.rng = None
        self.planned = 0          # positions [0, planned) were planned at assembly
        self.ahead = 0            # positions [0, ahead) were planned ahead (prefetcher)
        self.deferrals = 0
        self.repeats = 0

    def start_epoch(self, rng) -> None:
        self.rng = rng
        self.planned = self.ahead = self.deferrals = self.repeats = 0
        self.pace.restart()

    # ---- one batch ----------------------------------------------------------------------------
    def plan(self, order, k, view) -> np.ndarray:
        """Plans the batch at position k (and, with a prefetcher, the batches ahead of it) in
        `order`, in place. view: what the planner reads of the world (StallView). Returns the
        positions whose ids changed."""
        b = self.batch_size
        if k < self.planned:
            return np.empty(0, dtype=np.int64)    # planned before a resume: taken as it stands
        self.pace.observe(time.perf_counter(), *view.loader_totals())
        per_step = self.pace.per_step()
        self.planned = min(k + b, order.size)
        if per_step is None or per_step >= b:
            return np.empty(0, dtype=np.int64)    # not measured yet, or the store keeps up
        changed = []
        prefetching = view.prefetching()
        if prefetching:
            # the batches up to LOOKAHEAD_BATCHES ahead: what the store can read before the loop
            # gets there, after the misses in front of them
            for a in range(max(self.ahead, k + b), min(k + (LOOKAHEAD_BATCHES + 1) * b,
                                                       order.size), b):
                cached = view.cached(order[k:a + b])
                before = int((~cached[:a - k]).sum())
                can = math.floor((a - k) / b * per_step) - before
                changed += self._act(order, a, min(a + b, order.size), k,
                                     ~cached[a - k:], max(can, 0), per_step, view, True)
                self.ahead = a + b
        # the batch being assembled: what the store delivers during one step
        unc = ~view.cached(order[k:self.planned])
        changed += self._act(order, k, self.planned, k, unc, math.floor(per_step), per_step,
                             view, prefetching)
        return np.asarray(sorted(set(changed)), dtype=np.int64)

    def _act(self, order, a, end, k, uncached, allow, per_step, view, prefetching) -> list:
        """Defers or repeats the misses of order[a:end] beyond `allow` (uncached: their mask)."""
        excess = int(uncached.sum()) - int(allow)
        if excess <= 0:
            return []
        pos = a + np.flatnonzero(uncached)
        pos = np.sort(self.rng.choice(pos, size=excess, replace=False))
        changed = []
        left = []
        if prefetching:
            for p in pos.tolist():
                q = self._defer_to(order, p, end, k, per_step, view)
                if q is None:
                    left.append(p)
                    continue
                order[p], order[q] = order[q], order[p]
                changed += [p, q]
                self.deferrals += 1
        else:
            left = pos.tolist()
        if left and view.scored():
            credit = math.floor(self.budget * end) - self.repeats   # paced over the epoch
            if credit > 0:
                due = view.due(order[left])
                take = [p for p, d in zip(left, due.tolist()) if not d][:credit]
                got = view.pick_cached(self.rng, len(take)) if take else np.empty(0, np.int64)
                take = take[:got.size]
                if take:
                    order[take] = got
                    changed += take
                    self.repeats += len(take)
        return changed

    def _defer_to(self, order, p, end, k, per_step, view):
        """The first position q >= end holding a cached id that the store reaches in time: every
        miss in order[k:q + 1] read before the loop gets to q. None when there is none within
        DEFER_HORIZON_BATCHES."""
        b = self.batch_size
        stop = min(order.size, end + DEFER_HORIZON_BATCHES * b)
        if stop <= end:
            return None
        cached = view.cached(order[k:stop])
        misses = np.cumsum(~cached)                     # misses in order[k:j + 1]
        reach = np.floor((np.arange(k, stop) - k) / b * per_step)
        ok = cached & (misses <= reach)
        ok[:end - k] = False
        hit = np.flatnonzero(ok)
        return None if hit.size == 0 else int(k + hit[0])

    # ---- checkpoint ---------------------------------------------------------------------------
    def state(self) -> dict:
        return {"planned": self.planned, "ahead": self.ahead, "deferrals": self.deferrals,
                "repeats": self.repeats, "pace": self.pace.state(),
                "rng": None if self.rng is None else self.rng.bit_generator.state}

    def load(self, state: dict, rng) -> None:
        self.planned, self.ahead = int(state["planned"]), int(state["ahead"])
        self.deferrals, self.repeats = int(state["deferrals"]), int(state["repeats"])
        self.pace.load(state["pace"])
        self.rng = rng
        if state["rng"] is not None:
            self.rng.bit_generator.state = state["rng"]


class StallView:
    """What the planner reads of the world, for one ShadeSampler: the cache's cached set (one
    snapshot per plan: ids do not change their cached state when the order moves them), the data
    set's loader totals, whether a live prefetcher reads the published order, the scores, the
    coverage floor's due samples. refresh() before each plan."""

    def __init__(self, sampler, source):
        self.sampler = sampler
        self.source = source          # a CachedDataset (loader_totals)
        self._mask = None

    def refresh(self):
        self._mask = None

    def loader_totals(self):
        return self.source.loader_totals()

    def cached(self, ids) -> np.ndarray:
        if self._mask is None:
            self._mask = np.asarray(self.sampler.cache.cached_mask(), dtype=bool)
        return self._mask[ids]

    def prefetching(self) -> bool:
        from ..lookahead.board import board_for
        from ..lookahead.prefetcher import _process_alive
        board = board_for(self.sampler.cache)
        return board is not None and _process_alive(board.prefetcher_pid)

    def scored(self) -> bool:
        return self.sampler.has_scores()

    def due(self, ids) -> np.ndarray:
        s = self.sampler
        if s.coverage_epochs <= 0:
            return np.zeros(len(ids), dtype=bool)
        return s.last_drawn[ids] <= s.epoch - s.coverage_epochs

    def pick_cached(self, rng, m: int) -> np.ndarray:
        """m cached ids drawn with probability proportional to their scores (distinct when the
        cache holds enough)."""
        if self._mask is None:
            self.cached(np.empty(0, dtype=np.int64))
        cand = np.flatnonzero(self._mask)
        if cand.size == 0 or m <= 0:
            return np.empty(0, dtype=np.int64)
        w = np.asarray(self.sampler.table.scores[cand], dtype=np.float64)
        w = w / w.sum() if w.sum() > 0 else None
        return rng.choice(cand, size=m, replace=m > cand.size, p=w).astype(np.int64)
