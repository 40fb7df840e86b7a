"""Reads shaped for the device (csrc/io/extent_read.h): a batch is sorted by offset and
neighbours at most gap_bytes apart are read in one request (an extent), on both backends,
buffered and O_DIRECT, through read_many and the ReadStream; the bytes and the errors are those of
sample-by-sample reads, and io_counters() says what the device was asked."""
import os

import numpy as np
import pytest

import shadecache as sc
from shadecache import _io

MODES = [("pread", False), ("pread", True)]
if _io.built_with_uring() and _io.probe_backend("io_uring", 8)[0] == "io_uring":
    MODES += [("io_uring", False), ("io_uring", True)]


@pytest.fixture
def small(tmp_path):
    """2,000 samples of 100-400 bytes, shuffled on disk."""
    rng = np.random.default_rng(5)
    data = [rng.bytes(int(n)) for n in rng.integers(100, 400, 2000)]
    path = tmp_path / "small.shc"
    with sc.PackWriter(path, seed=3) as w:
        for i, d in enumerate(data):
            w.add(d, i % 7)
    return path, data


def _delta(store, before):
    now = store.io_counters()
    return {k: now[k] - before[k] for k in now}


@pytest.mark.parametrize("backend,direct", MODES)
def test_neighbours_on_disk_are_one_request(small, backend, direct):
    path, data = small
    with sc.PackedStore(path, backend=backend, direct=direct, gap_bytes=0) as s:
        run = s.disk_order()[500:700]             # 200 neighbours: touching, so one extent
        ids = np.random.default_rng(1).permutation(run)
        before = s.io_counters()
        assert s.read_many(ids) == [data[i] for i in ids]
        d = _delta(s, before)
        assert d["samples"] == 200 and d["requests"] == 1
        want = sum(len(data[i]) for i in run)
        assert want <= d["bytes"] <= want + (8192 if direct else 0)


@pytest.mark.parametrize("backend,direct", MODES)
def test_the_gap_threshold_decides_what_merges(small, backend, direct):
    """Every 4th neighbour: the gaps hold three samples (300-1,200 bytes). Below the gaps: one
    request per sample; above: one request for the whole run, its gaps read and dropped."""
    path, data = small
    order = np.asarray(sc.PackedStore(path, gap_bytes=0).disk_order())
    ids = order[100:900:4]
    want = [data[i] for i in ids]
    with sc.PackedStore(path, backend=backend, direct=False, gap_bytes=0) as s:
        before = s.io_counters()
        assert s.read_many(ids) == want
        assert _delta(s, before)["requests"] == len(ids)
    with sc.PackedStore(path, backend=backend, direct=direct, gap_bytes=2000) as s:
        before = s.io_counters()
        assert s.read_many(ids[::-1]) == want[::-1]
        d = _delta(s, before)
        assert d["requests"] == 1
        span = s.offset(ids[-1]) + len(data[ids[-1]]) - s.offset(ids[0])
        assert span <= d["bytes"] <= span + (8192 if direct else 0)


@pytest.mark.parametrize("backend,direct", MODES)
def test_extents_are_capped(small, backend, direct):
    path, data = small
    with sc.PackedStore(path, backend=backend, direct=direct, gap_bytes=1 << 20,
                        max_extent_bytes=4096) as s:
        ids = s.disk_order()[:400]
        before = s.io_counters()
        assert s.read_many(ids) == [data[i] for i in ids]
        d = _delta(s, before)
        total = sum(len(data[i]) for i in ids)
        assert total / 4096 <= d["requests"] <= 2 * total / 4096 + 1


@pytest.mark.parametrize("backend,direct", MODES)
def test_repeats_and_empty_samples_inside_extents(tmp_path, backend, direct):
    data = [b"", b"a" * 10, b"", b"b" * 5000, b"c", b""]
    p = tmp_path / "e.shc"
    with sc.PackWriter(p, shuffle=False) as w:
        for d in data:
            w.add(d, 0)
    with sc.PackedStore(p, backend=backend, direct=direct, gap_bytes=1 << 16) as s:
        ids = [3, 0, 3, 4, 1, 1, 5, 2]
        assert s.read_many(ids) == [data[i] for i in ids]
        assert s.read_many([0, 2, 5]) == [b"", b"", b""]


@pytest.mark.parametrize("backend,direct", MODES)
def test_a_corrupt_sample_inside_an_extent_is_named(small, backend, direct):
    """The first corrupt sample in batch order is named, whichever extent held it; verify()
    lists every one; verify=False hands the bytes out."""
    path, data = small
    s0 = sc.PackedStore(path, gap_bytes=0)
    run = [int(i) for i in s0.disk_order()[1000:1050]]
    victims = [run[30], run[10]]
    raw = bytearray(path.read_bytes())
    for v in victims:
        raw[s0.offset(v) + 5] ^= 0x40
    s0.close()
    path.write_bytes(bytes(raw))
    with sc.PackedStore(path, backend=backend, direct=direct, gap_bytes=1 << 16) as s:
        ids = run[::-1]        # run[30] comes before run[10] in this batch
        with pytest.raises(sc.CorruptSampleError) as ei:
            s.read_many(ids)
        assert ei.value.sample_id == run[30] and ei.value.offset == s.offset(run[30])
        assert s.verify() == sorted(victims)
    with sc.PackedStore(path, backend=backend, direct=direct, gap_bytes=1 << 16, verify=False) as s:
        got = s.read_many(run)
        assert [g == data[i] for g, i in zip(got, run)].count(False) == 2


@pytest.mark.parametrize("backend,direct", MODES)
def test_the_read_stream_reads_extents(small, backend, direct):
    path, data = small
    store = sc.PackedStore(path, direct=direct, gap_bytes=4096)
    rs = _io.ReadStream(store._r, backend, 8, 2)
    order = store.disk_order()
    batches = [order[k * 256:(k + 1) * 256] for k in range(6)]
    before = store.io_counters()
    for b in batches:
        rs.submit(store._r, np.random.default_rng(0).permutation(b))
    for b in batches:
        got = rs.take()
        assert sorted(got) == sorted(data[i] for i in b)
    assert _delta(store, before)["requests"] == 6
    rs.close()
    store.close()


def test_the_device_profile_sets_the_gap(tmp_path):
    rng = np.random.default_rng(2)
    p = tmp_path / "big.shc"
    with sc.PackWriter(p) as w:
        for _ in range(6000):
            w.add(rng.bytes(3000), 0)
    with sc.PackedStore(p) as s:            # 18 MB: measured at open
        dev = s.device
        assert dev["source"].startswith("measured")
        assert dev["iops"] > 0 and dev["bandwidth"] > 0
        assert s.gap_bytes == dev["gap_bytes"] == int(min(1 << 20, dev["bandwidth"] / dev["iops"]))
    cloud = {"iops": 3000, "bandwidth": 200 << 20}
    with sc.PackedStore(p, device=cloud) as s:
        assert s.gap_bytes == 69905 and s.iops_bound     # 3 KB samples: bytes cost less
    with sc.PackedStore(p, device={"iops": 3000, "bandwidth": 3 << 20}) as s:
        assert not s.iops_bound
    with pytest.raises(ValueError, match="gap_bytes"):
        sc.PackedStore(p, gap_bytes=-1, device=cloud)
    with pytest.raises(ValueError, match="device"):
        sc.PackedStore(p, device={"iops": 0, "bandwidth": 1})


def test_iops_bound_means_a_request_costs_four_times_the_bytes(tmp_path):
    rng = np.random.default_rng(3)
    cloud = {"iops": 3000, "bandwidth": 200 << 20}     # gap 69,905 bytes
    for size, bound in ((17_000, True), (18_000, False)):
        p = tmp_path / f"s{size}.shc"
        with sc.PackWriter(p) as w:
            for _ in range(50):
                w.add(rng.bytes(size), 0)
        with sc.PackedStore(p, device=cloud) as s:
            assert s.iops_bound is bound, size
