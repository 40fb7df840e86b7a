"""The order board's two files, made and mapped: the node's (NodeFile: the prefetcher's words, the
hand-off flags, the registry of jobs) and a job's (JobFile: its orders, rows, totals and scores).
board_layout.py has their offsets; board.py composes a job's handle from the two.

Both are made the same way: O_EXCL, mode 0600, never another user's (node_files.py), sized and
fallocated at once (a full tmpfs is an error now, not a SIGBUS later), the header written before
the magic, which is written last: a half-made file is refused by attach (ValueError) and waited
for by those who make or join one (board.py).
"""
from __future__ import annotations

import mmap
import os
import struct
import time

import numpy as np

from .. import node_files, shm
from ..process import start_time_of
from .board_layout import (H_CREATOR, H_CREATOR_START, H_MAGIC, H_N, H_SCORE_MERGE, H_VERSION,
                           HEADER_BYTES, JOB_MAGIC, JOB_VERSION, MAGIC, MAX_STREAMS, NONE,
                           VERSION, H_CAPACITY, H_GENERATION, H_SLOT, H_STREAMS, node_bytes, sizes)

ADVICE = "Another user made it first: use another cache name."


def is_file(path: str, identity: tuple) -> bool:
    """Whether the file at `path` is the one of `identity` (device, inode)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == identity


def unlink_if_current(path: str, identity: tuple) -> None:
    """Removes `path` when it is still the file of `identity` and this user's (in the sticky
    /dev/shm nobody else can put theirs in its place between that look and the unlink)."""
    if is_file(path, identity) and node_files.owned(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class _Mapped:
    """A board file mapped whole: path, identity (device, inode: a file made again is another),
    the mapping, and a descriptor kept for the registry's byte locks (process.py)."""

    def __init__(self, path: str, fd: int, magic: int, version: int, what: str):
        self.path, self.fd = path, fd
        try:
            st = os.fstat(fd)
            self.identity = (st.st_dev, st.st_ino)
            if st.st_size < HEADER_BYTES:
                raise ValueError(f"{path} is not an {what} (only {st.st_size} bytes)")
            self.mm = mmap.mmap(fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise
        self.size = st.st_size
        got, ver = struct.unpack_from("<2q", self.mm, H_MAGIC)
        if got != magic:
            self.close()
            raise ValueError(f"{path} is not an {what} (bad magic)")
        if ver != version:
            from ..errors import LayoutVersionError
            self.close()
            raise LayoutVersionError(f"{path}: {what} layout {ver}, this shadecache reads {version}")

    def word(self, at: int) -> int:
        return struct.unpack_from("<q", self.mm, at)[0]

    def view(self, dtype, count: int, offset: int, shape=None) -> np.ndarray:
        a = np.frombuffer(self.mm, dtype=dtype, count=count, offset=offset)
        return a if shape is None else a.reshape(shape)

    def is_current(self) -> bool:
        return is_file(self.path, self.identity)

    def unlink(self) -> None:
        unlink_if_current(self.path, self.identity)

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass   # a caller still holds a view; the mapping goes with the last of them
            self.mm = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _make(path: str, total: int, what: str, header: list, tail=()):
    """Makes the file at `path` (FileExistsError if it exists): `total` bytes, the header words
    [(offset, int64)], the `tail` [(offset, bytes)], then the magic (header[0]). Returns its fd."""
    free = shm.free_bytes()
    if total > free:
        from ..errors import CapacityError
        raise CapacityError(f"{what} needs {total} bytes, {shm.SHM_DIR} has {free} free")
    fd = node_files.create_file(path, os.O_RDWR, what, ADVICE)
    try:
        os.ftruncate(fd, total)
        os.posix_fallocate(fd, 0, total)
        for at, v in header[1:]:
            os.pwrite(fd, struct.pack("<q", int(v)), at)
        for at, data in tail:
            os.pwrite(fd, data, at)
        os.pwrite(fd, struct.pack("<q", header[0][1]), header[0][0])   # the magic last
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def _creator_words() -> list:
    me = os.getpid()
    return [(H_CREATOR, me), (H_CREATOR_START, start_time_of(me))]


class NodeFile(_Mapped):
    """The node's file of cache `cache_name` (board_layout.py)."""

    WHAT = "order board"

    def __init__(self, path: str, fd: int):
        super().__init__(path, fd, MAGIC, VERSION, self.WHAT)
        self.num_samples = self.word(H_N)
        if self.num_samples < 1 or self.size != node_bytes(self.num_samples):
            n = self.num_samples
            self.close()
            raise ValueError(f"{path}: damaged order board header ({n} samples, {self.size} bytes)")

    @classmethod
    def create(cls, cache_name: str, num_samples: int, score_merge: int) -> "NodeFile":
        path = shm.board_path(cache_name)
        fd = _make(path, node_bytes(num_samples), cls.WHAT,
                   [(H_MAGIC, MAGIC), (H_VERSION, VERSION), (H_N, num_samples),
                    (H_SCORE_MERGE, score_merge)] + _creator_words())
        return cls(path, fd)

    @classmethod
    def attach(cls, cache_name: str) -> "NodeFile":
        """FileNotFoundError if there is none, ValueError while it is being made (or is no board),
        PermissionError when it is not this user's own."""
        path = shm.board_path(cache_name)
        return cls(path, node_files.open_file(path, os.O_RDWR, cls.WHAT, advice=ADVICE))

    @classmethod
    def attach_whole(cls, cache_name: str, wait: float = 5.0) -> "NodeFile":
        """attach, waiting up to `wait` seconds for a file being made."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return cls.attach(cache_name)
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)


class JobFile(_Mapped):
    """The file of the job registered at `slot` of cache `cache_name` (board_layout.py)."""

    WHAT = "job board"

    def __init__(self, path: str, fd: int):
        super().__init__(path, fd, JOB_MAGIC, JOB_VERSION, self.WHAT)
        self.streams, self.capacity = self.word(H_STREAMS), self.word(H_CAPACITY)
        self.num_samples = self.word(H_N)
        self.slot, self.generation = self.word(H_SLOT), self.word(H_GENERATION)
        ok = 1 <= self.streams <= MAX_STREAMS and self.capacity >= 1 and self.num_samples >= 1
        if not ok or self.size != sizes(self.streams, self.capacity, self.num_samples)[-1]:
            self.close()
            raise ValueError(f"{path}: damaged job board header")

    @classmethod
    def create(cls, cache_name: str, slot: int, generation: int, num_samples: int, streams: int,
               capacity: int) -> "JobFile":
        """Makes the file of a job that has just registered at `slot` (a file left there by a
        job that is gone is removed first: the registry lock is held, the slot is this job's)."""
        path = shm.job_board_path(cache_name, slot)
        if os.path.lexists(path) and node_files.owned(path):
            os.unlink(path)
        *_, off_next, off_scores, total = sizes(streams, capacity, num_samples)
        none = np.full(streams * num_samples, NONE, np.int32).tobytes()  # nothing published yet
        fd = _make(path, total, cls.WHAT,
                   [(H_MAGIC, JOB_MAGIC), (H_VERSION, JOB_VERSION), (H_STREAMS, streams),
                    (H_CAPACITY, capacity), (H_N, num_samples), (H_SLOT, slot),
                    (H_GENERATION, generation)] + _creator_words(), [(off_next, none)])
        return cls(path, fd)

    @classmethod
    def attach(cls, cache_name: str, slot: int, wait: float = 5.0) -> "JobFile":
        """The job's file, waiting up to `wait` seconds for one being made."""
        path = shm.job_board_path(cache_name, slot)
        deadline = time.monotonic() + wait
        while True:
            try:
                return cls(path, node_files.open_file(path, os.O_RDWR, cls.WHAT, advice=ADVICE))
            except (ValueError, FileNotFoundError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)
