"""The jobs on a cache: who they are, whether they live, where their boards are.

A job is one training run: every rank of it, its DataLoader workers and the processes they start.
Its name is given where the node is composed (sc.Node(job=...)), else taken from
$SHADECACHE_JOB, else from torchrun's run id ($TORCHELASTIC_RUN_ID; "none", what torchrun says
when it was given no --rdzv-id, names nothing), else from the launching process: the leader of
this process's process group ("pgid-<pgid>-<its session id>"). A shell puts each command it
starts in a group of its own, and the processes a program starts stay in its group (torchrun's
ranks, mp.spawn's, subprocesses, DataLoader workers), so two commands are two jobs and the ranks
of one are one. Processes that a driver starts as separate jobs need a name each (job=,
$SHADECACHE_JOB, or a session of their own: start_new_session=True). The node's own processes
(workers, the prefetcher, the peer server) get the node's job with the node, as observers of its
board: they read and count for it, they do not keep it alive (below).

The registry is a table in the order board's file (board_layout.py: MAX_JOBS slots after the
header): a slot holds a job's generation (0: free; every registration gets a new one, so a slot
given to another job is told from the one a board was made for), the pid and start time of the
process that registered it, when, and its name. A job lives while some process holds the shared
lock on its slot's byte of that file (JOB_LIVE_AT + slot; process.hold_byte): each member process
of the job (one that joined it: composed a node of the job, or joined its board) takes it when it
joins, and the kernel drops a process's when it dies, SIGKILL included. A forked child does not
keep it (process.keep_from_children: the child closes its copy of the descriptor at the fork) and
is no member: a DataLoader worker, forked or spawned, attaches its job's board as an observer
(board.BoardLink), so the job lives exactly as long as its training processes, and its workers
neither keep a finished job's files (they are stopped after the atexit hook that leaves) nor a
SIGKILLed job alive until torch's watchdog ends them. Nothing is written at a death: whoever
looks next (a live job every half second, the prefetcher, `shadecache gc`) sees the byte free.

Contract: registrations, departures and the freeing of dead jobs' slots are made under the
registry lock (an exclusive lock on REGISTRY_LOCK_AT, process.exclusive_byte; a waiter of a dead
holder is let in by the kernel). A registering process takes its job's byte before it writes the
slot's generation, so a slot with a generation whose byte is free is a dead job's, never one being
registered. Lock order: the registry lock, then the cache's (the score merge writes the cache
under it: job_scores.py).
"""
from __future__ import annotations

import contextlib
import os
import time

import numpy as np

from .. import node_files, shm
from ..process import (byte_held, close_kept, exclusive_byte, hold_byte, keep_from_children,
                       start_time_of)
from .board_layout import (H_GENERATIONS, J_GENERATION, J_NAME, J_PID, J_SINCE, J_START,
                           JOB_LIVE_AT, JOB_NAME_BYTES, JOB_SLOT_BYTES, MAX_JOBS, REGISTRY_LOCK_AT)

JOB_ENV = "SHADECACHE_JOB"
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
# (board identity, slot, generation) -> [token of the descriptor holding that job's byte in this
# process (process.keep_from_children), how many of this process's handles joined it]
_HELD: dict = {}
# a forked child is no member of its parent's jobs: its copies of the descriptors are closed by
# process.py's hook, and it forgets them here
os.register_at_fork(after_in_child=_HELD.clear)


def job_name(job=None) -> str:
    """The job's name: `job`, else the default (module docstring). ValueError for a name that is
    empty, has a NUL, takes more than JOB_NAME_BYTES - 1 bytes in UTF-8, or is not text UTF-8 can
    hold (a lone surrogate: what os.environ gives for a non-UTF-8 byte of $SHADECACHE_JOB);
    TypeError for a non-string."""
    if job is None:
        job = os.environ.get(JOB_ENV) or _torchrun_id() or launching_process()
    if not isinstance(job, str):
        raise TypeError(f"job must be a str naming the training job, got {type(job).__name__}")
    try:
        # strict: the registry stores these bytes and Jobs.name() decodes them, so every name
        # accepted here reads back the same and is found again by every process of the job (a
        # surrogate, passed through, would read back as U+FFFD: a new job per process)
        raw = job.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"job name {job!r} is not valid UTF-8 text (a byte that is not UTF-8, "
                         f"as in a $SHADECACHE_JOB of another encoding): give a UTF-8 name") from None
    if not raw or b"\0" in raw or len(raw) >= JOB_NAME_BYTES:
        raise ValueError(f"job name {job!r}: give 1 to {JOB_NAME_BYTES - 1} bytes of UTF-8 without NUL")
    return job


def _torchrun_id():
    run = os.environ.get(TORCHRUN_ENV)
    return None if run in (None, "", "none") else run


def launching_process() -> str:
    """The default job name of this process: its process group's, "pgid-<pgid>-<sid>" (the
    group's id and its session's). Both stay what they are while the group has a member, whether
    or not its leader still runs (a launcher that backgrounds its ranks and exits: the ranks that
    compose their nodes after it are the same job). A group id is reused only once the group is
    empty: its job's processes are gone (or left the group), and a dead job is never found by
    name (Jobs.find asks its liveness byte), so a later group of the same id starts a new job."""
    return f"pgid-{os.getpgid(0)}-{os.getsid(0)}"


class Jobs:
    """The registry of one node file (board_files.NodeFile): slots (an int64 view of the table),
    liveness, registration. A view over the mapping: board.py's OrderBoard holds one as
    board.jobs."""

    def __init__(self, node_file):
        self._file = node_file
        self._table = node_file.view(np.int64, MAX_JOBS * JOB_SLOT_BYTES // 8,
                                     shm.JOB_TABLE_AT, (MAX_JOBS, JOB_SLOT_BYTES // 8))
        self._raw = node_file.view(np.uint8, MAX_JOBS * JOB_SLOT_BYTES, shm.JOB_TABLE_AT,
                                   (MAX_JOBS, JOB_SLOT_BYTES))
        self._header = node_file.view(np.int64, 16, 0)
        self.cache_name = os.path.basename(node_file.path)[len(shm.BOARD_PREFIX):]

    def close(self) -> None:
        self._table = self._raw = self._header = None

    # ---- reading the table --------------------------------------------------------------------
    def generation(self, slot: int) -> int:
        return int(self._table[slot, J_GENERATION // 8])

    def name(self, slot: int) -> str:
        raw = bytes(self._raw[slot, J_NAME:]).split(b"\0", 1)[0]
        return raw.decode("utf-8", "replace")

    def registered(self) -> list:
        """[(slot, generation)] of the slots that hold a job (live or not: live() tells)."""
        gens = self._table[:, J_GENERATION // 8]
        return [(int(s), int(gens[s])) for s in np.flatnonzero(gens)]

    def lives(self, slot: int) -> bool:
        """Whether some process holds the job's byte at `slot`."""
        return byte_held(self._file.fd, JOB_LIVE_AT + int(slot))

    def live(self) -> list:
        """[(slot, generation)] of the jobs that live now."""
        return [(s, g) for s, g in self.registered() if self.lives(s)]

    def find(self, name: str):
        """(slot, generation) of the live job named `name`, or None."""
        for s, g in self.registered():
            if self.name(s) == name and self.lives(s):
                return s, g
        return None

    def describe(self) -> list:
        """[{slot, name, generation, pid, live, since}] of every registered job."""
        out = []
        for s, g in self.registered():
            row = self._table[s]
            out.append({"slot": s, "name": self.name(s), "generation": g, "pid": int(row[J_PID // 8]),
                        "live": self.lives(s), "since": int(row[J_SINCE // 8]) / 1e9})
        return out

    # ---- changing it (under the registry lock) --------------------------------------------------
    @contextlib.contextmanager
    def locked(self):
        """The registry lock. FileNotFoundError when the board's name no longer names this file
        (removed, made again): the caller attaches the one there now. Whoever removes the file
        (the last job to leave, `gc`) does so holding this lock, so a waiter that opened the file
        before the removal sees it has no name left (st_nlink 0) once it gets in."""
        with exclusive_byte(self._file.path, REGISTRY_LOCK_AT) as fd:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self._file.identity or st.st_nlink == 0:
                raise FileNotFoundError(f"{self._file.path} was removed or made again since it "
                                        "was attached")
            yield

    def register(self, name: str, counted: bool = True):
        """(slot, generation, joined): the live job `name` joined (this process holds its byte
        from now on), or a new registration in a free slot (or one a dead job held, its board
        removed). sc.CapacityError when MAX_JOBS jobs live on the cache. Registry lock held."""
        self.free_dead()
        found = self.find(name)
        if found is not None:
            self.hold(*found, counted=counted)
            return found[0], found[1], True
        free = [s for s in range(MAX_JOBS) if not self.generation(s)]
        if not free:
            from ..errors import CapacityError
            raise CapacityError(f"cache {self.cache_name!r} has {MAX_JOBS} jobs registered, "
                                f"the most one cache takes: {[self.name(s) for s in range(MAX_JOBS)]}")
        slot = free[0]
        gen = int(self._header[H_GENERATIONS // 8]) + 1
        self._header[H_GENERATIONS // 8] = gen
        self.hold(slot, gen, counted=counted)   # the byte before the generation (module docstring)
        row = self._table[slot]
        me = os.getpid()
        row[J_PID // 8], row[J_START // 8], row[J_SINCE // 8] = me, start_time_of(me), time.time_ns()
        raw = name.encode("utf-8")           # job_name() checked it encodes
        self._raw[slot, J_NAME:] = 0
        self._raw[slot, J_NAME:J_NAME + len(raw)] = np.frombuffer(raw, np.uint8)
        row[J_GENERATION // 8] = gen
        return slot, gen, False

    def hold(self, slot: int, generation: int, counted: bool = True) -> None:
        """This process holds the byte of the job at `slot`: once per process and registration
        (one descriptor), counted per handle that joins it (release() lets go with the last);
        counted=False: a handle that is never closed rides along (it holds the byte if no handle
        does, and counts for nothing: the last counted handle's release, or the exit, ends it).
        A forked child does not hold it (module docstring)."""
        key = (self._file.identity, int(slot), int(generation))
        if key in _HELD:
            _HELD[key][1] += int(counted)
            return
        fd = os.open(self._file.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        token = keep_from_children(fd)
        try:
            node_files.check(fd, self._file.path, "order board")
            hold_byte(fd, JOB_LIVE_AT + int(slot))
        except BaseException:
            close_kept(token)
            raise
        _HELD[key] = [token, int(counted)]

    def free_dead(self) -> list:
        """Frees the slots of the jobs that are gone and removes their boards; returns the slots
        freed. Registry lock held."""
        freed = []
        for s, g in self.registered():
            if not self.lives(s):
                self._free(s)
                freed.append(s)
        return freed

    def _free(self, slot: int) -> None:
        self._table[slot, J_GENERATION // 8] = 0
        path = shm.job_board_path(self.cache_name, slot)
        if os.path.lexists(path) and node_files.owned(path):
            os.unlink(path)

    def settle(self) -> bool:
        """After a process released its hold of a job (release()): when no process of that job
        is left, its slot is freed and its board removed, and so are those of jobs that died
        meanwhile (the last job to leave must not leave a killed job's board behind: nobody else
        would look). Returns whether a job still lives on the cache. Registry lock held."""
        self.free_dead()
        return bool(self.live())


def release(identity: tuple, slot: int, generation: int, counted: bool = True,
            everything: bool = False) -> int:
    """One of this process's handles of the job at `slot` of the node file `identity` lets go
    (counted=False: one that counted for nothing, hold(counted=False); everything=True: all of
    them, at exit); the byte is released when no counted handle is left. Returns how many of
    this process's handles still hold it."""
    key = (identity, int(slot), int(generation))
    held = _HELD.get(key)
    if held is None:
        return 0
    held[1] = 0 if everything else held[1] - int(counted)
    if held[1] > 0:
        return held[1]
    del _HELD[key]
    close_kept(held[0])
    return 0


def holding(identity: tuple, slot: int, generation: int) -> int:
    """How many of this process's handles hold the job at `slot` of the node file `identity`."""
    held = _HELD.get((identity, int(slot), int(generation)))
    return 0 if held is None else held[1]
