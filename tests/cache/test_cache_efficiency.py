"""capacity_bytes is memory, and that memory holds samples. Measured from outside the engine, as a
node's administrator sees it: the blocks /dev/shm allocated to the cache's file (st_blocks) stay
within capacity_bytes plus max(1 MiB, 2%), and the bytes `get` returns fill >= 80-93% of
capacity_bytes after filling with more than fits under random scores (and again after more puts:
fragmentation). The full table (larger caches, the log-normal mix of 1 KB..16 MiB, through a
packed store and CachedDataset) is bench/bench_efficiency.py."""
import os

import numpy as np
import pytest

import shadecache as sc
from shadecache import _core

from values import make_value, verify_value

KB, MiB = 1 << 10, 1 << 20


def ram(cache):
    """Bytes /dev/shm allocated to the cache's file."""
    return os.stat(_core.CacheCore.path(cache.name)).st_blocks * 512


def allowance(cap):
    return max(MiB, cap // 50)


def held(cache):
    """Sample bytes the cache returns, read back through get_many (each checked)."""
    total = 0
    for k in range(0, cache.num_samples, 4096):
        ids = range(k, min(cache.num_samples, k + 4096))
        for i, v in zip(ids, cache.get_many(ids)):
            if v is not None:
                assert verify_value(i, v) == ""
                total += len(v)
    return total


def churn(cache, sizes, puts, rng, version):
    """`puts` puts of random ids with sizes drawn from `sizes` and random scores, in batches."""
    n = cache.num_samples
    for k in range(0, puts, 256):
        ids = rng.integers(0, n, min(256, puts - k))
        vals = [make_value(int(i), version, int(sizes[i])) for i in ids]
        cache.put_many(ids, vals, scores=rng.random(len(ids)).astype(np.float32))


def fill_and_measure(cache, sizes, rng):
    """Fills with 3x the capacity of random ids under random scores, then 2x more (new scores):
    the fractions of capacity_bytes held after each, with RAM checked against the allowance."""
    cap = cache.capacity_bytes
    mean = float(np.mean(sizes))
    out = []
    for version, times in ((0, 3), (1, 2)):
        churn(cache, sizes, int(times * cap / mean) + 1, rng, version)
        assert ram(cache) <= cap + allowance(cap), (ram(cache), cap)
        out.append(held(cache) / cap)
        cache.check()
    return out


@pytest.mark.parametrize("size,cap,target,fits_twice", [
    (3 * KB, 16 * MiB, 0.93, False),
    (4 * KB, 16 * MiB, 0.93, False),
    (110 * KB, 64 * MiB, 0.93, False),
    (MiB, 64 * MiB, 0.90, False),
    (256, 16 * MiB, 0.80, True),
])
@pytest.mark.parametrize("given_sizes", [True, False], ids=["sizes", "no-sizes"])
def test_fixed_sizes_fill_the_memory(cache_name, size, cap, target, fits_twice, given_sizes):
    rng = np.random.default_rng(size)
    n = 2 * cap // size if fits_twice else max(64, 3 * cap // size)
    sizes = np.full(n, size, dtype=np.int64)
    kw = dict(sizes=sizes) if given_sizes else {}
    with sc.Cache.create(cache_name, num_samples=n, capacity_bytes=cap, **kw) as c:
        first, after = fill_and_measure(c, sizes, rng)
        assert first >= target and after >= target, (first, after, c.stats())


def test_small_values_in_a_small_cache(cache_name):
    """4 KB samples in a 4 MiB cache, a 10% cache of a small set: the per-sample index of all
    10240 ids is inside the 4 MiB, and samples still fill >= 90% of it."""
    n = 10 * (4 * MiB) // (4 * KB)
    sizes = np.full(n, 4 * KB, dtype=np.int64)
    with sc.Cache.create(cache_name, num_samples=n, capacity_bytes=4 * MiB, sizes=sizes) as c:
        first, after = fill_and_measure(c, sizes, np.random.default_rng(4))
        assert first >= 0.90 and after >= 0.90, (first, after)


def lognormal_sizes(n, rng, largest=16 * MiB):
    return np.clip(rng.lognormal(np.log(110 * KB), 1.2, n), KB, largest).astype(np.int64)


@pytest.mark.parametrize("given_sizes", [True, False], ids=["sizes", "no-sizes"])
def test_a_log_normal_mix_fills_the_memory(cache_name, given_sizes):
    """The image-like mix (median 110 KB, sigma 1.2) in a 64 MiB cache, its largest samples
    clipped at 4 MiB (bench_efficiency.py runs 256 MiB and 16 MiB samples)."""
    rng = np.random.default_rng(7)
    cap = 64 * MiB
    sizes = lognormal_sizes(3 * cap // (226 * KB), rng, largest=4 * MiB)
    kw = dict(sizes=sizes) if given_sizes else {}
    with sc.Cache.create(cache_name, num_samples=len(sizes), capacity_bytes=cap, **kw) as c:
        first, after = fill_and_measure(c, sizes, rng)
        assert first >= 0.90 and after >= 0.90, (first, after, c.stats())


def test_a_shifting_mix_fills_the_memory(cache_name):
    """3 KB samples, then 100 KB ones: the memory of the first serves the second."""
    cap = 16 * MiB
    n_small, n_big = 3 * cap // (3 * KB), 3 * cap // (100 * KB)
    with sc.Cache.create(cache_name, num_samples=n_small + n_big, capacity_bytes=cap,
                         sizes=np.full(16, 3 * KB)) as c:
        for k in range(0, n_small, 512):
            ids = np.arange(k, min(n_small, k + 512))
            c.put_many(ids, [make_value(int(i), 0, 3 * KB) for i in ids])
        assert held(c) >= 0.93 * cap
        for k in range(n_small, n_small + n_big, 64):
            ids = np.arange(k, min(n_small + n_big, k + 64))
            c.put_many(ids, [make_value(int(i), 0, 100 * KB) for i in ids])
        assert held(c) >= 0.90 * cap and ram(c) <= cap + allowance(cap)
        c.check()


def test_capacity_for_holds_that_many(cache_factory):
    sizes = [3 * KB] * 100
    cap = sc.Cache.capacity_for(700, sizes, num_samples=2000)
    c = cache_factory(2000, cap, policy="lru", sizes=sizes)
    for k in range(0, 2000, 500):
        ids = np.arange(k, k + 500)
        c.put_many(ids, [make_value(int(i), 0, 3 * KB) for i in ids])
    items = c.stats()["items"]
    assert 700 <= items <= 700 * 1.1, items
    assert ram(c) <= cap + allowance(cap)
    # The README's path: the store's lengths, their count the number of samples.
    lengths = np.random.default_rng(1).lognormal(np.log(110 * KB), 1.2, 2000).astype(np.int64).clip(KB, 4 * MiB)
    cap = sc.Cache.capacity_for(200, lengths)
    assert cap > 200 * lengths.mean()
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


def test_value_over_the_capacity_is_refused_up_front(cache_factory):
    c = cache_factory(10, 400_000, sizes=[50_000])
    assert c.put(0, b"x" * 50_000)
    with pytest.raises(sc.ValueTooLargeError, match="more than the capacity"):
        c.put(1, b"x" * 400_001)
    assert c.get(0) == b"x" * 50_000
    c.check()
