"""The order board: each rank's upcoming sample order, published into the node's shared memory,
and what the node's prefetcher and readers hand each other.

One handle (OrderBoard, passed explicitly: the node holds it in a BoardLink) over one file, in
four concerns, each a class of its own module:

    board.orders    orders.py          the published orders, cursors and next uses (a seqlock
                                       per stream)
    board.flags     handoff.py         PREFETCHED / ON_WAY / WANTED per sample: the hand-off
                                       between the prefetcher and the readers
    board.counters  epoch_counters.py  per-epoch rows of the prefetcher, the readers, the samplers
    board.control   control.py         the prefetcher's registration, stop word, read rule and
                                       reach; the claim on starting one; the board's creator

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

import functools
import mmap
import os
import struct
import time
from typing import Optional

import numpy as np

from .. import node_files, shm
from ..process import start_time_of
from .board_layout import (COUNTER_OFF, COUNTERS, EPOCH_SLOTS, H_CREATOR, H_CREATOR_START,
                           HEADER_BYTES, MAGIC, MAX_STREAMS, NEXT_EPOCH_ROOM, NONE, ON_WAY,
                           PREFETCHED, READER_COUNTERS, READER_OFF, READS_ADMITTED,
                           READS_EVERY_MISS, READS_UNTIL_FULL, SAMPLER_COUNTERS, SAMPLER_OFF,
                           STREAM_BYTES, VERSION, WANTED, sizes)
from .control import Control
from .epoch_counters import EpochCounters
from .handoff import HandOff
from .orders import Orders

__all__ = ["OrderBoard", "BoardLink", "READS_EVERY_MISS", "READS_ADMITTED", "READS_UNTIL_FULL",
           "PREFETCHED", "ON_WAY", "WANTED", "NONE", "COUNTERS", "READER_COUNTERS",
           "SAMPLER_COUNTERS", "EPOCH_SLOTS", "NEXT_EPOCH_ROOM", "MAX_STREAMS"]


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


class OrderBoard:
    """The board of the cache `cache_name`: its file, mapped, and its four concerns (module
    docstring). OrderBoard.create(cache_name, num_samples, streams=1, capacity=None) (capacity:
    entries per stream, default num_samples + min(num_samples, NEXT_EPOCH_ROOM): an epoch and the
    head of the next one); OrderBoard.attach(cache_name)."""

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
        total = sizes(streams, capacity, n)[-1]
        if size != total:
            self._mm.close()
            raise ValueError(f"{path}: {size} bytes, its header describes {total}")
        self._compose()
        self._creator = os.getpid() if owner else None

    def _compose(self) -> None:
        """The four concerns over their views of the mapping (the layout: module docstring)."""
        mm, s, c, n = self._mm, self.streams, self.capacity, self.num_samples
        off_ids, off_nxt, off_next, off_flags, _ = sizes(s, c, n)

        def view(dtype, count, offset, shape=None):
            a = np.frombuffer(mm, dtype=dtype, count=count, offset=offset)
            return a if shape is None else a.reshape(shape)
        self._header = header = view(np.int64, HEADER_BYTES // 8, 0)
        self.control = Control(header, self.path)
        self.counters = EpochCounters(
            view(np.int64, EPOCH_SLOTS * len(COUNTERS), COUNTER_OFF, (EPOCH_SLOTS, len(COUNTERS))),
            view(np.int64, EPOCH_SLOTS * len(READER_COUNTERS), READER_OFF),   # flat: atomic adds
            view(np.int64, EPOCH_SLOTS * len(SAMPLER_COUNTERS), SAMPLER_OFF))
        self.orders = Orders(
            view(np.int64, MAX_STREAMS * STREAM_BYTES // 8, HEADER_BYTES,
                 (MAX_STREAMS, STREAM_BYTES // 8)),
            view(np.int64, s * c, off_ids, (s, c)), view(np.int32, s * c, off_nxt, (s, c)),
            view(np.int32, s * n, off_next, (s, n)), header, s, c, n, self.counters)
        self.counters.bind_orders(self.orders)
        self.flags = HandOff(view(np.uint8, n, off_flags), header, self.control)

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
        *_, total = sizes(int(streams), capacity, int(num_samples))
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
            os.pwrite(fd, struct.pack("<q", me), H_CREATOR)
            os.pwrite(fd, struct.pack("<q", start_time_of(me)), H_CREATOR_START)
            # next_use starts as NONE everywhere (no stream has published)
            off_next = sizes(int(streams), capacity, int(num_samples))[2]
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
        for part in (self.orders, self.flags, self.counters, self.control):
            part.close()   # each drops its views of the mapping
        self._header = None
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
            if board.control.creator_gone():
                board.unlink()
                board.close()
                continue
            self._board = board
            return board

    def __getstate__(self):
        return {"cache_name": self.cache_name}

    def __setstate__(self, state):
        self.__init__(state["cache_name"])

