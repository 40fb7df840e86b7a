"""The package's own processes: whether one is alive, and the command that starts one.

Alive: the one test every part of shadecache asks (the creator of a segment, the prefetcher
registered on an order board, the writer of a peer server's status file). It is the engine's
(csrc/common/proc.h, the same test the engine applies to pin records): a pid that /proc does not
know, an exited process its parent has not waited for yet (a zombie maps nothing and runs
nothing), or another process that reused the pid (start times differ) are gone. When /proc cannot
tell (unreadable), the process counts as alive: keeping a dead owner's files a while is better
than taking a live owner's. All processes of a node share one pid namespace.

Started: every interpreter the package starts (the peer server, the prefetcher) runs its module
as `python -m` would, but isolated (`python -I`: no working directory or script directory on its
import path, no PYTHON* variables, no user site), with an import path it is given: this package's
folder, then the parent's own path (its working directory for "") minus every entry another user
or group could write to or replace. `python -m` puts the working directory first: a module planted
in a world-writable working directory would run inside the child (the peer server holds the
secret; the prefetcher writes the cache). So a class the child unpickles (a store of the user's
own) must come from a directory only its owner may write to. "Replace" covers the entry's parents:
a directory of this user's inside one that others may write to (without the sticky bit, which
keeps them from renaming what is not theirs) can be renamed away and another put in its place,
at any time in the child's life (modules are imported lazily too). Each entry is resolved to its
real path first, and that path is what the child gets: no symbolic link that someone could point
elsewhere later.
"""
import contextlib
import fcntl
import os
import stat
import struct
import sys

from . import _core


def alive(pid: int, start_time: int = 0) -> bool:
    """True unless process `pid` is known to be gone; with `start_time` (clock ticks since boot,
    start_time_of), also when the pid now names another process."""
    return pid > 0 and not _core.process_gone(int(pid), int(start_time))


def start_time_of(pid: int) -> int:
    """The start time of process `pid` (0 when there is none): with the pid, it names one process."""
    return _core.process_start_time(int(pid))


def isolated_python(module: str) -> list:
    """The command that runs `module` as `python -m module` does (as __main__, its package's
    __main__ for a package) in an isolated interpreter with a safe import path (module docstring)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [here] + [os.path.realpath(p) for p in (q or os.getcwd() for q in sys.path) if trusted_dir(p)]
    code = (f"import sys; sys.path[:0] = {list(dict.fromkeys(path))!r}; "
            f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-I", "-c", code]


def trusted_dir(path: str) -> bool:
    """An import path entry no other user could have planted a module in, nor replace: absolute;
    its real path owned by this user or root and writable by no group and nobody else; each of
    its parents owned by this user or root and writable by no group and nobody else, unless it
    has the sticky bit (as /tmp: others may add entries there, not rename or remove ours)."""
    if not os.path.isabs(path):
        return False
    real = os.path.realpath(path)
    mine = (0, os.geteuid())
    try:
        st = os.stat(real)
        if st.st_uid not in mine or st.st_mode & 0o022:
            return False
        parent = os.path.dirname(real)
        while True:
            st = os.stat(parent)
            if st.st_uid not in mine or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
                return False
            if parent == os.path.dirname(parent):
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


# ---- liveness the kernel vouches for: open-file-description byte locks ------------------------
# A process says "I live" by holding a shared lock on one byte of a file (fcntl F_OFD_SETLK): the
# kernel drops it when the last descriptor of that open file description closes, which a SIGKILL
# does at once. Another process asks whether anyone holds the byte with F_OFD_GETLK (LMDB's
# reader table holds its readers' liveness the same way, with per-process locks). The bytes may
# lie past the end of the file: nothing is read or written there.
#
# A forked child gets a copy of every descriptor, and a copy refers to the same open file
# description: while the child keeps it, the description and its locks live on, whatever the
# parent does (closes its own descriptor, exits, is SIGKILLed). And the child cannot let go of the
# lock for itself alone: F_UNLCK on the shared description would drop it for the parent too. So
# the descriptors that carry this process's locks are kept here (keep_from_children), and a
# forked child closes its copies at once (os.register_at_fork): a lock this process holds is
# this process's alone, never its DataLoader workers'. (The child's close leaves the parent's
# descriptor, and so the lock, as they were.) A child started by fork + exec (subprocess) closes
# them at the exec: each is O_CLOEXEC.
_F_RDLCK, _F_WRLCK, _F_UNLCK = 0, 1, 2
_FLOCK = "hhxxxxqqixxxx"     # struct flock (Linux, 64-bit): l_type, l_whence, l_start, l_len, l_pid
_KEPT: dict = {}             # token -> a descriptor that carries a lock of this process


def keep_from_children(fd: int) -> object:
    """Registers `fd` as carrying a lock of this process only: a forked child closes its copy.
    Returns the token that close_kept() takes."""
    token = object()
    _KEPT[token] = fd
    return token


def close_kept(token) -> None:
    """Closes the descriptor of `token` (keep_from_children), once; nothing when it is not this
    process's (a child forked while it was open has closed its copy already)."""
    fd = _KEPT.pop(token, None)
    if fd is not None:
        os.close(fd)


def _close_kept_in_child() -> None:
    # the child runs one thread now: nothing else touches _KEPT
    for fd in _KEPT.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _KEPT.clear()


os.register_at_fork(after_in_child=_close_kept_in_child)


def _flock(kind: int, at: int) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, int(at), 1, 0)


def hold_byte(fd: int, at: int) -> None:
    """Takes a shared lock on byte `at` of the file open at `fd` for as long as that open file
    description lives (OSError if the kernel refuses it). Register `fd` with keep_from_children
    unless forked children are to keep the lock alive."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(_F_RDLCK, at))


def byte_held(fd: int, at: int) -> bool:
    """Whether some open file description other than `fd`'s holds a lock on byte `at`."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(_F_WRLCK, at))
    return struct.unpack(_FLOCK, got)[0] != _F_UNLCK


@contextlib.contextmanager
def exclusive_byte(path: str, at: int):
    """An exclusive lock on byte `at` of the file at `path`, waited for, on a descriptor of its
    own (so two threads of one process exclude each other too); released when the block ends or
    the process dies, never kept by a child forked meanwhile (keep_from_children: another
    thread's fork, a DataLoader starting its workers, would otherwise hold it as long as the
    child lives)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    token = keep_from_children(fd)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _flock(_F_WRLCK, at))
        yield fd
    finally:
        close_kept(token)
