"""Bad input: each case is a clear exception naming what was wrong, and nothing cached is lost."""
import contextlib
import shutil
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest

import shadecache as sc
from shadecache import _core

MiB = 1 << 20


@pytest.fixture
def filled(cache_name):
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=2 * MiB, max_item_bytes=64 << 10) as c:
        for i in range(50):
            c.put(i, bytes([i]) * 1000, score=float(i))
        yield c
        # Whatever the test did, everything put before it is still there and intact.
        assert [c.get(i) for i in range(50)] == [bytes([i]) * 1000 for i in range(50)]
        c.check()


def test_ids_out_of_range(filled):
    for bad in (100, 10**12, -1):
        with pytest.raises(IndexError, match=f"sample id {bad}"):
            filled.get(bad)
    with pytest.raises(IndexError, match="sample id 100 is out of range.*num_samples=100"):
        filled.put(100, b"x")
    with pytest.raises(IndexError, match="-5"):
        filled.get_many([1, 2, -5])
    # A batch with one bad id changes nothing: validation happens before the lock.
    with pytest.raises(IndexError, match="sample id 100"):
        filled.put_many([60, 100], [b"a", b"b"])
    assert not filled.contains(60)
    with pytest.raises(IndexError, match="sample id 100"):
        filled.update_scores([1, 100], [9.0, 9.0])
    assert filled.scores()[1] == 1.0


def test_values_too_large(filled):
    with pytest.raises(sc.ValueTooLargeError, match="sample id 3 is 70000 bytes.*at most 65536"):
        filled.put(3, b"z" * 70_000)
    with pytest.raises(ValueError):  # ValueTooLargeError is a ValueError
        filled.put_many([70, 71], [b"ok", b"z" * 200_000])
    assert not filled.contains(70)


def test_value_larger_than_whole_cache(cache_name):
    # max_item_bytes above what the cache can hold: the cache's own limit is the one in force, and
    # a value beyond it is refused with the capacity named.
    with sc.Cache.create(cache_name, num_samples=10, capacity_bytes=MiB, max_item_bytes=4 * MiB) as c:
        assert c.max_item_bytes < MiB
        with pytest.raises(sc.ValueTooLargeError, match="more than the capacity"):
            c.put(1, b"x" * (2 * MiB))
        assert c.put(1, b"x" * c.max_item_bytes) and len(c.get(1)) == c.max_item_bytes
        c.check()


def test_capacity_too_small_for_the_index_names_the_least(cache_name):
    with pytest.raises(ValueError, match=r"too small for num_samples=200000.*the minimum is capacity_bytes=(\d+)") as e:
        sc.Cache.create(cache_name, num_samples=200_000, capacity_bytes=MiB)
    least = int(e.value.args[0].rsplit("=", 1)[1])
    assert 200_000 * 12 < least < 200_000 * 12 + MiB
    with sc.Cache.create(cache_name, num_samples=200_000, capacity_bytes=least) as c:
        assert c.put(7, b"fits") and c.get(7) == b"fits"
        c.check()


def test_wrong_types(filled):
    with pytest.raises(TypeError):
        filled.get("3")
    with pytest.raises(TypeError, match="bytes-like"):
        filled.put(3, "a str is not bytes")
    with pytest.raises(TypeError, match="bytes-like.*int"):
        filled.put_many([60, 61], [b"ok", 5])
    assert not filled.contains(60)
    with pytest.raises(TypeError, match="integers"):
        filled.get_many(["a", "b"])
    with pytest.raises(ValueError, match="2 ids but 1 values"):
        filled.put_many([60, 61], [b"a"])
    with pytest.raises(ValueError, match="one entry per id"):
        filled.update_scores([1, 2], [1.0])
    with pytest.raises(ValueError, match="NaN"):
        filled.update_scores([1], [float("nan")])
    with pytest.raises(TypeError, match="num_samples must be an int"):
        sc.Cache.create("x-never", num_samples="10", capacity_bytes=MiB)
    with pytest.raises(ValueError, match="unknown policy 'mru'"):
        sc.Cache.create("x-never", num_samples=10, capacity_bytes=MiB, policy="mru")
    with pytest.raises(ValueError, match="may only hold letters"):
        sc.Cache.create("bad/name", num_samples=10, capacity_bytes=MiB)
    buf = bytearray(10)
    with pytest.raises(ValueError, match="too small for sample id 1"):
        filled.get_into(1, buf)
    with pytest.raises(TypeError, match="writable buffer"):
        filled.get_into(1, b"read-only bytes")


def test_ids_and_values_that_would_be_misread(filled):
    """Inputs a silent cast would turn into other data: float, bool and string id arrays (1.9 ->
    id 1), ids beyond int64, non-finite scores (±inf breaks eviction sums), object arrays as
    values (their bytes are pointers into this process) and strided arrays. Each is refused with
    a clear error and nothing changes."""
    before = filled.cached_mask().copy()
    for ids in (np.array([1.9, 2.5]), np.array([True, False]), np.array(["5", "6"])):
        with pytest.raises(TypeError, match="ids must be integers, got an array of dtype"):
            filled.put_many(ids, [b"x", b"y"])
        with pytest.raises(TypeError, match="ids must be integers"):
            filled.get_many(ids)
        with pytest.raises(TypeError, match="ids must be integers"):
            filled.update_scores(ids, [1.0, 1.0])
    for call in (lambda: filled.get(10**30), lambda: filled.get_many([10**30]), lambda: filled.view(10**30)):
        with pytest.raises(IndexError, match="out of range"):
            call()
    for bad in (float("inf"), float("-inf"), 1e300):
        with pytest.raises(ValueError, match="not finite"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy's own note on 1e300 -> float32
            filled.update_scores([1], [bad])
        with pytest.raises(ValueError, match="not finite"):
            filled.put(60, b"v", score=bad)
    with pytest.raises(TypeError, match="Python objects"):
        filled.put(60, np.array([object(), object()]))
    with pytest.raises(TypeError, match="contiguous"):
        filled.put(60, np.arange(20, dtype=np.uint8)[::2])
    assert np.array_equal(filled.cached_mask(), before)
    filled.check()


def test_a_huge_score_passing_through_leaves_the_sums_exact(cache_name):
    """A score of 1e30 set and then lowered again must not wipe out the small keys of its page
    from the per-page sums that pick which page moves (a running double sum would lose them)."""
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=MiB, max_item_bytes=1000) as c:
        for i in range(50):
            c.put(i, b"v" * 100, score=1.0)
        c.update_scores([0], [1e30])
        c.update_scores([0], [1.0])
        c.check()


def test_a_refused_update_keeps_the_cached_value(cache_name):
    """A put of a cached id with a value of another size class that the cache refuses (static and
    full) leaves the old value cached: the old copy goes only once the new one has a slot."""
    with sc.Cache.create(cache_name, num_samples=1000, capacity_bytes=64 << 10, max_item_bytes=60_000,
                         policy="static") as c:
        i = 0
        while c.put(i, b"s" * 100):
            i += 1
        assert c.put(0, b"L" * 3000) is False
        assert c.get(0) == b"s" * 100
        c.check()


_SCORE_RACE = r"""
import sys, threading
import numpy as np
import shadecache as sc

c = sc.Cache.attach(sys.argv[1])
n = c.num_samples
ids = np.arange(n, dtype=np.int64)
scores = np.ones(n, dtype=np.float32)
stop = False


def mutate():  # flips one id between valid and far out of range while update_scores runs
    while not stop:
        ids[n // 2] = 0xFFFFFFF0
        ids[n // 2] = 0


t = threading.Thread(target=mutate)
t.start()
rejected = 0
try:
    for _ in range(100):
        try:
            c.update_scores(ids, scores)
        except IndexError:
            rejected += 1
finally:
    stop = True
    t.join()
c.check()
print("ok", rejected)
"""


def test_update_scores_uses_the_ids_it_checked(cache_name):
    """Another thread changing the id array while update_scores runs without the GIL cannot make
    it use an id it did not check (it used to re-read the caller's array: a write out of bounds)."""
    with sc.Cache.create(cache_name, num_samples=200_000, capacity_bytes=4 * MiB, max_item_bytes=1000) as c:
        res = subprocess.run([sys.executable, "-c", _SCORE_RACE, cache_name], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-2000:]}"
        assert res.stdout.split()[0] == "ok"
        c.check()


def test_name_taken_and_missing(filled):
    with pytest.raises(FileExistsError, match=f"cache '{filled.name}' already exists"):
        sc.Cache.create(filled.name, num_samples=10, capacity_bytes=MiB)
    with pytest.raises(FileNotFoundError, match="no cache named 'no-such-cache'"):
        sc.Cache.attach("no-such-cache")


def test_use_after_close(cache_name):
    c = sc.Cache.create(cache_name, num_samples=10, capacity_bytes=MiB)
    c.put(1, b"a")
    other = sc.Cache.attach(cache_name)
    c.close()
    for call in (lambda: c.get(1), lambda: c.put(2, b"b"), lambda: c.get_many([1]), c.stats, c.check,
                 lambda: c.update_scores([1], [1.0]), c.cached_mask):
        with pytest.raises(sc.ClosedError, match="closed"):
            call()
    assert other.get(1) == b"a", "closing one handle does not disturb another"
    other.close()
    c.unlink()


_CLOSE_RACE = r"""
import sys, threading
import numpy as np
import shadecache as sc

name = sys.argv[1]
big = b"b" * (200 << 10)  # above the size at which put releases the GIL for the copy
closed_errors = 0
lock = threading.Lock()


def hammer(cache, k):
    global closed_errors
    calls = (lambda: cache.put(k, big), lambda: cache.put_many([k, k + 1], [big, big]),
             lambda: cache.update_scores(np.arange(64), np.ones(64, np.float32)),
             cache.stats, cache.check, lambda: cache.remove(k))
    i = 0
    while True:
        try:
            calls[i % len(calls)]()
        except sc.ClosedError:
            with lock:
                closed_errors += 1
            return
        i += 1


for round in range(20):
    cache = sc.Cache.attach(name)
    threads = [threading.Thread(target=hammer, args=(cache, 2 * t)) for t in range(3)]
    for t in threads:
        t.start()
    threading.Event().wait(0.02)
    cache.close()  # while the threads are inside calls that run without the GIL
    for t in threads:
        t.join()
print("ok", closed_errors)
"""


def test_close_while_other_threads_are_inside_calls(cache_name):
    """close() from one thread while others are inside put / put_many / update_scores / stats /
    check (which run without the GIL) waits for those calls to leave the mapping: each thread
    ends with ClosedError on its next call, and nothing crashes (a real SIGSEGV would show as the
    subprocess dying)."""
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=8 * MiB,
                         max_item_bytes=(256 << 10)) as c:
        res = subprocess.run([sys.executable, "-c", _CLOSE_RACE, cache_name], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-2000:]}"
        assert res.stdout.split() == ["ok", "60"]
        c.check()


def test_shm_too_small(cache_name):
    free = shutil.disk_usage("/dev/shm").free
    with pytest.raises(sc.CapacityError, match=r"needs .* of shared memory but /dev/shm has only"):
        sc.Cache.create(cache_name, num_samples=10, capacity_bytes=free + (64 << 30))
    assert cache_name not in _core.CacheCore.list(), "a refused create leaves no segment behind"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) to mount a small tmpfs")
def test_full_tmpfs_is_an_error_not_a_sigbus(cache_name, tmp_path):
    """In a private mount namespace with a 4 MiB /dev/shm, a 16 MiB cache fails cleanly at create
    (free-space check) and a cache that fits works; the process never dies of SIGBUS."""
    script = f"""
import shadecache as sc
try:
    sc.Cache.create("{cache_name}", num_samples=10, capacity_bytes=16 << 20)
    raise SystemExit("created a cache larger than /dev/shm")
except sc.CapacityError as e:
    print("refused:", e)
with sc.Cache.create("{cache_name}", num_samples=10, capacity_bytes=2 << 20) as c:
    c.put(1, b"fits")
    assert c.get(1) == b"fits"
print("ok")
"""
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f"mount -t tmpfs -o size=4m tmpfs /dev/shm && {sys.executable} -c '{script}'"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=str(__import__('pathlib').Path(__file__).parents[2]))
    if res.returncode != 0 and "Operation not permitted" in res.stderr:
        pytest.skip("mount namespaces are not permitted here: " + res.stderr.strip())
    assert res.returncode == 0, res.stdout + res.stderr
    assert "refused: cache" in res.stdout and "/dev/shm has only" in res.stdout and "ok" in res.stdout


@contextlib.contextmanager
def _header_field(path, offset, fmt, change):
    """Overwrites the header field `fmt` (struct format) at byte `offset` of segment file `path`
    with change(old value); yields the old value; writes it back at exit."""
    size = struct.calcsize(fmt)
    with open(path, "r+b") as f:
        f.seek(offset)
        (old,) = struct.unpack(fmt, f.read(size))
        f.seek(offset)
        f.write(struct.pack(fmt, change(old)))
    try:
        yield old
    finally:
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(struct.pack(fmt, old))


def test_attach_to_another_layout_version_or_a_foreign_segment(cache_name):
    """The header names its layout version; attach refuses any other, any non-shadecache file and
    a header whose page size is no power of two (the read path shifts by its log2)."""
    with sc.Cache.create(cache_name, num_samples=10, capacity_bytes=MiB) as c:
        c.put(1, b"kept")
        path = _core.CacheCore.path(cache_name)
        # Header: u64 magic, u32 layout_version, 7 more u32s, u64 num_samples, u64 capacity_bytes,
        # u64 page_size at byte 56.
        with _header_field(path, 8, "<I", lambda v: v + 1) as version:
            with pytest.raises(sc.LayoutVersionError, match=f"layout version {version + 1}.*reads version {version}"):
                sc.Cache.attach(cache_name)
        # A segment of the layout before chunked values (version 5): a clear error, never a misread.
        with _header_field(path, 8, "<I", lambda v: 5):
            with pytest.raises(sc.LayoutVersionError, match="layout version 5 but this shadecache reads version 6"
                                                             ".*recreate the cache"):
                sc.Cache.attach(cache_name)
        with _header_field(path, 0, "<8s", lambda v: b"NOTMAGIC"):
            with pytest.raises(sc.LayoutVersionError, match="not a shadecache segment"):
                sc.Cache.attach(cache_name)
        with _header_field(path, 56, "<Q", lambda v: v + 64) as page_size:
            with pytest.raises(sc.LayoutVersionError, match=f"page size of {page_size + 64} bytes, not a power of two"):
                sc.Cache.attach(cache_name)
        assert sc.Cache.attach(cache_name).get(1) == b"kept"
