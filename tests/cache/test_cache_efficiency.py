"""A byte budget that holds what it says: size classes fitted to the sample sizes given
at create, learned from the values otherwise; capacity_bytes a budget of value bytes when sizes
are given; stats() value_bytes / efficiency; Cache.capacity_for. The full table (sizes x cache
sizes, through CachedDataset) is bench/bench_efficiency.py."""
import numpy as np
import pytest

import shadecache as sc

from values import make_value, verify_value

MiB = 1 << 20


def _fill(c, n, size, first=0, version=0):
    ids = np.arange(first, first + n, dtype=np.int64)
    c.put_many(ids, [make_value(int(i), version, size) for i in ids])


@pytest.mark.parametrize("size", [256, 3 << 10, 4096, 110 << 10])
def test_sizes_given_fill_the_budget(cache_factory, size):
    cap = 8 * MiB
    n = 2 * cap // size
    c = cache_factory(n, cap, policy="lru", sizes=[size] * 10)
    _fill(c, n, size)
    s = c.stats()
    assert s["value_bytes"] == s["bytes_used"] <= cap
    assert s["efficiency"] == pytest.approx(s["value_bytes"] / cap)
    assert s["efficiency"] >= 0.95, s
    # the memory behind it is stated: headers and page ends on top of the budget
    assert s["data_bytes"] >= s["value_bytes"] and s["segment_bytes"] > s["data_bytes"]
    assert s["segment_bytes"] == sc.Cache.memory_for(n, cap, sizes=[size] * 10, policy="lru")
    for i in range(n - 20, n):
        v = c.get(i)
        assert v is not None and verify_value(i, v) == ""
    c.check()


def test_budget_is_never_exceeded_by_mixed_sizes(cache_factory):
    rng = np.random.default_rng(1)
    sizes = rng.lognormal(np.log(20_000), 1.0, 3000).astype(np.int64).clip(1, 900_000)
    cap = 16 * MiB
    c = cache_factory(len(sizes), cap, policy="importance", sizes=sizes)
    for i, sz in enumerate(sizes.tolist()):
        c.put(i, make_value(i, 0, sz), score=float(rng.random()))
        if i % 500 == 0:
            assert c.stats()["value_bytes"] <= cap
    s = c.stats()
    assert s["value_bytes"] <= cap and s["efficiency"] >= 0.85, s
    c.check()


def test_classes_are_learned_without_sizes(cache_factory):
    # No sizes: capacity_bytes is the memory, headers included. 3 KB values still get a class cut
    # for them (the old fixed classes held 81% of the bytes).
    c = cache_factory(4000, 8 * MiB, policy="lru")
    _fill(c, 4000, 3 << 10)
    assert c.stats()["efficiency"] >= 0.95
    # the mix changes: 100 KB values take pages of the 3 KB class
    _fill(c, 200, 100 << 10, first=3000, version=1)
    s = c.stats()
    assert s["page_moves"] > 0 and s["efficiency"] >= 0.90, s
    c.check()


def test_capacity_for_holds_that_many(cache_factory):
    sizes = [3 << 10] * 100
    cap = sc.Cache.capacity_for(700, sizes)
    assert cap == 700 * (3 << 10)
    c = cache_factory(2000, cap, policy="lru", sizes=sizes)
    _fill(c, 2000, 3 << 10)
    assert c.stats()["items"] == 700
    with pytest.raises(ValueError, match="sizes is empty"):
        sc.Cache.capacity_for(10, [])
    with pytest.raises(ValueError, match=">= 0"):
        sc.Cache.capacity_for(-1, sizes)


def test_bad_sizes_are_refused(cache_name):
    with pytest.raises(TypeError, match="sizes must be integers"):
        sc.Cache.create(cache_name, 10, MiB, sizes=[1.5, 2.0])
    with pytest.raises(TypeError, match="sizes must be integers"):
        sc.Cache.create(cache_name, 10, MiB, sizes=np.array([b"x"], dtype=object))
    with pytest.raises(ValueError, match=">= 0"):
        sc.Cache.create(cache_name, 10, MiB, sizes=[10, -1])
    with pytest.raises(ValueError, match="larger than max_item_bytes"):
        sc.Cache.create(cache_name, 10, MiB, sizes=[5000], max_item_bytes=4000)
    assert cache_name not in sc.cache.list_caches()


def test_value_over_the_budget_is_refused_up_front(cache_factory):
    c = cache_factory(10, 100_000, sizes=[50_000])
    assert c.put(0, b"x" * 50_000)
    with pytest.raises(sc.ValueTooLargeError, match="more than the capacity"):
        c.put(1, b"x" * 100_001)
    assert c.get(0) == b"x" * 50_000
    c.check()
