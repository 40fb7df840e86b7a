"""Single-process behaviour of the cache: round trips, policies, size-class moves, snapshots."""
import os
import pickle

import numpy as np
import pytest

import shadecache as sc
from values import make_value, verify_value

MiB = 1 << 20


def test_round_trip_and_stats(cache_name):
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=4 * MiB) as c:
        assert c.get(3) is None
        assert c.put(3, b"abc") is True
        assert c.get(3) == b"abc"
        assert c.contains(3) and not c.contains(4)
        assert c.put(4, bytearray(b"xyz")) and c.get(4) == b"xyz"
        assert c.put(5, memoryview(b"0123456789")[2:5]) and c.get(5) == b"234"
        assert c.put(6, np.arange(10, dtype=np.uint8)) and c.get(6) == bytes(range(10))
        assert c.put(7, b"") and c.get(7) == b""
        assert c.get_many([3, 8, 4]) == [b"abc", None, b"xyz"]
        assert c.get_many(np.array([5, 7])) == [b"234", b""]
        buf = bytearray(16)
        assert c.get_into(3, buf) == 3 and buf[:3] == b"abc"
        assert c.get_into(9, buf) == -1
        s = c.stats()
        assert s["items"] == 5 and s["bytes_used"] == 3 + 3 + 3 + 10 + 0
        assert s["inserts"] == 5 and s["hits"] >= 7 and s["misses"] >= 2
        assert 0 < s["hit_ratio"] < 1
        mask = c.cached_mask()
        assert mask.dtype == np.bool_ and list(np.flatnonzero(mask)) == [3, 4, 5, 6, 7]
        assert c.remove(3) and not c.remove(3) and c.get(3) is None
        c.check()


def test_overwrite_same_and_other_size_class(cache_name):
    with sc.Cache.create(cache_name, num_samples=10, capacity_bytes=4 * MiB) as c:
        c.put(1, b"a" * 100)
        c.put(1, b"b" * 120)  # same class: in place
        assert c.get(1) == b"b" * 120
        c.put(1, b"c" * 50_000)  # another class
        assert c.get(1) == b"c" * 50_000
        s = c.stats()
        assert s["items"] == 1 and s["bytes_used"] == 50_000 and s["updates"] == 2
        c.check()


@pytest.mark.parametrize("policy", sorted(sc.POLICIES))
def test_replacing_a_value_by_another_shape_on_the_same_page(cache_name, policy):
    """A value of 4 chunks replaced by a 2-byte one: both heads are 32-byte slots of one class, the
    new head on the page of the old, which the old was alone on. Evicting the old copy must not
    take that page (it crashed when the new head was only counted once published)."""
    with sc.Cache.create(cache_name, num_samples=64, capacity_bytes=MiB, policy=policy) as c:
        chunk = c.stats()["chunk_size"]
        assert c.put(63, b"x" * (4 * chunk))
        assert c.put(63, b"ab", score=-1.0) and c.get(63) == b"ab"
        c.check()
        assert c.put(63, b"y" * (4 * chunk)) and c.get(63) == b"y" * (4 * chunk)
        c.check()


def test_importance_evicts_lowest_and_admits_only_higher(cache_name):
    # One 64 KiB page of 4 KiB-class slots: 16 values of 4000 bytes fill it.
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=64 * 1024, max_item_bytes=4000) as c:
        per_page = 0
        while c.put(per_page, b"x" * 4000, score=float(per_page + 1)):
            per_page += 1
            if c.stats()["evictions"]:
                break
        c.check()
        s = c.stats()
        assert s["evictions"] == 1, "the first put past capacity evicts exactly one value"
        assert not c.contains(0), "the lowest score (id 0) goes first"
        low = s["items"]
        # A new sample whose score does not beat the lowest cached one is refused (SHADE).
        assert c.put(99, b"y" * 4000, score=0.5) is False
        assert c.stats()["rejected"] == 1 and not c.contains(99)
        # Raising a cached sample's score protects it; lowering another makes it the victim.
        c.update_scores([1], [1000.0])
        c.update_scores([5], [-1.0])
        assert c.put(98, b"z" * 4000, score=500.0)
        assert c.contains(1) and not c.contains(5)
        assert c.stats()["items"] == low
        scores = c.scores()
        assert scores[1] == 1000.0 and scores[5] == -1.0 and scores[98] == 500.0
        assert scores[50] == 0.0  # never seen: the ghost-cache default
        c.check()


def _fill(c, n, size):
    return [c.put(i, make_value(i, 0, size)) for i in range(n)]


def _fill_until_first_eviction(c, size):
    """Puts ids 0, 1, ... until one put evicts; returns how many were put."""
    n = 0
    while c.stats()["evictions"] == 0:
        assert c.put(n, make_value(n, 0, size))
        n += 1
    return n


def test_lru_keeps_recently_read(cache_name):
    with sc.Cache.create(cache_name, num_samples=1000, capacity_bytes=64 * 1024, policy="lru") as c:
        n = _fill_until_first_eviction(c, 4000)
        assert n > 4 and not c.contains(0) and c.stats()["evictions"] == 1  # the least recent went
        c.get(1)  # 1 is now the most recent; 2 the least
        c.put(100, make_value(100, 0, 4000))
        assert c.contains(1) and not c.contains(2)
        c.check()


def test_fifo_evicts_in_insert_order_regardless_of_reads(cache_name):
    with sc.Cache.create(cache_name, num_samples=1000, capacity_bytes=64 * 1024, policy="fifo") as c:
        n = _fill_until_first_eviction(c, 4000)
        assert n > 4 and not c.contains(0)
        c.get(1)
        c.put(100, make_value(100, 0, 4000))
        assert not c.contains(1) and c.contains(2)
        c.check()


def test_static_fills_once_and_never_evicts(cache_name):
    with sc.Cache.create(cache_name, num_samples=1000, capacity_bytes=64 * 1024, policy="static") as c:
        admitted = _fill(c, 40, 4000)
        k = sum(admitted)
        assert k > 4 and admitted == [True] * k + [False] * (40 - k)
        s = c.stats()
        assert s["evictions"] == 0 and s["rejected"] == 40 - k and s["items"] == k
        c.check()


def test_memory_moves_between_size_classes(cache_name):
    # Fill with 3 KB values, then ask for 100 KB ones: the memory of the 3 KB values must serve
    # the 100 KB ones (their chunks and tails), evicting the oldest 3 KB values only.
    with sc.Cache.create(cache_name, num_samples=12000, capacity_bytes=16 * MiB, policy="lru") as c:
        for i in range(8000):
            c.put(i, make_value(i, 0, 3000))
        s = c.stats()
        assert s["evictions"] > 0 and s["efficiency"] >= 0.9, s
        for i in range(100):
            assert c.put(10000 + i, make_value(10000 + i, 1, 100_000))
        s = c.stats()
        big = [c.get(10000 + i) for i in range(100)]
        assert all(b is not None and verify_value(10000 + i, b) == "" for i, b in enumerate(big))
        small = np.flatnonzero(c.cached_mask()[:8000])
        assert small.size and small.min() > 8000 - small.size - 1, "only the oldest 3 KB values went"
        assert s["efficiency"] >= 0.9, s
        c.check()


def test_pickles_by_name_and_attach_sees_same_data(cache_name):
    with sc.Cache.create(cache_name, num_samples=10, capacity_bytes=MiB) as c:
        c.put(2, b"shared")
        other = pickle.loads(pickle.dumps(c))
        assert other.name == cache_name and other.get(2) == b"shared"
        other.put(3, b"from other")
        assert c.get(3) == b"from other"
        other.close()
        assert c.get(2) == b"shared", "closing an attached handle leaves the creator's intact"


def test_update_scores_accepts_lists_arrays_and_tensors(cache_name):
    torch = pytest.importorskip("torch")
    with sc.Cache.create(cache_name, num_samples=10, capacity_bytes=MiB) as c:
        c.update_scores([0, 1], [0.5, 1.5])
        c.update_scores(np.array([2]), np.array([2.5], dtype=np.float64))
        c.update_scores(torch.tensor([3]), torch.tensor([3.5]))
        assert list(c.scores()[:4]) == [0.5, 1.5, 2.5, 3.5]


def test_importance_keeps_the_top_scores(cache_name):
    rng = np.random.default_rng(0)
    n = 20_000
    with sc.Cache.create(cache_name, num_samples=n, capacity_bytes=8 * MiB, max_item_bytes=4096) as c:
        scores = rng.random(n).astype(np.float32)
        admitted = c.put_many(np.arange(n), [os.urandom(1000) for _ in range(n)], scores=scores)
        c.check()
        cached = np.flatnonzero(c.cached_mask())
        assert admitted.sum() >= len(cached) > 0
        # One size class: what stays is exactly the top of the score distribution.
        top = np.sort(scores)[-len(cached):]
        assert scores[cached].min() >= top.min()


def test_mixed_sizes_stay_consistent(cache_name):
    rng = np.random.default_rng(1)
    n = 20_000
    with sc.Cache.create(cache_name, num_samples=n, capacity_bytes=8 * MiB, max_item_bytes=4096) as c:
        sizes = rng.integers(10, 4000, n)
        values = [make_value(i, 0, int(sizes[i])) for i in range(n)]
        scores = rng.random(n).astype(np.float32)
        c.put_many(np.arange(n), values, scores=scores)
        c.check()
        cached = np.flatnonzero(c.cached_mask())
        # Memory moves between size classes by moving values, never by evicting out of order:
        # what stays is the top of the scores, as with one size.
        assert scores[cached].mean() > scores.mean() + 0.2, (scores[cached].mean(), len(cached))
        got = c.get_many(np.arange(n))
        assert all(v is None or v == values[i] for i, v in enumerate(got))
