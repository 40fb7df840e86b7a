"""The order board's process control: the node's prefetcher (its pid and start time, the stop
word, the read rule and reach it publishes for the samplers), the claim on starting one, and the
board's creator."""
from __future__ import annotations

import contextlib
import fcntl
import os

from ..process import alive, close_kept, keep_from_children, start_time_of
from .board_layout import (H_CREATOR, H_CREATOR_START, H_PREFETCHER, H_PREFETCHER_START, H_REACH,
                           H_READ_RULE, H_STOP)


class Control:
    """The control words of one board (board.py: OrderBoard.control)."""

    def __init__(self, header, path: str):
        self._header, self.path = header, path

    def close(self) -> None:
        self._header = None

    @property
    def prefetcher_pid(self) -> int:
        return int(self._header[H_PREFETCHER // 8])
    def set_prefetcher(self, pid: int) -> None:
        """Registers process `pid` as the node's prefetcher (0: none), with its start time, so
        that the pid names that process only (prefetcher_alive)."""
        self._header[H_PREFETCHER_START // 8] = start_time_of(pid) if pid else 0
        self._header[H_PREFETCHER // 8] = int(pid)
    def prefetcher_start(self) -> int:
        return int(self._header[H_PREFETCHER_START // 8])
    def prefetcher_alive(self) -> bool:
        """Whether the registered prefetcher runs: its pid is alive and, when its start time was
        registered, names the same process (a killed prefetcher's pid may name another one by
        now). The two words are not read as one: a reader racing a new registration may take the
        new prefetcher for gone, which costs it a read of its own, never a wrong value."""
        pid = self.prefetcher_pid
        return bool(pid) and alive(pid, self.prefetcher_start())
    def prefetcher_died(self) -> bool:
        """Whether a prefetcher is registered and gone without unregistering (killed: a clean
        stop unregisters)."""
        return bool(self.prefetcher_pid) and not self.prefetcher_alive()
    def set_read_rule(self, rule: int, reach: int) -> None:
        """The prefetcher's rule (READS_*) and reach (half the samples the cache holds: how far
        ahead of the cursors its automatic lookahead reads at most), for the samplers' stall
        budget, which bends the order around what it reads."""
        self._header[H_REACH // 8] = int(reach)
        self._header[H_READ_RULE // 8] = int(rule)
    @property
    def read_rule(self) -> int:
        """The live prefetcher's READS_* rule, 0 when none runs."""
        return int(self._header[H_READ_RULE // 8]) if self.prefetcher_alive() else 0
    @property
    def reach(self) -> int:
        return int(self._header[H_REACH // 8])
    @property
    def stop_requested(self) -> bool:
        return bool(self._header[H_STOP // 8])
    def request_stop(self, value: bool = True) -> None:
        self._header[H_STOP // 8] = int(bool(value))
    @contextlib.contextmanager
    def starting(self):
        """Yields True in the one process that may start the node's prefetcher now (an exclusive
        flock on the board file, not waited for: the kernel drops it when the holder dies), False
        in any other that asks meanwhile."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        token = keep_from_children(fd)   # a child forked meanwhile must not keep the claim
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            close_kept(token)
    def creator_gone(self) -> bool:
        """Whether the process that made this board is gone (its pid and start time)."""
        pid = int(self._header[H_CREATOR // 8])
        return pid > 0 and not alive(pid, int(self._header[H_CREATOR_START // 8]))
