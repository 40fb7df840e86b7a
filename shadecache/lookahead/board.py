"""The order board: each job's upcoming sample orders, published into the node's shared memory, and
what the node's prefetcher and readers hand each other.

One handle per job (OrderBoard, passed explicitly: the node holds it in a BoardLink) over two
files (board_files.py; offsets in board_layout.py), in concerns, each a class of its own module:

    board.orders    orders.py          the job's published orders, cursors and next uses (a
                                       seqlock per stream)                       the job's file
    board.counters  epoch_counters.py  per-epoch rows of the job's readers and samplers, its
                                       totals (and the prefetcher's rows, node-wide)  the job's
    board.scores    job_scores.py      the job's own score table                 the job's file
    board.flags     handoff.py         PREFETCHED / ON_WAY / WANTED per sample: the hand-off
                                       between the prefetcher and every reader   the node's file
    board.control   control.py         the prefetcher's registration, stop word, read rule and
                                       reach; the claim on starting one; the file's creator
    board.jobs      jobs.py            the registry of the jobs on the cache     the node's file
    board.all_jobs  all_jobs.py        every job's board, seen from this process
    board.merge     job_scores.py      the job's scores into the cache's, merged with the others'

Several jobs may train on one cache at once (docs/jobs.md): each has its own orders, counters and
scores, in a file of its own; the hand-off flags are per sample and every job's, so a sample two
jobs need is read once; one prefetcher reads ahead in every job's orders.

ShadeSampler draws a whole epoch's order before the epoch starts. Publishing it lets the node's
prefetcher (shadecache/lookahead/prefetcher.py) read the upcoming misses ahead of the DataLoader and lets the
clairvoyant eviction policy keep what will be read soonest (Belady, NoPFS SC'21).

Files: `/dev/shm/shadecache-order.<cache name>` (the node's) and `shadecache-job.<cache>.<slot>`
(a job's), mode 0600; a job's is removed by the last of its processes to leave, the node's by the
last job (shm.py has the rules, and gc's for what killed jobs leave). Neither is a cache segment,
so `shadecache ls` does not list them. A board that is not this user's, or is open to group or
others, is never attached (node_files.py): another user could have made it first under the
predictable name. A job's file holds S streams, one per rank of the job on the node (the stream
of a rank is its LOCAL_RANK, else its rank, modulo S), each bounded to `capacity` entries: an
order longer than that is published up to `capacity` (the prefetcher and the policy then see less
of the future, nothing breaks).

Positions. Entry k of the order a stream published for epoch e has the global position
P = e * capacity + k. When the sampler already knows its next epoch's order (a uniform draw that
the cache does not rearrange: ShadeSampler.next_epoch_order), the stream holds this epoch's order
followed by as much of the next one as fits (`NEXT_EPOCH_ROOM` entries by default; the stream's
epoch length says where the epoch ends), so the window of the prefetcher and the next uses run on
across the epoch boundary; when the next epoch is published its entries move to
(e + 1) * capacity + k', later by the same amount for all of them, which keeps their order.
Positions grow with time on every stream and are compared across the ranks of a job (DDP ranks
step together), so "the next position at which any rank reads sample i" is the minimum over
streams of that stream's next position of i. Across jobs positions are not compared
(all_jobs.py).

Layout (little-endian; all offsets fixed by the header so attach checks them):

  the node's file
    header   4096 bytes   magic, version, num_samples, creator pid and start time, prefetcher
                          pid + stop word + start time, read rule, reach, WANTED count, score
                          merge rule, last job generation; the prefetcher's per-epoch rows
    jobs     MAX_JOBS x 128 bytes   the registry (jobs.py)
    flags    N uint8      PREFETCHED (1) while sample i sits in the cache because the
                          prefetcher brought it and no read has used it yet; ON_WAY (2)
                          while the prefetcher reads it or holds it for its turn (a reader
                          waits for it); WANTED (3): on its way and a reader waits for it
                          now (the prefetcher hands it to the cache)
  a job's file
    header   4096 bytes   magic, version, streams, capacity, num_samples, creator, slot and
                          generation, the batch size of its scores; its totals; per-epoch rows:
                          the readers' (CachedDataset), the samplers' (repeats and deferrals)
    streams  S x 64 bytes seq, epoch, length, cursor, epoch length (see the contract below)
    ids      S x capacity int64    the published order of each stream
    nxt      S x capacity int32    nxt[k]: the next k' > k with ids[k'] == ids[k] in the same stream
                                   and epoch, or NONE
    next_use S x N int32           the next k (>= cursor) at which this stream reads sample i in its
                                   current epoch, or NONE
    scores   N float32             the job's own scores (job_scores.py)

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
- The registry and the score merge: jobs.py, job_scores.py (the registry lock, then the cache's).
"""
from __future__ import annotations

import functools
import os
import time
from typing import Optional

import numpy as np

from .. import shm
from .all_jobs import AllJobs
from .board_files import JobFile, NodeFile, unlink_if_current
from .board_layout import (COUNTER_OFF, COUNTERS, EPOCH_SLOTS, FLAGS_AT, H_SCORE_MERGE,
                           HEADER_BYTES, MAX_STREAMS, NEXT_EPOCH_ROOM, NONE, ON_WAY, PREFETCHED,
                           READER_COUNTERS, READS_ADMITTED, READS_EVERY_MISS, READS_UNTIL_FULL,
                           SAMPLER_COUNTERS, SCORE_MERGES, WANTED)
from .control import Control
from .handoff import HandOff
from .job_scores import DEFAULT_RULE, ScoreMerge, check_rule, rule_name
from .job_view import JobView
from . import jobs as registry
from .jobs import Jobs, job_name

__all__ = ["OrderBoard", "BoardLink", "BoardMismatchError", "READS_EVERY_MISS", "READS_ADMITTED",
           "READS_UNTIL_FULL", "PREFETCHED", "ON_WAY", "WANTED", "NONE", "COUNTERS", "READER_COUNTERS",
           "SAMPLER_COUNTERS", "EPOCH_SLOTS", "NEXT_EPOCH_ROOM", "MAX_STREAMS"]


class BoardMismatchError(ValueError):
    """The cache's board was made for another number of samples or another score merge rule
    than this node asks for: a composition error, reported wherever the board is looked for
    (never taken for "no board yet")."""


def _check_shape(num_samples, streams, capacity) -> int:
    """The capacity (entries per stream) of a job board of this shape; TypeError / ValueError
    naming what is wrong."""
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
    return capacity


def _node_parts(node: NodeFile):
    """(header words, prefetcher rows) of the node's file: what every JobView takes of it."""
    header = node.view(np.int64, HEADER_BYTES // 8, 0)
    rows = node.view(np.int64, EPOCH_SLOTS * len(COUNTERS), COUNTER_OFF, (EPOCH_SLOTS, len(COUNTERS)))
    return header, rows


def _abandoned(node: NodeFile) -> bool:
    """A node's file on which no job lives and whose creator is gone (a killed job's)."""
    jobs = Jobs(node)
    try:
        return not jobs.live() and Control(node.view(np.int64, HEADER_BYTES // 8, 0),
                                           node.path).creator_gone()
    finally:
        jobs.close()


class OrderBoard:
    """One job's handle on the board of its cache (module docstring). OrderBoard.create /
    join / attach make one; node: the NodeFile, view: the job's JobView."""

    def __init__(self, node: NodeFile, view: JobView, made_job: bool, held: bool = False):
        self._node, self._view = node, view
        self.path = view.file.path
        self.identity = (node.identity, view.file.identity)
        self._node_path = node.path
        self.streams, self.capacity = view.file.streams, view.file.capacity
        self.num_samples = view.file.num_samples
        self.slot, self.generation = view.slot, view.generation
        header, rows = _node_parts(node)
        self._header = header
        self.control = Control(header, node.path)
        self.flags = HandOff(node.view(np.uint8, self.num_samples, FLAGS_AT), header, self.control)
        self.jobs = Jobs(node)
        self.cache_name = self.jobs.cache_name
        self.job = self.jobs.name(self.slot)
        self.orders, self.counters, self.scores = view.orders, view.counters, view.scores
        self.all_jobs = AllJobs(node, self.jobs, (header, rows), own=view)
        self.merge = ScoreMerge(self.all_jobs, view, self.score_merge)
        self._creator = os.getpid() if made_job else None
        # the process in which this handle holds one count of its job's byte (jobs.hold), or
        # None (an observer's handle, one that rides along uncounted, or one that let go):
        # let_go() gives that count back, leave() every count of the process
        self._held = os.getpid() if held else None
        self._own_key = f"{self.path}#{self.generation}"   # its leave at exit (shm.own)

    @property
    def score_merge(self) -> str:
        return rule_name(int(self._header[H_SCORE_MERGE // 8]))

    # ---- lifetime ----------------------------------------------------------------------------
    @classmethod
    def create(cls, cache_name: str, num_samples: int, streams: int = 1,
               capacity: Optional[int] = None, job=None, score_merge: str = DEFAULT_RULE) -> "OrderBoard":
        """Makes the board of cache `cache_name` with job `job` (default: jobs.job_name()) on it;
        FileExistsError if the cache has a board (join() joins it). capacity: entries per stream,
        default num_samples + min(num_samples, NEXT_EPOCH_ROOM): an epoch and the head of the
        next one."""
        capacity = _check_shape(num_samples, streams, capacity)
        name = job_name(job)
        node = NodeFile.create(cache_name, int(num_samples), SCORE_MERGES[check_rule(score_merge)])
        try:
            return cls._register(node, name, int(streams), capacity, True)
        except BaseException:
            node.unlink()
            node.close()
            raise

    @classmethod
    def join(cls, cache_name: str, num_samples: int, streams: int = 1, capacity=None, job=None,
             score_merge=None, make: bool = True, wait: float = 5.0,
             counted: bool = True) -> "OrderBoard":
        """The board of job `job` on cache `cache_name`: the cache's board made (make=True) or
        attached (one being made waited for up to `wait` seconds; one on which no job lives and
        whose creator is gone made anew), the job registered there or joined (this process then
        counts among its processes). score_merge: the rule the board must have (ValueError when
        another made it with another; None: the board's, DEFAULT_RULE for a new one).
        FileNotFoundError when make=False and there is no board. counted=False: the handle is
        never closed (a sampler's own link) and counts for nothing in this process's hold of the
        job (jobs.Jobs.hold): it holds the job only while no counted handle does, until exit."""
        capacity = _check_shape(num_samples, streams, capacity)
        name = job_name(job)
        rule = check_rule(score_merge) if score_merge is not None else None
        while True:
            node = cls._node_file(cache_name, int(num_samples), rule, make, wait)
            if node is None:
                continue
            try:
                return cls._register(node, name, int(streams), capacity, counted)
            except FileNotFoundError:
                node.close()       # made again since it was attached: the one there now

    @classmethod
    def _node_file(cls, cache_name, num_samples, rule, make, wait):
        """The cache's node file made or attached (join), or None to look again."""
        if make:
            try:
                return NodeFile.create(cache_name, num_samples, SCORE_MERGES[rule or DEFAULT_RULE])
            except FileExistsError:
                pass
        try:
            node = NodeFile.attach_whole(cache_name, wait)
        except FileNotFoundError:
            if not make:
                raise
            return None
        if node.num_samples != num_samples:
            node.close()
            raise BoardMismatchError(f"the board of cache {cache_name!r} is for {node.num_samples} samples, "
                             f"not {num_samples}")
        have = rule_name(node.word(H_SCORE_MERGE))
        if rule is not None and have != rule:
            node.close()
            raise BoardMismatchError(f"the jobs on cache {cache_name!r} merge their scores by {have!r}; "
                             f"this node asks for {rule!r}: compose it with score_merge={have!r}")
        if _abandoned(node):
            node.unlink()
            node.close()
            return None
        return node

    @classmethod
    def _register(cls, node: NodeFile, name: str, streams: int, capacity: int,
                  counted: bool) -> "OrderBoard":
        """Registers (or joins) job `name` on `node`; its file made (a new registration) or
        attached (a live job's), under the registry lock. On return this process holds the
        job's byte (one count: the board leaves it); on any failure it does not (a byte kept
        would keep a job that never ran, or a later one at its slot, looking alive)."""
        jobs = Jobs(node)
        cache_name = jobs.cache_name
        try:
            with jobs.locked():
                slot, gen, joined = jobs.register(name, counted)
                try:
                    f = _job_file(node, cache_name, slot, gen, joined, streams, capacity)
                except BaseException:
                    registry.release(node.identity, slot, gen, counted=counted)
                    jobs.settle()         # a registration of its own that failed: its slot freed
                    raise
        finally:
            jobs.close()
        try:
            board = cls(node, JobView(f, *_node_parts(node)), made_job=not joined, held=counted)
        except BaseException:
            f.close()
            registry.release(node.identity, slot, gen, counted=counted)
            _settle(node)
            raise
        shm.own(board._own_key, functools.partial(_leave_at_exit, cache_name, node.identity, slot, gen))
        return board

    @classmethod
    def attach(cls, cache_name: str, job=None, member: bool = False) -> "OrderBoard":
        """The board of job `job` on cache `cache_name` (None: this process's default job when it
        lives there, else the live job of the lowest slot). FileNotFoundError if there is none,
        PermissionError (naming the owner) when a file is not this user's own or is open to group
        or others. member=True: this process counts among the job's processes (jobs.py)."""
        node = NodeFile.attach(cache_name)
        jobs = Jobs(node)
        held = f = None
        try:
            found = jobs.find(job_name(job))
            if found is None and job is None:
                live = jobs.live()
                found = live[0] if live else None
            if found is None:
                which = f"job {job!r}" if job is not None else "job"
                raise FileNotFoundError(f"no {which} lives on the order board of cache {cache_name!r}")
            f = JobFile.attach(cache_name, found[0])
            if f.generation != found[1]:
                raise FileNotFoundError(f"the job at slot {found[0]} of cache {cache_name!r} left")
            if member:
                jobs.hold(*found)
                held = found
            board = cls(node, JobView(f, *_node_parts(node)), made_job=False, held=member)
        except BaseException:
            if f is not None:
                f.close()
            if held is not None:
                registry.release(node.identity, *held)
            jobs.close()
            node.close()
            raise
        jobs.close()
        if member:
            shm.own(board._own_key, functools.partial(_leave_at_exit, cache_name, node.identity, *found))
        return board

    @property
    def closed(self) -> bool:
        return self._node is None

    @property
    def created_here(self) -> bool:
        """Whether this process registered the board's job (and leaves it at its exit)."""
        return self._creator == os.getpid()

    def close(self):
        if self._node is None:
            return
        self.all_jobs.close()
        for part in (self.flags, self.control, self.jobs):
            part.close()   # each drops its views of the mapping
        self._view.close()
        self._header = None
        self._node.close()
        self._node = None

    def leave(self) -> None:
        """This process leaves the job (what its exit does), whichever of its handles joined it:
        the job's board goes with the job's last process, the node's file with the last job."""
        self._held = None
        registry.release(self.identity[0], self.slot, self.generation, everything=True)
        shm.disown(self._own_key)
        self._settle()

    def let_go(self) -> None:
        """This handle gives back its count of this process's hold of the job (one node of the
        job closes: BoardLink.close): the process leaves the job with the last counted handle
        (several nodes of one job in one process), as leave() does. Nothing for a handle that
        holds no count (an observer's, one that let go already)."""
        if self._held != os.getpid():
            return
        self._held = None
        if registry.release(self.identity[0], self.slot, self.generation) == 0:
            shm.disown(self._own_key)
            self._settle()

    def _settle(self) -> None:
        if self._node is not None:
            _settle(self._node)
        else:
            _settle_named(self.cache_name, self.identity[0])

    def unlink(self):
        """Removes the names of the node's file and of the job's (when each is still this board's
        file and this user's); processes that have them mapped keep them until they close."""
        shm.disown(self._own_key)
        # by path and identity, not through the mappings: a closed board can be unlinked too
        unlink_if_current(self.path, self.identity[1])
        unlink_if_current(self._node_path, self.identity[0])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._creator == os.getpid() and not self.closed:
            self.leave()
        self.close()

    def is_current(self) -> bool:
        """Whether this board is still what its names hold (two stats and a word): the node's
        file and the job's at their paths, and the job still registered at its slot."""
        return (self._view.file.is_current() and self._node.is_current()
                and self.jobs.generation(self.slot) == self.generation)

    def __reduce__(self):
        return (OrderBoard.attach, (self.jobs.cache_name, self.job))


def _job_file(node: NodeFile, cache_name: str, slot: int, gen: int, joined: bool, streams: int,
              capacity: int) -> JobFile:
    """The file of the job just registered (made) or joined (attached) at `slot`; registry lock
    held, so a live job's file is whole. A live job whose file is missing or another's (removed
    under it: by hand, or by a `gc` older than the registry lock's) gets it made again, rather
    than having every later rank wait for it forever: the ranks that had the removed one see
    their board is no longer current and attach the new one (BoardLink.get)."""
    if joined:
        try:
            f = JobFile.attach(cache_name, slot, wait=0)
        except FileNotFoundError:
            f = None
        if f is not None and f.generation == gen:
            return f
        if f is not None:
            f.close()
    return JobFile.create(cache_name, slot, gen, node.num_samples, streams, capacity)


def _settle(node: NodeFile) -> None:
    """After this process let go of a job on `node` (registry.release): under the registry lock,
    the slots of the jobs no process holds freed and their boards removed; the node's file
    removed when no job lives on it."""
    jobs = Jobs(node)
    try:
        with jobs.locked():
            if not jobs.settle():
                node.unlink()
    except FileNotFoundError:
        pass   # the node's file was made again since: that one is other jobs'
    finally:
        jobs.close()


def _settle_named(cache_name: str, identity: tuple) -> None:
    """_settle on the node's file of `identity`, attached by name, if that file is still the
    cache's board."""
    try:
        node = NodeFile.attach(cache_name)
    except (OSError, ValueError):
        return
    try:
        if node.identity == identity:
            _settle(node)
    finally:
        node.close()


def _leave_at_exit(cache_name: str, identity: tuple, slot: int, generation: int) -> None:
    """At this process's exit: every handle of it lets go of its job on the node's file of
    `identity` (its byte released now, not at the last close of its descriptor), then that file
    is settled if it is still the cache's board."""
    registry.release(identity, slot, generation, everything=True)
    _settle_named(cache_name, identity)


class BoardLink:
    """The board of one job on one cache as a node holds it (sc.Node passes it to its miss path,
    its samplers and its prefetcher): the board attached when it exists, looked for again at most
    once a second while it does not (another rank, or the node's own first publish, may make it
    later), and dropped once it is no longer current. A member link (the node's: the job's
    training process) joins the job on a board it finds, and leaves it at close(); an observer
    (observer(): the prefetcher, the peer server; and every copy of a link in another process:
    a DataLoader worker, forked or spawned) only attaches, so the job lives exactly as long as
    the processes that composed its nodes (jobs.py). Pickles as the cache's and the job's names:
    a DataLoader worker or the prefetcher attaches in its own process."""

    RELOOK_S = 1.0

    def __init__(self, cache_name: str, job=None, num_samples=None, streams=None,
                 member: bool = True, score_merge=None, counted: bool = False):
        self.cache_name, self.job = cache_name, job_name(job)
        self.num_samples, self.streams = num_samples, streams
        self.member, self.score_merge = bool(member), score_merge
        # counted: this link is closed by its owner (a node's: Node.close), and its join counts
        # in this process's hold of the job until then; a link nobody closes (a sampler's own)
        # rides along (OrderBoard.join counted=False)
        self.counted = bool(counted)
        self._board = None
        self._looked = None       # (when, the node file's identity or None) of a look that found no board
        self._pid = os.getpid()
        self._closed = False

    def observer(self) -> "BoardLink":
        """A link to the same board that does not join the job (processes the node starts)."""
        return BoardLink(self.cache_name, self.job, self.num_samples, self.streams, member=False,
                         score_merge=self.score_merge)

    def get(self) -> Optional[OrderBoard]:
        """The board, or None while there is none (PermissionError when the board at its name
        is another user's: refused, never attached; BoardMismatchError when it was made for
        another number of samples or score merge rule than this node's)."""
        if self._pid != os.getpid():
            # a forked child (a DataLoader worker) attaches on its own, as an observer: it holds
            # none of its parent's jobs (jobs.py) and must not keep a job alive after its parent
            self._board, self._looked, self._pid = None, None, os.getpid()
            self.member = False
        if self._closed:
            return None
        b = self._board
        if b is not None and not b.closed and b.is_current():
            return b
        # b, if any, is no longer what the names hold: let go of it (its mapping, its descriptors
        # and this link's count of its job) once the one there now is joined (joined first: the
        # job's byte stays held across, so a job of one process is not freed in between)
        self._board = None
        try:
            return self._look(b)
        finally:
            if b is not None:
                self._drop(b)

    def _look(self, b) -> Optional[OrderBoard]:
        now, there = time.monotonic(), _file_identity(shm.board_path(self.cache_name))
        # A look that found nothing is not repeated for RELOOK_S (a join costs opens and locks),
        # unless the node's file changed since (one stat): a board made right after a sampler
        # was (in the same process, a test, a rerun) is found at once.
        if (b is None and self._looked is not None and now - self._looked[0] < self.RELOOK_S
                and self._looked[1] == there):
            return None
        self._looked = (now, there)
        try:
            if self.member and self.num_samples is not None:
                self._board = OrderBoard.join(self.cache_name, self.num_samples, self._streams(),
                                              job=self.job, score_merge=self.score_merge, make=False,
                                              counted=self.counted)
            else:
                self._board = OrderBoard.attach(self.cache_name, self.job)
        except BoardMismatchError:
            raise      # the node's composition, not the board's state: a job never runs boardless by it
        except (FileNotFoundError, ValueError):   # none yet, or one being made
            self._board = None
        return self._board

    def let_go(self) -> None:
        """This link's count of its job given back now, as close() gives it, the board kept open
        (Node.close: the prefetcher it started asks the board who still trains before it
        closes)."""
        if self._board is not None and self._pid == os.getpid():
            self._board.let_go()

    def close(self) -> None:
        """The node is done: a member link leaves its job (the job's board goes with the job's
        last process, the node's file with the last job: another node of the same job in this
        process keeps the job until it closes too); the board is closed. Later get() gives None."""
        self._closed = True
        b, self._board = self._board, None
        if b is not None and self._pid == os.getpid():
            self._drop(b)

    @staticmethod
    def _drop(board: OrderBoard) -> None:
        try:
            board.let_go()        # this link's count of the job, if it holds one
        finally:
            board.close()

    def _streams(self) -> int:
        return self.streams if self.streams is not None else local_ranks()

    def create(self, num_samples: int, streams: int, wait: float = 5.0) -> OrderBoard:
        """The job's board: the cache's board made (its files removed when the last job leaves),
        or joined once it is whole (a board being made is waited for up to `wait` seconds), or
        made anew in place of one on which no job lives (a killed job's)."""
        self.num_samples, self.streams = num_samples, streams
        if self._board is not None:
            b, self._board = self._board, None
            self._drop(b)
        self._board = OrderBoard.join(self.cache_name, num_samples, streams, job=self.job,
                                      score_merge=self.score_merge, wait=wait, counted=self.counted)
        return self._board

    def __getstate__(self):
        return {"cache_name": self.cache_name, "job": self.job, "num_samples": self.num_samples,
                "streams": self.streams, "member": self.member, "score_merge": self.score_merge}

    def __setstate__(self, state):
        # a copy in another process (a spawned DataLoader worker) is an observer: the processes
        # that compose a node are the job's members, not those the node travels to
        self.__init__(**{**state, "member": False, "counted": False})


def _file_identity(path: str):
    """(device, inode) of the file at `path`, or None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def local_ranks() -> int:
    """The ranks of this job on this node: $LOCAL_WORLD_SIZE, else 1."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(local) if local.isdigit() and int(local) >= 1 else 1
