"""SSDTier on real files: round trip, warm restart, damaged files, budget and eviction by score,
a failing write, and the tier in CachedDataset's miss path."""
import os
import warnings

import numpy as np
import pytest

import shadecache as sc
from shadecache.ssd import layout as ssd_layout


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


def _where(t, i):
    """(slot file, offset, length) of sample i in the tier's packed layout."""
    lay = t._layout
    s = int(lay.size[i])
    return lay.file_of(s), int(lay.slot[i]) * s, int(lay.length[i])


def _damage(path, off, length, how):
    with open(path, "r+b") as f:
        if how == "flip":
            f.seek(off + length - 1)
            b = f.read(1)
            f.seek(off + length - 1)
            f.write(bytes([b[0] ^ 0x40]))
        else:
            f.truncate(off + length - 10)


@pytest.mark.parametrize("damage", ["flip", "truncate", "journal"])
def test_damaged_value_is_a_miss_and_removed(tmp_path, damage):
    """A byte flipped in a value's slot, its slot file truncated, or its journal entry flipped
    (dropped on replay by a restarted job): a miss, the rest of the tier unharmed."""
    vals = _values(10, seed=1)
    vals[4] = b"x" * 1000          # alone in its size class (the others are < 500 bytes)
    t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    t.put_many(range(10), vals)
    t.flush()
    if damage == "journal":
        raw = bytearray(open(t._layout.journal_path, "rb").read())
        for k in range(32, len(raw), 32):
            if int.from_bytes(raw[k:k + 8], "little") == 4:
                raw[k + 20] ^= 0x01          # a bit of its crc field: the entry's own crc32c fails
        open(t._layout.journal_path, "wb").write(bytes(raw))
        t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)   # a restarted job replays the journal
        assert t.get_many([3, 4, 5]) == [vals[3], None, vals[5]]
        assert t.stats()["torn_entries"] == 1 and t.stats()["items"] == 9
        return
    _damage(*_where(t, 4), damage)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = t.get_many([3, 4, 5])
    assert got == [vals[3], None, vals[5]]
    assert t.stats()["corrupt"] == 1 and t.stats()["items"] == 9
    again = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)    # the removal is in the journal
    assert again.get_many([4, 3]) == [None, vals[3]]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damage_after_a_good_read_is_a_miss(tmp_path, damage):
    """A value read once is read again through the same open slot file; a byte flipped or the
    file truncated in place afterwards is still caught (crc32c, short read) and the value
    removed; its slot is reused by the next value of its class."""
    vals = _values(10, seed=5)
    vals[4] = b"y" * 1000
    t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    t.put_many(range(10), vals)
    t.flush()
    assert t.get_many(range(10)) == vals
    where = _where(t, 4)
    _damage(*where, damage)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert t.get_many([3, 4, 5]) == [vals[3], None, vals[5]]
    assert t.get_many([4]) == [None]
    t.put_many([11], [b"z" * 1000])
    t.flush()
    assert _where(t, 11)[:2] == where[:2] and t.get_many([11]) == [b"z" * 1000]


def test_another_process_sees_writes_and_removals(tmp_path):
    """The processes of a node share one directory: what one writes (and removes) the others
    find at their next read, through the journal."""
    vals = _values(20, seed=6)
    t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    t.put_many(range(10), vals[:10])
    t.flush()
    assert t.get_many(range(10)) == vals[:10]
    pid = os.fork()
    if pid == 0:   # another process of the node: writes 10..19, removes 3 (as a damaged value)
        code = 1
        try:
            t.put_many(range(10, 20), vals[10:])
            t.flush()
            lay = t._layout
            with lay.locked(), t._mu:
                lay.do_catch_up()
                lay.append([ssd_layout.entry(3, int(lay.size[3]), int(lay.slot[3]), ssd_layout.REMOVED, 0)])
            code = 0 if t.get_many(range(20)) == vals[:3] + [None] + vals[4:] else 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert t.get_many(range(20)) == vals[:3] + [None] + vals[4:]
    assert t.stats()["items"] == 19


@pytest.mark.parametrize("backend", ["io_uring", "pread"])
def test_native_batch_reader_statuses(tmp_path, backend):
    """The io_uring (and pread) batch reader: ok, missing (no descriptor), damaged (crc32c or a
    short read), and a read that fails (a directory's descriptor: EISDIR) each get their own
    status, never an exception."""
    from shadecache import _io

    data = b"".join(bytes([k]) * 100 for k in range(4))
    f = tmp_path / "slots.dat"
    f.write_bytes(data)
    fd = os.open(f, os.O_RDONLY)
    dfd = os.open(tmp_path, os.O_RDONLY)
    try:
        r = _io.TierReader(backend)
        crc = [_io.crc32c(bytes([k]) * 100) for k in range(4)]
        cols = (np.array([fd, fd, -1, dfd, fd, fd], np.int32), np.array([0, 100, 0, 0, 350, 300]),
                np.array([100, 100, 0, 100, 100, 100]), np.array([crc[0], crc[0], 0, 0, crc[3], crc[3]], np.uint32))
        values, status, errs, hits, nbytes, bad = r.read_many([0, 1, 2, 3, 4, 5, 77, 0], *cols)
        assert status.tolist() == [0, 2, 1, 3, 2, 0, 1, 0]     # id 77: past the columns, a miss
        assert (hits, nbytes, bad) == (3, 300, 3)
        assert values == [bytes(100), None, None, None, None, bytes([3]) * 100, None, bytes(100)]
        assert errs[3] == 21   # EISDIR
        with pytest.raises(ValueError):
            r.read_many([0], np.array([fd], np.int32), np.array([0, 1]), np.array([1]), np.array([0], np.uint32))
        with pytest.raises(ValueError):
            r.read_many([0], np.array([fd], np.int32), np.array([-5]), np.array([1]), np.array([0], np.uint32))
        with pytest.raises(IndexError):
            r.read_many([-1], *cols)
    finally:
        os.close(fd)
        os.close(dfd)
    t = sc.SSDTier(tmp_path / "t", capacity_bytes=1 << 20)
    with pytest.raises(IndexError):
        t.get_many([-1])


def test_budget_evicts_the_lowest_scores(tmp_path, cache_factory):
    cache = cache_factory(100, policy="importance")
    scores = np.arange(100, dtype=np.float32)
    cache.update_scores(np.arange(100), scores)
    t = sc.SSDTier(tmp_path, capacity_bytes=10 * sc.SSDTier.slot_bytes(100), cache=cache)
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
    os.mkdir(t._layout.file_of(sc.SSDTier.slot_bytes(3) * 2))   # a directory where a slot file must go
    with pytest.warns(RuntimeWarning, match="writes disabled"):
        t.put_many([2], [b"two" * 6])
        t.flush()
    assert t.disabled and t.get_many([1, 2]) == [b"one", None]
    assert sc.SSDTier.slot_bytes(18) == 2 * sc.SSDTier.slot_bytes(3)
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
    ds = sc.Node(store, None, ssd=ssd, read_ahead=False).dataset()
    assert ds.fetch_bytes(np.arange(200)) == vals
    ssd.flush()
    assert ds.stats()["store_reads"] == 200
    assert ds.fetch_bytes(np.arange(200)) == vals
    s = ds.stats()
    assert s["store_reads"] == 200 and s["tiers"]["ssd"]["hits"] == 200


def _pack(path, vals):
    with sc.PackWriter(str(path)) as w:
        for v in vals:
            w.add(v, 0)
    return sc.PackedStore(str(path))


def test_a_tier_of_another_data_set_is_refused(tmp_path):
    """Two data sets on one tier directory: the second job must never read the first job's bytes
    by id (without it, job B read store A's bytes for 50 of 50 samples)."""
    a = _pack(tmp_path / "a.shc", _values(50, seed=3))
    b_vals = _values(50, seed=4)
    b = _pack(tmp_path / "b.shc", b_vals)
    ds_a = sc.Node(a, None, ssd=sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20), read_ahead=False).dataset()
    ds_a.fetch_bytes(np.arange(50))
    ds_a.node.ssd.flush()
    assert ds_a.node.ssd.stats()["items"] == 50
    with pytest.raises(sc.FingerprintError, match="another directory"):
        sc.Node(b, None, ssd=sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20), read_ahead=False).dataset()
    with pytest.raises(sc.FingerprintError):   # explicitly, and through the constructor
        sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, fingerprint=b.fingerprint)
    # the refusal removed nothing: job A's next run finds its tier warm
    again = sc.Node(a, None, ssd=sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20), read_ahead=False).dataset()
    assert again.node.ssd.stats()["items"] == 50 and again.node.ssd.fingerprint == a.fingerprint
    # B in its own directory reads its own bytes
    ds_b = sc.Node(b, None, ssd=sc.SSDTier(tmp_path / "ssd-b", capacity_bytes=1 << 20), read_ahead=False).dataset()
    assert ds_b.fetch_bytes(np.arange(50)) == b_vals


def test_an_unrecorded_tier_with_samples_is_refused(tmp_path):
    """A tier filled without a data set recorded (SSDTier used on its own) is not adopted by the
    first data set that comes along: its samples could be anyone's."""
    t = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20)
    t.put_many(range(5), _values(5))
    t.flush()
    store = _pack(tmp_path / "s.shc", _values(5, seed=9))
    with pytest.raises(sc.FingerprintError, match="unrecorded"):
        sc.Node(store, None, ssd=sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20), read_ahead=False).dataset()
    with pytest.raises(ValueError, match="fingerprint"):
        t.bind("")


def test_forked_child_opens_its_own_files(tmp_path):
    """A forked process (a DataLoader worker) does not use its parent's descriptors (the file
    lock is per open file): its first use of the tier opens its own, and reads the same bytes."""
    vals = _values(20, seed=7)
    t = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    t.put_many(range(20), vals)
    t.flush()
    assert t.get_many(range(20)) == vals
    import fcntl

    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:   # reads, then holds the tier's file lock until the parent has tried it
        try:
            ok = t.get_many(range(20)) == vals
            with t._layout.locked():
                os.write(w, str(int(ok)).encode())
                os.read(r2, 1)
        finally:
            os._exit(0)
    os.close(w)
    ok = int(os.read(r, 100))
    try:   # the child's lock is its own open file: the parent's descriptor cannot take it now
        with pytest.raises(BlockingIOError):
            fcntl.flock(t._layout._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.write(w2, b"x")
        os.waitpid(pid, 0)
    assert ok == 1
    assert t.get_many(range(20)) == vals


def test_open_tier_files_stay_out_of_selects_range(tmp_path):
    """The descriptors the tier keeps open (slot files, journal) sit at or above 1024
    (FD_SETSIZE) where the limit allows, so that the process can still select() its sockets."""
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
        if target.startswith(str(tmp_path)) and (target.endswith(".dat") or target.endswith("index")):
            mine.append(int(fd))
    assert len(mine) >= 2 and min(mine) >= 1024


def test_sigkilled_writer_leaves_nothing_wrong(tmp_path):
    """A process SIGKILLed while it writes (values, journal appends, evictions) at several
    points: a restarted job replays the journal and every value it returns is the right one; a
    torn tail (half an entry) is dropped and cut off by the next writer."""
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    script = textwrap.dedent(f"""
        import numpy as np, shadecache as sc
        t = sc.SSDTier({str(tmp_path)!r}, capacity_bytes=300 * sc.SSDTier.slot_bytes(600))
        i = 0
        while True:   # ids cycle through 0..999 so that the budget evicts and slots are reused
            ids = [(i + k) % 1000 for k in range(50)]
            t.put_many(ids, [bytes([j % 251]) * (100 + j % 500) for j in ids])
            t.flush()
            i += 50
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for n, delay in enumerate((0.3, 0.5, 0.8)):
        p = subprocess.Popen([sys.executable, "-c", script], env=env)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        with open(os.path.join(tmp_path, "index"), "ab") as f:
            f.write(b"\x07" * 16)          # half an entry, as a write cut short would leave
        t = sc.SSDTier(tmp_path, capacity_bytes=300 * sc.SSDTier.slot_bytes(600))
        got = t.get_many(range(1000))
        for j, v in enumerate(got):
            assert v is None or v == bytes([j % 251]) * (100 + j % 500)
        t.put_many([5000 + n], [b"after"])   # a new id: a held one is not queued, so not written
        t.flush()
        assert t.get_many([5000 + n]) == [b"after"] and (os.path.getsize(t._layout.journal_path) % 32) == 0
        assert t.stats()["bytes_used"] <= t.capacity_bytes


def test_evictions_reuse_slots(tmp_path, cache_factory):
    """Values displaced by higher-scoring ones free their slots, which the newcomers of the same
    size class take: the slot files do not grow past what the budget holds."""
    cache = cache_factory(1000, policy="importance")
    cache.update_scores(np.arange(1000), np.arange(1000, dtype=np.float32))
    t = sc.SSDTier(tmp_path, capacity_bytes=50 * sc.SSDTier.slot_bytes(3000), cache=cache)
    for first in range(0, 500, 50):
        t.put_many(range(first, first + 50), [bytes([first % 251]) * 3000] * 50)
        t.flush()
    assert t.ids().tolist() == list(range(450, 500))
    assert t.get_many([450, 499]) == [bytes([450 % 251]) * 3000] * 2
    lay = t._layout
    assert lay.nslots[sc.SSDTier.slot_bytes(3000)] == 50 and t.stats()["evictions"] == 450


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs mounted for the test (root only; mode 0700: a tier directory others may
    write is refused), unmounted after it."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", str(mnt)])


def test_disk_full_shrinks_the_budget(small_disk):
    """ENOSPC on a small tmpfs: the budget shrinks to what the disk holds, with a warning; what
    was written reads back exactly; reads go on."""
    with sc.SSDTier(small_disk, capacity_bytes=64 << 20) as t:
        vals = [bytes([k % 251]) * 5000 for k in range(400)]   # 2 MB: four times the disk
        with pytest.warns(RuntimeWarning, match="disk full"):
            for k in range(0, 400, 50):
                t.put_many(range(k, k + 50), vals[k:k + 50])
                t.flush()
        s = t.stats()
        assert s["write_errors"] >= 1 and s["capacity_bytes"] < 512 << 10 and s["disabled"] is None
        held = t.ids()
        assert 0 < held.size < 400
        assert t.get_many(held) == [vals[k] for k in held.tolist()]


def test_disk_full_does_not_drain_the_tier(small_disk):
    """A small tmpfs filled with values of one size class, then values of a larger class keep
    coming: the tier fills what the disk holds (not just its last whole chunk), and the larger
    values, for which the disk has no room, evict nothing and do not ratchet the budget down
    (it used to shrink by their size at every batch, to 0: the tier emptied itself)."""
    with sc.SSDTier(small_disk, capacity_bytes=64 << 20) as t:
        small = [bytes([k % 251]) * 5000 for k in range(200)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k in range(0, 200, 50):
                t.put_many(range(k, k + 50), small[k:k + 50])
                t.flush()
            held = t.ids()
            assert held.size * sc.SSDTier.slot_bytes(5000) > (512 << 10) * 3 // 4   # the disk, used
            for r in range(10):
                t.put_many(range(1000 + 4 * r, 1004 + 4 * r), [bytes([r]) * 20000] * 4)
                t.flush()
        s = t.stats()
        assert t.ids().tolist() == held.tolist() and s["evictions"] == 0
        assert s["capacity_bytes"] >= s["bytes_used"] == held.size * sc.SSDTier.slot_bytes(5000)
        assert t.get_many(held) == [small[k] for k in held.tolist()]


def test_journal_compaction_is_followed_by_other_readers(tmp_path):
    """Puts and evictions grow the journal; past twice the live entries (+4096) it is rewritten
    and replaced, and a tier opened before (another process's view) follows the new file."""
    other = sc.SSDTier(tmp_path, capacity_bytes=1 << 20)
    assert other.get_many([0]) == [None]
    t = sc.SSDTier(tmp_path, capacity_bytes=20 * sc.SSDTier.slot_bytes(10))
    for first in range(0, 3000, 100):
        t.put_many(range(first, first + 100), [b"%10d" % i for i in range(first, first + 100)])
        t.flush()
    held = t.ids()
    assert held.size == 20
    assert os.path.getsize(t._layout.journal_path) < 4096 * 32   # compacted at least once
    assert other.get_many(held) == [b"%10d" % i for i in held.tolist()]
    assert other.ids().tolist() == held.tolist()


def test_slot_reused_by_another_process_under_a_read_is_a_plain_miss(tmp_path):
    """A reader whose index is a moment old (it looked at the journal just before another
    process evicted sample 0 and wrote sample 1 into its slot) reads sample 1's bytes for 0: the
    crc32c fails, the journal is read again, and 0 is a plain miss: no exception, nothing counted
    damaged, nothing removed that another process holds."""
    import subprocess
    import sys
    import textwrap
    import time

    slot = sc.SSDTier.slot_bytes(200)
    t = sc.SSDTier(tmp_path, capacity_bytes=slot)          # room for one value
    t.put_many([0], [b"a" * 200])
    t.flush()
    assert t.get_many([0]) == [b"a" * 200]
    t._layout._tailed = time.monotonic() + 3600   # its index stays as it is now (the 1 ms window, stretched)
    script = textwrap.dedent(f"""
        import shadecache as sc
        t = sc.SSDTier({str(tmp_path)!r}, capacity_bytes={slot})
        t.put_many([1], [b"b" * 200])
        t.flush()
        assert t.ids().tolist() == [1] and t.get_many([0, 1]) == [None, b"b" * 200]
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", script], env=env, check=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # a plain miss warns of nothing
        assert t.get_many([0]) == [None]
    t._layout._tailed = 0.0
    assert t.get_many([0, 1]) == [None, b"b" * 200]
    assert t.stats()["corrupt"] == 0 and t.ids().tolist() == [1]


def test_readers_and_writers_of_several_processes_never_see_wrong_bytes(tmp_path):
    """Two processes writing (evicting, reusing slots, compacting the journal) and two reading
    the whole id range, for about two seconds: every value read is the right one, and no reader
    fails."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys, time, warnings
        import shadecache as sc
        warnings.simplefilter("ignore")
        t = sc.SSDTier({str(tmp_path)!r}, capacity_bytes=100 * sc.SSDTier.slot_bytes(300))
        val = lambda j: bytes([j % 251, (j * 7) % 256]) * (50 + j % 100)
        end, i, seed = time.monotonic() + 2.0, 0, int(sys.argv[2])
        while time.monotonic() < end:
            if sys.argv[1] == "w":
                ids = [(seed * 997 + i + k) % 3000 for k in range(64)]
                t.put_many(ids, [val(j) for j in ids])
                t.flush()
                i += 64
            else:
                for j, v in enumerate(t.get_many(range(3000))):
                    assert v is None or v == val(j), j
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    ps = [subprocess.Popen([sys.executable, "-c", script, role, str(k)], env=env)
          for k, role in enumerate("wwrr")]
    assert [p.wait(timeout=60) for p in ps] == [0, 0, 0, 0]


def test_close_writes_what_is_queued_and_stops_the_writer(tmp_path):
    """close() flushes, ends the writer thread and closes every descriptor of the tier; the
    object opens the tier again when used after it, and finds what was written."""
    import threading

    def fds_under(path):
        out = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith(str(path)):
                    out.add(fd)
            except OSError:
                pass
        return out

    vals = _values(40, seed=5)
    with sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20) as t:
        t.put_many(range(40), vals)
        writer = t._thread
        assert writer.is_alive() and fds_under(tmp_path / "ssd")
    assert not writer.is_alive() and writer not in threading.enumerate()
    assert fds_under(tmp_path / "ssd") == set()
    assert t.get_many(range(40)) == vals          # reopened on use, everything was written
    t.close()
    assert fds_under(tmp_path / "ssd") == set()


def test_old_layout_directories_are_reported(tmp_path):
    old = tmp_path / "ssd" / "0a"
    old.mkdir(parents=True)
    (old / "10.s").write_bytes(b"x")
    with pytest.warns(RuntimeWarning, match="old one-file-per-sample layout"):
        sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20).close()


def test_a_journal_entry_whose_length_overflows_its_slot_is_dropped(tmp_path):
    """An entry with a valid checksum but a length that does not fit its slot size (not one the
    tier writes) is dropped on replay like a torn one: a read must never go past its slot."""
    vals = _values(3, seed=6)
    t = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20)
    t.put_many(range(3), vals)
    t.flush()
    s = sc.SSDTier.slot_bytes(len(vals[1]))
    with open(tmp_path / "ssd" / "index", "ab") as f:
        f.write(ssd_layout.entry(1, s, 0, 1 << 30, 0))      # 1 GiB claimed in a small slot
    again = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20)
    assert again.get_many(range(3)) == vals
    assert again.stats()["torn_entries"] == 1


def test_values_written_together_come_back_in_one_read(tmp_path):
    """One put_many fills neighbouring slots in its order, so a read of those values, in any
    order, is one request of the native reader (values at most gap_bytes apart are read as one
    extent): gap_bytes=100 merges neighbouring slots (3,000 B values in 3,072 B slots), no more."""
    rng = np.random.default_rng(4)
    vals = [rng.bytes(3000) for _ in range(100)]
    with sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20) as t:
        t.put_many(np.arange(100), vals)
        t.flush()
        order = rng.permutation(100)
        assert t.get_many(order) == [vals[k] for k in order]
        assert t.stats()["read_requests"] == 1
        assert t.get_many([3, 50, 97]) == [vals[3], vals[50], vals[97]]   # 150 KB apart: 3
        assert t.stats()["read_requests"] == 4
    with sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, gap_bytes=100) as t:
        assert t.get_many([1, 2, 4]) == [vals[1], vals[2], vals[4]]
        assert t.stats()["read_requests"] == 2          # 1-2 neighbours (72 B apart), 4 a slot further


def test_a_full_tier_queues_nothing_it_would_refuse(tmp_path, cache_factory):
    """put_many leaves out, as arrays and before the queue, what the writer would refuse: the
    ids the tier holds and, once the budget is spent, ids scoring no higher than the lowest
    score held; a higher score still goes through (and evicts)."""
    cache = cache_factory(100, policy="importance")
    cache.update_scores(np.arange(100), np.ones(100, np.float32))
    t = sc.SSDTier(tmp_path, capacity_bytes=10 * sc.SSDTier.slot_bytes(100), cache=cache)
    t.put_many(np.arange(10), [bytes([i]) * 100 for i in range(10)])
    t.flush()
    assert t.stats()["items"] == 10
    t.put_many(np.arange(30), [b"x" * 100] * 30)      # held, or no higher than what is held
    assert t._queue.qsize() == 0 and t._queued == [0, 0]
    cache.update_scores([50], [5.0])
    t._floor = (-1.0, None)                           # the next look sees the held scores again
    t.put_many([49, 50], [b"y" * 100, b"z" * 100])
    t.flush()
    assert t.get_many([49, 50, 0]) == [None, b"z" * 100, None]   # id 0: the first of the lowest
    assert t.stats()["items"] == 10 and t.stats()["evictions"] == 1
    with pytest.raises(ValueError, match="queue_bytes"):
        sc.SSDTier(tmp_path, capacity_bytes=1, queue_bytes=-1)


def test_a_batch_larger_than_the_queue_is_cut_and_counted(tmp_path):
    with sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, queue_bytes=1000) as t:
        t.put_many(np.arange(5), [b"v" * 400] * 5)   # two fit the queue's bytes, three dropped
        t.flush()
        assert t.stats()["dropped"] == 3
        assert [v is not None for v in t.get_many(range(5))] == [True, True, False, False, False]
