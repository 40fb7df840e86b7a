"""ReadStream (csrc/io/read_stream.h): batches come back whole, in submission order, with the same
bytes and the same errors as read_many, on both backends, buffered and O_DIRECT."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import shadecache as sc
from shadecache import _io

MODES = [("pread", False), ("pread", True)]
if _io.built_with_uring() and _io.probe_backend("io_uring", 8)[0] == "io_uring":
    MODES += [("io_uring", False), ("io_uring", True)]


@pytest.fixture
def packed(tmp_path):
    rng = np.random.default_rng(3)
    data = [rng.bytes(int(s)) for s in rng.integers(0, 9000, 600)] + [b"", rng.bytes(70_000)]
    path = tmp_path / "s.shc"
    with sc.PackWriter(path) as w:
        for d in data:
            w.add(d, 0)
    return path, data


URING = any(b == "io_uring" for b, _ in MODES)


def stream_through(rs, store, batches, ahead=4):
    """Every batch through the stream with `ahead` queued behind the one taken; their bytes."""
    got = []
    for k, b in enumerate(batches):
        rs.submit(store._r, b)
        if k >= ahead:
            got.append(rs.take())
    while rs.pending:
        got.append(rs.take())
    return got


@pytest.mark.parametrize("backend,direct", MODES)
@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("submission", ["spread", "single", "auto"])
def test_stream_returns_every_batch_in_order(packed, backend, direct, lanes, submission):
    path, data = packed
    store = sc.PackedStore(path, direct=direct)
    rs = _io.ReadStream(store._r, backend, 8, lanes, submission)
    assert rs.backend == backend and rs.lanes == lanes and rs.lane_depth == -(-8 // lanes)
    # the modes are io_uring's: the pread pool always spreads
    assert rs.submission == ("single" if submission == "single" and backend == "io_uring" else "spread")
    rng = np.random.default_rng(lanes)
    batches = [rng.integers(0, len(data), int(rng.integers(0, 300))) for _ in range(25)]
    got = stream_through(rs, store, batches)
    assert len(got) == len(batches)
    for b, g in zip(batches, got):
        assert g == [data[i] for i in b]
    rs.close()
    assert rs.closed


@pytest.mark.parametrize("submission", ["spread", "single"])
def test_a_corrupt_sample_fails_its_batch_only(packed, submission):
    path, data = packed
    store = sc.PackedStore(path)
    off = store.offset(5)
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 1]))
    rs = _io.ReadStream(store._r, "auto", 8, 2, submission)
    rs.submit(store._r, [1, 2])
    rs.submit(store._r, [3, 5, 4])
    rs.submit(store._r, [6])
    assert rs.take() == [data[1], data[2]]
    with pytest.raises(sc.CorruptSampleError) as e:
        rs.take()
    assert e.value.sample_id == 5 and e.value.offset == off
    assert rs.take() == [data[6]]


@pytest.mark.skipif(not URING, reason="io_uring is refused here")
@pytest.mark.parametrize("direct", [False, True])
def test_auto_submission_tries_both_modes_and_loses_nothing(packed, direct):
    """auto runs one mode for an epoch (>= 4 batches and 25 ms), then the other one it has not
    measured yet: a stream kept busy for longer than two epochs has switched at least once, and
    every batch still comes back whole and in order across the switches."""
    path, data = packed
    store = sc.PackedStore(path, direct=direct)
    rs = _io.ReadStream(store._r, "io_uring", 8, 2, "auto")
    rng = np.random.default_rng(11)
    t_end = time.monotonic() + 0.5
    queued = []
    while time.monotonic() < t_end or rs.mode_switches == 0:
        b = rng.integers(0, len(data), 64)
        rs.submit(store._r, b)
        queued.append(b)
        if len(queued) > 4:
            assert rs.take() == [data[i] for i in queued.pop(0)]
        assert time.monotonic() < t_end + 30, "auto never switched mode"
    while queued:
        assert rs.take() == [data[i] for i in queued.pop(0)]
    assert rs.mode_switches >= 1 and rs.submission in ("spread", "single")
    rs.close()


@pytest.mark.skipif(not URING, reason="io_uring is refused here")
@pytest.mark.parametrize("submission,lanes", [("single", 3), ("spread", 2)])
def test_single_runs_every_batch_on_lane_0_and_spread_on_all(packed, submission, lanes):
    path, data = packed
    store = sc.PackedStore(path)
    rs = _io.ReadStream(store._r, "io_uring", 8, lanes, submission)
    rng = np.random.default_rng(5)
    # A lane takes a batch only once the scheduler wakes it: on a loaded machine lane 0 can run a
    # whole round of page-cache reads first. Spread is given rounds until every lane ran one (a
    # lane that never runs fails at the deadline); single must keep every round on lane 0.
    submitted = 0
    deadline = time.monotonic() + 20
    while True:
        batches = [rng.integers(0, len(data), 32) for _ in range(60)]
        assert stream_through(rs, store, batches) == [[data[i] for i in b] for b in batches]
        submitted += len(batches)
        if submission == "spread" and all(n > 0 for n in rs.lane_batches):
            break
        if submission == "single" and submitted >= 120:
            break
        assert time.monotonic() < deadline, f"spread never ran a batch on some lane: {rs.lane_batches}"
    ran = rs.lane_batches
    assert sum(ran) == submitted
    if submission == "single":
        assert ran[0] == submitted
    else:
        assert all(n > 0 for n in ran)
    rs.close()


@pytest.mark.skipif(not URING, reason="io_uring is refused here")
@pytest.mark.parametrize("direct", [False, True])
def test_single_reads_queued_batches_in_one_call(packed, direct):
    """In the single mode lane 0 feeds the batches queued behind the one it runs into the same
    backend call, so the ring does not drain between them: with four batches kept queued, 60
    batches take a handful of calls, not 60, and each still comes back whole and in order."""
    path, data = packed
    store = sc.PackedStore(path, direct=direct)
    rs = _io.ReadStream(store._r, "io_uring", 8, 1, "single")
    rng = np.random.default_rng(6)
    batches = [rng.integers(0, len(data), 64) for _ in range(60)]
    assert stream_through(rs, store, batches) == [[data[i] for i in b] for b in batches]
    assert rs.lane_batches == [60]
    assert 1 <= rs.single_calls <= 15
    rs.close()


@pytest.mark.skipif(not URING, reason="io_uring is refused here")
@pytest.mark.parametrize("direct", [False, True])
def test_a_read_error_in_single_mode_fails_its_batch_only(packed, tmp_path, direct):
    """A failed read stops the call that feeds many batches; the batches it had not finished are
    read again alone, so the error reaches the batch that asked for the bytes and no other."""
    path, data = packed
    p = tmp_path / "t.shc"
    p.write_bytes(path.read_bytes())
    store = sc.PackedStore(p, direct=direct)
    # pack shuffles placement: cut the file inside the sample that lies last in it
    last = max((i for i in range(len(data)) if data[i]), key=store.offset)
    os.truncate(p, store.offset(last) + len(data[last]) // 2)
    rs = _io.ReadStream(store._r, "io_uring", 8, 1, "single")
    batches = [[i for i in range(k, k + 41) if i != last] for k in range(0, 205, 41)]
    batches.insert(2, [3, last, 4])
    for b in batches:
        rs.submit(store._r, b)
    for k, b in enumerate(batches):
        if k == 2:
            with pytest.raises(sc.StoreFormatError, match="truncated"):
                rs.take()
        else:
            assert rs.take() == [data[i] for i in b]
    rs.close()


@pytest.mark.skipif(not URING, reason="io_uring is refused here")
def test_io_counters_count_what_was_handed_out_once(packed, tmp_path):
    """io_counters() counts samples handed out: a batch whose read failed counts nothing, and a
    batch read again after a failed call of the single mode counts once."""
    path, data = packed
    p = tmp_path / "t.shc"
    p.write_bytes(path.read_bytes())
    store = sc.PackedStore(p, backend="io_uring")
    last = max((i for i in range(len(data)) if data[i]), key=store.offset)
    os.truncate(p, store.offset(last) + len(data[last]) // 2)
    c0 = store.io_counters()
    with pytest.raises(sc.StoreFormatError):
        store.read_many([1, 2, last])
    assert store.io_counters() == c0
    rs = _io.ReadStream(store._r, "io_uring", 8, 1, "single")
    good = [[i for i in range(k, k + 40) if i != last and data[i]] for k in range(0, 240, 40)]
    batches = good[:3] + [[last]] + good[3:]
    for b in batches:
        rs.submit(store._r, b)
    for b in batches:
        if b == [last]:
            with pytest.raises(sc.StoreFormatError):
                rs.take()
        else:
            assert rs.take() == [data[i] for i in b]
    rs.close()
    assert store.io_counters()["samples"] - c0["samples"] == sum(map(len, good))


# Run in a process of its own: it needs the two lowest free descriptors to be the only ones a
# stream can take, which a process that ran other tests (descriptors freed in any order, streams
# collected late) does not give reliably.
MIXED_LANES = r"""
import os, resource, sys, time
import numpy as np
import shadecache as sc
from shadecache import _io

def rings():
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += "io_uring" in os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            pass
    return n

path = sys.argv[1]
store = sc.PackedStore(path, direct=False)
data = store.read_many(range(len(store)))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
before = rings()
seen = []
deadline = time.monotonic() + 60
for trial in range(2000):   # which lane gets the ring is a race: on a loaded machine lane 0 wins
    if time.monotonic() > deadline:   # far more often, so try until both outcomes are seen
        break
    # the two lowest free descriptors: the stream's dup takes the first, one ring the second
    a, b = os.open("/dev/null", os.O_RDONLY), os.open("/dev/null", os.O_RDONLY)
    os.close(a)
    os.close(b)
    resource.setrlimit(resource.RLIMIT_NOFILE, (b + 1, hard))
    try:
        rs = _io.ReadStream(store._r, "auto", 8, 2, "single")
        time.sleep(0.02)                    # lane 1 makes its backend under the limit too
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        if rings() - before != 1:
            continue
        assert (rs.backend, rs.submission) in (("io_uring", "single"), ("pread", "spread")), rs.backend
        seen.append(rs.backend)
        rng = np.random.default_rng(trial)
        batches = [rng.integers(0, len(data), 200) for _ in range(40)]
        got = []
        for k, ids in enumerate(batches):
            rs.submit(store._r, ids)
            if k >= 10:
                got.append(rs.take())
        while rs.pending:
            got.append(rs.take())
        assert got == [[data[i] for i in ids] for ids in batches]
    finally:
        rs.close()
    if len(seen) >= 30 and seen.count("pread") >= 5 and "io_uring" in seen:
        break
print(seen.count("io_uring"), seen.count("pread"))
"""


@pytest.mark.skipif(not URING, reason="io_uring is refused here")
def test_lanes_on_different_backends_run_the_single_mode_only_on_lane_0s_ring(packed):
    """With descriptors for one ring only, one lane gets io_uring and the other the pread pool,
    whichever is first. The stream's backend and its modes are lane 0's: single where lane 0 has
    the ring, spread where lane 0 has the pool (whose threads land reads concurrently: the single
    mode's bookkeeping would race there, and hung or corrupted the heap). Both read every batch
    whole."""
    path, _ = packed
    out = subprocess.run([sys.executable, "-c", MIXED_LANES, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    uring, pread = map(int, out.stdout.split())
    assert uring >= 1 and pread >= 5, (uring, pread)


@pytest.mark.skipif(not URING, reason="io_uring is refused here")
def test_auto_counts_only_the_time_batches_run(packed):
    """A stream made long before its first batch (the prefetcher's, at start) is not slow: auto
    measures samples per second while a batch runs. Counting the wait, the first mode measured
    would read a few hundred samples per second here and lose to the other for good."""
    path, data = packed
    store = sc.PackedStore(path)          # buffered: the page cache serves these in microseconds
    rs = _io.ReadStream(store._r, "io_uring", 8, 2, "auto")
    time.sleep(0.5)
    rng = np.random.default_rng(9)
    deadline = time.monotonic() + 30
    queued = []
    while min(rs.mode_rates) == 0:
        b = rng.integers(0, len(data), 64)
        rs.submit(store._r, b)
        queued.append(b)
        if len(queued) > 4:
            assert rs.take() == [data[i] for i in queued.pop(0)]
        assert time.monotonic() < deadline, "auto never measured both modes"
    while queued:
        assert rs.take() == [data[i] for i in queued.pop(0)]
    # samples per second of each mode: thousands at the least, where 64 x 4 samples over the
    # 0.5 s wait would be about 500
    assert min(rs.mode_rates) > 10_000, rs.mode_rates
    rs.close()


def test_bad_input_is_refused(packed):
    path, data = packed
    store = sc.PackedStore(path)
    rs = _io.ReadStream(store._r, "auto", 8, 2)
    with pytest.raises(IndexError):
        rs.submit(store._r, [0, len(data)])
    with pytest.raises(TypeError):
        rs.submit(store._r, [0.5])
    assert rs.pending == 0
    with pytest.raises(ValueError, match="no batch is pending"):
        rs.take()
    with pytest.raises(ValueError):
        _io.ReadStream(store._r, "auto", 0, 2)
    with pytest.raises(ValueError):
        _io.ReadStream(store._r, "auto", 8, 0)
    with pytest.raises(ValueError):
        _io.ReadStream(store._r, "nvme", 8, 1)
    with pytest.raises(ValueError, match="submission must be 'auto', 'spread' or 'single', not 'fast'"):
        _io.ReadStream(store._r, "auto", 8, 2, "fast")
    rs.submit(store._r, [1])
    rs.close()                     # a dropped batch: never handed out
    with pytest.raises(sc.ClosedError):
        rs.take()
    with pytest.raises(sc.ClosedError):
        rs.submit(store._r, [1])


def test_a_forked_child_cannot_use_its_parents_stream(packed):
    path, _ = packed
    store = sc.PackedStore(path)
    rs = _io.ReadStream(store._r, "auto", 8, 2)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            rs.submit(store._r, [1])
        except ValueError as e:
            code = 0 if "only in the process that made it" in str(e) else 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    rs.submit(store._r, [1])
    assert len(rs.take()) == 1



@pytest.mark.skipif(not URING, reason="io_uring is refused here")
def test_packed_stream_passes_its_submission_mode_on(packed):
    path, data = packed
    store = sc.PackedStore(path)
    with store.stream(8, 2, "single") as s:
        s.submit([3, 1, 4])
        assert s.take() == [data[3], data[1], data[4]]
        assert s.submission == "single" and s.mode_switches == 0
    with store.stream(8, 2) as s:
        assert s.submission == "single"           # the default
    with store.stream(8, 2, "spread") as s:
        s.submit([2])
        assert s.take() == [data[2]] and s.submission == "spread"
    with pytest.raises(ValueError, match="submission must be"):
        store.stream(8, 2, "batched")
