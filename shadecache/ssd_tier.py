"""SSDTier: a node-local disk tier between the peers and the store.

    ssd = sc.SSDTier("/local/nvme/shadecache", capacity_bytes=200 << 30, cache=cache)
    ssd.get_many(ids) -> [bytes | None]      checked reads; a bad file is a miss (and removed)
    ssd.put_many(ids, values)                queued for the background writer; never blocks

One file per sample, `<dir>/<id % 256:02x>/<id>.s`: a 16-byte header (magic "SHS1", crc32c u32,
length u64) then the bytes. A file appears only whole (written to a temporary name, then
renamed), so a reader or a restart sees either nothing or a complete file; the tier survives
restarts of the job (a warm restart finds it full). Every read is checked against its length and
crc32c: a file truncated or flipped behind our back is removed and reported as a miss, so the
caller reads the store instead and nothing wrong is returned.

Writes happen off the read path, in one background thread per process, fed by a bounded queue
(when the queue is full the sample is simply not written). Over budget, the writer evicts the
samples with the lowest importance score in the cache's shared score table (`cache=`), or
in directory order without one. ENOSPC shrinks the budget to what the disk holds now; EIO (or any other
write failure) disables writes with a warning; reads go on.

Several processes of a node may use one directory: files are whole or absent, and each writer
rescans the directory's size now and then, so the budget holds approximately.
"""
import os
import queue
import struct
import threading
import time
import warnings

import numpy as np

from ._io import crc32c

_HEAD = struct.Struct("<4sIQ")
_MAGIC = b"SHS1"
_RESCAN_EVERY = 256     # writes between two rescans of the directory's size


class SSDTier:
    def __init__(self, path, capacity_bytes: int, cache=None, queue_size: int = 4096):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.path = os.fspath(path)
        os.makedirs(self.path, exist_ok=True)
        if not os.access(self.path, os.W_OK):
            raise PermissionError(f"SSD tier directory {self.path} is not writable")
        self.capacity_bytes = capacity_bytes
        self.cache = cache
        self.queue_size = queue_size
        self._setup()

    def _setup(self):
        self._pid = os.getpid()
        self._queue = queue.Queue(self.queue_size)
        self._thread = None
        self._files = None        # id -> bytes on disk, built by the writer's first scan
        self._used = 0
        self._writes_since_scan = 0
        self.disabled = None      # why writes stopped, or None
        self.counters = {"hits": 0, "misses": 0, "bytes_read": 0, "corrupt": 0, "writes": 0,
                         "bytes_written": 0, "dropped": 0, "evictions": 0, "write_errors": 0}

    def __reduce__(self):
        return (SSDTier, (self.path, self.capacity_bytes, self.cache, self.queue_size))

    def _file(self, i: int) -> str:
        return os.path.join(self.path, f"{i % 256:02x}", f"{i}.s")

    # ---- reads -------------------------------------------------------------------------------
    def get_many(self, ids) -> list:
        """bytes or None for every id; every hit verified (length and crc32c)."""
        if self._pid != os.getpid():
            self._setup()
        out = []
        c = self.counters
        for i in ids:
            i = int(i)
            path = self._file(i)
            try:
                with open(path, "rb", buffering=0) as f:
                    raw = f.read()
            except (FileNotFoundError, NotADirectoryError):
                c["misses"] += 1
                out.append(None)
                continue
            except OSError as e:     # EIO and the like: a miss, the store has it
                self._warn(f"cannot read {path}: {e}")
                c["misses"] += 1
                out.append(None)
                continue
            v = self._check(raw)
            if v is None:
                c["corrupt"] += 1
                c["misses"] += 1
                self._warn(f"SSD tier file {path} is damaged (length or crc32c); removed, the store is read instead")
                self._remove(i)
                out.append(None)
                continue
            c["hits"] += 1
            c["bytes_read"] += len(v)
            out.append(v)
        return out

    @staticmethod
    def _check(raw: bytes):
        if len(raw) < _HEAD.size:
            return None
        magic, crc, n = _HEAD.unpack_from(raw)
        if magic != _MAGIC or n != len(raw) - _HEAD.size:
            return None
        v = raw[_HEAD.size:]
        return v if crc32c(v) == crc else None

    # ---- writes (background) -----------------------------------------------------------------
    def put_many(self, ids, values) -> None:
        """Queues the samples to be written; returns at once (a full queue drops them)."""
        if self._pid != os.getpid():
            self._setup()
        if self.disabled is not None or self.capacity_bytes == 0:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="shadecache-ssd-writer", daemon=True)
            self._thread.start()
        for i, v in zip(ids, values):
            try:
                self._queue.put_nowait((int(i), bytes(v)))
            except queue.Full:
                self.counters["dropped"] += 1

    def flush(self, timeout: float = 30.0) -> None:
        """Waits until everything queued so far is written (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def _writer(self):
        while True:
            i, v = self._queue.get()
            try:
                if self.disabled is None:
                    self._write(i, v)
            except Exception as e:   # keep the thread alive; the sample is simply not kept
                self._disable(f"unexpected error writing sample {i}: {e!r}")
            finally:
                self._queue.task_done()

    def _scan(self):
        files = {}
        for sub in os.scandir(self.path):
            if not sub.is_dir():
                continue
            for e in os.scandir(sub.path):
                if e.name.endswith(".s"):
                    try:
                        files[int(e.name[:-2])] = e.stat().st_size
                    except (ValueError, OSError):
                        pass
        self._files = files
        self._used = sum(files.values())
        self._writes_since_scan = 0

    def _write(self, i: int, v: bytes):
        if self._files is None or self._writes_since_scan >= _RESCAN_EVERY:
            self._scan()
        if i in self._files:
            return
        size = _HEAD.size + len(v)
        if size > self.capacity_bytes:
            return
        if self._used + size > self.capacity_bytes and not self._evict(self._used + size - self.capacity_bytes, i):
            return
        path = self._file(i)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_HEAD.pack(_MAGIC, crc32c(v), len(v)))
                f.write(v)
            os.rename(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self.counters["write_errors"] += 1
            if e.errno == 28:   # ENOSPC: the disk holds less than the budget said
                self.capacity_bytes = self._used
                self._warn(f"SSD tier {self.path}: disk full; budget shrunk to {self._used} bytes")
            else:
                self._disable(f"SSD tier {self.path}: write failed ({e}); writes disabled")
            return
        self._files[i] = size
        self._used += size
        self._writes_since_scan += 1
        self.counters["writes"] += 1
        self.counters["bytes_written"] += len(v)

    def _evict(self, need: int, incoming: int) -> bool:
        """Frees at least `need` bytes, lowest score first; False when the newcomer scores no
        higher than what it would displace (the cache's admission rule)."""
        ids = np.fromiter(self._files.keys(), dtype=np.int64, count=len(self._files))
        if self.cache is not None:
            scores = self.cache.scores()
            order = np.argsort(scores[ids], kind="stable")
            if scores[incoming] <= scores[ids[order[0]]]:
                return False
        else:   # no scores: in directory order (arbitrary but cheap)
            order = np.arange(ids.size)
        freed = 0
        for k in order.tolist():
            if freed >= need:
                break
            i = int(ids[k])
            freed += self._files.get(i, 0)
            self._remove(i)
            self.counters["evictions"] += 1
        return freed >= need

    def _remove(self, i: int):
        try:
            os.unlink(self._file(i))
        except OSError:
            pass
        if self._files is not None:
            self._used -= self._files.pop(i, 0)

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
        if self._files is None:
            self._scan()
        d = dict(self.counters)
        d.update(items=len(self._files), bytes_used=self._used, capacity_bytes=self.capacity_bytes,
                 disabled=self.disabled, path=self.path)
        return d

    def __repr__(self):
        return f"SSDTier({self.path!r}, capacity_bytes={self.capacity_bytes})"
