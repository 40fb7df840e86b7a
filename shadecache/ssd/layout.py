"""The SSD tier's on-disk layout: slot files plus an append-only index journal.

    <dir>/slots-<S>.dat   values of one size class: slot k holds one value at offset k * S
    <dir>/index           the journal: a 32-byte header, then 32-byte entries (put / remove)
    <dir>/lock            flock'ed by whoever appends to the journal (any process of the node)

Size classes: a value of n bytes goes into a slot of `slot_bytes(n)` (n rounded up to an eighth
of its power of two, at least 16: at most 12.5% slack), so a node's size mix uses a few tens of
files, each one descriptor kept open, and a read is one pread of the value at its offset (the
packed store's cost). A freed slot is reused by the next value of its class; files grow in
preallocated chunks (posix_fallocate; each doubles the file, 16 slots to 64 MiB at a time; one
slot when the disk has no room for the chunk), so a full disk shows up as ENOSPC when a file
grows, not as a hole that fails later.

Journal entry (little endian): id i64, slot size u32, slot u32, length u32 (REMOVED = 0xFFFFFFFF),
crc32c of the value u32, reserved u32 (0), crc32c of the 28 bytes before it u32. Every process
that uses the tier keeps the whole index in memory (numpy arrays by id: ids are dense) and tails
the journal before each read batch, so that what one process writes the others find, and a job
that restarts replays the journal and finds the tier as it was (warm restart).

Crash safety (SIGKILL at any point, or a torn file): nothing is trusted without its checksum.
- A value is written into its slot before its put entry is appended; a remove entry is appended
  before its slot is reused. A crash between the two leaves an entry whose value does not match
  its crc32c (or a slot nobody names): a read finds the mismatch and treats it as a miss.
- A torn or flipped journal entry fails its own crc32c and is dropped on replay; a torn tail
  (not a whole entry) is cut off by the next appender, under the lock.
- Two put entries naming one slot (a remove lost in a crash): the later one owns it.
Readers take no lock: a slot reused under a reader's feet fails that value's crc32c, and the
reader then re-checks the journal before it calls the value damaged.

Ownership (node_files.py): the directory must be this user's and closed to writing by group and
others (made 0700 when missing); every file in it is opened relative to the directory's
descriptor with O_NOFOLLOW and must be this user's regular file (0600; a 0644 one of an older
version is made 0600, one writable by others refused); temporary names are random (O_EXCL).

Contracts: methods named do_* need `mu` (a threading.Lock: the index arrays) held; append()
also needs the file lock (`locked()`). Not fork-safe: a forked process opens its own (SSDTier
does so when its pid changes)."""
import errno
import fcntl
import os
import struct
import threading
import time

import numpy as np

from .. import node_files
from .._io import crc32c

ENTRY = struct.Struct("<qIIIIII")       # id, slot size, slot, length, crc, reserved, entry crc
_DTYPE = np.dtype([("id", "<i8"), ("size", "<u4"), ("slot", "<u4"), ("len", "<u4"), ("crc", "<u4"),
                   ("res", "<u4"), ("ecrc", "<u4")])
HEADER = b"SHSSDIX1" + bytes(24)         # magic + version, one entry wide
REMOVED = 0xFFFFFFFF
MOVED = 0xFFFFFFFE                       # last entry of a journal that compaction replaced
MAX_ID = (1 << 31) - 1                   # ids are dense; larger ones are not kept
_HIGH_FD = 1024                          # kept descriptors go at or above this (FD_SETSIZE)


def slot_bytes(n: int) -> int:
    """The slot size a value of n bytes takes: n rounded up to an eighth of its power of two
    (at least 16 bytes)."""
    g = max(16, 1 << max(0, n.bit_length() - 4))
    return max(16, -(-n // g) * g)


def slot_bytes_of(lengths: np.ndarray) -> np.ndarray:
    """slot_bytes of every length (an int64 array), as arrays."""
    n = np.asarray(lengths, dtype=np.int64)
    bits = np.zeros(n.size, dtype=np.int64)
    pos = n > 0
    bits[pos] = np.floor(np.log2(n[pos])).astype(np.int64) + 1     # n.bit_length()
    g = np.maximum(16, np.left_shift(1, np.maximum(0, bits - 4)))
    return np.maximum(16, -(-n // g) * g)


def entry(i: int, size: int, slot: int, length: int, crc: int) -> bytes:
    head = ENTRY.pack(i, size, slot, length, crc, 0, 0)[:28]
    return head + struct.pack("<I", crc32c(head))


def _open(name: str, flags: int, dir_fd: int, create: bool = False) -> int:
    """A file of the tier directory (dir_fd): never through a link, this user's own, 0600."""
    return node_files.open_file(name, flags, "SSD tier file", dir_fd=dir_fd, create=create, tighten=True,
                                advice="Remove the tier directory and let shadecache make it again.")


def _high(fd: int) -> int:
    """fd moved to >= 1024 where the limit allows (a process holding many tier descriptors must
    keep its own sockets within select()'s reach)."""
    try:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _HIGH_FD)
    except OSError:
        return fd
    os.close(fd)
    return high


class Layout:
    """The index (in memory, rebuilt from the journal) and the open slot files of one directory."""

    def __init__(self, path: str):
        self.path = path
        self.journal_path = os.path.join(path, "index")   # for messages; files open by dir_fd
        # what close() closes: slot size -> read/write descriptor of its file, the journal, the
        # lock, the directory (every file is opened relative to it: the path is looked up once)
        self._fds, self._jfd, self._lock_fd = {}, -1, -1
        self.dir_fd = _high(node_files.own_directory(path, "SSD tier directory"))
        try:
            self._lock_fd = _open("lock", os.O_RDWR, self.dir_fd, create=True)
        except BaseException:
            os.close(self.dir_fd)
            self.dir_fd = -1
            raise
        self._tlock = threading.Lock()   # flock is per open file: threads of this process queue here
        self._ino = None
        self._checked = 0.0       # when the journal's path was last looked up
        self._tailed = 0.0        # when its size was last looked at (at most once a millisecond)
        self._file_slots = {}     # slot size -> slots the file has room for (preallocated)
        self.torn = 0             # journal entries dropped on replay (bad crc32c)
        self.do_reset()

    # ---- index state -------------------------------------------------------------------------
    def do_reset(self):
        # by id (the columns the native reader looks ids up in): slot size (-1: not held), slot,
        # descriptor of the slot file (-1: not held), offset, value length, crc32c
        self.size = np.full(0, -1, dtype=np.int64)
        self.slot = np.zeros(0, dtype=np.int64)
        self.fdv = np.full(0, -1, dtype=np.int32)
        self.off = np.zeros(0, dtype=np.int64)
        self.length = np.zeros(0, dtype=np.int64)
        self.crc = np.zeros(0, dtype=np.uint32)
        self.owner = {}           # slot size -> {slot: id}
        self.free = {}            # slot size -> set of free slots below nslots
        self.nslots = {}          # slot size -> highest slot named + 1
        self.used = 0             # bytes of the slots held
        self.items = 0
        self._jpos = 0

    def _grow(self, i: int):
        n = max(i + 1, 2 * self.size.size, 1024)
        for name, fill in (("size", -1), ("slot", 0), ("fdv", -1), ("off", 0), ("length", 0), ("crc", 0)):
            old = getattr(self, name)
            new = np.full(n, fill, dtype=old.dtype)
            new[:old.size] = old
            setattr(self, name, new)

    def do_drop(self, i: int):
        s = int(self.size[i])
        if s < 0:
            return
        k = int(self.slot[i])
        self.owner[s].pop(k, None)
        self.free[s].add(k)
        self.size[i] = -1
        self.fdv[i] = -1
        self.used -= s
        self.items -= 1

    def _apply(self, i, s, k, length, crc):
        if length == REMOVED:
            if 0 <= i < self.size.size and self.size[i] == s and self.slot[i] == k:
                self.do_drop(i)
            return
        if i >= self.size.size:
            self._grow(i)
        own = self.owner.setdefault(s, {})
        free = self.free.setdefault(s, set())
        n = self.nslots.get(s, 0)
        if k >= n:
            free.update(range(n, k))
            self.nslots[s] = k + 1
        other = own.get(k)
        if other is not None and other != i:
            self.do_drop(other)
        self.do_drop(i)
        free.discard(k)
        own[k] = i
        self.size[i], self.slot[i], self.length[i], self.crc[i] = s, k, length, crc
        self.off[i] = k * s
        self.fdv[i] = self.fd(s)
        self.used += s
        self.items += 1

    def do_catch_up(self, force: bool = False):
        """Applies what the journal gained since the last call (all of it after a compaction
        replaced the file, or on the first call). Only whole entries are read. Cheap when nothing
        changed: unless forced (every caller holding the file lock forces), no syscall within a
        millisecond of the last look (what other processes append shows up at most 1 ms late;
        this process's own appends apply at once), else one fstat;
        a compaction ends the old file with a MOVED entry, and only then (or once a second, or
        when there is no file yet) is the path looked up again."""
        now = time.monotonic()
        if self._jfd >= 0 and not force and (now - self._tailed < 0.001
                               or os.fstat(self._jfd).st_size == self._jpos and now - self._checked < 1.0):
            return
        self._tailed = now
        if now - self._checked >= 1.0 or self._jfd < 0:
            self._checked = now   # the path is looked up at least once a second (a MOVED entry lost)
        self._follow()
        if self._jfd < 0:
            return
        end = os.fstat(self._jfd).st_size
        end -= (end - self._jpos) % ENTRY.size
        if end <= self._jpos:
            return
        raw = os.pread(self._jfd, end - self._jpos, self._jpos)
        self._jpos += len(raw) - len(raw) % ENTRY.size
        ents = np.frombuffer(raw, dtype=_DTYPE, count=len(raw) // ENTRY.size)
        for k, e in enumerate(ents.tolist()):
            if (crc32c(raw[k * 32:k * 32 + 28]) != e[6] or e[0] < 0 or e[0] > MAX_ID or e[1] == 0
                    or (e[3] < MOVED and slot_bytes(e[3]) != e[1])):
                # a put whose length does not belong in its slot size is not one we wrote: the
                # reader would read past its slot (and allocate what the length says)
                self.torn += 1
                continue
            if e[3] == MOVED:
                if self._follow():
                    return self.do_catch_up(force=True)
                continue
            self._apply(e[0], e[1], e[2], e[3], e[4])

    def _follow(self) -> bool:
        """(Re)opens the journal at its path when that is another file than ours, and starts
        over from it; True when it did."""
        try:
            st = os.stat("index", dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if self._jfd >= 0 and st is not None and st.st_ino == self._ino:
            return False
        if self._jfd >= 0:
            os.close(self._jfd)
            self._jfd = -1
        self.do_reset()
        if st is None:
            return False
        self._jfd = _high(_open("index", os.O_RDWR | os.O_APPEND, self.dir_fd))
        self._ino = os.fstat(self._jfd).st_ino
        if os.pread(self._jfd, len(HEADER), 0) == HEADER:
            self._jpos = len(HEADER)
        else:   # not our journal (or torn at birth): nothing is trusted from it
            self._jpos = os.fstat(self._jfd).st_size
        return True

    # ---- writing (the file lock held) --------------------------------------------------------
    def locked(self):
        """The journal's file lock (other processes) and its thread lock (this process's threads).
        Taken before mu, never after it."""
        return _FileLock(self._lock_fd, self._tlock)

    def do_open_journal(self):
        """Creates the journal if there is none (or replaces one that is not ours), and cuts off a
        torn tail left by a writer that died mid-entry. File lock held."""
        try:
            fd = _open("index", os.O_RDONLY, self.dir_fd)
            ok = os.pread(fd, len(HEADER), 0) == HEADER
            os.close(fd)
        except FileNotFoundError:
            ok = False
        if not ok:
            self._write_journal([])
        self.do_catch_up(force=True)
        size = os.fstat(self._jfd).st_size
        if (size - len(HEADER)) % ENTRY.size:
            os.ftruncate(self._jfd, size - (size - len(HEADER)) % ENTRY.size)

    def _write_journal(self, entries):
        """Replaces the journal with one holding `entries` (written, fsync'ed, renamed into
        place), then ends the old file with a MOVED entry so that every process tailing it
        follows. File lock held."""
        try:
            old = _open("index", os.O_WRONLY | os.O_APPEND, self.dir_fd)
        except FileNotFoundError:
            old = -1
        try:
            node_files.replace(self.path, "index", HEADER + b"".join(entries), "SSD tier journal",
                               dir_fd=self.dir_fd, sync=True)
        except BaseException:
            if old >= 0:
                os.close(old)
            raise
        if old >= 0:
            os.write(old, entry(0, 1, 0, MOVED, 0))
            os.close(old)
        self._follow()

    def append(self, entries):
        """Appends entries and applies them: all of them, or none (OSError). File lock and mu
        held."""
        if entries:
            raw = b"".join(entries)
            end = os.fstat(self._jfd).st_size
            try:
                n = os.write(self._jfd, raw)
            except OSError:
                n = -1
            if n != len(raw):   # a disk full midway: nothing of it is kept (no torn entry)
                os.ftruncate(self._jfd, end)
                raise OSError(errno.ENOSPC, f"journal {self.journal_path}: short write")
            self.do_catch_up(force=True)

    def compact_if_needed(self):
        """Rewrites the journal with one entry per held value when it has grown to more than
        twice that (plus slack). File lock and mu held; other processes notice the new file."""
        entries = (self._jpos - len(HEADER)) // ENTRY.size
        if entries <= 2 * self.items + 4096:
            return
        held = np.flatnonzero(self.size >= 0)
        self._write_journal([entry(int(i), int(self.size[i]), int(self.slot[i]), int(self.length[i]),
                                   int(self.crc[i])) for i in held])
        self.do_catch_up(force=True)

    def take_slot(self, s: int) -> int:
        """A free slot of size class s, its file grown (preallocated) when needed: by a chunk, or
        by one slot when the disk has no room for the chunk. Raises OSError (ENOSPC when the disk
        has no room for one more slot). File lock and mu held."""
        free = self.free.setdefault(s, set())
        self.owner.setdefault(s, {})
        if free:
            k = min(free)
            free.discard(k)      # taken: give_back() returns it if the write fails
            return k
        k = self.nslots.get(s, 0)
        fd = self.fd(s, create=True)
        if k >= self._file_slots.get(s, 0):
            have = os.fstat(fd).st_size // s
            if k >= have:
                chunk = min(max(16, k), max(1, (64 << 20) // s))   # doubles, 16 slots to 64 MiB
                try:
                    _extend(fd, (k + chunk) * s)
                except OSError as e:
                    if e.errno != errno.ENOSPC or chunk == 1:
                        raise
                    # A nearly full disk: the tier still takes what fits, one slot at a time,
                    # short of the room the journal needs to grow and be compacted.
                    st = os.statvfs(self.dir_fd)
                    if st.f_bavail * st.f_frsize < s + 2 * self._jpos + (64 << 10):
                        raise
                    chunk = 1
                    _extend(fd, (k + 1) * s)
                have = k + chunk
            self._file_slots[s] = have
        self.nslots[s] = k + 1
        return k

    def spare(self, s: int) -> int:
        """Slots of size class s a value can take without growing its file (free ones, and the
        file's preallocated room past the highest slot named). mu held."""
        n = len(self.free.get(s, ()))
        fd = self.fd(s)
        if fd >= 0:
            n += max(0, os.fstat(fd).st_size // s - self.nslots.get(s, 0))
        return n

    def allocated(self) -> int:
        """Bytes the slot files hold on disk now (slots named and preallocated room). mu held."""
        return sum(os.fstat(fd).st_size for fd in (self.fd(s) for s in self.nslots) if fd >= 0)

    def give_back(self, s: int, k: int):
        """A slot take_slot() gave out whose value was not written. mu held."""
        if k not in self.owner.get(s, {}):
            self.free.setdefault(s, set()).add(k)

    # ---- files -------------------------------------------------------------------------------
    def file_of(self, s: int) -> str:
        return os.path.join(self.path, f"slots-{s}.dat")

    def fd(self, s: int, create: bool = False) -> int:
        fd = self._fds.get(s)
        if fd is None:
            try:
                fd = _high(_open(f"slots-{s}.dat", os.O_RDWR, self.dir_fd, create=create))
            except FileNotFoundError:
                return -1
            self._fds[s] = fd
        return fd

    def __del__(self):
        self.close()

    def close(self):
        for fd in list(self._fds.values()) + [self._jfd, self._lock_fd, getattr(self, "dir_fd", -1)]:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fds = {}
        self._jfd = self._lock_fd = self.dir_fd = -1
        self.fdv = np.full(0, -1, dtype=np.int32)   # nothing may be read through closed descriptors


def _extend(fd: int, size: int):
    """The file grown to `size` bytes, preallocated where the file system can (ENOSPC now rather
    than a hole that fails later)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):   # no preallocation here
            raise
        os.ftruncate(fd, size)


class _FileLock:
    def __init__(self, fd, tlock):
        self.fd, self.tlock = fd, tlock

    def __enter__(self):
        self.tlock.acquire()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self.tlock.release()
            raise
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.tlock.release()
