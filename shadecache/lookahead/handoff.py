"""The order board's hand-off flags between the prefetcher and the readers: a byte per sample
(PREFETCHED, ON_WAY, WANTED; board.py's memory contract), and the count of WANTED a reader sets."""
from __future__ import annotations

import time

import numpy as np

from ..process import alive
from .board_layout import H_WANTED_SEQ, ON_WAY, PREFETCHED, WANTED


class HandOff:
    """The flags of one board (board.py: OrderBoard.flags). control: the board's Control (a
    reader waits only while the prefetcher lives)."""

    def __init__(self, flags, header, control):
        self._flags, self._header, self._control = flags, header, control

    def close(self) -> None:
        self._flags = self._header = None

    def mark_on_way(self, ids) -> None:
        """The prefetcher is reading these ids (readers wait for them instead of reading them)."""
        self._flags[ids] = ON_WAY
    def on_way(self, ids) -> np.ndarray:
        """Bool mask: which ids the prefetcher is reading or holding now (ON_WAY or WANTED)."""
        return self._flags[ids] >= ON_WAY
    def wanted(self, ids=None) -> np.ndarray:
        """Bool mask over `ids`: those on their way that a reader waits for now; with no ids,
        the ids so flagged (a scan of N bytes)."""
        if ids is None:
            return np.flatnonzero(self._flags == WANTED)
        return self._flags[ids] == WANTED
    def mark_prefetched(self, ids) -> None:
        """The prefetcher brought these ids into the cache; no read has used them yet."""
        self._flags[ids] = PREFETCHED
    def unmark(self, ids) -> None:
        """Neither on their way nor unused in the cache: read but refused by the cache, or found
        evicted before any read used them (wasted)."""
        self._flags[ids] = 0
    def clear_on_way(self) -> None:
        """Drops every "on its way" flag, WANTED included (a prefetcher that starts: one killed
        left them set)."""
        self._flags[self._flags >= ON_WAY] = 0
    def prefetched(self, ids) -> np.ndarray:
        """Bool mask: which ids still carry the flag (brought, and not used by a read yet)."""
        return self._flags[ids] == PREFETCHED
    def claim_prefetched(self, ids, hit) -> int:
        """A reader's batch: clears the flags of the prefetched ids it found in the cache (hit():
        the batch's bool mask of cache hits, asked for only when some id is flagged) and returns
        how many distinct ids that was: the batch's prefetch hits. A byte store per id: two
        readers claiming one id at once may both count it (a rare overcount)."""
        flags = self._flags[ids]
        if not (flags == PREFETCHED).any():
            return 0
        used = ids[(flags == PREFETCHED) & hit()]
        self._flags[used] = 0
        return int(np.unique(used).size)
    def wait_for(self, ids, timeout: float) -> np.ndarray:
        """Waits (up to `timeout` seconds, while the prefetcher lives) until none of `ids` is on
        its way; returns the mask of those that were. A reader calls it before reading its misses,
        so that a sample the prefetcher is reading is read once. It flags them WANTED: the
        prefetcher holds what it read ahead until a reader asks for it, then offers it to the
        cache (docs/prefetch.md)."""
        coming = self.on_way(ids)
        if not coming.any():
            return coming
        wait = ids[coming]
        self._flags[wait] = WANTED
        from .. import _io
        _io.atomic_add(self._header, H_WANTED_SEQ // 8, 1)   # after the flags: the prefetcher looks
        deadline = time.monotonic() + timeout
        control = self._control
        if not control.prefetcher_alive():
            return coming
        pid, start = control.prefetcher_pid, control.prefetcher_start()
        while (self.on_way(wait).any() and time.monotonic() < deadline and alive(pid, start)):
            time.sleep(0.0005)
        return coming

