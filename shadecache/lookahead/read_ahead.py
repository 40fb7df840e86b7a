"""The prefetcher's loop: the body of the node's prefetcher process (prefetcher.py starts it).

Each pass takes a snapshot (the published window, the cache's cached mask and fullness), asks the
plan (plan.py) for the next batch, makes room for it if the plan says so, and submits it through
the node's tier chain (tiers.ChainReader: the store's reads stay in flight across batches); when
nothing is to be submitted, or max_batches are in flight, it takes the oldest read and lands it:
offered to the cache through the node's admission rule, what the cache refuses to the copying
tiers (the SSD tier). With a copying tier a read is held instead, and each sample is offered when
a loader takes the batch that holds it (the cursor passes it) or asks for it (WANTED): the cache
and the SSD tier then see each sample when the loader reads it, as without a prefetcher
(docs/prefetch.md). A hand-over thread does that every poll_s.

State shared by the loop and the hand-over thread is guarded by `mu` (and so are the board's
counter rows, whose adds are not atomic): in flight, on the way, held, flagged, refused, full.
Lock order: mu, then the cache's own lock (inside put_many / remove); the board takes none. A
read is waited for without mu (the hand-over goes on meanwhile).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque

import numpy as np

from .. import _io
from ..cache.handle import DEFAULT_MAX_ITEM_BYTES
from ..store.protocol import lengths_of
from . import plan
from .all_jobs import PLACE_SPAN
from .board import READS_ADMITTED, READS_EVERY_MISS, READS_UNTIL_FULL
from .pace import Pace

IDLE_S = 0.05      # how often a prefetcher with nothing to read or hand over looks again
READERS_EVERY_S = 0.2   # how often the prefetcher looks for a live job (serving)


class Window:
    """The published orders of every stream of every job, merged: ids by distance from their
    stream's cursor (first occurrence kept), their places (all_jobs.py: the job's slot and its
    global position, board.py: epoch * capacity + entry), the most advanced stream's epoch, and
    {(slot, stream): (epoch, cursor)}.

    `lookahead` is the node's whole window, and it is a depth: pace.py sizes it by the loaders'
    pace summed over every stream (what they take while a few reads complete), so each stream
    with ids left reads an equal share of it ahead of its cursor; a sample two streams share
    counts in both. Each stream taking all of it, four jobs read four times what the cache keeps
    ahead of them and evicted their own reads (1.16x one job's bytes; 1.02x and 0.95x once
    shared). Keeping the lookahead's first distinct ids instead (a shared sample counted once, a
    short stream's rest to the others) read deeper where jobs converge, and 1.26x (docs/jobs.md)."""

    def __init__(self, jobs, lookahead: int):
        parts, dists, places, self.epoch, self.cursors = [], [], [], -1, {}
        snaps = [(slot, s, view, snap) for slot, s, view in jobs.streams()
                 if (snap := view.orders.snapshot(s, window=lookahead)) is not None]
        share = max(1, lookahead // max(1, sum(1 for *_, snap in snaps if snap[1].size)))
        for slot, s, view, (e, ids, cursor) in snaps:
            ids = ids[:share]
            self.cursors[(slot, s)] = (e, cursor)
            self.epoch = max(self.epoch, e)
            parts.append(ids)
            dists.append(np.arange(ids.size))
            places.append(slot * PLACE_SPAN + e * view.orders.capacity + cursor + dists[-1])
        if not parts:
            self.ids = self.places = np.empty(0, np.int64)
            return
        ids = np.concatenate(parts)
        by_distance = np.argsort(np.concatenate(dists), kind="stable")
        ids, places = ids[by_distance], np.concatenate(places)[by_distance]
        _, first = np.unique(ids, return_index=True)
        first = np.sort(first)
        self.ids, self.places = ids[first], places[first]


class Held:
    """What the prefetcher read ahead and holds until a reader asks for it (a copying tier is in
    the chain): batches as read (tiers.Read), each sample's global position, which are still
    held. Guarded by the loop's mu."""

    def __init__(self):
        self.batches = []       # [Read, epoch, positions, still held (bool mask), bytes held]

    def add(self, read, epoch: int, positions: np.ndarray, nbytes: np.ndarray) -> None:
        self.batches.append([read, epoch, positions, np.ones(read.ids.size, dtype=bool), nbytes])

    @property
    def nbytes(self) -> int:
        return sum(int(b[4][b[3]].sum()) for b in self.batches)

    def take(self, due) -> list:
        """[(Read of the due samples, epoch)]: due(ids, positions) -> bool mask of those to hand
        over now; they are held no more."""
        out, left = [], []
        for b in self.batches:
            read, epoch, positions, held, _ = b
            pos = np.flatnonzero(held)
            pos = pos[due(read.ids[pos], positions[pos])]
            if pos.size:
                out.append((read.part(pos), epoch))
                held[pos] = False
            if held.any():
                left.append(b)
        self.batches = left
        return out


class ReadAhead:
    """The loop's state and its steps (module docstring). node: the sc.Node the process was
    started for (its chain, cache, board and admission rule); options: prefetcher.DEFAULTS."""

    def __init__(self, node, options: dict):
        self.chain, self.cache, self.board = node.chain, node.cache, node.board
        self.jobs = self.board.all_jobs      # every job's orders (the flags are the node's)
        self.admission, self.options = node.admission, options
        self.lengths = lengths_of(self.chain.store)
        self.tier = self.chain.reader(options["max_batches"], options["queue_depth"], options["lanes"])
        copies, extents = self.chain.keeps_copies, self.chain.reads_extents
        self.rule = READS_UNTIL_FULL if extents else READS_ADMITTED if copies else READS_EVERY_MISS
        self.copies = copies
        mean = float(self.lengths.mean()) if self.lengths is not None and self.lengths.size else 4096.0
        items = int(self.cache.capacity_bytes // max(mean, 1.0))
        self.reach = max(1, items // 2)     # a window larger than half the cache evicts its own reads
        self.lookahead = options["lookahead_samples"]
        self.pace = None
        if self.lookahead is None:   # automatic: the loaders' pace and the reads' latency
            self.pace = Pace(options["batch"], options["max_batches"], items)
            self.lookahead = self.pace.window(self._top())
        self.limits = plan.Limits(options["batch"], options["max_batches"], options["lookahead_bytes"],
                                  min(self.cache.max_item_bytes, DEFAULT_MAX_ITEM_BYTES))
        self.copying = [t for _, t in self.chain.tiers if callable(getattr(t, "put_many", None))]
        self.mu = threading.Lock()
        self.inflight = deque()   # (epoch, bytes, submit time, positions) in submission order
        self.on_way = set()       # read, or held, and not offered yet
        self.held = Held()
        self.flagged = set()      # ids this process flagged "prefetched" and not yet seen used
        self.refused = set()      # ids the cache refused this epoch: not read again for it
        self._fullness(self.cache.stats())
        self.last_epoch = None
        self.stopping = False
        self.done = threading.Event()
        self._readers_seen = 0.0     # when a live job was last seen (serving())

    def _top(self) -> int:
        """The longest order a stream of any job holds (the automatic lookahead's cap)."""
        return max([v.orders.capacity for v in self.jobs.views()] or [self.board.capacity])

    def _fullness(self, st: dict) -> None:
        """The cache is full when it has refused or evicted before (then what is read ahead makes
        room, or is what it would admit); `engine_full`: the engine itself said so (it refused,
        or evicted since this process started), and its free bytes say nothing any more (slots
        are rounded up to their size class, so a cache of small samples is out of memory with
        bytes_used well below its capacity)."""
        self.full = self.engine_full = bool(st["evictions"] or st["rejected"])
        self.evicted_before = st["evictions"]
        self.free = 0             # the cache's bytes nothing cached, held or in flight takes

    # ---- one pass ------------------------------------------------------------------------------
    def step(self) -> None:
        """One pass: observe, plan and submit a batch; else take the oldest read, or rest."""
        self.jobs.free_dead()                          # a killed job's board goes (all_jobs.py)
        window = Window(self.jobs, self.lookahead)     # before mu: the hand-over waits on it
        cached = np.asarray(self.cache.cached_mask(), dtype=bool)
        with self.mu:
            self._observe(window, cached)
            submitted = self._submit(self._plan(window, cached))
        if self.inflight and (not submitted or len(self.inflight) >= self.limits.max_batches):
            self._take()
        elif not submitted:
            self._rest()

    def _rest(self) -> None:
        """Nothing to read now: waits until a stream moves (a cursor, a publish, a rewrite) or
        IDLE_S passes (a sample evicted from the window is a candidate again), looking every
        poll_s at the streams' words only. A pass over the window costs far more than that look,
        and on a small machine every pass is taken from the loaders' cores. Under the extent plan
        a full cache is read ahead no more (it only shrinks by removals): IDLE_S, whatever moves."""
        deadline = time.monotonic() + IDLE_S
        if self.full and self.rule == READS_UNTIL_FULL and not self.held.batches:
            time.sleep(IDLE_S)
            return
        seen = self.jobs.marks()
        while time.monotonic() < deadline and not self.stopping:
            time.sleep(self.options["poll_s"])
            if self.jobs.marks() != seen or self.board.control.stop_requested:
                return

    def _observe(self, window: Window, cached: np.ndarray) -> None:
        """What changed since the last pass (mu held): the loaders' pace, a new epoch (nothing is
        refused in it yet), stray WANTED flags, the cache's fullness, used and wasted prefetches."""
        if self.pace is not None:
            self.pace.saw_cursors(time.monotonic(), window.cursors)
        if window.epoch != self.last_epoch:
            self.refused.clear()
            self.last_epoch = window.epoch
        self._clear_stray_wanted()
        if not self.engine_full:
            # The loaders' own misses fill the cache too, unseen by _land; and a policy that
            # evicts to admit refuses nothing, so a refused insert alone never tells: until the
            # engine refused or evicted, what is cached, held and in flight says it
            st = self.cache.stats()
            self.free = st["capacity_bytes"] - st["bytes_used"] - self._pending_bytes()
            self.engine_full = st["evictions"] > self.evicted_before
            self.full = self.full or self.engine_full or self.free <= 0.1 * st["capacity_bytes"]
        if self.flagged:   # flags cleared by readers: used prefetches; flagged and gone: wasted
            f = np.fromiter(self.flagged, dtype=np.int64, count=len(self.flagged))
            used = ~self.board.flags.prefetched(f)
            wasted = f[~used & ~cached[f]]
            if wasted.size:
                self.board.flags.unmark(wasted)
                self.board.counters.count(max(window.epoch, 0), prefetch_wasted=int(wasted.size))
            self.flagged.difference_update(f[used].tolist())
            self.flagged.difference_update(wasted.tolist())

    def _plan(self, window: Window, cached: np.ndarray) -> plan.Reads:
        """The next batch (plan.py), with room made for it in a full cache (mu held)."""
        skip = self.on_way | self.refused
        ids, places = plan.candidates(window.ids, window.places, cached, self.chain.keeps,
                                      np.fromiter(skip, np.int64, len(skip)))
        if self.pace is not None:
            self.pace.saw_window(int(window.ids.size), int(ids.size) + len(self.on_way))
            self.lookahead = self.pace.window(self._top())
        ahead = plan.Ahead(len(self.inflight), len(self.on_way), self._pending_bytes(),
                           self.full, self.engine_full, self.free)
        reads = plan.next_reads(ids, places, self.lengths, self.rule, ahead, self.limits,
                                self.chain.held, self._would_admit)
        if reads.evict and self._shared():
            reads = plan.Reads(reads.ids, reads.places, reads.nbytes, 0)   # the engine's policy decides
        if reads.evict:
            latest = int(self.jobs.next_use(reads.ids).max())
            removed = self.admission.make_room(self.cache, self.jobs.next_use, reads.evict, latest)
            k = reads.ids.size - reads.evict + removed
            reads = plan.Reads(reads.ids[:k], reads.places[:k], reads.nbytes[:k], 0)
        return reads

    def _would_admit(self, ids, displaced):
        return self.admission.would_admit(self.cache, ids, displaced)

    def _submit(self, reads: plan.Reads) -> bool:
        """Marks the batch on its way and submits it (mu held); False when nothing was."""
        if not reads.ids.size:
            return False
        batch, places, nbytes = reads.ids, reads.places, reads.nbytes
        board = self.board
        board.flags.mark_on_way(batch)     # readers wait for these instead of reading them
        # A loader that took one of them since the window was read may have looked for the mark
        # before it was made, and reads it itself: leave it to it. (The loader moves the cursor
        # before it looks; the fence orders our mark before our look at the cursor.)
        _io.memory_fence()
        taken = self.jobs.behind(places)
        if taken.any():
            board.flags.unmark(batch[taken])
            batch, places, nbytes = batch[~taken], places[~taken], nbytes[~taken]
        if not batch.size:
            return False
        mates = self.tier.submit(batch, board.flags.on_way)   # no mate that an earlier batch reads
        if mates.size:
            # the extent mates read with the batch are on their way too: not candidates of the
            # next batches (each would read the same extents again), and a loader waits for them
            board.flags.mark_on_way(mates)
            self.on_way.update(mates.tolist())
        epoch = max(self.last_epoch if self.last_epoch is not None else 0, 0)
        self.inflight.append((epoch, nbytes, time.monotonic(), places))
        self.on_way.update(batch.tolist())
        board.counters.count(epoch, reads_issued=int(batch.size))
        return True

    def _take(self) -> None:
        """Waits for the oldest read (without mu), then lands or holds it."""
        epoch, nbytes, t_sub, places = self.inflight[0]
        read = self.tier.take()
        if self.pace is not None:
            self.pace.saw_batch(time.monotonic() - t_sub)
        with self.mu:
            self.inflight.popleft()
            if self._arrived(read, epoch, places, nbytes):
                self.hand_over()           # what a reader already waits for

    def _pending_bytes(self) -> int:
        """Bytes read ahead and not offered yet: held, and in flight (mu held)."""
        return self.held.nbytes + sum(int(f[1].sum()) for f in self.inflight)

    # ---- landing ---------------------------------------------------------------------------------
    def _arrived(self, read, epoch: int, places, nbytes) -> bool:
        """One read done: held until a reader asks for it when a copying tier is in the chain,
        else offered now; returns whether it is held (mu held). A read that brought extent mates
        is offered whole, now, as the loader offers its own extent reads: the cache and the SSD
        tier keep whole extents, and with the mates offered at once and the asked samples held
        until their turn, extents landed in pieces."""
        if self.copies and read.asked == read.ids.size:
            self.held.add(read, epoch, places, nbytes)
            return True
        self._land(read, epoch)
        return False

    def _land(self, read, epoch: int) -> None:
        """Offers one read through the node's admission rule (what the cache refuses to the
        copying tiers) and flags what it admitted (mu held)."""
        ids, board = read.ids, self.board
        room = None if self.copies else self._room_for
        admitted = self.chain.admit(read, room, staged_again=True)
        if not admitted.all():
            # full only when it refused something offered to it (what the SSD tier served is
            # offered only into free room: that is no refusal)
            self.full = self.full or bool((read.offered & ~admitted).any())
            self.engine_full = self.engine_full or self.full
            self.refused.update(ids[~admitted].tolist())
            if self.copies:   # a reader asks for these now or soon: from the SSD tier, once written
                for t in self.copying:
                    flush = getattr(t, "flush", None)
                    if callable(flush):
                        flush(2.0)
        self.on_way.difference_update(ids.tolist())
        got = ids[admitted]
        board.flags.unmark(ids[~admitted])
        board.flags.mark_prefetched(got)
        self.flagged.update(got.tolist())
        board.counters.count(epoch, prefetched=int(got.size),
                    prefetched_bytes=int(sum(len(d) for d, a in zip(read.values, admitted) if a)))

    def _shared(self) -> bool:
        """Whether several jobs share the cache. Then the prefetcher makes no room of its own: the
        engine's policy over the merged scores decides what a read displaces (job_scores.py:
        under "uses", what the fewest live jobs still need). Room made by next use, as for one
        job, took the samples one job had brought for the others first: their next use in each
        job's order lies far ahead until the job takes them (sampling/follow.py brings a cached
        sample forward only at the batch that takes it)."""
        return len(self.jobs.registered()) > 1

    def _room_for(self, ids) -> bool:
        """A full cache refused `ids` (no copying tier): room among the samples needed later than
        these (none when one of them is needed by nobody any more; none with several jobs:
        _shared)."""
        if self._shared():
            return False
        nu = self.jobs.next_use(ids)
        if (nu < 0).any():
            return False
        return self.admission.make_room(self.cache, self.jobs.next_use, 2 * int(ids.size),
                                        int(nu.max())) > 0

    def hand_over(self, everything: bool = False) -> None:
        """Offers the held samples a reader waits for (WANTED), and those no reader will ask for
        any more (their turn is behind the cursors, or no published order reads them); all of
        them when stopping (mu held)."""
        board = self.board

        def due(ids, positions):
            if everything:
                return np.ones(ids.size, dtype=bool)
            nu = self.jobs.next_use(ids)
            return board.flags.wanted(ids) | (nu < 0) | self.jobs.behind(positions)
        for read, epoch in self.held.take(due):
            self._land(read, epoch)

    def _clear_stray_wanted(self) -> None:
        """A reader's WANTED that landed after the offer: cleared whether or not a copying tier
        is in the chain (left, every later reader of the sample would wait for it)."""
        stray = self.board.flags.wanted()
        if stray.size:
            mine = np.fromiter(self.on_way, np.int64, len(self.on_way))   # held or in flight
            self.board.flags.unmark(stray[~np.isin(stray, mine)])

    # ---- the process ---------------------------------------------------------------------------
    def _hand_over_loop(self) -> None:
        """Every poll_s while something is held or in flight (else IDLE_S): hands over what is
        due, when something that decides it moved since the last hand-over began (a stream's
        cursor or order, a reader's WANTED: AllJobs.marks; a read held since). The marks are taken
        before the hand-over, so what moves while it runs is seen at the next poll."""
        seen = None
        while not self.done.wait(self.options["poll_s"] if self.held.batches or self.inflight
                                 else IDLE_S):
            marks = (self.jobs.marks(), len(self.held.batches))
            if marks == seen:
                continue
            seen = marks
            with self.mu:
                self.hand_over()
            seen = (seen[0], len(self.held.batches))   # what it took is no news

    def serving(self) -> bool:
        """Whether this process is the node's registered prefetcher (one whose start outlasted
        its starter's wait may have registered over another: one of them goes) and a job lives
        on the board: a training process of any job holds its byte (jobs.py). The prefetcher is
        the node's, not its starter's: it outlives the process that started it, killed or done,
        for as long as another job (or another rank of the starter's) trains on the node, and
        exits within READERS_EVERY_S once none does. The registry is looked at no more often
        than that."""
        if self.board.control.prefetcher_pid != os.getpid():
            return False
        now = time.monotonic()
        if now - self._readers_seen < READERS_EVERY_S:
            return True
        if not self.board.jobs.live():
            return False
        self._readers_seen = now
        return True

    def run(self) -> None:
        """Runs passes until the board's stop word, SIGTERM or no one is served (serving());
        then finishes what is in flight and offers everything held (a clean stop leaves no
        read to die with the process)."""
        helper = None
        if self.copies:
            helper = threading.Thread(target=self._hand_over_loop, name="sc-prefetch-hand-over",
                                      daemon=True)
            helper.start()
        signal.signal(signal.SIGTERM, self._on_term)
        try:
            while not self.stopping and not self.board.control.stop_requested and self.serving():
                self.step()
            self.done.set()
            if helper is not None:
                helper.join()
            with self.mu:
                while self.inflight:
                    epoch, nbytes, _, places = self.inflight.popleft()
                    self._arrived(self.tier.take(), epoch, places, nbytes)
                self.hand_over(everything=True)
        finally:
            self.done.set()
            if helper is not None:
                helper.join(5.0)
            self.tier.close()

    def _on_term(self, *_) -> None:
        self.stopping = True
