"""The stall budget: the epoch's order bends around a store that cannot keep up with training.

A miss stalls the training loop when it is not in the cache by the time its batch is assembled and
the store, at its measured speed, cannot deliver it in time. ShadeSampler calls `StallPlanner.plan`
before each batch's ids are taken; the planner changes the order from that position on, in place.

When the store is too slow. Two speeds are measured in each batch (StallPace): step_s, the
seconds of one training step outside the loader's waits, and miss_s, the seconds the tiers below
the cache take per sample they serve. The store delivers step_s / miss_s samples during one step
(the median over the last batches); when that is half a batch or more (SLOW), or when the store
serves a sample in under 200 us (STORAGE_S: memory, the page cache, a local NVMe drive), nothing is
ever moved or repeated: a store that fast keeps up with
training once reads overlap compute, as DataLoader workers or a prefetcher make them (the stall
budget does not replace them: it acts where the store is too slow for any overlap to keep up).

A miss here is a sample that waits on shared storage (or a peer): neither cached nor held by the
node's SSD tier, whose reads are local (StallView.hold); the store's pace is measured over the
store's own reads (its fallback, a wait on the prefetcher, over every sample not cached).

What the planner does with the batch's misses when the store is too slow:
- with a live prefetcher (the order board's), every miss of the batch is one the prefetcher has not
  brought yet, most likely one it is reading: a read by the loader now would read it twice. Each is
  deferred: it trades places with the nearest cached sample after the batch (the loop trains that
  one now, without waiting), or, when none is left, with a miss beyond the prefetcher's reach (half
  the cache ahead of the loader) that nobody reads yet, the lowest-scored first: the loader reads
  that one, once, while the prefetcher brings the first. The epoch keeps every sample it held;
  only the order changes, and each sample is read once. With an SSD tier (where the prefetcher
  reads only what a full cache would admit) a miss is deferred once unless it is on its way: one
  still not on its way at its new batch is one the prefetcher does not take up, and the loader
  reads it there.
- without one, the loader reads as many misses as the store delivers during one step; the rest
  would make the loop wait longer than a step.
- what still waits on the store (the far misses brought forward, the misses beyond a step's worth)
  is replaced by cached samples chosen by importance (probability proportional to the score),
  within the stall budget: at most `budget` x the positions planned so far (with a prefetcher,
  decided so far: below), so repeats spread over the epoch; the misses replaced are the
  lowest-scored (a sample the model already fits costs least to leave out), never one the
  coverage floor protects this epoch, and only once scores exist (no scores, no repeats); and,
  under the coverage floor, at most the share of the epoch's misses that every epoch can leave
  out (half at the default two epochs, less what the accuracy budget left out:
  StallPlanner._room). The rest is read: a stall.
- with a prefetcher, the planner decides ahead of it: each upcoming miss that nobody reads yet
  (neither cached nor on its way) is looked at once, when it enters the window the plan decides
  over (with an SSD tier the plan's horizon, without one twice the prefetcher's reach), and the
  share of them that the epoch's room and budget allow is replaced then, the lowest-scored
  first (StallPlanner._decide_ahead); a repeat placed ahead whose sample left the cache gets
  another cached sample at its batch. The prefetcher reads every miss of the order at the store's
  pace, so an epoch on a store slower than training takes its misses / the store's rate
  whatever the order, and only a read that never happens saves time; a miss the prefetcher has
  read is no longer one the planner may leave out. Measured on a throttled disk (bench/fidelity.py
  slow): repeats made only at the batch being assembled replaced misses the prefetcher was
  already reading, and saved neither reads nor time against uniform sampling; repeats decided
  ahead saved both (docs/importance.md, "The stall budget").

Not under the extent order (ShadeSampler does not plan there): a miss is read with its whole
extent, which the pass's other samples of that extent share, so a repeat in place of one sample
saves no read (docs/importance.md).

Reproducible: the planner's random choices come from its own stream of the sampler's seed (seed,
epoch, rank); given the same sequence of stalls (which ids of which batch were not cached, at which
measured speeds, and with a prefetcher which were on their way over the plan's horizon) the order
is the same. state() / load() carry the position planned up to, the counts, the stream's state,
the speeds and what was decided ahead (LookAhead), so a resumed epoch goes on exactly.
"""
import math
import os
import time
from collections import deque

import numpy as np

from ..lookahead.board import READS_ADMITTED, READS_EVERY_MISS
from ..lookahead.publish import board_of
from ..store.protocol import lengths_of

DEFER_HORIZON_BATCHES = 64   # a miss is deferred at most this many batches
# The planner acts when the store delivers less than this fraction of a batch during one step. A
# store within twice of training is left to the overlap of reads and compute (a prefetcher,
# workers); and on a machine whose CPUs are shared, both speeds swing with the processes that run
# meanwhile (under a loaded CPU a page-cache read can take as long as a disk's:
# docs/benchmark_history.md, "The stall planner's thresholds"), so a store that keeps up can look
# as slow as training for a few batches, never twice as slow.
SLOW = 0.5
# ... and only a store that takes at least this long a sample is storage the loop can stall on. A
# store in memory, in the page cache or on a local NVMe drive serves a sample in microseconds to
# tens of them: its reads cost the loop CPU, which more readers (workers, a prefetcher) take off
# it, not waiting. The line lies between the two measured on this project's shared machines: a
# store in tmpfs read by a tiny model's loop, and the throttled disk of bench/fidelity.py
# (docs/benchmark_history.md, "The stall planner's thresholds").
STORAGE_S = 200e-6


def thread_sched_s():
    """(seconds the calling thread has run on a CPU, seconds it has waited on a run queue for
    one, seconds the other threads of this process have waited on a run queue) from the
    kernel's schedstat files (/proc/thread-self/schedstat, /proc/self/task/*/schedstat: the first
    two fields, in ns), or None where the kernel does not say. The rest of the calling thread's
    wall time it slept: on storage, on another thread of the process, or on anything else."""
    try:
        me = os.path.basename(os.readlink("/proc/thread-self"))
        ran = queued = others = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                    r, q = f.read().split()[:2]
            except FileNotFoundError:     # the thread ended meanwhile
                continue
            if tid == me:
                ran, queued = int(r), int(q)
            else:
                others += int(q)
        return ran / 1e9, queued / 1e9, others / 1e9
    except (OSError, ValueError):
        return None


class StallPace:
    """How many samples the store delivers during one training step (per_step), from the data
    set's running totals (CachedDataset.loader_totals) at each batch boundary: the median over the
    last WINDOW batches (at least MIN_SAMPLES) of step_i / miss_i, with step_i the seconds between
    the two boundaries minus what the loader waited for misses, and miss_i the seconds the tiers
    below the cache took per sample they served in that batch (their own calls: the cache insert
    and the Python around them are the loader's cost, not the store's), from batches that read at
    least MIN_MISSES samples (a few stragglers measure a read's latency, not the store's pace).
    Both come from the same batch, so when other processes take the CPUs a read from the page
    cache and a training step slow down together and the ratio stays; a store that waits on its
    device does not. With a prefetcher the loader reads little itself: it waits for the samples
    the prefetcher is reading (node/miss_path.py, MissPath.fetch). A batch whose loader read
    fewer than MIN_MISSES samples but waited at least as long as it computed, for at least MIN_MISSES
    samples that were not cached when it asked, measures the store by that wait instead: those
    samples took (step_i + wait_i) to come, miss_i = (step_i + wait_i) / missed. (Before this rule,
    on a throttled disk with the prefetcher, the loader read nothing itself in the whole first epoch
    and waited for much of it, so the first epoch went unplanned: docs/importance.md, "The stall
    budget".) The median keeps one slow batch from moving anything. step_s and miss_s: the
    medians of each, for reports. restart() forgets the last boundary (an epoch's end: the
    time until the next one is evaluation, not a step). fixed=(step_s, miss_s): these speeds,
    nothing measured."""

    WINDOW = 9
    # A full window: with 3, the first batches of a run under a loaded CPU made a page-cache store
    # look too slow in some fidelity runs (docs/benchmark_history.md, "The stall planner's
    # thresholds").
    MIN_SAMPLES = 9
    MIN_MISSES = 8

    def __init__(self, fixed=None):
        self.fixed = fixed is not None
        self.step_s, self.miss_s = (None, None) if fixed is None else map(float, fixed)
        self._steps = deque(maxlen=self.WINDOW)
        self._misses = deque(maxlen=self.WINDOW)
        self._ratios = deque(maxlen=self.WINDOW)
        self._last = None

    def restart(self):
        self._last = None

    def observe(self, now: float, read: int, tier_s: float, wait_s: float, missed: int = 0,
                sched=None, floor_s: float = 0.0) -> None:
        """One batch boundary: the data set's running totals (CachedDataset.loader_totals):
        samples the loader read from the tiers below the cache, the seconds of those reads, the
        seconds it waited on misses, the samples not cached when it asked for them; sched: this
        thread's (ran, queued) seconds so far (thread_sched_s), or None; floor_s: the least a
        sample costs the store's device at its sustained rate (StallView.read_floor_s: its bytes
        at the device's bandwidth), below which no batch's measure is taken.

        A device that lets reads burst measures faster than it can go on: a throttled disk served
        the loader's batches after idle time (its throttle's unused budget) far faster than its
        sustained rate, while the prefetcher read the rest; the median of such batches said the
        store keeps up, the planner stopped acting, and those epochs read far more of the data
        (docs/benchmark_history.md, "The store's sustained rate bounds the stall budget's
        pace").

        What the CPUs' contention explains is not the store's. Only the time the thread slept in
        a batch (its wall time less what it ran and what it waited for a CPU) can be the store's,
        less what the process's other threads waited for a CPU meanwhile: a read from memory is
        handed to other threads (io_uring's worker, a pread pool) that wait for a CPU while this
        one sleeps. Without the bound, in the fidelity sweep under a loaded CPU, a store in tmpfs
        looked slow and drew stall repeats: the loop thread slept a small part of its wait for
        samples from tmpfs and waited for a CPU most of the rest, while io_uring's worker thread
        waited for one (docs/benchmark_history.md, "The stall planner's thresholds")."""
        if self.fixed:
            return
        if self._last is not None:
            t0, r0, s0, w0, m0, c0 = self._last
            dt, dr, ds, dw = now - t0, read - r0, tier_s - s0, max(wait_s - w0, 0.0)
            dm = missed - m0
            if dt > 0:
                step = max(dt - dw, 0.0)
                self._steps.append(step)
                if sched is not None and c0 is not None:
                    ran, queued, others = (a - b for a, b in zip(sched, c0))
                    slept = max(dt - ran - queued - others, 0.0)
                    ds, dw = min(ds, slept), min(dw, slept)
                miss = None
                if dr >= self.MIN_MISSES and ds > 0:
                    miss = ds / dr
                elif dm >= self.MIN_MISSES and dw >= step > 0:   # waited on the prefetcher
                    miss = (step + dw) / dm
                if miss is not None:
                    miss = max(miss, floor_s)
                    self._misses.append(miss)
                    self._ratios.append(step / miss)
                if len(self._ratios) >= self.MIN_SAMPLES:
                    self.step_s = float(np.median(self._steps))
                    self.miss_s = float(np.median(self._misses))
        self._last = (now, read, tier_s, wait_s, missed, sched)

    def per_step(self):
        """Samples the store delivers during one training step, or None before it is measured."""
        if self.step_s is None or self.miss_s is None:
            return None
        if self.fixed:
            return self.step_s / max(self.miss_s, 1e-12)
        return float(np.median(self._ratios))

    def state(self) -> dict:
        return {"step_s": self.step_s, "miss_s": self.miss_s, "steps": list(self._steps),
                "misses": list(self._misses), "ratios": list(self._ratios)}

    def load(self, state: dict) -> None:
        if not self.fixed:
            self.step_s, self.miss_s = state["step_s"], state["miss_s"]
            self._steps = deque(state.get("steps", []), maxlen=self.WINDOW)
            self._misses = deque(state.get("misses", []), maxlen=self.WINDOW)
            self._ratios = deque(state.get("ratios", []), maxlen=self.WINDOW)
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
        self.planned = 0          # positions [0, planned) were planned
        self.deferrals = 0
        self.repeats = 0
        self.room = None          # the epoch's room for stall repeats (_room), once it acts in it
        self.ahead = None         # with a prefetcher: what it decided ahead (LookAhead)

    def start_epoch(self, rng) -> None:
        self.rng = rng
        self.planned = self.deferrals = self.repeats = 0
        self.room = None
        self.ahead = None
        self.pace.restart()

    # ---- one batch ----------------------------------------------------------------------------
    def plan(self, order, k, view) -> np.ndarray:
        """Plans the batch at position k of `order`, in place, before its ids are taken. view:
        what the planner reads of the world (StallView). Returns the positions whose ids
        changed."""
        b = self.batch_size
        if k < self.planned:
            return np.empty(0, dtype=np.int64)    # planned before a resume: taken as it stands
        self.pace.observe(time.perf_counter(), *view.loader_totals(), sched=thread_sched_s(),
                          floor_s=view.read_floor_s())
        per_step = self.pace.per_step()
        end = self.planned = min((k // b + 1) * b, order.size)   # the batch that k is in
        if per_step is None or per_step >= SLOW * b or self.pace.miss_s < STORAGE_S:
            return np.empty(0, dtype=np.int64)    # not measured yet, or the store keeps up
        if self.room is None:
            self.room = self._room(order, k, view)
        rule = view.prefetcher_rule()
        prefetching = rule in (READS_EVERY_MISS, READS_ADMITTED)
        filters = rule == READS_ADMITTED   # it reads only what a full cache would admit
        stop = end                 # the last position this plan looks at, + 1
        if prefetching:
            reach = max(b, view.prefetcher_reach())
            stop = min(order.size, end + max(2 * reach, DEFER_HORIZON_BATCHES * b))
        view.hold(order[k:stop])   # one snapshot of what the node holds, for all of the plan
        changed = []
        if prefetching and (self.ahead is None or self.ahead.size != order.size):
            self.ahead = LookAhead(order.size)
        if self.ahead is not None:   # repeats placed ahead, also once the prefetcher is gone
            changed += self._refill(order, k, end, view)
        uncached = ~view.cached(order[k:end])
        # With a prefetcher reading the published order, a miss here is one it has not brought
        # yet: most likely in flight, so a read now would read it twice. Without one, the loader
        # reads what the store delivers during one step without the store setting the pace.
        allow = 0 if prefetching else math.floor(per_step)
        pos = k + np.flatnonzero(uncached)
        if pos.size > allow:
            if prefetching:
                pos = self._defer(order, pos, end, stop, reach, filters, view, changed)
            else:
                pos = pos[self._easiest(view, order[pos], pos.size - allow)]
            if view.scored():
                changed += self._repeat(order, pos, view)
        if prefetching and view.scored():
            # How far ahead the planner decides. With an SSD tier the prefetcher never removes a
            # sample to make room: over the whole horizon. Without one it makes room among the
            # samples needed later (the board's next uses), and repeats placed across the epoch
            # would give the cached samples next uses everywhere: within twice its reach
            # (docs/importance.md, "Repeats on two budgets", has the measurements).
            upto = stop if filters else min(stop, end + 2 * reach)
            changed += self._decide_ahead(order, end, upto, view)
        return np.asarray(sorted(set(changed)), dtype=np.int64)

    def _defer(self, order, pos, end, stop, reach, filters, view, changed) -> np.ndarray:
        """With a prefetcher: each miss at `pos` trades places with the nearest cached sample
        after this batch (the loop trains that one now, without a wait), else with a miss beyond
        the prefetcher's reach, the lowest scores first (nobody reads those yet: the loader does,
        once, while the prefetcher brings the first); the cache keeps the arrivals until their
        turn, which comes within about its own size. When the prefetcher reads only what a full
        cache would admit (`filters`: an SSD tier), a miss deferred before and still not on its
        way is read now: the prefetcher will not take it up, and deferral after deferral would
        carry such misses to the epoch's end, where they all wait at once. When it reads every
        miss, one not on its way yet is one it has not reached: deferred again. Adds the
        positions changed to `changed`; returns those that still wait on the store (the far
        misses the loader reads now, or misses nothing could move)."""
        again = (self.ahead.deferred[pos] & ~view.on_way(order[pos]) if filters
                 else np.zeros(pos.size, dtype=bool))
        movable = pos[~again]
        ahead = view.cached(order[end:stop])
        targets = (end + np.flatnonzero(ahead))[:movable.size]
        far = end + reach + np.flatnonzero(~ahead[reach:])
        far = far[~self.ahead.placed[far]]   # a repeat placed there is refilled, not read
        need = movable.size - targets.size
        if need > 0 and far.size:
            far = np.sort(far[self._easiest(view, order[far], need)])
            targets = np.concatenate([targets, far])
        m = targets.size
        if m:
            near = movable[:m]
            order[near], order[targets] = order[targets], order[near].copy()
            self.ahead.swap(near, targets)
            self.ahead.deferred[targets] = True
            changed += near.tolist() + targets.tolist()
            self.deferrals += m
        return pos[~view.cached(order[pos])]

    def _decide_ahead(self, order, end, stop, view) -> list:
        """With a prefetcher: decides, once, the fate of each upcoming miss in [end, stop) that it
        has not looked at before (neither cached nor on its way, not due under the coverage
        floor): of those, the share that the epoch's allowance left (its room under the floor,
        and budget x its positions) spreads over them and the like beyond `stop` (estimated at
        the rate found so far) is replaced now, the lowest-scored, by cached samples chosen by
        importance; the others are left for the prefetcher to read. The budget is also a running
        cap, budget x the positions decided so far (`stop`): candidates that cap cut off are
        looked at again by the next plans. Returns the positions changed.

        Why now and not as the loader gets there: the prefetcher reads every miss of the
        published order at the store's pace, so the epoch takes (misses / the store's rate)
        whatever the order, and only a read that never happens saves time. Its window reaches
        past the loader, and what it has read is no longer a miss the planner may replace: with
        the repeats paced by the positions the loader had reached, the epochs that had to leave
        out every miss they could (under the floor, each warm epoch in turn) lost the last
        batches' share to the prefetcher's reads: fewer stall repeats than without a prefetcher,
        and more of the data read (bench/prefetch_tiers.py; docs/benchmark_history.md, "The stall
        budget decides ahead of the prefetcher"). The repeats placed ahead are kept cached by
        their use (the board's next uses), and one whose sample left the cache anyway is
        refilled at its batch (_refill)."""
        a = self.ahead
        win = np.arange(end, stop)
        ids = order[win]
        fresh = ~a.seen[win] & ~view.cached(ids) & ~view.on_way(ids) & ~view.due(ids)
        first = win >= a.horizon      # positions looked at for the first time
        a.looked += int(np.count_nonzero(first))
        a.found += int(np.count_nonzero(fresh & first))
        a.horizon = max(a.horizon, stop)
        cand = win[fresh]
        room = min(math.floor(self.room), math.floor(self.budget * order.size)) - self.repeats
        cap = min(math.floor(self.room), math.floor(self.budget * stop)) - self.repeats
        if cand.size == 0 or room <= 0 or cap <= 0:
            a.seen[cand] = room <= 0    # nothing left to spend: decided (read); else look again
            return []
        beyond = (order.size - stop) * a.found / max(a.looked, 1)
        want = min(1.0, room / (cand.size + beyond)) * cand.size + a.carry
        m = min(int(want), cap)
        a.carry = want - int(want) if m == int(want) else 0.0
        chosen = np.sort(cand[self._easiest(view, order[cand], m)])
        # decided: what was chosen, and, unless the running cap cut the share, the rest (read)
        a.seen[cand if m == int(want) else chosen] = True
        chosen = self._fill(order, chosen, view)
        a.placed[chosen] = True
        self.repeats += int(chosen.size)
        return chosen.tolist()

    def _refill(self, order, k, end, view) -> list:
        """The repeats placed ahead (_decide_ahead) in the batch [k, end) whose sample is no
        longer held (evicted since) get another cached sample, chosen the same way: a repeat is
        any cached sample, and one that has left the cache would be read. Not new repeats.
        Returns the positions changed."""
        pos = k + np.flatnonzero(self.ahead.placed[k:end])
        return self._fill(order, pos[~view.cached(order[pos])], view).tolist()

    def _repeat(self, order, pos, view) -> list:
        """Replaces the lowest-scored misses at positions `pos` (not due under the coverage floor)
        by cached samples chosen by importance, within what the budget allows so far (paced over
        the epoch: budget x the positions planned), and within the epoch's room under the
        coverage floor (_room, paced the same way). A miss left out of one epoch is due in the
        next (with the floor at two epochs), so an epoch that left out more than its share left
        the next fewer to leave out, and epochs alternated between reading less and more (with a
        prefetcher, whose look-ahead offered many misses at once); with the room they read alike
        (docs/benchmark_history.md, "The stall budget holds every epoch to the share of misses
        the floor allows"). With a
        prefetcher most repeats are decided ahead (_decide_ahead) and count against the same
        credit. Returns the positions changed."""
        room = self.room * self.planned / max(order.size, 1)
        credit = min(math.floor(self.budget * self.planned), math.floor(room)) - self.repeats
        if credit <= 0 or pos.size == 0:
            return []
        left = pos[~view.due(order[pos])]
        left = self._fill(order, np.sort(left[self._easiest(view, order[left], credit)]), view)
        self.repeats += int(left.size)
        return left.tolist()

    def _fill(self, order, pos, view) -> np.ndarray:
        """Puts cached samples chosen by importance (view.pick_cached) at positions `pos`, in
        order; returns the positions filled (fewer when the cache holds nothing)."""
        if pos.size == 0:
            return pos
        got = view.pick_cached(self.rng, pos.size)
        pos = pos[:got.size]
        order[pos] = got
        return pos

    def _room(self, order, k, view) -> float:
        """The stall repeats this epoch may make in all if every epoch is to make as many, under
        the coverage floor: a sample left out K - 1 epochs in a row is due in the next, so an
        epoch may leave out (K - 1)/K of its draw's misses (view.skip_share), less those the
        accuracy budget already left out (view.left_out; due next epoch too). The draw's misses:
        what the node does not hold over the rest of the order, scaled to the whole of it (the
        positions trained already are held now; under pads, where they are the cached ones, this
        counts more misses than there were, which loosens the cap), plus those left out. Without
        the floor, no limit beyond the budget."""
        share = view.skip_share()
        if share >= 1.0:
            return float(order.size)
        rest = order[k:]
        left = view.left_out()
        misses = view.misses(rest) * order.size / max(rest.size, 1) + left
        return max(share * misses - left, 0.0)

    def _easiest(self, view, ids, m: int) -> np.ndarray:
        """Indices into `ids` of the m with the lowest scores (a sample the model already fits
        costs least to leave out), ties in a random order from the planner's stream."""
        if m >= ids.size:
            return np.arange(ids.size)
        if m <= 0:
            return np.empty(0, dtype=np.int64)
        tie = self.rng.permutation(ids.size)
        return tie[np.argsort(view.scores(ids[tie]), kind="stable")[:m]]

    # ---- checkpoint ---------------------------------------------------------------------------
    def state(self) -> dict:
        return {"planned": self.planned, "deferrals": self.deferrals,
                "repeats": self.repeats, "room": self.room, "pace": self.pace.state(),
                "ahead": None if self.ahead is None else self.ahead.state(),
                "rng": None if self.rng is None else self.rng.bit_generator.state}

    def load(self, state: dict, rng) -> None:
        self.planned = int(state["planned"])
        self.deferrals, self.repeats = int(state["deferrals"]), int(state["repeats"])
        self.room = state.get("room")
        self.ahead = None if state.get("ahead") is None else LookAhead.from_state(state["ahead"])
        self.pace.load(state["pace"])
        self.rng = rng
        if state["rng"] is not None:
            self.rng.bit_generator.state = state["rng"]


class LookAhead:
    """What the planner decided ahead of the loader in one epoch, with a prefetcher
    (StallPlanner._decide_ahead): the positions whose miss it has looked at (`seen`: decided
    once, replaced or left to be read), the positions where it placed a stall repeat (`placed`:
    refilled at their batch if the sample left the cache meanwhile), the positions a deferral
    moved a miss to (`deferred`: with an SSD tier, one still not on its way there is read, not
    deferred again), how far it has looked (`horizon`), the positions first looked at and the
    misses it could leave out among them (`looked`, `found`: their rate estimates those beyond
    the horizon), and the fraction of a repeat carried to the next decision. The masks follow
    the ids when a deferral swaps two positions."""

    def __init__(self, size: int):
        self.size = int(size)
        self.seen = np.zeros(self.size, dtype=bool)
        self.placed = np.zeros(self.size, dtype=bool)
        self.deferred = np.zeros(self.size, dtype=bool)
        self.horizon = self.looked = self.found = 0
        self.carry = 0.0

    def swap(self, a, b) -> None:
        for m in (self.seen, self.placed, self.deferred):
            m[a], m[b] = m[b], m[a].copy()

    def move(self, places, sources) -> None:
        """Positions `places` took the samples of positions `sources` (sampling/follow.py)."""
        for m in (self.seen, self.placed, self.deferred):
            m[places] = m[sources].copy()

    def state(self) -> dict:
        return {"size": self.size, "seen": np.flatnonzero(self.seen).tolist(),
                "placed": np.flatnonzero(self.placed).tolist(),
                "deferred": np.flatnonzero(self.deferred).tolist(), "horizon": self.horizon,
                "looked": self.looked, "found": self.found, "carry": self.carry}

    @classmethod
    def from_state(cls, state: dict) -> "LookAhead":
        a = cls(state["size"])
        a.seen[np.asarray(state["seen"], dtype=np.int64)] = True
        a.placed[np.asarray(state["placed"], dtype=np.int64)] = True
        a.deferred[np.asarray(state["deferred"], dtype=np.int64)] = True
        a.horizon, a.looked = int(state["horizon"]), int(state["looked"])
        a.found = int(state["found"])
        a.carry = float(state["carry"])
        return a


class StallView:
    """What the planner reads of the world, for one ShadeSampler: the cache's cached set and what
    the node holds without shared storage (one snapshot per plan: ids do not change their state
    when the order moves them), the data set's loader totals, whether a live prefetcher reads the
    published order, the scores, the coverage floor's due samples. refresh() before each plan."""

    def __init__(self, sampler, source):
        self.sampler = sampler
        self.source = source          # a CachedDataset (loader_totals, its tier chain)
        self._mask = None             # cached in RAM
        self._held = None             # this plan's snapshot (hold): the node holds it
        self._way = None              # ... and the prefetcher is reading it (ON_WAY)
        self._way_buf = self._way_ids = None   # that mask's memory, and the ids it set
        self._pool = None             # (cached ids, their weights) for pick_cached, once a plan
        self._floor = None            # read_floor_s, once

    def refresh(self):
        self._mask = self._held = self._way = self._pool = None

    def loader_totals(self):
        return self.source.loader_totals()

    def read_floor_s(self) -> float:
        """The least a sample costs the store's device at its sustained rate: its mean bytes over
        the bandwidth of the device profile the store was given or measured at open. Not one
        request (1 / iops) a sample: the store merges neighbours within gap_bytes into one
        request, in any batch, so a floor of one request a sample made the planner act where the
        store kept up (docs/benchmark_history.md, "The store's sustained rate bounds the stall
        budget's pace"). Only where every read reaches the
        device (O_DIRECT) and the loader reads from nothing else below the cache (no home peer
        tier, whose reads are faster); 0 otherwise (a store in the page cache reads in
        microseconds, and the pace must see that)."""
        if self._floor is None:
            self._floor = 0.0
            store = getattr(self.source, "store", None)
            bandwidth = (getattr(store, "device", None) or {}).get("bandwidth")
            chain = self._chain()
            peers = chain is not None and chain.partitions
            if getattr(store, "direct", False) and bandwidth and not peers:
                lengths = lengths_of(store)
                if lengths is not None and lengths.size:
                    self._floor = float(np.mean(lengths)) / float(bandwidth)
        return self._floor

    def _cached_mask(self) -> np.ndarray:
        if self._mask is None:
            self._mask = np.asarray(self.sampler.cache.cached_mask(), dtype=bool)
        return self._mask

    def hold(self, ids) -> None:
        """Takes this plan's snapshot of what the node holds, for `ids` (the positions the plan
        looks at; the others count as cached in RAM or not): cached in RAM, or read from this
        node's own copies (the SSD tier, at local-disk speed: TierChain.held_locally) and not
        on their way (the prefetcher reads a sample the SSD tier holds too while the cache has
        room, and a reader that asks for it waits for that read, which goes with the store's).
        The planner bends the order around the others only: a repeat in place of a sample the
        SSD tier holds saves no read of the store, and it spent the budget that a store miss
        needed (docs/importance.md). One snapshot, so that a plan's steps agree (a flag that
        changed between two looks moved a deferral's target into the repeats), taken over the
        plan's ids only (asked of the whole data set, the SSD tier's index cost every planned
        batch time in proportion to the data set: docs/benchmark_history.md, "The stall budget
        counts the SSD tier's samples as held").
        The ON_WAY flags are read first and the cache after them: a read that lands in between is
        seen cached, never as neither cached nor on its way (a miss the planner would replace,
        its read thrown away)."""
        ids = np.asarray(ids, dtype=np.int64)
        board = board_of(self.sampler)
        if self._way_buf is None:   # one mask over all ids, cleared where the last plan set it
            self._way_buf = np.zeros(self.sampler.cache.num_samples, dtype=bool)
        else:
            self._way_buf[self._way_ids] = False
        if board is not None and ids.size:
            self._way_buf[ids] = board.flags.on_way(ids)
        self._way_ids = ids
        self._way, self._mask, self._pool = self._way_buf, None, None
        self._held = self._held_mask(ids)

    def _held_mask(self, ids) -> np.ndarray:
        """The mask over all ids of what the node holds, exact for `ids` (see hold)."""
        held = self._cached_mask()
        chain = self._chain()
        if chain is not None and chain.keeps_copies:
            ids = np.asarray(ids, dtype=np.int64)
            ask = np.zeros(held.size, dtype=bool)   # distinct, without a sort of up to N ids
            ask[ids[~held[ids]]] = True
            rest = np.flatnonzero(ask)
            if rest.size:
                held = held.copy()
                held[rest] = np.asarray(chain.held_locally(rest), dtype=bool) & ~self.on_way(rest)
        return held

    def misses(self, ids) -> int:
        """How many of `ids` (sample ids, each occurrence counted) the node does not hold now (as
        hold counts them; the plan's snapshot is left as it is)."""
        ids = np.asarray(ids, dtype=np.int64)
        return int(np.count_nonzero(~self._held_mask(ids)[ids]))

    def cached(self, ids) -> np.ndarray:
        """Which ids the node holds, by this plan's snapshot (hold); cached in RAM before one."""
        return (self._cached_mask() if self._held is None else self._held)[ids]

    def _chain(self):
        """The tier chain of the data set's node (None without one)."""
        node = getattr(self.source, "node", None)
        return None if node is None else node.chain

    def prefetcher_rule(self) -> int:
        """The read rule the live prefetcher published on the board (lookahead/board.py:
        READS_*), 0 when none runs: what it reads ahead, from its own word."""
        board = board_of(self.sampler)
        return 0 if board is None else board.control.read_rule

    def prefetching(self) -> bool:
        """Whether a live prefetcher reads the order's misses ahead (not under the extent plan,
        READS_UNTIL_FULL: there it leaves a full cache's misses to the loader, whose reads are
        whole extents, and a miss deferred out of its extent's window is read apart from it)."""
        return self.prefetcher_rule() in (READS_EVERY_MISS, READS_ADMITTED)

    def prefetcher_reach(self) -> int:
        """How far ahead of the cursors the prefetcher reads at most (published by it)."""
        board = board_of(self.sampler)
        return 0 if board is None else board.control.reach

    def on_way(self, ids) -> np.ndarray:
        """Which ids the prefetcher is reading (the board's ON_WAY flags): after hold, by this
        plan's snapshot (exact for the ids it took; others read as not on their way); before
        one, now."""
        if self._way is not None:
            return self._way[ids]
        board = board_of(self.sampler)
        return np.zeros(len(ids), dtype=bool) if board is None else board.flags.on_way(ids)

    def scored(self) -> bool:
        return self.sampler.has_scores()

    def scores(self, ids) -> np.ndarray:
        return self.sampler.table.scores[ids]

    def due(self, ids) -> np.ndarray:
        s = self.sampler
        if s.coverage_epochs <= 0:
            return np.zeros(len(ids), dtype=bool)
        return s.last_drawn[ids] <= s.epoch - s.coverage_epochs

    def left_out(self) -> int:
        """Misses of this rank's draw that the accuracy budget replaced this epoch."""
        return int(self.sampler.last_epoch_stats.get("substituted", 0))

    def skip_share(self) -> float:
        """The share of its misses an epoch may leave out if every epoch is to leave out as many,
        under the coverage floor (K = coverage_epochs: a sample left out K - 1 epochs in a row is
        due in the next): (K - 1) / K; all of them without the floor."""
        k = self.sampler.coverage_epochs
        return 1.0 if k <= 0 else (k - 1) / k

    def pick_cached(self, rng, m: int) -> np.ndarray:
        """m cached ids drawn with probability proportional to their scores (distinct when the
        cache holds enough)."""
        if self._pool is None:   # once a plan: a plan may pick up to three times
            cand = np.flatnonzero(self._cached_mask())
            w = np.asarray(self.sampler.table.scores[cand], dtype=np.float64)
            self._pool = (cand, w / w.sum() if w.sum() > 0 else None)
        cand, w = self._pool
        if cand.size == 0 or m <= 0:
            return np.empty(0, dtype=np.int64)
        return rng.choice(cand, size=m, replace=m > cand.size, p=w).astype(np.int64)
