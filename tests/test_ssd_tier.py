"""SSDTier on real files: round trip, warm restart, damaged files, budget and eviction by score,
a failing write, and the tier in CachedDataset's miss path."""
import os
import warnings

import numpy as np
import pytest

import shadecache as sc


def _values(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(0, 500)), dtype=np.uint8).tobytes() for _ in range(n)]


def test_round_trip_and_warm_restart(tmp_path):
    vals = _values(50)
    t = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20)
    assert t.get_many(range(50)) == [None] * 50
    t.put_many(range(50), vals)
    t.flush()
    assert t.get_many(range(50)) == vals
    again = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20)   # a new job on this node
    assert again.get_many([3, 49, 0]) == [vals[3], vals[49], vals[0]]
    assert again.stats()["items"] == 50


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_damaged_file_is_a_miss_and_removed(tmp_path, damage):
    vals = _values(10, seed=1)
    vals[4] = b"x" * 100
    t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    t.put_many(range(10), vals)
    t.flush()
    path = t._file(4)
    raw = bytearray(open(path, "rb").read())
    if damage == "flip":
        raw[-1] ^= 0x40
    elif damage == "truncate":
        raw = raw[:-10]
    else:
        raw[:4] = b"JUNK"
    open(path, "wb").write(bytes(raw))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = t.get_many([3, 4, 5])
    assert got == [vals[3], None, vals[5]]
    assert not os.path.exists(path)
    assert t.stats()["corrupt"] == 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damage_behind_an_open_file_is_a_miss(tmp_path, damage):
    """A file read once stays open (the next read is one value read through its descriptor); a
    byte flipped or the file truncated in place afterwards is still caught (crc32c of the first
    read; a short read falls back to the path and its checks) and the file removed."""
    vals = _values(10, seed=5)
    vals[4] = b"y" * 300
    t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    t.put_many(range(10), vals)
    t.flush()
    assert t.get_many(range(10)) == vals
    assert t._reader.open_files == 10
    assert t.get_many([4, 2]) == [vals[4], vals[2]]          # through the open descriptors
    with open(t._file(4), "r+b") as f:                        # same inode, changed in place
        if damage == "flip":
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x10]))
        else:
            f.truncate(100)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert t.get_many([3, 4, 5]) == [vals[3], None, vals[5]]
    assert not os.path.exists(t._file(4))
    assert t.get_many([4]) == [None]


def test_removed_file_is_dropped_from_the_open_set(tmp_path):
    """A file another process removed (its eviction) still reads its own correct bytes through
    the open descriptor until the sweep (at most a second) closes it; then it is a miss."""
    import time

    vals = _values(4, seed=6)
    t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    t.put_many(range(4), vals)
    t.flush()
    assert t.get_many(range(4)) == vals
    os.unlink(t._file(1))                 # not through this tier: as another process would
    assert t.get_many([1]) in ([vals[1]], [None])
    time.sleep(1.1)
    assert t.get_many([1, 2]) == [None, vals[2]]
    assert t._reader.open_files == 3


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_native_batch_reader_statuses(tmp_path, backend):
    """The io_uring (and pread) batch reader: ok, missing, damaged, and a read that fails (a
    directory where the file should be: EISDIR) each get their own status; the tier turns the
    failure into a miss with a warning, never an exception."""
    from shadecache import _io

    vals = _values(6, seed=3)
    t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    t.put_many(range(5), vals[:5])
    t.flush()
    os.makedirs(t._file(5))              # EISDIR on read
    raw = bytearray(open(t._file(2), "rb").read())
    raw[-1] ^= 1
    open(t._file(2), "wb").write(bytes(raw))
    assert _io.TierReader.path_of(str(tmp_path), 5) == t._file(5)
    r = _io.TierReader(backend)
    values, status, errs, hits, nbytes, bad = r.read_many(str(tmp_path), [0, 2, 5, 77, 4])
    assert status.tolist() == [0, 2, 3, 1, 0]
    assert (hits, nbytes, bad) == (2, len(vals[0]) + len(vals[4]), 2)
    assert values == [vals[0], None, None, None, vals[4]]
    assert errs[2] == 21   # EISDIR
    with pytest.raises(IndexError):
        r.read_many(str(tmp_path), [-1])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert t.get_many([5, 0]) == [None, vals[0]]


def test_budget_evicts_the_lowest_scores(tmp_path, cache_factory):
    cache = cache_factory(100, policy="importance")
    scores = np.arange(100, dtype=np.float32)
    cache.update_scores(np.arange(100), scores)
    t = sc.SSDTier(tmp_path, capacity_bytes=10 * (16 + 100), cache=cache)
    t.put_many(range(20, 30), [bytes([i]) * 100 for i in range(20, 30)])
    t.flush()
    assert t.stats()["items"] == 10
    t.put_many([5], [b"z" * 100])      # scores lower than all kept: not admitted
    t.put_many([90, 91], [b"a" * 100, b"b" * 100])   # higher: evict 20, 21
    t.flush()
    got = t.get_many([5, 20, 21, 22, 90, 91])
    assert got == [None, None, None, bytes([22]) * 100, b"a" * 100, b"b" * 100]
    assert t.stats()["bytes_used"] <= t.capacity_bytes


def test_failing_write_disables_writes_reads_go_on(tmp_path):
    t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    t.put_many([1], [b"one"])
    t.flush()
    open(os.path.join(tmp_path, f"{2:02x}"), "w").close()   # a file where the directory must go
    with pytest.warns(RuntimeWarning, match="writes disabled"):
        t.put_many([2], [b"two"])
        t.flush()
    assert t.disabled and t.get_many([1, 2]) == [b"one", None]
    with pytest.raises(ValueError):
        sc.SSDTier(tmp_path, capacity_bytes=-1)


def test_dataset_reads_the_ssd_tier_before_the_store(tmp_path, cache_factory):
    path = str(tmp_path / "s.shc")
    vals = _values(200, seed=2)
    with sc.PackWriter(path) as w:
        for v in vals:
            w.add(v, 0)
    store = sc.PackedStore(path)
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20)
    ds = sc.CachedDataset(store, None, ssd=ssd)
    assert ds.fetch_bytes(np.arange(200)) == vals
    ssd.flush()
    assert ds.stats()["store_reads"] == 200
    assert ds.fetch_bytes(np.arange(200)) == vals
    s = ds.stats()
    assert s["store_reads"] == 200 and s["tiers"]["ssd"]["hits"] == 200


def test_forked_child_drops_the_parents_open_files(tmp_path):
    """A forked process (a DataLoader worker) does not keep its parent's open tier files: its
    first use of the tier drops the inherited reader and the descriptors with it."""
    vals = _values(20, seed=7)
    t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    t.put_many(range(20), vals)
    t.flush()
    assert t.get_many(range(20)) == vals
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report open descriptors before and after its first read
        try:
            before = len(os.listdir("/proc/self/fd"))
            ok = t.get_many([0, 1]) == vals[:2]
            after = len(os.listdir("/proc/self/fd"))
            os.write(w, f"{before} {after} {int(ok)}".encode())
        finally:
            os._exit(0)
    os.close(w)
    before, after, ok = map(int, os.read(r, 100).split())
    os.waitpid(pid, 0)
    # 20 inherited closed; 2 files reopened and the child's own io_uring ring (1-2 descriptors)
    assert ok == 1 and before - after >= 20 - 2 - 2


def test_open_tier_files_stay_out_of_selects_range(tmp_path):
    """The descriptors the tier keeps open sit at or above 1024 (FD_SETSIZE) where the limit
    allows, so that a process holding thousands of them can still select() its own sockets."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1100:
        pytest.skip("descriptor limit too low to move above 1024")
    vals = _values(30, seed=8)
    t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    t.put_many(range(30), vals)
    t.flush()
    assert t.get_many(range(30)) == vals
    mine = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(tmp_path)) and target.endswith(".s"):
            mine.append(int(fd))
    assert len(mine) == 30 and min(mine) >= 1024
