"""The order board: each rank's upcoming sample order, published into the node's shared memory.

ShadeSampler draws a whole epoch's order before the epoch starts. Publishing it lets the node's
prefetcher (shadecache/lookahead/prefetcher.py) read the upcoming misses ahead of the DataLoader and lets the
clairvoyant eviction policy keep what will be read soonest (Belady, NoPFS SC'21).

One board per cache, a file `/dev/shm/shadecache-order.<cache name>` (mode 0600, removed by its
creator; not a cache segment, so `shadecache ls` does not list it). A board that is not this
user's, or is open to group or others, is never attached (node_files.py): another user could
have made it first under the predictable name. It holds S streams, one per
rank of the node (the stream of a rank is its LOCAL_RANK, else its rank, modulo S), each bounded
to `capacity` entries: an order longer than that is published up to `capacity` (the prefetcher and
the policy then see less of the future, nothing breaks).

Positions. Entry k of the order a stream published for epoch e has the global position
P = e * capacity + k. When the sampler already knows its next epoch's order (a uniform draw that
the cache does not rearrange: ShadeSampler.next_epoch_order), the stream holds this epoch's order
followed by as much of the next one as fits (`NEXT_EPOCH_ROOM` entries by default), so the window
of the prefetcher and the next uses run on across the epoch boundary; when the next epoch is
published its entries move to (e + 1) * capacity + k', later by the same amount for all of them,
which keeps their order. Positions grow with time on every stream and are compared across the ranks of
a node (DDP ranks step together), so "the next position at which any rank reads sample i" is the
minimum over streams of that stream's next position of i.

Layout (little-endian; all offsets fixed by the header so attach checks them):

    header   4096 bytes   magic, version, streams, capacity, num_samples, creator pid,
                          prefetcher pid + stop word, creator and prefetcher start times
                          (at 64 and 72; 0 in a board of an older writer), per-epoch rows: the
                          prefetcher's counters, the readers' (CachedDataset), the samplers'
                          (repeats and deferrals)
    streams  S x 64 bytes seq, epoch, length, cursor (see the contract below)
    ids      S x capacity int64    the published order of each stream
    nxt      S x capacity int32    nxt[k]: the next k' > k with ids[k'] == ids[k] in the same stream
                                   and epoch, or NONE
    next_use S x N int32           the next k (>= cursor) at which this stream reads sample i in its
                                   current epoch, or NONE
    flags    N uint8               PREFETCHED (1) while sample i sits in the cache because the
                                   prefetcher brought it and no read has used it yet; ON_WAY (2)
                                   while the prefetcher reads it or holds it for its turn (a reader
                                   waits for it); WANTED (3): on its way and a reader waits for it
                                   now (the prefetcher hands it to the cache)

Concurrency contract (single writer per stream; any number of readers; no lock):
- The writer of stream s is the training process of that rank (through ShadeSampler's hook).
  publish() is a seqlock write: seq += 1 (odd), a full fence, write ids/nxt/next_use/length/epoch,
  a full fence, seq += 1 (even); so is rewrite(), by which the sampler's stall budget changes
  entries the loader has not taken yet (shadecache/sampling/stalls.py). A reader copies what it needs between two reads of seq and keeps
  the copy only when both are equal and even, with a fence after the first read and before the
  second (memory_fence(): std::atomic_thread_fence(seq_cst) in the native _io module), so the
  contract holds on weakly ordered CPUs too, not only on x86-TSO.
- The cursor (how many entries of the epoch the DataLoader has taken from the sampler) and the
  next_use entries of consumed samples are single aligned 8/4-byte stores by the same writer,
  outside the seqlock: a reader may see the old or the new value, both valid, never a torn one.
  Between publishes, next_use entries only move later within an epoch (as samples are taken),
  so a stale one errs on "needed sooner". A publish rewrites the whole row (to NONE, then the
  new first uses) and next_use() reads it without the seqlock: during a publish a reader may see
  an id as NONE (no known use) or at its new position. Next uses steer eviction and the
  prefetcher's room-making, never what a reader gets: a wrong one costs a read, nothing else.
- The per-epoch prefetch counters and the flags are written by the prefetcher (one per node); the
  flags are also cleared by the processes that read a prefetched sample (a byte store; two readers
  clearing the same flag at once may both count the prefetch hit, a rare overcount), and a reader
  that waits for a sample on its way turns its ON_WAY into WANTED. That store may land just after
  the prefetcher handed the sample over (a byte store, no compare-and-swap): the prefetcher clears
  WANTED on every id it no longer holds, on each pass, so such a reader waits one pass longer. A
  reader waits for a sample on its way only while the prefetcher lives, and only so long: a
  killed prefetcher's ON_WAY and WANTED flags cost a reader that wait, never a wrong value (the
  cache decides).
- A process killed at any point leaves at most one stream with an odd seq: readers skip that
  stream until its writer (or a successor) publishes again. Nothing in the cache depends on the
  board, so a dead board writer can never make the cache inconsistent.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import mmap
import os
import struct
import time
from typing import Optional

import numpy as np

from .. import node_files, shm
from ..process import alive, start_time_of

MAGIC = 0x3152454452_4F4353   # "SCORDER1"-ish tag; any other value is not a board
VERSION = 1
HEADER_BYTES = 4096
STREAM_BYTES = 64
MAX_STREAMS = 64
NONE = np.iinfo(np.int32).max          # "no known next use" in nxt / next_use
EPOCH_SLOTS = 32                       # per-epoch counter rows kept (epoch mod EPOCH_SLOTS)
# Entries a stream keeps by default beyond an epoch's order: the head of the next epoch, when the
# sampler knows it already (a uniform order the cache does not rearrange). Far more than any
# lookahead window needs; 12 bytes each per stream.
NEXT_EPOCH_ROOM = 65536
# flags[i]: brought and unused / being read or held by the prefetcher / that, and a reader waits
PREFETCHED, ON_WAY, WANTED = 1, 2, 3
COUNTERS = ("epoch", "prefetched", "prefetch_wasted", "prefetched_bytes", "reads_issued")
_COUNTER_OFF = 128                     # header offset of the counter rows
# The readers' per-epoch rows (CachedDataset in any process of the node adds to them with an
# atomic add; the stream writer that publishes an epoch first zeroes its row): what the training
# loop saw, per epoch. In the header's spare bytes (zeros in a board of an older writer).
READER_COUNTERS = ("epoch", "samples", "hits", "prefetch_hits", "wait_ns")
_READER_OFF = 2048
# The samplers' per-epoch rows (ShadeSampler in any rank of the node adds with an atomic add): the
# repeats and deferrals its epoch's order holds. Epoch e's row is slot e % EPOCH_SLOTS, stamped by
# the reader row of that slot; cleared with it. The header's last spare bytes (3328..4096).
SAMPLER_COUNTERS = ("accuracy_repeats", "stall_deferrals", "stall_repeats")
_SAMPLER_OFF = _READER_OFF + EPOCH_SLOTS * len(READER_COUNTERS) * 8

# header words (int64 each) at these byte offsets
_H_MAGIC, _H_VERSION, _H_STREAMS, _H_CAPACITY, _H_N = 0, 8, 16, 24, 32
_H_CREATOR, _H_CREATOR_START = shm.BOARD_CREATOR_AT, shm.BOARD_CREATOR_START_AT   # shm.py sweeps by them
_H_PREFETCHER, _H_STOP = 48, 56
_H_PREFETCHER_START = 72   # the prefetcher's start time: with its pid, one process (pids are reused)
_H_READ_RULE, _H_REACH = 80, 88   # what the prefetcher reads ahead, and how far (its own words)
# Counts every WANTED a reader sets (atomic add): the prefetcher's hand-over looks at it (and the
# streams' words) to tell whether anything that decides a hand-over moved, without a scan of N
# flags each poll.
_H_WANTED_SEQ = 96
# The prefetcher's read rule, written by it when it starts (0 in a board no prefetcher ran on):
# READS_EVERY_MISS  every miss of its window, making room in a full cache (no copying tier);
# READS_ADMITTED    once the cache is full, only what it would admit when due (an SSD tier keeps
#                   the rest, and the loader reads it from there);
# READS_UNTIL_FULL  nothing once the cache is full (the extent plan: the loader's own reads are
#                   whole extents)
READS_EVERY_MISS, READS_ADMITTED, READS_UNTIL_FULL = 1, 2, 3
# stream record words
_S_SEQ, _S_EPOCH, _S_LENGTH, _S_CURSOR = 0, 1, 2, 3

def _fence():
    # A full hardware fence around the seqlock's sequence word (see the module docstring).
    from .. import _io
    _io.memory_fence()


def _is_file(path: str, identity: tuple) -> bool:
    """Whether the file at `path` is the one of `identity` (device, inode)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == identity


def _unlink_if_current(path: str, identity: tuple) -> None:
    """Removes `path` when it is still the board of `identity` and this user's."""
    if _is_file(path, identity) and node_files.owned(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _sizes(streams: int, capacity: int, n: int):
    off_streams = HEADER_BYTES
    off_ids = off_streams + MAX_STREAMS * STREAM_BYTES
    off_nxt = off_ids + streams * capacity * 8
    off_next = off_nxt + streams * capacity * 4
    off_flags = off_next + streams * n * 4
    total = off_flags + n
    return off_ids, off_nxt, off_next, off_flags, total


class OrderBoard:
    """The published orders of the ranks of one node, for the cache `cache_name`.

    OrderBoard.create(cache_name, num_samples, streams=1, capacity=None)   (capacity: entries per
    stream, default num_samples + min(num_samples, NEXT_EPOCH_ROOM): an epoch and the head of the
    next one); OrderBoard.attach(cache_name); publish(stream, epoch, order);
    snapshot(stream) -> (epoch, ids, cursor) or None; next_use(ids) -> global positions;
    set_cursor(stream, k). See the module docstring for the layout and the memory contract.
    """

    def __init__(self, path: str, fd: int, owner: bool):
        self.path = path
        try:
            st = os.fstat(fd)
            size = st.st_size
            self.identity = (st.st_dev, st.st_ino)   # which file: a board made again is another
            if size < HEADER_BYTES:
                raise ValueError(f"{path} is not an order board (only {size} bytes)")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, streams, capacity, n = struct.unpack_from("<5q", self._mm, 0)
        if magic != MAGIC:
            self._mm.close()
            raise ValueError(f"{path} is not an order board (bad magic)")
        if version != VERSION:
            from ..errors import LayoutVersionError
            self._mm.close()
            raise LayoutVersionError(f"{path}: order board layout {version}, this shadecache "
                                     f"reads {VERSION}")
        if not (1 <= streams <= MAX_STREAMS and capacity >= 1 and n >= 1):
            self._mm.close()
            raise ValueError(f"{path}: damaged order board header")
        self.streams, self.capacity, self.num_samples = streams, capacity, n
        off_ids, off_nxt, off_next, off_flags, total = _sizes(self.streams, self.capacity,
                                                              self.num_samples)
        if size != total:
            self._mm.close()
            raise ValueError(f"{path}: {size} bytes, its header describes {total}")
        self._header = np.frombuffer(self._mm, dtype=np.int64, count=HEADER_BYTES // 8)
        self._srec = np.frombuffer(self._mm, dtype=np.int64, count=MAX_STREAMS * STREAM_BYTES // 8,
                                   offset=HEADER_BYTES).reshape(MAX_STREAMS, STREAM_BYTES // 8)
        self._ids = np.frombuffer(self._mm, dtype=np.int64, count=self.streams * self.capacity,
                                  offset=off_ids).reshape(self.streams, self.capacity)
        self._nxt = np.frombuffer(self._mm, dtype=np.int32, count=self.streams * self.capacity,
                                  offset=off_nxt).reshape(self.streams, self.capacity)
        self._next = np.frombuffer(self._mm, dtype=np.int32, count=self.streams * self.num_samples,
                                   offset=off_next).reshape(self.streams, self.num_samples)
        self._flags = np.frombuffer(self._mm, dtype=np.uint8, count=self.num_samples, offset=off_flags)
        self._counters = np.frombuffer(self._mm, dtype=np.int64, count=EPOCH_SLOTS * len(COUNTERS),
                                       offset=_COUNTER_OFF).reshape(EPOCH_SLOTS, len(COUNTERS))
        self._readers = np.frombuffer(self._mm, dtype=np.int64,
                                      count=EPOCH_SLOTS * len(READER_COUNTERS),
                                      offset=_READER_OFF)   # flat: _io.atomic_add indexes it
        self._samplers = np.frombuffer(self._mm, dtype=np.int64,
                                       count=EPOCH_SLOTS * len(SAMPLER_COUNTERS),
                                       offset=_SAMPLER_OFF)
        self._creator = os.getpid() if owner else None

    # ---- lifetime ----------------------------------------------------------------------------
    @classmethod
    def create(cls, cache_name: str, num_samples: int, streams: int = 1,
               capacity: Optional[int] = None) -> "OrderBoard":
        """Creates the board of cache `cache_name`; FileExistsError if it exists."""
        for what, v in (("num_samples", num_samples), ("streams", streams)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{what} must be an int, got {type(v).__name__}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if not 1 <= streams <= MAX_STREAMS:
            raise ValueError(f"streams must be in 1..{MAX_STREAMS}, got {streams}")
        capacity = int(num_samples + min(int(num_samples), NEXT_EPOCH_ROOM) if capacity is None
                       else capacity)
        if not 1 <= capacity < NONE:
            raise ValueError(f"capacity must be in 1..{NONE - 1}, got {capacity}")
        path = shm.board_path(cache_name)
        *_, total = _sizes(int(streams), capacity, int(num_samples))
        free = shm.free_bytes()
        if total > free:
            from ..errors import CapacityError
            raise CapacityError(f"order board needs {total} bytes, {shm.SHM_DIR} has {free} free")
        fd = node_files.create_file(path, os.O_RDWR, "order board",
                                    "Another user made it first: use another cache name.")
        try:
            os.ftruncate(fd, total)
            os.posix_fallocate(fd, 0, total)   # a full tmpfs is an error now, not a SIGBUS later
            hdr = struct.pack("<qqqqq", 0, VERSION, streams, capacity, num_samples)
            os.pwrite(fd, hdr, 0)
            me = os.getpid()
            os.pwrite(fd, struct.pack("<q", me), _H_CREATOR)
            os.pwrite(fd, struct.pack("<q", start_time_of(me)), _H_CREATOR_START)
            # next_use starts as NONE everywhere (no stream has published)
            off_next = _sizes(int(streams), capacity, int(num_samples))[2]
            os.pwrite(fd, np.full(int(streams) * int(num_samples), NONE, np.int32).tobytes(), off_next)
            os.pwrite(fd, struct.pack("<q", MAGIC), 0)   # the magic last: a half-made board is refused
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        board = cls(path, fd, owner=True)
        # removed at this process's exit, but never a board made at that name since (another
        # job's, or another user's); the registry holds its name and identity, not the board
        shm.own(path, functools.partial(_unlink_if_current, path, board.identity))
        return board

    @classmethod
    def attach(cls, cache_name: str) -> "OrderBoard":
        """The board of cache `cache_name`; FileNotFoundError if there is none, PermissionError
        (naming the owner) when it is not this user's own or is open to group or others."""
        path = shm.board_path(cache_name)
        fd = node_files.open_file(path, os.O_RDWR, "order board",
                                  advice="Another user made it first: use another cache name.")
        return cls(path, fd, owner=False)

    @property
    def closed(self) -> bool:
        return self._mm is None

    @property
    def created_here(self) -> bool:
        """Whether this process made the board (and removes it at its exit)."""
        return self._creator == os.getpid()

    def close(self):
        if self._mm is None:
            return
        for a in ("_header", "_srec", "_ids", "_nxt", "_next", "_flags", "_counters", "_readers",
                  "_samplers"):
            setattr(self, a, None)
        try:
            self._mm.close()
        except BufferError:
            pass   # a caller still holds a view; the mapping goes with the last of them
        self._mm = None

    def unlink(self):
        """Removes the board's name, when the file there is still this board (not one made since
        under the name) and this user's (in the sticky /dev/shm nobody else can put theirs in its
        place between that look and the unlink)."""
        _unlink_if_current(self.path, self.identity)
        shm.disown(self.path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        if self._creator == os.getpid():
            self.unlink()

    def is_current(self) -> bool:
        """Whether this board is still the file at its path (one stat): its creator may have
        unlinked it, and made a new one."""
        return _is_file(self.path, self.identity)

    def __reduce__(self):
        return (OrderBoard.attach, (os.path.basename(self.path)[len(shm.BOARD_PREFIX):],))

    # ---- the writer side (one process per stream) --------------------------------------------
    def _check_stream(self, stream: int) -> int:
        if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
            raise TypeError(f"stream must be an int, got {type(stream).__name__}")
        if not 0 <= stream < self.streams:
            raise IndexError(f"stream {stream} is not in 0..{self.streams - 1}")
        return int(stream)

    def publish(self, stream: int, epoch: int, order) -> int:
        """Publishes `order` (sample ids) as stream's order for `epoch`; returns how many entries
        were published (at most `capacity`). The cursor goes back to 0."""
        s = self._check_stream(stream)
        ids = np.asarray(order)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise TypeError("order must be a 1-D array of integer sample ids")
        ids = ids[:self.capacity].astype(np.int64, copy=False)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples):
            bad = ids[(ids < 0) | (ids >= self.num_samples)][0]
            raise IndexError(f"sample id {int(bad)} is out of range 0..{self.num_samples - 1}")
        m = ids.size
        k = np.arange(m, dtype=np.int64)
        # next occurrence in the same order: sort by (id, position), link neighbours of equal id
        srt = np.lexsort((k, ids))
        nxt = np.full(m, NONE, dtype=np.int32)
        same = ids[srt[1:]] == ids[srt[:-1]] if m > 1 else np.zeros(0, bool)
        nxt[srt[:-1][same]] = srt[1:][same]
        rec = self._srec[s]
        # odd: readers keep away. A writer killed mid-publish left seq odd; adding 1 would make
        # it even (readers would take the order being written), so go to the NEXT odd value.
        seq = int(rec[_S_SEQ])
        odd = seq + 1 if seq % 2 == 0 else seq + 2
        rec[_S_SEQ] = odd
        _fence()
        self._ids[s, :m] = ids
        self._nxt[s, :m] = nxt
        row = self._next[s]
        row[:] = NONE
        row[ids[::-1]] = k[::-1].astype(np.int32)    # the last write per id wins: its first k
        rec[_S_LENGTH] = m
        rec[_S_EPOCH] = int(epoch)
        rec[_S_CURSOR] = 0
        _fence()
        rec[_S_SEQ] = odd + 1         # even: a consistent order is up
        # The readers' rows. A row is never zeroed while it can be counted into: other ranks may
        # already count reads of this epoch (atomic adds) while this publish runs, so zeroing this
        # epoch's row here lost their counts. Rows start at zero when the board is created; the
        # row of the NEXT epoch is cleared (of the counts of EPOCH_SLOTS epochs ago) by the
        # publishes of this epoch, before any rank can read in the next one (a rank publishes the
        # next epoch only after this one, and then stamps it, which stops the clearing).
        w = len(READER_COUNTERS)
        e = int(epoch)
        row = self._readers[(e % EPOCH_SLOTS) * w:(e % EPOCH_SLOTS + 1) * w]
        if row[0] != e:
            row[0] = e
        nxt = self._readers[((e + 1) % EPOCH_SLOTS) * w:((e + 1) % EPOCH_SLOTS + 1) * w]
        if nxt[0] != e + 1:
            if nxt[1:].any():
                nxt[1:] = 0
            ws = len(SAMPLER_COUNTERS)
            srow = self._samplers[((e + 1) % EPOCH_SLOTS) * ws:((e + 1) % EPOCH_SLOTS + 1) * ws]
            if srow.any():
                srow[:] = 0
        return m

    def published(self, stream: int) -> np.ndarray:
        """A copy of the ids the stream shows now (the writer's own view: no seqlock needed by the
        stream's one writer; empty before its first publish)."""
        s = self._check_stream(stream)
        if int(self._srec[s, _S_SEQ]) == 0:
            return np.empty(0, dtype=np.int64)
        return self._ids[s, :int(self._srec[s, _S_LENGTH])].copy()

    def set_cursor(self, stream: int, k: int) -> None:
        """The DataLoader has taken entries [0, k) of the stream's order (one aligned store)."""
        self._srec[stream, _S_CURSOR] = k

    def consumed(self, stream: int, first: int, last: int) -> np.ndarray:
        """Entries [first, last) were taken: each of their samples' next use in this stream moves
        to its following occurrence (or NONE). Returns those samples' ids."""
        ids = self._ids[stream, first:last]
        # in position order, so a sample taken twice in the range ends at its latest successor
        self._next[stream][ids] = self._nxt[stream, first:last]
        return ids

    def rewrite(self, stream: int, positions, ids, lo: int) -> np.ndarray:
        """Entries `positions` of the stream's order (not taken by the loader yet: >= lo) now hold
        `ids` (the sampler moved or replaced them while the epoch runs). A seqlock write, as
        publish: the chains (nxt) of every id that left or entered those entries are rebuilt, and
        each such id's next use becomes its first position >= lo. Positions past the published
        length are ignored. Returns the ids whose next use changed (for the clairvoyant policy)."""
        s = self._check_stream(stream)
        rec = self._srec[s]
        length = int(rec[_S_LENGTH])
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        new = np.asarray(ids, dtype=np.int64).reshape(-1)
        if pos.shape != new.shape:
            raise ValueError(f"{pos.size} positions but {new.size} ids")
        keep = pos < length
        pos, new = pos[keep], new[keep]
        if pos.size == 0:
            return np.empty(0, dtype=np.int64)
        if pos.min() < lo or (new.size and (new.min() < 0 or new.max() >= self.num_samples)):
            raise IndexError(f"rewrite: positions must be >= {lo} and ids in 0..{self.num_samples - 1}")
        row = self._ids[s, :length]
        touched = np.unique(np.concatenate([row[pos], new]))
        seq = int(rec[_S_SEQ])
        odd = seq + 1 if seq % 2 == 0 else seq + 2
        rec[_S_SEQ] = odd
        _fence()
        row[pos] = new
        at = np.flatnonzero(np.isin(row, touched))        # every entry of a touched id, in order
        srt = at[np.argsort(row[at], kind="stable")]       # by id, then position
        same = row[srt[1:]] == row[srt[:-1]]
        nxt = self._nxt[s]
        nxt[srt] = NONE
        nxt[srt[:-1][same]] = srt[1:][same]
        nu = self._next[s]
        nu[touched] = NONE
        later = srt[srt >= lo]
        nu[row[later][::-1]] = later[::-1].astype(np.int32)   # the last write per id: its first
        _fence()
        rec[_S_SEQ] = odd + 1
        return touched

    # ---- the reader side ---------------------------------------------------------------------
    def snapshot(self, stream: int, window: Optional[int] = None):
        """(epoch, ids from the cursor on (at most `window` of them), cursor), or None when the
        stream has published nothing or is being written. A consistent copy (seqlock)."""
        s = self._check_stream(stream)
        rec = self._srec[s]
        for _ in range(100):
            seq = int(rec[_S_SEQ])
            if seq == 0:
                return None
            if seq & 1:
                time.sleep(0.0005)
                continue
            _fence()
            epoch, length, cursor = int(rec[_S_EPOCH]), int(rec[_S_LENGTH]), int(rec[_S_CURSOR])
            cursor = min(max(cursor, 0), length)
            end = length if window is None else min(length, cursor + int(window))
            ids = self._ids[s, cursor:end].copy()
            _fence()
            if int(rec[_S_SEQ]) == seq:
                return epoch, ids, cursor
        return None   # a writer died mid-publish (odd seq forever) or keeps rewriting

    def next_use(self, ids) -> np.ndarray:
        """Global position (epoch * capacity + k) of the next read of each id by any stream, or
        -1 where no stream knows one. Benign races: see the module docstring."""
        ids = np.asarray(ids, dtype=np.int64)
        best = np.full(ids.size, np.iinfo(np.int64).max, dtype=np.int64)
        for s in range(self.streams):
            if int(self._srec[s, _S_SEQ]) == 0:
                continue
            k = self._next[s][ids].astype(np.int64)
            pos = np.where(k == NONE, np.iinfo(np.int64).max,
                           int(self._srec[s, _S_EPOCH]) * self.capacity + k)
            np.minimum(best, pos, out=best)
        best[best == np.iinfo(np.int64).max] = -1
        return best

    def marks(self) -> bytes:
        """What changes whenever a stream publishes, rewrites or moves its cursor, or a reader
        asks for a sample on its way (WANTED): the streams' (seq, epoch, cursor) words and the
        WANTED count, as bytes (one copy). Equal marks: none of that happened since."""
        return (self._srec[:self.streams, [_S_SEQ, _S_EPOCH, _S_CURSOR]].tobytes()
                + self._header[_H_WANTED_SEQ // 8].tobytes())

    def creator_gone(self) -> bool:
        """Whether the process that made this board is gone (its pid and start time)."""
        pid = int(self._header[_H_CREATOR // 8])
        return pid > 0 and not alive(pid, int(self._header[_H_CREATOR_START // 8]))

    @contextlib.contextmanager
    def starting(self):
        """Yields True in the one process that may start the node's prefetcher now (an exclusive
        flock on the board file, not waited for: the kernel drops it when the holder dies), False
        in any other that asks meanwhile."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def stream_state(self, stream: int) -> dict:
        rec = self._srec[self._check_stream(stream)]
        return {"seq": int(rec[_S_SEQ]), "epoch": int(rec[_S_EPOCH]), "length": int(rec[_S_LENGTH]),
                "cursor": int(rec[_S_CURSOR])}

    # ---- the flags: set by the prefetcher, claimed (or waited for) by the readers -----------
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
        _io.atomic_add(self._header, _H_WANTED_SEQ // 8, 1)   # after the flags: the prefetcher looks
        deadline = time.monotonic() + timeout
        if not self.prefetcher_alive():
            return coming
        pid = self.prefetcher_pid
        while (self.on_way(wait).any() and time.monotonic() < deadline
               and alive(pid, self._prefetcher_start())):
            time.sleep(0.0005)
        return coming

    # ---- prefetcher registration and counters ------------------------------------------------
    @property
    def prefetcher_pid(self) -> int:
        return int(self._header[_H_PREFETCHER // 8])

    def set_prefetcher(self, pid: int) -> None:
        """Registers process `pid` as the node's prefetcher (0: none), with its start time, so
        that the pid names that process only (prefetcher_alive)."""
        self._header[_H_PREFETCHER_START // 8] = start_time_of(pid) if pid else 0
        self._header[_H_PREFETCHER // 8] = int(pid)

    def _prefetcher_start(self) -> int:
        return int(self._header[_H_PREFETCHER_START // 8])

    def prefetcher_alive(self) -> bool:
        """Whether the registered prefetcher runs: its pid is alive and, when its start time was
        registered, names the same process (a killed prefetcher's pid may name another one by
        now). The two words are not read as one: a reader racing a new registration may take the
        new prefetcher for gone, which costs it a read of its own, never a wrong value."""
        pid = self.prefetcher_pid
        return bool(pid) and alive(pid, self._prefetcher_start())

    def set_read_rule(self, rule: int, reach: int) -> None:
        """The prefetcher's rule (READS_*) and reach (half the samples the cache holds: how far
        ahead of the cursors its automatic lookahead reads at most), for the samplers' stall
        budget, which bends the order around what it reads."""
        self._header[_H_REACH // 8] = int(reach)
        self._header[_H_READ_RULE // 8] = int(rule)

    @property
    def read_rule(self) -> int:
        """The live prefetcher's READS_* rule, 0 when none runs."""
        return int(self._header[_H_READ_RULE // 8]) if self.prefetcher_alive() else 0

    @property
    def reach(self) -> int:
        return int(self._header[_H_REACH // 8])

    @property
    def stop_requested(self) -> bool:
        return bool(self._header[_H_STOP // 8])

    def request_stop(self, value: bool = True) -> None:
        self._header[_H_STOP // 8] = int(bool(value))

    def count(self, epoch: int, **deltas) -> None:
        """Adds to epoch's counters (prefetcher only: the single writer of the counter rows)."""
        row = self._counters[int(epoch) % EPOCH_SLOTS]
        if row[0] != epoch:
            row[1:] = 0
            row[0] = epoch
        for key, v in deltas.items():
            row[COUNTERS.index(key)] += int(v)

    def current_epoch(self) -> int:
        """The latest epoch any stream has published (-1: none yet)."""
        seqs = self._srec[:self.streams, _S_SEQ]
        epochs = self._srec[:self.streams, _S_EPOCH][seqs != 0]
        return int(epochs.max()) if epochs.size else -1

    def count_reads(self, stream: int, samples: int, hits: int, prefetch_hits: int, wait_ns: int) -> None:
        """Adds one batch of reads to the reader row of `stream`'s epoch (any process; atomic adds;
        the stream whose epoch a process's reads count in: publish.reader_stream). Ranks of a node
        may be an epoch apart for a moment, and each read counts in its own rank's epoch."""
        from .. import _io
        rec = self._srec[stream]
        epoch = int(rec[_S_EPOCH]) if int(rec[_S_SEQ]) else self.current_epoch()
        if epoch < 0:
            return
        base = (epoch % EPOCH_SLOTS) * len(READER_COUNTERS)
        for name, v in (("samples", samples), ("hits", hits), ("prefetch_hits", prefetch_hits),
                        ("wait_ns", wait_ns)):
            if v:
                _io.atomic_add(self._readers, base + READER_COUNTERS.index(name), int(v))

    def count_sampler(self, epoch: int, **deltas) -> None:
        """Adds to epoch's sampler row (any process; atomic adds): accuracy_repeats,
        stall_deferrals, stall_repeats (SAMPLER_COUNTERS)."""
        from .. import _io
        base = (int(epoch) % EPOCH_SLOTS) * len(SAMPLER_COUNTERS)
        for name, v in deltas.items():
            if v:
                _io.atomic_add(self._samplers, base + SAMPLER_COUNTERS.index(name), int(v))

    def epoch_counters(self) -> list:
        """[{epoch, prefetched, prefetch_wasted, prefetched_bytes, reads_issued, samples, hits,
        prefetch_hits, wait_s, accuracy_repeats, stall_deferrals, stall_repeats}] of the epochs
        recorded, oldest first (the last EPOCH_SLOTS epochs): the prefetcher's counters, what the
        loaders read (CachedDataset) and what the samplers' orders repeated or deferred."""
        by_epoch = {}
        for r in self._counters:
            d = dict(zip(COUNTERS, (int(v) for v in r)))
            if any(d[c] for c in COUNTERS[1:]):
                by_epoch[d["epoch"]] = d
        w = len(READER_COUNTERS)
        for k in range(EPOCH_SLOTS):
            d = dict(zip(READER_COUNTERS, (int(v) for v in self._readers[k * w:(k + 1) * w])))
            ws = len(SAMPLER_COUNTERS)
            sd = dict(zip(SAMPLER_COUNTERS, (int(v) for v in self._samplers[k * ws:(k + 1) * ws])))
            if any(d[c] for c in READER_COUNTERS[1:]) or any(sd.values()):
                row = by_epoch.setdefault(d["epoch"], {c: 0 for c in COUNTERS} | {"epoch": d["epoch"]})
                row.update(samples=d["samples"], hits=d["hits"], prefetch_hits=d["prefetch_hits"],
                           wait_s=d["wait_ns"] / 1e9, **sd)
        for row in by_epoch.values():
            for c in ("samples", "hits", "prefetch_hits") + SAMPLER_COUNTERS:
                row.setdefault(c, 0)
            row.setdefault("wait_s", 0.0)
        return [by_epoch[e] for e in sorted(by_epoch)]

    def totals(self) -> dict:
        t = {c: 0 for c in COUNTERS[1:]}
        for r in self.epoch_counters():
            for c in t:
                t[c] += r[c]
        return t


class BoardLink:
    """The order board of one cache as a node holds it (sc.Node passes it to its miss path, its
    samplers and its prefetcher): the board attached when it exists, looked for again at most
    once a second while it does not (another rank, or the node's own first publish, may make it
    later), and dropped once its creator removed it. Pickles as the cache's name: a DataLoader
    worker or the prefetcher attaches in its own process."""

    RELOOK_S = 1.0

    def __init__(self, cache_name: str):
        self.cache_name = cache_name
        self._board = None
        self._looked = None       # when a look last found no board
        self._pid = os.getpid()

    def get(self) -> Optional[OrderBoard]:
        """The board, or None while there is none (PermissionError when the board at its name
        is another user's: refused, never attached)."""
        if self._pid != os.getpid():   # a forked child attaches on its own
            self._board, self._looked, self._pid = None, None, os.getpid()
        b = self._board
        if b is not None and not b.closed and b.is_current():
            return b
        now = time.monotonic()
        if b is None and self._looked is not None and now - self._looked < self.RELOOK_S:
            return None
        self._looked = now
        try:
            self._board = OrderBoard.attach(self.cache_name)
        except (FileNotFoundError, ValueError):
            self._board = None
        return self._board

    def create(self, num_samples: int, streams: int, wait: float = 5.0) -> OrderBoard:
        """The board: made (this process removes it at its exit), or the one another process
        made, once it is whole (its magic is written last: a board being made is waited for up
        to `wait` seconds), or made anew in place of one whose creator is gone (a killed job's:
        its orders, flags and stream count are nobody's any more)."""
        deadline = time.monotonic() + wait
        while True:
            try:
                self._board = OrderBoard.create(self.cache_name, num_samples, streams=streams)
                return self._board
            except FileExistsError:
                pass
            try:
                board = OrderBoard.attach(self.cache_name)
            except FileNotFoundError:
                continue                      # removed since: make it
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)             # being made by another process
                continue
            if board.creator_gone():
                board.unlink()
                board.close()
                continue
            self._board = board
            return board

    def __getstate__(self):
        return {"cache_name": self.cache_name}

    def __setstate__(self, state):
        self.__init__(state["cache_name"])

