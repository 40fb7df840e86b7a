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
