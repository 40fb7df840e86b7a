"""SSDTier: a node-local disk tier between the peers and the store.

    ssd = sc.SSDTier("/local/nvme/shadecache", capacity_bytes=200 << 30, cache=cache)
    ssd.bind(store.fingerprint)              # CachedDataset and the peer server do this for you
    ssd.get_many(ids) -> [bytes | None]      checked reads; a bad value is a miss (and removed)
    ssd.put_many(ids, values)                queued for the background writer; never blocks

Packed layout (shadecache/ssd/layout.py): values in a few large slot files, one per size class,
read by offset; an index (id -> slot file, offset, length, crc32c) kept in memory by every
process and persisted as an append-only journal, so that a restarted job replays it and finds
the tier full (warm restart), and the processes of a node that share the directory see each
other's writes. Every read is checked against the crc32c the index recorded (the store's own
checksum of the value): a value torn by a SIGKILL, truncated or flipped behind our back is
removed and reported as a miss, so the caller reads the store instead and nothing wrong is
returned; a torn journal entry is dropped on replay.

Reads are one native batch without the GIL (csrc/io/tier_reader.h): the index gives each id's
descriptor, offset, length and crc32c (numpy, no per-sample Python), then the values are read by
offset through io_uring (the pread pool where io_uring is refused), all in one batch, values of one
file at most `gap_bytes` apart in one read, checked as they complete: the packed store's
read_many cost. Writes happen off the read path, in one background thread per process, fed by a
bounded queue of batches (at most `queue_size` values and `queue_bytes` bytes queued; what does
not fit is simply not written). A batch's values go into neighbouring slots in the order given,
written with one pwrite per run of slots, so that the samples of one store extent, offered
together in disk order (the tier chain does), come back in one read. put_many itself does no
per-sample work for what the writer would refuse anyway: ids the tier holds, and, when the tier
has no room left, ids that score no higher than the lowest score it holds (checked as arrays). `capacity_bytes` bounds the bytes of the slots held (a value takes
ssd_layout.slot_bytes(len) bytes: at most 12.5% more than its length). Over budget, the writer
evicts the samples with the lowest importance score in the cache's shared score table
(`cache=`), or in id order without one, and admits a newcomer only when it scores higher than
what it displaces; freed slots are reused by later values of their size class. ENOSPC shrinks
the budget to what the slot files hold on disk now, and for a minute only values that find a slot
of their size class already on disk are written (nothing is evicted for a value that cannot be); EIO (or any other write failure) disables writes with a
warning; reads go on.

The directory and its files belong to the user (node_files.py): a directory that another user
owns, or that group or others may write, is refused with PermissionError naming the owner or the
mode (another user could plant values, or links that make the tier write into the victim's
files); one that does not exist is made 0700, its files 0600, opened with O_NOFOLLOW.

A tier directory belongs to one data set: `bind(fingerprint)` (the store's `fingerprint`; a
cache created with `fingerprint=` passes its own) records it in `<dir>/fingerprint` the first
time and refuses another data set afterwards with FingerprintError, so that a job over another
store (or a rebuilt one) never reads the old store's bytes by id. CachedDataset binds its SSD
tier to its store; so does the peer server when it is given a store.
"""
import errno
import os
import queue
import threading
import time
import warnings

import numpy as np

from .. import _io, node_files
from .._io import crc32c
from ..errors import FingerprintError
from .layout import MAX_ID, REMOVED, Layout, entry, slot_bytes, slot_bytes_of

_BATCH = 256     # values the writer gathers from its queue before a round
_ROUND = 1024    # values written per journal append at most (the locks are held for one round)
_DISK_FULL_RETRY = 60.0   # seconds after ENOSPC before a slot file is grown again


class SSDTier:
    def __init__(self, path, capacity_bytes: int, cache=None, queue_size: int = 65536, queue_depth: int = 64,
                 fingerprint=None, queue_bytes: int = 64 << 20, gap_bytes: int = 32 << 10):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        # "dir/" and "dir/." are "dir": a link there is refused, never followed (node_files).
        self.path = node_files.directory_path(path, "SSD tier directory")
        # Made 0700 when missing; refused when another user owns it or may write it (node_files).
        os.close(node_files.own_directory(self.path, "SSD tier directory"))
        if not os.access(self.path, os.W_OK):
            raise PermissionError(f"SSD tier directory {self.path} is not writable")
        self.capacity_bytes = capacity_bytes
        self.cache = cache
        if any(e.is_dir() and len(e.name) == 2 and all(ch in "0123456789abcdef" for ch in e.name)
               for e in os.scandir(self.path)):
            warnings.warn(f"shadecache: SSD tier {self.path} holds directories of the old "
                          "one-file-per-sample layout; they are ignored (remove them to free the disk)",
                          RuntimeWarning, stacklevel=2)
        for name, v in (("queue_size", queue_size), ("queue_bytes", queue_bytes), ("gap_bytes", gap_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        self.queue_size = queue_size
        self.queue_bytes = queue_bytes
        self.gap_bytes = gap_bytes
        self.queue_depth_io = int(queue_depth)
        self._layout = None
        self._setup()
        self.fingerprint = None
        if fingerprint is None and cache is not None:
            fingerprint = getattr(cache, "fingerprint", None) or None
        if fingerprint is not None:
            self.bind(fingerprint)

    slot_bytes = staticmethod(slot_bytes)
    lengths = None   # the tier protocol (store/protocol.py): no sample's length is known unread

    def _setup(self):
        if self._layout is not None:   # a forked child: the parent's descriptors are not ours
            self._layout.close()
        self._pid = os.getpid()
        self._mu = threading.Lock()    # the index arrays (Layout's do_* methods)
        self._layout = Layout(self.path)
        self._reader = None            # _io.TierReader, made in the process that reads
        self._queue = queue.Queue()    # batches [(id, bytes)]; bounded by _queued (values, bytes)
        self._qmu = threading.Lock()   # _queued
        self._queued = [0, 0]          # values and bytes queued, not yet written
        self._floor = (-1.0, None)     # (monotonic time, lowest score held) of the last look
        self._thread = None
        self.disabled = None           # why writes stopped, or None
        self._disk_full = 0.0          # until when (monotonic) no slot file is grown: ENOSPC
        self.counters = {"hits": 0, "misses": 0, "bytes_read": 0, "read_ns": 0, "calls": 0, "corrupt": 0, "writes": 0,
                         "bytes_written": 0, "dropped": 0, "evictions": 0, "write_errors": 0}

    def __reduce__(self):
        return (SSDTier, (self.path, self.capacity_bytes, self.cache, self.queue_size, self.queue_depth_io,
                          self.fingerprint, self.queue_bytes, self.gap_bytes))

    def bind_store(self, store) -> None:
        """bind(store.fingerprint) when the store has one (a store without one binds nothing):
        what CachedDataset and the peer server do with the store they read behind this tier."""
        fp = getattr(store, "fingerprint", None)
        if fp:
            self.bind(fp)

    def bind(self, fingerprint: str) -> None:
        """Makes the directory the tier of the data set `fingerprint` (a store's `fingerprint`):
        recorded on first use; FingerprintError when the directory already belongs to another
        data set, or holds samples of an unrecorded one (nothing is removed: the user decides)."""
        if not isinstance(fingerprint, str) or not fingerprint or "\0" in fingerprint or len(fingerprint) > 256:
            raise ValueError(f"fingerprint must be a non-empty str of at most 256 characters without "
                             f"NUL, got {fingerprint!r}")
        self._mine()
        lay = self._layout
        with lay.locked(), self._mu:   # file lock before mu, as the writer takes them
            try:
                fd = node_files.open_file("fingerprint", os.O_RDONLY, "SSD tier file", dir_fd=lay.dir_fd,
                                          tighten=True)
                with open(fd, "r", encoding="utf-8", errors="replace") as f:
                    found = f.read(4096).strip()
            except FileNotFoundError:
                found = None
            if found is not None and found != fingerprint:
                raise FingerprintError(
                    f"SSD tier {self.path} holds samples of data set {found or '(empty record)'}, "
                    f"not {fingerprint}: use another directory for this data set, or remove that one")
            if found is None:
                lay.do_catch_up(force=True)
                if lay.items:
                    raise FingerprintError(
                        f"SSD tier {self.path} holds {lay.items} samples of an unrecorded data set, "
                        f"not known to be {fingerprint}: use another directory, or remove that one")
                node_files.replace(self.path, "fingerprint", (fingerprint + "\n").encode(), "SSD tier file",
                                   dir_fd=lay.dir_fd, sync=True)
        self.fingerprint = fingerprint

    def _mine(self):
        if self._pid != os.getpid() or self._layout is None:   # forked, or closed
            self._setup()

    def ids(self) -> np.ndarray:
        """The ids the tier holds now (sorted)."""
        self._mine()
        with self._mu:
            self._layout.do_catch_up()
            return np.flatnonzero(self._layout.size >= 0)

    def holds(self, ids) -> np.ndarray:
        """Bool mask: which of `ids` the tier holds now, by its index (nothing is read or checked;
        a held value may still turn out damaged when read)."""
        self._mine()
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        with self._mu:
            self._layout.do_catch_up()
            size = self._layout.size
            inside = (ids >= 0) & (ids < size.size)
            out = np.zeros(ids.size, dtype=bool)
            out[inside] = size[ids[inside]] >= 0
            return out

    # ---- reads -------------------------------------------------------------------------------
    def get_many(self, ids) -> list:
        """bytes or None for every id; every hit verified (length and crc32c). The index gives
        where each value is; one native batch reads and checks them all without the GIL."""
        self._mine()
        if self._reader is None:
            self._reader = _io.TierReader("auto", self.queue_depth_io, self.gap_bytes)
        t0 = time.perf_counter_ns()
        lay = self._layout
        with self._mu:
            lay.do_catch_up()
            cols = (lay.fdv, lay.off, lay.length, lay.crc)
        # The columns are read without mu: a row the writer changes meanwhile can only fail its
        # crc32c (then _damaged reads it again before it calls it damaged), never pass wrongly.
        values, status, errs, hits, nbytes, bad = self._reader.read_many(ids, *cols)
        c = self.counters
        c["read_ns"] += time.perf_counter_ns() - t0
        c["calls"] += 1
        c["hits"] += hits
        c["misses"] += len(values) - hits
        c["bytes_read"] += nbytes
        if bad:
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)
            for k in np.flatnonzero(status >= 2).tolist():
                i = int(ids[k])
                if status[k] == 2:
                    self._damaged(i)
                else:   # EIO and the like: a miss, the store has it
                    self._warn(f"cannot read sample {i} from {lay.file_of(int(lay.size[i]))}: "
                               f"{os.strerror(int(errs[k]))}")
        return values

    read_many = get_many   # the tier protocol's batched read (shadecache/store/protocol.py)

    def _damaged(self, i: int):
        """Value i did not match its crc32c (or was short). Read again with the index held still
        (file lock: no process writes; mu: no thread of ours): if it fails again it is damaged
        and removed; if not, its slot was reused under the first read's feet (a plain miss)."""
        lay = self._layout
        with lay.locked(), self._mu:
            lay.do_catch_up(force=True)
            status = self._reader.read_many([i], lay.fdv, lay.off, lay.length, lay.crc)[1]
            if status is not None and status[0] == 2:   # None: nothing failed (read or missing)
                s = int(lay.size[i])
                self.counters["corrupt"] += 1
                self._warn(f"SSD tier value of sample {i} in {lay.file_of(s)} is damaged "
                           "(length or crc32c); removed, the store is read instead")
                lay.append([entry(i, s, int(lay.slot[i]), REMOVED, 0)])

    # ---- writes (background) -----------------------------------------------------------------
    def put_many(self, ids, values) -> None:
        """Queues the samples to be written, in this order (neighbouring slots); returns at once.
        Left out without per-sample work: ids the tier holds, ids past MAX_ID, and, when the tier
        has no room for them, those that score no higher than the lowest score it holds (the
        writer would refuse them); what does not fit the queue is dropped (counted)."""
        self._mine()
        if self.disabled is not None or self.capacity_bytes == 0:
            return
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size != len(values):
            raise ValueError(f"put_many got {ids.size} ids but {len(values)} values")
        if not ids.size:
            return
        keep = self._worth_writing(ids, values)
        if not keep.any():
            return
        pos = np.flatnonzero(keep).tolist()
        batch, nbytes = [], 0
        with self._qmu:
            room_values = self.queue_size - self._queued[0]
            room_bytes = self.queue_bytes - self._queued[1]
            for k in pos:
                v = values[k]
                if len(batch) >= room_values or nbytes + len(v) > room_bytes:
                    break
                batch.append((int(ids[k]), bytes(v)))
                nbytes += len(v)
            self._queued[0] += len(batch)
            self._queued[1] += nbytes
        self.counters["dropped"] += len(pos) - len(batch)
        if batch:
            if self._thread is None:
                self._thread = threading.Thread(target=self._writer, name="shadecache-ssd-writer", daemon=True)
                self._thread.start()
            self._queue.put(batch)

    def _worth_writing(self, ids: np.ndarray, values) -> np.ndarray:
        """Bool mask of the ids the writer could admit: not held, in range, and, past the room the
        budget has left (queued bytes counted as taken), scoring above the lowest held score (the
        writer's own rule, _admit; that floor is looked up at most every 0.2 s)."""
        size = self._layout.size   # read without mu: a stale answer only costs the writer a look
        keep = (ids >= 0) & (ids <= MAX_ID)
        inside = keep & (ids < size.size)
        keep[inside] &= size[ids[inside]] < 0
        if not keep.any():
            return keep
        scores = self.cache.scores() if self.cache is not None else None
        if scores is None:
            return keep
        room = self.capacity_bytes - self._layout.used - self._queued[1]
        slots = slot_bytes_of(np.fromiter(map(len, (values[k] for k in np.flatnonzero(keep).tolist())),
                                          np.int64))
        fits = np.cumsum(slots) <= room
        if fits.all():
            return keep
        floor = self._lowest_held(scores)
        if floor is None:
            return keep
        pos = np.flatnonzero(keep)
        rest = pos[~fits]
        inrange = ids[rest] < scores.size
        keep[rest] = inrange & (scores[np.minimum(ids[rest], scores.size - 1)] > floor)
        return keep

    def _lowest_held(self, scores):
        t, floor = self._floor
        now = time.monotonic()
        if now - t < 0.2:
            return floor
        size = self._layout.size
        held = np.flatnonzero(size[:scores.size] >= 0)
        floor = float(scores[held].min()) if held.size else None
        self._floor = (now, floor)
        return floor

    def flush(self, timeout: float = 30.0) -> None:
        """Waits until everything queued so far is written (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queued[0] and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self, timeout: float = 30.0) -> None:
        """Writes what is queued (up to `timeout` seconds), stops the writer thread and closes
        the tier's files. The tier stays on disk for the next job; using this object again
        reopens it."""
        if self._pid != os.getpid():   # a forked copy: the parent's files and thread are not ours
            return
        if self._thread is not None:
            self.flush(timeout)
            self._queue.put(None)       # the writer's signal to end (after what is queued)
            self._thread.join(timeout)
            self._thread = None
        self._reader = None
        if self._layout is not None:
            self._layout.close()
            self._layout = None             # the next use opens the tier again (_mine)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _writer(self):
        while True:
            item = self._queue.get()
            if item is None:   # close()
                return
            batch, stop = list(item), False
            while len(batch) < _BATCH:   # more rounds in one journal append
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:   # close() right behind: write this batch, then end
                    stop = True
                    break
                batch.extend(item)
            try:
                # rounds of at most _ROUND values: the file lock and mu are held for one round
                for at in range(0, len(batch), _ROUND):
                    if self.disabled is None:
                        self._write(batch[at:at + _ROUND])
            except Exception as e:   # keep the thread alive; the samples are simply not kept
                self._disable(f"SSD tier {self.path}: unexpected error writing: {e!r}; writes disabled")
            finally:
                with self._qmu:
                    self._queued[0] -= len(batch)
                    self._queued[1] -= sum(len(v) for _, v in batch)
            if stop:
                return

    def _write(self, batch):
        """One journal round: under the file lock, evictions (remove entries appended first),
        then every value into its slot (a run of neighbouring slots in one pwrite), then their
        put entries in one append."""
        lay = self._layout
        with lay.locked(), self._mu:
            lay.do_open_journal()
            plan, seen = [], set()
            for i, v in batch:
                if i > MAX_ID or i in seen or (i < lay.size.size and lay.size[i] >= 0):
                    continue
                seen.add(i)
                plan.append((i, v, slot_bytes(len(v))))
            if self._disk_full > time.monotonic():
                # The disk had no room: only values that find a slot of their class already on
                # disk are written (no eviction for a value that would fail to grow its file).
                room, kept = {}, []
                for i, v, s in plan:   # one look (an fstat) per size class, not per value
                    if s not in room:
                        room[s] = lay.spare(s)
                    if room[s] > 0:
                        kept.append((i, v, s))
                    room[s] -= 1
                plan = kept
            plan = self._admit(plan)
            slotted, failed = [], None
            for i, v, s in plan:
                try:
                    slotted.append((i, v, s, lay.take_slot(s)))
                except OSError as e:
                    failed = e
                    break
            written = self._write_runs(lay, slotted)
            if len(written) < len(slotted):
                for _, _, s, k in slotted[len(written):]:
                    lay.give_back(s, k)
                failed = failed or self._run_error
            puts = [entry(i, s, k, len(v), crc32c(v)) for i, v, s, k in written]
            try:
                lay.append(puts)
            except OSError as e:   # no put entry kept: the slots are free again
                for _, _, s, k in written:
                    lay.give_back(s, k)
                failed, written = e, []
            self.counters["writes"] += len(written)
            self.counters["bytes_written"] += sum(len(v) for _, v, _, _ in written)
            if failed is not None:   # after the append: a shrunk budget counts what was written
                self._write_failed(failed)
            lay.compact_if_needed()

    _run_error = None

    def _write_runs(self, lay, slotted) -> list:
        """Writes each value into its slot: a run of neighbouring slots of one file as one pwrite
        (the slots' slack zero-filled). Returns the prefix of `slotted` written; the first failure
        is kept in _run_error."""
        self._run_error = None
        done, j = 0, 0
        while j < len(slotted):
            s, k0 = slotted[j][2], slotted[j][3]
            e = j + 1
            while e < len(slotted) and e - j < 2048 and slotted[e][2] == s and slotted[e][3] == k0 + (e - j):
                e += 1
            if e - j == 1:
                buf = slotted[j][1]
            else:
                buf = bytearray((e - j) * s)
                for r in range(j, e):
                    v = slotted[r][1]
                    at = (r - j) * s
                    buf[at:at + len(v)] = v
            try:
                if os.pwrite(lay.fd(s), buf, k0 * s) != len(buf):
                    raise OSError(errno.EIO, "short write")
            except OSError as err:
                self._run_error = err
                return slotted[:done]
            done = j = e
        return slotted[:done]

    def _admit(self, plan):
        """The planned values that fit the budget, after evicting (lowest score first) what they
        displace; a newcomer that scores no higher than the lowest held is not admitted. Remove
        entries are appended here, before any slot is reused. File lock and mu held."""
        lay = self._layout
        need = lay.used + sum(s for _, _, s in plan) - self.capacity_bytes
        if need <= 0:
            return plan
        held = np.flatnonzero(lay.size >= 0)
        scores = self.cache.scores() if self.cache is not None else None
        order = held[np.argsort(scores[held], kind="stable")] if scores is not None else held
        p, used, keep, removes = 0, lay.used, [], []
        for i, v, s in plan:
            if s > self.capacity_bytes:
                continue
            freed = []
            while used + s > self.capacity_bytes and p < order.size:
                victim = int(order[p])
                if scores is not None and (i >= scores.size or scores[i] <= scores[victim]):
                    break
                p += 1
                freed.append(victim)
                used -= int(lay.size[victim])
            if used + s > self.capacity_bytes:
                p -= len(freed)               # not admitted: its victims stay
                used += sum(int(lay.size[j]) for j in freed)
                continue
            removes += [entry(j, int(lay.size[j]), int(lay.slot[j]), REMOVED, 0) for j in freed]
            self.counters["evictions"] += len(freed)
            used += s
            keep.append((i, v, s))
        lay.append(removes)
        return keep

    def _write_failed(self, e: OSError):
        self.counters["write_errors"] += 1
        if e.errno == errno.ENOSPC:   # the disk holds less than the budget said
            # What the slot files hold on disk stays ours (freed slots are reused, not given
            # back): the budget shrinks to that, never below, so that failures do not ratchet
            # it down; for a minute only slots already on disk are used (see _write).
            self._disk_full = time.monotonic() + _DISK_FULL_RETRY
            self.capacity_bytes = min(self.capacity_bytes, max(self._layout.used, self._layout.allocated()))
            self._warn(f"SSD tier {self.path}: disk full; budget shrunk to {self.capacity_bytes} bytes")
        else:
            self._disable(f"SSD tier {self.path}: write failed ({e}); writes disabled")

    def _disable(self, why: str):
        self.disabled = why
        self._warn(why)

    _warned = set()

    def _warn(self, msg: str):
        key = msg.split(":")[0]
        if key not in SSDTier._warned:
            SSDTier._warned.add(key)
            warnings.warn(f"shadecache: {msg}", RuntimeWarning, stacklevel=3)

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> dict:
        self._mine()
        with self._mu:
            self._layout.do_catch_up()
            items, used, torn = self._layout.items, self._layout.used, self._layout.torn
        d = dict(self.counters)
        d["mean_get_seconds"] = d["read_ns"] / d["calls"] / 1e9 if d["calls"] else 0.0
        # reads this process issued (values of one file at most gap_bytes apart: one read)
        d["read_requests"] = self._reader.requests if self._reader is not None else 0
        d.update(items=items, bytes_used=used, capacity_bytes=self.capacity_bytes, torn_entries=torn,
                 disabled=self.disabled, path=self.path)
        return d

    def __repr__(self):
        return f"SSDTier({self.path!r}, capacity_bytes={self.capacity_bytes})"
