"""Whether a process is alive: the one test every part of shadecache asks (the creator of a
segment, the prefetcher registered on an order board, the writer of a peer server's status file).

It is the engine's (csrc/common/proc.h, the same test the engine applies to pin records): a pid
that /proc does not know, an exited process its parent has not waited for yet (a zombie maps
nothing and runs nothing), or another process that reused the pid (start times differ) are gone.
When /proc cannot tell (unreadable), the process counts as alive: keeping a dead owner's files a
while is better than taking a live owner's. All processes of a node share one pid namespace.
"""
from . import _core


def alive(pid: int, start_time: int = 0) -> bool:
    """True unless process `pid` is known to be gone; with `start_time` (clock ticks since boot,
    start_time_of), also when the pid now names another process."""
    return pid > 0 and not _core.process_gone(int(pid), int(start_time))


def start_time_of(pid: int) -> int:
    """The start time of process `pid` (0 when there is none): with the pid, it names one process."""
    return _core.process_start_time(int(pid))
