"""The node's shadecache files in /dev/shm: what each is called, who removes it, and what is left
behind when its owner is gone.

    shadecache.<cache>                  a cache segment (the engine names, lists and removes them:
                                        csrc/cache/segment.cc; cache/node.py)
    shadecache-order.<cache>            the cache's order board (lookahead/board.py): what the
                                        node shares (the prefetcher's words, the hand-off flags)
                                        and the registry of the jobs on the cache
    shadecache-job.<cache>.<slot>       one job's board: its orders, counters and scores (the
                                        job registered at <slot> of the order board)
    shadecache-tiers.<cache>.json       what the cache's peer server publishes (status.py),
    shadecache-prefetch.<cache>.json    what the cache's prefetcher publishes (status.py),
    <either>.json.<pid>.<random>.tmp    and their writers' files before the rename

Ownership: the process that creates a segment removes it when it exits: own() registers the
removal for interpreter exit in the creating pid only (a forked child inherits the registry and
must not remove its parent's files), and the removal takes the file only while it is still the
one this process made (its own may have been removed, and another job's made under the name); a
peer server removes its status file when it stops. A job's board goes when its job leaves (the
last of its member processes to leave: its last node closed, or its exit; a forked DataLoader
worker is no member), and the order board with the last job that leaves (docs/jobs.md).

What a killed owner leaves, sweep() removes (with the segments of dead creators, cache/node.py's
gc): order boards on which no job lives and whose creator is gone (a board whose creator is
unknown: when its cache no longer exists), job boards whose job is gone (its liveness byte on the
order board held by no process, its slot freed or given to another job, or no order board), status
files whose writer is gone, and the temporary files of a writer that is gone. A file's owner is the
process that wrote it: the board header's creator (pid and start time, at BOARD_CREATOR_AT), the
status file's "pid", the temporary name's <pid>; a job's, the processes that hold its byte.
An order board and a job board are judged and removed under the order board's registry lock (the
lock jobs register, make their boards and leave under: lookahead/jobs.py), and a job board only
when its generation is not that of a live registration of its slot: a job that registers between
gc's look and its unlink would otherwise lose its new board.
"""
import atexit
import json
import os
import struct

from . import node_files
from .process import alive, byte_held, exclusive_byte

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "shadecache."        # the engine's (csrc/cache/segment.cc); the others must differ
BOARD_PREFIX = "shadecache-order."
JOB_PREFIX = "shadecache-job."
STATUS_PREFIX = "shadecache-tiers."
PREFETCH_STATUS_PREFIX = "shadecache-prefetch."
SERVER, PREFETCHER = "server", "prefetcher"     # the roles that publish a status file
_STATUS_PREFIXES = {SERVER: STATUS_PREFIX, PREFETCHER: PREFETCH_STATUS_PREFIX}
_MAX_STATUS_BYTES = 1 << 20           # far more than any status; a larger file is not one
# The board header's creator: int64 pid at this byte offset, int64 start time (process.py) 24 bytes
# on (lookahead/board.py writes both; a board of an older writer has 0 there: pid only).
BOARD_CREATOR_AT = 40
BOARD_CREATOR_START_AT = 64
# The registry of jobs in the order board (lookahead/jobs.py): MAX_JOBS slots of JOB_SLOT_BYTES at
# JOB_TABLE_AT, each starting with its generation (0: free); the job at slot j lives while some
# process holds a lock on byte JOB_LIVE_AT + j of the board's file (process.hold_byte). A job
# board's header names its slot and generation at JOB_SLOT_AT, JOB_GENERATION_AT.
MAX_JOBS = 32
JOB_TABLE_AT = 4096
JOB_SLOT_BYTES = 128
JOB_LIVE_AT = 1 << 40
REGISTRY_LOCK_AT = JOB_LIVE_AT - 1     # the registry lock's byte (lookahead/jobs.py Jobs.locked)
JOB_SLOT_AT, JOB_GENERATION_AT = 48, 56


def _check_name(cache_name: str) -> str:
    if not isinstance(cache_name, str) or not cache_name or "/" in cache_name:
        raise ValueError(f"files in {SHM_DIR} are named after their cache; bad cache name {cache_name!r}")
    return cache_name


def board_path(cache_name: str) -> str:
    return os.path.join(SHM_DIR, BOARD_PREFIX + _check_name(cache_name))


def job_board_path(cache_name: str, slot: int) -> str:
    return os.path.join(SHM_DIR, f"{JOB_PREFIX}{_check_name(cache_name)}.{int(slot)}")


def status_path(cache_name: str, role: str = SERVER) -> str:
    return os.path.join(SHM_DIR, f"{_STATUS_PREFIXES[role]}{_check_name(cache_name)}.json")


def free_bytes() -> int:
    """Bytes /dev/shm can still give (a file larger than this would SIGBUS when touched)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


# ---- what this process created, removed at its exit -----------------------------------------
_OWNED: dict = {}   # key -> (creating pid, remove())


def own(key: str, remove) -> None:
    """Runs remove() at interpreter exit, in this process only (not in a forked child). remove()
    takes the file only if it is still the one this process made."""
    _OWNED[key] = (os.getpid(), remove)


def disown(key: str) -> None:
    """The file went another way (unlinked, or it outlives its creator): nothing at exit."""
    _OWNED.pop(key, None)


def _remove_owned_at_exit():
    for pid, remove in list(_OWNED.values()):
        if pid == os.getpid():
            try:
                remove()
            except OSError:
                pass


atexit.register(_remove_owned_at_exit)


# ---- what killed owners leave -----------------------------------------------------------------
def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def read_status(path: str):
    """The status object in `path`; None when there is no file. ValueError when it does not parse
    as one (writers rename whole files into place: no live writer leaves such a file);
    PermissionError (naming the owner) when the file is not this user's own, is open to group or
    others, or is a link: such a file is never read (node_files)."""
    try:
        fd = node_files.open_file(path, os.O_RDONLY | os.O_NONBLOCK, "tier status file")
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MAX_STATUS_BYTES + 1)
    d = json.loads(raw) if len(raw) <= _MAX_STATUS_BYTES else None   # ValueError when not JSON
    if not isinstance(d, dict):
        raise ValueError(f"{path} is not a status object")
    return d


def writer_gone(status: dict) -> bool:
    """Whether the process a status object names as its writer ("pid") is gone (or none is named)."""
    try:
        return not alive(int(status.get("pid")))
    except (TypeError, ValueError):
        return True


def board_creator(path: str):
    """(pid, start time) of the board at `path` as its header names them; None when it names no
    creator (a board being made, a short or foreign file, a link)."""
    try:
        fd = node_files.open_file(path, os.O_RDONLY | os.O_NONBLOCK, "order board")
    except OSError:
        return None
    try:
        head = os.pread(fd, BOARD_CREATOR_START_AT + 8, 0)
    finally:
        os.close(fd)
    if len(head) < BOARD_CREATOR_START_AT + 8:
        return None
    (pid,) = struct.unpack_from("<q", head, BOARD_CREATOR_AT)
    (start,) = struct.unpack_from("<q", head, BOARD_CREATOR_START_AT)
    return (pid, start) if pid > 0 else None


def board_jobs(path: str):
    """{slot: (generation, live)} of the jobs registered on the order board at `path` (live: some
    process holds the slot's liveness byte); None when there is no such board of this user or it
    is not of a layout with jobs."""
    try:
        fd = node_files.open_file(path, os.O_RDONLY | os.O_NONBLOCK, "order board")
    except OSError:
        return None
    try:
        head = os.pread(fd, 16, 0)
        table = os.pread(fd, MAX_JOBS * JOB_SLOT_BYTES, JOB_TABLE_AT)
        if len(head) < 16 or struct.unpack_from("<q", head, 8)[0] < 2 or \
                len(table) < MAX_JOBS * JOB_SLOT_BYTES:
            return None
        jobs = {}
        for j in range(MAX_JOBS):
            (gen,) = struct.unpack_from("<q", table, j * JOB_SLOT_BYTES)
            if gen:
                jobs[j] = (gen, byte_held(fd, JOB_LIVE_AT + j))
        return jobs
    finally:
        os.close(fd)


def _word(fd: int, at: int):
    raw = os.pread(fd, 8, at)
    return struct.unpack("<q", raw)[0] if len(raw) == 8 else None


def _same_file(path: str, fd: int) -> bool:
    """Whether the name `path` still holds the file open at `fd`."""
    try:
        st, mine = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _sweep_job_board(entry: str, path: str) -> bool:
    """Removes the job board `entry` (shadecache-job.<cache>.<slot>) when it is a gone job's;
    returns whether it did. Gone: no order board of its cache, or the order board's slot holds
    no registration, another one than the file's (its generation), or one whose liveness byte
    nobody holds. Decided and removed under the order board's registry lock, the lock under
    which jobs register and make their files: a job that registers at the slot meanwhile waits,
    and its file is never taken for the dead one's."""
    cache, _, slot = entry[len(JOB_PREFIX):].rpartition(".")
    if not cache or not slot.isdigit() or int(slot) >= MAX_JOBS:
        return False
    slot, board = int(slot), board_path(cache)
    try:
        job_fd = node_files.open_file(path, os.O_RDONLY | os.O_NONBLOCK, "job board")
    except OSError:
        return False
    try:
        mine = _word(job_fd, JOB_GENERATION_AT)
        if not node_files.owned(board):
            if os.path.lexists(board):
                return False          # another user's name: not this user's cache's board
            # No order board: no registration can name this file. (One made from now on
            # registers at the slot and makes its file under its own lock, removing a stale one
            # first: the window is this look to the unlink, a name checked to be this file.)
            return _same_file(path, job_fd) and _unlink(path)
        try:
            with exclusive_byte(board, REGISTRY_LOCK_AT) as fd:
                if os.fstat(fd).st_nlink == 0:
                    return False      # removed while this waited: look again at the next gc
                gen = _word(fd, JOB_TABLE_AT + slot * JOB_SLOT_BYTES)
                version = _word(fd, 8)
                if gen is None or version is None or version < 2:
                    return False      # no registry (being made, or an older layout)
                live = gen != 0 and gen == mine and byte_held(fd, JOB_LIVE_AT + slot)
                return not live and _same_file(path, job_fd) and _unlink(path)
        except FileNotFoundError:
            return False              # the order board went meanwhile: the next gc sees it
    finally:
        os.close(job_fd)


def _sweep_board(entry: str, path: str, live_caches) -> bool:
    """Removes the order board `entry` when no job lives on it and its creator is gone (when the
    header names none: when its cache is not in `live_caches`); returns whether it did. Decided
    and removed under its registry lock: a job registering meanwhile waits, then finds the file
    removed (Jobs.locked) and makes the board anew."""
    try:
        with exclusive_byte(path, REGISTRY_LOCK_AT) as fd:
            if os.fstat(fd).st_nlink == 0 or not _same_file(path, fd):
                return False
            creator = board_creator(path)
            jobs = board_jobs(path) or {}
            gone = not any(lives for _, lives in jobs.values()) and (
                not alive(*creator) if creator is not None else entry[len(BOARD_PREFIX):] not in live_caches)
            return gone and _unlink(path)
    except OSError:       # gone meanwhile, a link (O_NOFOLLOW), not ours to open for writing
        return False


def sweep(live_caches) -> list:
    """Removes this user's order boards on which no job lives and whose creator is gone (when
    the header names none: boards of caches not in `live_caches`), job boards of jobs that are
    gone, status files whose writer is gone (or that do not parse) and temporary files of writers
    that are gone; returns the names removed (`shadecache gc`). A live creator's board stays, its
    cache made or not yet. Another user's files are left alone, and links are never followed."""
    removed = []
    live = set(live_caches)
    for entry in os.listdir(SHM_DIR):
        path = os.path.join(SHM_DIR, entry)
        status = entry.startswith((STATUS_PREFIX, PREFETCH_STATUS_PREFIX))
        boards = (BOARD_PREFIX, JOB_PREFIX)
        if (status or entry.startswith(boards)) and not node_files.owned(path):
            continue
        if entry.startswith(BOARD_PREFIX):
            if _sweep_board(entry, path, live):
                removed.append(entry)
            continue
        elif entry.startswith(JOB_PREFIX):
            if _sweep_job_board(entry, path):
                removed.append(entry)
            continue
        elif status and entry.endswith(".json"):
            try:
                d = read_status(path)
                gone = d is not None and writer_gone(d)
            except (ValueError, OSError):   # garbage (a torn write of an older server), a link
                                            # or a 0644 file of ours: nobody trusts it
                gone = True
        elif status and entry.endswith(".tmp"):
            # <cache>.json.<pid>.<thread>.tmp: gone when the writing process is
            pid = entry[:-len(".tmp")].split(".json.")[-1].split(".")[0]
            gone = pid.isdigit() and not alive(int(pid))
        else:
            continue
        if gone and _unlink(path):
            removed.append(entry)
    return removed
