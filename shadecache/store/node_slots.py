"""One bounded set of object-store requests per node: a slot per request, held as a byte lock.

Every process of a node that reads an object store (the training ranks, their DataLoader workers,
the prefetcher, the peer server) takes a slot before each request and gives it back after, so
the node never has more than `slots` requests in flight to one endpoint, however many processes
read directly (2 ranks x 4 workers share the same `slots`).

A slot is byte i of a lock file, locked with an open-file-description lock (fcntl F_OFD_SETLK):
- the kernel releases it when the holder dies, SIGKILL included (its descriptors close), so a
  killed worker never keeps a slot: no lease, no repair, no sweeper (LMDB's reader table uses a
  byte lock the same way);
- an OFD lock belongs to the open file description, not to the process (a POSIX lock of the
  process would be shared by all its threads, and dropped when any descriptor of the file
  closes): each slot held in this process has a description of its own, so threads of one
  process hold distinct slots;
- after fork a child shares its parent's descriptions (and so their locks): the child closes the
  inherited ones at once (os.register_at_fork), idle or held by a parent thread, and opens its
  own; the parent keeps its slots (its explicit unlock releases them, and a parent killed while
  holding one leaves no child holding the description open).
Waiting: a process that finds every slot taken tries again after a short sleep (1 ms, doubling to
20 ms): requests last tens of milliseconds, so a poll costs little, and it cannot wait on one busy
slot while another frees (a blocking F_OFD_SETLKW would).

The lock file is `<dir>/s3-slots-<hash of the endpoint>`, in a directory of this user's own
(node_files.own_directory: 0700, refused when another user owns it); it is never removed (removing
a lock file under processes that hold it would split them across two files). The bound counts
requests, not sockets: idle pooled connections hold no slot (bench/object_store.py measures both
at its proxy).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import random
import struct
import threading
import time
from contextlib import contextmanager

from .. import node_files

__all__ = ["NodeSlots", "default_slot_dir"]

# struct flock on Linux x86-64 and aarch64: short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid (0 for OFD locks), padded to 32 bytes
_FLOCK = "hhxxxxqqi4x"
_POLL_FIRST, _POLL_MAX = 0.001, 0.020


def default_slot_dir() -> str:
    """$SHADECACHE_SLOT_DIR, else $XDG_RUNTIME_DIR/shadecache, else /tmp/shadecache-<uid>."""
    given = os.environ.get("SHADECACHE_SLOT_DIR")
    if given:
        return given
    run = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(run, "shadecache") if run else f"/tmp/shadecache-{os.geteuid()}"


def _lock(fd: int, kind: int, slot: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, slot, 1, 0))
        return True
    except (BlockingIOError, PermissionError):   # EAGAIN / EACCES: another description holds it
        return False


class NodeSlots:
    """At most `slots` holders at once across every process of the node that uses the same
    `key` (an endpoint) and directory. acquire() is a context manager; held() says how many
    this process holds."""

    def __init__(self, key: str, slots: int, directory: str | None = None):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, not {slots!r}")
        self.slots = slots
        directory = directory or default_slot_dir()
        self.path = os.path.join(directory, "s3-slots-" + hashlib.sha256(key.encode()).hexdigest()[:16])
        dfd = node_files.own_directory(directory, "the object store's slot directory")
        try:
            fd = node_files.open_file(os.path.basename(self.path), os.O_RDWR, "the object store's slot file",
                                      dir_fd=dfd, create=True)
            os.close(fd)
        finally:
            os.close(dfd)
        self._mu = threading.Lock()
        self._pid = os.getpid()
        self._free: list = []       # descriptions of this process not holding a slot
        self._busy: set = set()     # descriptions holding one
        _INSTANCES.add(self)

    def _description(self) -> int:
        with self._mu:
            if self._pid != os.getpid():   # forked: what the parent opened is the parent's
                self._after_fork()
            if self._free:
                return self._free.pop()
        return os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)

    def _after_fork(self) -> None:
        for fd in self._free + list(self._busy):
            os.close(fd)
        self._free, self._busy = [], set()
        self._pid = os.getpid()

    @contextmanager
    def acquire(self, deadline: float | None = None):
        """Holds one slot for the `with` block. TimeoutError when `deadline` (time.monotonic())
        passes first."""
        fd = self._description()
        pid = os.getpid()
        slot = self._take(fd, deadline)
        try:
            yield slot
        finally:
            with self._mu:
                if self._pid == pid == os.getpid():   # else a fork closed it (_after_fork)
                    _lock(fd, fcntl.F_UNLCK, slot)
                    self._busy.discard(fd)
                    self._free.append(fd)

    def _take(self, fd: int, deadline: float | None) -> int:
        wait = _POLL_FIRST
        first = random.randrange(self.slots)   # spread the processes over the slots
        while True:
            for j in range(self.slots):
                slot = (first + j) % self.slots
                if _lock(fd, fcntl.F_WRLCK, slot):
                    with self._mu:
                        self._busy.add(fd)
                    return slot
            if deadline is not None and time.monotonic() > deadline:
                with self._mu:
                    self._free.append(fd)
                raise TimeoutError(f"no request slot of {self.path} came free in time "
                                   f"({self.slots} slots, all held)")
            time.sleep(wait * (0.5 + random.random()))
            wait = min(_POLL_MAX, wait * 2)

    def held(self) -> int:
        """Slots this process holds now."""
        return len(self._busy) if self._pid == os.getpid() else 0

    def close(self) -> None:
        with self._mu:
            for fd in self._free:
                os.close(fd)
            self._free = []


import weakref  # noqa: E402

_INSTANCES: "weakref.WeakSet[NodeSlots]" = weakref.WeakSet()


def _drop_inherited() -> None:
    # In the child right after fork: the descriptions the parent held are the parent's (their
    # locks with them); close the idle ones at once. One a parent thread held mid-request is not
    # in _free and stays open until that thread's own release, which closes it in this child.
    for s in list(_INSTANCES):
        s._after_fork()


os.register_at_fork(after_in_child=_drop_inherited)
