"""Every job on the node's board, seen together from one process: the prefetcher reads ahead in all
of their orders, and a job's score merge (job_scores.py) reads all of their scores and what each
still reads.

Each job registered on the node's file (jobs.py) has a JobView here: its file attached (the job's
own handle reuses its own view), dropped when its slot is freed or given to another job. A view
is built from the slot's table words (one read of MAX_JOBS words) at most every LOOK_S, so a
merge per batch costs no system call but the registry lock; the liveness bytes are asked only by
free_dead (at most every FREE_S), which frees what a dead job held: so a SIGKILLed job is noticed
within FREE_S by any process that calls it (a live job's sampler per batch, the prefetcher per
pass).

Positions across jobs. Within a job, a global position (board.py: epoch * capacity + entry)
orders its ranks' reads; across jobs positions mean nothing (each job runs at its own pace). The
prefetcher's places carry their job: place = slot * PLACE_SPAN + position (behind() compares each
with its own job's most advanced cursor), and next_use() answers a distance: entries ahead of the
cursor of the job that reads the sample soonest, which is how far ahead it is needed in reads of
that job; the prefetcher only compares such distances with each other in one pass.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from .board_files import JobFile
from .job_view import JobView

PLACE_SPAN = 1 << 40    # positions stay below 2^39 (csrc/cache/policy.h kMaxNextUsePosition)


class AllJobs:
    """The jobs on one node file (module docstring). node: the board's NodeFile; jobs: its Jobs;
    node_parts: what a JobView takes of the node's file (board.py); own: the JobView of the
    process's own job, or None (the prefetcher, `shadecache stats`)."""

    LOOK_S = 0.05
    FREE_S = 0.5

    def __init__(self, node, jobs, node_parts, own=None):
        self.node, self.jobs, self.node_parts, self.own = node, jobs, node_parts, own
        self._views = {}          # slot -> JobView
        self._looked = self._freed = -1.0
        self._mu = threading.Lock()   # the prefetcher's loop and hand-over thread both look

    def close(self) -> None:
        with self._mu:
            for slot, v in list(self._views.items()):
                if v is not self.own:
                    v.close()
            self._views = {}

    def locked(self):
        return self.jobs.locked()

    def registered(self) -> tuple:
        return tuple(self.jobs.registered())

    def free_dead(self) -> list:
        """Frees the slots of jobs that are gone (their boards removed), at most every FREE_S;
        returns the slots freed."""
        now = time.monotonic()
        if now - self._freed < self.FREE_S:
            return []
        self._freed = now
        if all(self.jobs.lives(s) for s, _ in self.jobs.registered()):
            return []
        try:
            with self.jobs.locked():
                return self.jobs.free_dead()
        except FileNotFoundError:
            return []

    def views(self) -> list:
        """JobView of every registered job (attached now where new; a job whose file is not made
        yet, or is gone, is left out until it is there)."""
        with self._mu:
            now = time.monotonic()
            if now - self._looked >= self.LOOK_S or not self._views:
                self._looked = now
                self._refresh()
            return list(self._views.values())

    def _refresh(self) -> None:
        wanted = dict(self.jobs.registered())
        for slot, v in list(self._views.items()):
            if wanted.get(slot) != v.generation:
                if v is not self.own:
                    v.close()
                del self._views[slot]
        for slot, gen in wanted.items():
            if slot in self._views:
                continue
            if self.own is not None and (self.own.slot, self.own.generation) == (slot, gen):
                self._views[slot] = self.own
                continue
            try:
                f = JobFile.attach(self.jobs.cache_name, slot, wait=0)
            except (OSError, ValueError):
                continue
            if f.generation != gen:
                f.close()
                continue
            self._views[slot] = JobView(f, *self.node_parts)

    # ---- the prefetcher's view of every job's orders -----------------------------------------
    def streams(self) -> list:
        """[(slot, stream, JobView)] of every stream of every job."""
        return [(v.slot, s, v) for v in self.views() for s in range(v.orders.streams)]

    def next_use(self, ids) -> np.ndarray:
        """Per id, the least distance (entries ahead of its job's most advanced cursor) at which
        some job reads it next, -1 where no job knows one."""
        ids = np.asarray(ids, dtype=np.int64)
        best = np.full(ids.size, np.iinfo(np.int64).max, dtype=np.int64)
        for v in self.views():
            nu = v.orders.next_use(ids)
            now = max(v.orders.now(), 0)
            d = np.where(nu < 0, np.iinfo(np.int64).max, np.maximum(nu - now, 0))
            np.minimum(best, d, out=best)
        best[best == np.iinfo(np.int64).max] = -1
        return best

    def behind(self, places) -> np.ndarray:
        """Bool mask: which places (slot * PLACE_SPAN + position) are behind their job's most
        advanced cursor now (taken by a loader of that job), or of a job that is gone."""
        places = np.asarray(places, dtype=np.int64)
        slots, pos = places // PLACE_SPAN, places % PLACE_SPAN
        now = np.full(int(slots.max()) + 1 if places.size else 0, np.iinfo(np.int64).max)
        for v in self.views():
            if v.slot < now.size:
                now[v.slot] = v.orders.now()
        return pos < now[slots] if places.size else np.zeros(0, dtype=bool)

    def marks(self) -> bytes:
        """What changes whenever a job's stream publishes, rewrites or moves its cursor, a job
        comes or goes, or a reader asks for a sample on its way (Orders.marks, of every job)."""
        return b"".join(v.orders.marks() for v in self.views()) + repr(self.registered()).encode()
