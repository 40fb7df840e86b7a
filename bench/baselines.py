"""The alternatives a user would pick instead of shadecache's Cache, set up outside any timed region.

Each store is filled from a `workload.ValueSet`, can `verify` a sample of ids against it (outside
the timed region, so a fast-but-wrong baseline is caught), and owns what it creates: `close()`
(also run by `with`) unlinks shared memory, stops servers and removes temporary directories,
whatever happened before.

The `*_loop` functions are the timed loops, written as tightly as a user would write them: the
methods they call are bound to locals first, the keys are prepared beforehand, and every get
makes a `bytes` copy, as `Cache.get` does.
"""
import itertools
import os
import resource
import shutil
import subprocess
import tempfile
import time
from multiprocessing import shared_memory

from tqdm import tqdm


_shm_serial = itertools.count()


def _progress(total, desc, unit="B"):
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=False, mininterval=0.5)


# --------------------------------------------------------------------------------------------
# multiprocessing.shared_memory + a dict index
# --------------------------------------------------------------------------------------------
class _Closing:
    """`with store:` closes it: every baseline store releases what it made (shm, dirs, servers)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ShmDictStore(_Closing):
    """Values packed back to back in one POSIX shared-memory block; a dict maps id -> (start, end).

    No eviction, no locking, no checking: it sits near the copy limit of a Python-level get.
    """

    def __init__(self, values, name=None):
        self.values = values
        if name is None:  # a recognisable name, so a leak is easy to attribute
            name = f"shadecache-bench-shm-{os.getpid()}-{next(_shm_serial)}"
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=max(values.total_bytes, 1))
        try:
            self.buf = self.shm.buf
            self.index = {}
            with _progress(values.total_bytes, f"shm+dict fill {values.size} B") as bar:
                for ids, vals in values.chunks():
                    for i, v in zip(ids, vals):
                        start = i * values.size
                        self.buf[start:start + len(v)] = v
                        self.index[i] = (start, start + len(v))
                    bar.update(len(ids) * values.size)
        except BaseException:
            self.close()
            raise

    def verify(self, ids):
        for i in ids:
            start, end = self.index[i]
            self.values.check_value(i, bytes(self.buf[start:end]))

    def close(self):
        shm, self.shm = getattr(self, "shm", None), None
        if shm is None:
            return
        self.buf = None
        try:
            shm.close()
        finally:
            shm.unlink()


def shm_dict_get_loop(buf, index, ids):
    # memoryview.tobytes() measured ~10% faster here than bytes(view) for 3 KB values.
    for i in ids:
        start, end = index[i]
        buf[start:end].tobytes()


def plain_copy_loop(buf, offsets, size):
    """A plain Python-level bytes copy of `size` bytes at each offset of a shm mapping: no index, no
    checks, only the copy (and a memoryview slice). The reference a get is held against."""
    for o in offsets:
        buf[o:o + size].tobytes()


# --------------------------------------------------------------------------------------------
# LMDB, one read transaction per get
# --------------------------------------------------------------------------------------------
def lmdb_key(i):
    """Big-endian 8-byte keys sort in id order, so the fill can append."""
    return i.to_bytes(8, "big")


class LmdbStore(_Closing):
    """An LMDB environment in a temporary directory, read the way a Dataset over LMDB reads it.

    By default the read side is opened as the common ImageNet-over-LMDB loaders open it
    (readonly, lock=False, readahead=False), the fastest per-item read path py-lmdb offers;
    `reopen(lock=True)` gives LMDB's default reader-table locking. `lmdb_get_loop` opens one
    read transaction per item and copies the value out.
    """

    def __init__(self, values, lock=False):
        import lmdb

        self.values = values
        # On disk, as a data set is, read through a warm page cache. (On tmpfs LMDB measured
        # ~20% slower here: its mapping takes many more minor faults.)
        self.dir = tempfile.mkdtemp(prefix="shadecache-bench-lmdb-")
        self.env = None
        try:
            self.map_size = int(values.total_bytes * 1.6) + (64 << 20)
            writer = lmdb.open(self.dir, map_size=self.map_size, sync=False, metasync=False,
                               writemap=True, map_async=True)
            try:
                with _progress(values.total_bytes, f"lmdb fill {values.size} B") as bar:
                    for ids, vals in values.chunks(16384):
                        with writer.begin(write=True) as txn:
                            for i, v in zip(ids, vals):
                                txn.put(lmdb_key(i), v, append=True)
                        bar.update(len(ids) * values.size)
            finally:
                writer.close()
            self.reopen(lock)
        except BaseException:
            self.close()
            raise

    def reopen(self, lock):
        """Reopen the read side with (lock=True, LMDB's default) or without reader-table locking.

        py-lmdb allows one open environment per path and process, hence a reopen rather than
        two environments side by side.
        """
        import lmdb

        if self.env is not None:
            self.env.close()
            self.env = None
        self.lock = lock
        self.env = lmdb.open(self.dir, readonly=True, lock=lock, readahead=False,
                             map_size=self.map_size)

    def warm(self):
        """Reads the data file through, so every get is served from the page cache."""
        with open(os.path.join(self.dir, "data.mdb"), "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass

    def timed_gets(self, keys, attempts=3):
        """Seconds of one `lmdb_get_loop` over `keys`, served from the page cache.

        Another process on a shared machine may drop the page cache (`echo 3 >
        /proc/sys/vm/drop_caches`); gets then read the disk (this once gave 3k gets/s mid-run). A
        loop that took major faults is thrown away, the file warmed again and the loop rerun.
        """
        for _ in range(attempts):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            t0 = time.perf_counter()
            lmdb_get_loop(self.env, keys)
            dt = time.perf_counter() - t0
            if resource.getrusage(resource.RUSAGE_SELF).ru_majflt == before:
                return dt
            self.warm()
        raise RuntimeError(f"LMDB gets in {self.dir} kept reading the disk after {attempts} warm-ups: "
                           "something keeps dropping the page cache")

    def verify(self, ids):
        for i in ids:
            with self.env.begin() as txn:
                self.values.check_value(i, txn.get(lmdb_key(i)))

    def close(self):
        env, self.env = getattr(self, "env", None), None
        try:
            if env is not None:
                env.close()
        finally:
            if getattr(self, "dir", None):
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = None


def lmdb_get_loop(env, keys):
    # begin().get(): one read transaction per item, aborted when the transaction object dies
    # right after the get; py-lmdb returns a bytes copy (buffers=False).
    begin = env.begin
    for k in keys:
        begin().get(k)


# --------------------------------------------------------------------------------------------
# Redis, MGET of a whole batch, hiredis parser, unix socket
# --------------------------------------------------------------------------------------------
class RedisUnavailable(RuntimeError):
    """redis-server, redis-py or hiredis is missing; the message says which."""


def redis_key(i):
    return b"s:%d" % i


class RedisStore(_Closing):
    """A real redis-server started on a unix socket in a temporary directory, no persistence.

    Raises RedisUnavailable (with the reason) when redis-server, redis-py or the hiredis
    parser is absent; the caller reports that as a skip.
    """

    def __init__(self, values, server="redis-server"):
        self.values = values
        self.dir = None
        self.proc = None
        self.client = None
        binary = shutil.which(server)
        if binary is None:
            raise RedisUnavailable(f"{server!r} is not on PATH; install redis-server to run the "
                                   "Redis MGET comparison")
        try:
            import redis
            from redis.utils import HIREDIS_AVAILABLE
        except ImportError as exc:
            raise RedisUnavailable(f"redis-py is not installed ({exc})") from exc
        if not HIREDIS_AVAILABLE:
            raise RedisUnavailable("the hiredis parser is not installed (pip install hiredis)")
        try:
            self.dir = tempfile.mkdtemp(prefix="shadecache-bench-redis-")
            self.socket = os.path.join(self.dir, "redis.sock")
            self.proc = subprocess.Popen(
                [binary, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
                 "--save", "", "--appendonly", "no", "--dir", self.dir, "--daemonize", "no",
                 "--loglevel", "warning", "--logfile", os.path.join(self.dir, "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.client = redis.Redis(unix_socket_path=self.socket)
            self._wait_ready()
            pool = self.client.connection_pool
            conn = pool.get_connection()
            try:
                parser = type(conn._parser).__name__
            finally:
                pool.release(conn)
            self.parser = parser
            if "Hiredis" not in parser:
                raise RedisUnavailable(f"redis-py chose the {parser} parser, not hiredis")
            self._fill()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout=20.0):
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with status {self.proc.returncode} at "
                                   f"start; see its log in {self.dir}")
            if os.path.exists(self.socket):
                try:
                    if self.client.ping():
                        return
                except Exception:  # not accepting yet
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer on {self.socket} "
                                   f"within {timeout} s")
            time.sleep(0.02)

    def _fill(self):
        with _progress(self.values.total_bytes, f"redis fill {self.values.size} B") as bar:
            for ids, vals in self.values.chunks(1024):
                self.client.mset({redis_key(i): v for i, v in zip(ids, vals)})
                bar.update(len(ids) * self.values.size)
        have = self.client.dbsize()
        if have != self.values.n:
            raise RuntimeError(f"redis holds {have} keys after the fill, expected {self.values.n}")

    def verify(self, ids):
        got = self.client.mget([redis_key(i) for i in ids])
        for i, v in zip(ids, got):
            self.values.check_value(i, v)

    def close(self):
        client, self.client = self.client, None
        proc, self.proc = self.proc, None
        try:
            if client is not None:
                client.close()
        finally:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if self.dir:
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = None


def redis_mget_loop(client, key_batches):
    # execute_command("MGET", *keys) skips redis-py's argument massaging in mget(); it measured
    # ~15% faster, so it is the stronger baseline.
    execute = client.execute_command
    for keys in key_batches:
        execute("MGET", *keys)
