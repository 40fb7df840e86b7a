"""Values far larger than a page (chains of chunks): 2, 16 and 64 MiB values round-trip through
put / put_many / get / get_many / view under every policy, share memory with small values both
ways, keep a view's bytes when replaced (a view of a value in chunks is a private copy), and
max_item_bytes still works as a limit. The crash and 4-process tests with these sizes are in
test_cache_crash.py and test_cache_processes.py."""
import pytest

import shadecache as sc
from values import make_value, verify_value

MiB = 1 << 20
LARGE = (2 * MiB, 16 * MiB, 64 * MiB)


@pytest.fixture(scope="module")
def large_values():
    return {size: make_value(k, size, size) for k, size in enumerate(LARGE)}


@pytest.mark.parametrize("policy", sorted(sc.POLICIES))
def test_large_values_round_trip(cache_name, policy, large_values):
    with sc.Cache.create(cache_name, num_samples=50, capacity_bytes=160 * MiB, policy=policy) as c:
        assert c.stats()["chunk_size"] < MiB  # every value here is a chain of many chunks
        assert c.max_item_bytes >= 64 * MiB  # no limit unless asked for: whatever the cache holds
        for k, size in enumerate(LARGE):
            assert c.put(k, large_values[size], score=1.0 + k)
        assert c.put(10, b"s" * 3000, score=5.0)
        c.check()
        for k, size in enumerate(LARGE):
            assert c.get(k) == large_values[size]
        got = c.get_many([2, 10, 0, 1, 49])
        assert got[0] == large_values[64 * MiB] and got[1] == b"s" * 3000
        assert got[2] == large_values[2 * MiB] and got[3] == large_values[16 * MiB] and got[4] is None
        for k, size in enumerate(LARGE):
            with c.view(k) as v:
                assert len(v) == size and bytes(v) == large_values[size]
        # put_many of large values; a rewrite of the same length is written over its chunks.
        adm = c.put_many([3, 4], [large_values[2 * MiB][::-1], large_values[16 * MiB][::-1]], scores=[9.0, 9.0])
        assert adm.all()
        assert c.get(3) == large_values[2 * MiB][::-1] and c.get(4) == large_values[16 * MiB][::-1]
        assert c.put(4, large_values[16 * MiB], score=9.0)
        assert c.get(4) == large_values[16 * MiB]
        # Large to small and back: the chunks' pages go back to the free page list.
        assert c.put(2, b"t" * 500, score=8.0) and c.get(2) == b"t" * 500
        c.check()
        assert c.put(2, large_values[64 * MiB], score=8.0) and c.get(2) == large_values[64 * MiB]
        c.check()
        assert c.remove(2) and c.get(2) is None
        c.check()
        s = c.stats()
        assert s["bytes_used"] == sum(len(v) for v in c.get_many(range(50)) if v is not None)


@pytest.mark.parametrize("policy", ["importance", "lru", "fifo", "clairvoyant"])
def test_large_and_small_values_take_memory_from_each_other(cache_name, policy):
    """A cache full of small values makes room for a 16 MiB value (the small values' pages empty,
    and go to its chunks), and small values make room again by evicting it."""
    n = 12_000
    with sc.Cache.create(cache_name, num_samples=n, capacity_bytes=24 * MiB, policy=policy) as c:
        small = 0
        while c.stats()["free_pages"] > 0:
            c.put(small, make_value(small, 1, 3000), score=0.1)
            small += 1
        big = make_value(n - 1, 2, 16 * MiB)
        assert c.put(n - 1, big, score=10.0)
        assert c.get(n - 1) == big
        c.check()
        for i in range(small, small + 1000):   # 30 MB of 30 KB values, keyed above the big one
            c.put(i, make_value(i, 1, 30_000), score=20.0)
        c.check()
        if policy != "clairvoyant":   # no next uses given: clairvoyant's order is not this one
            assert c.get(n - 1) is None
        for i, v in enumerate(c.get_many(range(n))):
            assert v is None or verify_value(i, v) == ""


def test_a_view_of_a_large_value_is_a_copy_that_outlives_it(cache_name, large_values):
    """A value in chunks is not contiguous: its view is a private copy, so replacing, evicting or
    removing the value leaves no zombie and the view still shows the bytes it was made from."""
    v16 = large_values[16 * MiB]
    with sc.Cache.create(cache_name, num_samples=10, capacity_bytes=40 * MiB, policy="lru") as c:
        assert c.put(0, v16)
        view = c.view(0)
        assert c.put(0, v16[::-1])
        assert c.stats()["zombies"] == 0 and c.stats()["pinned"] == 0
        assert c.get(0) == v16[::-1]
        c.check()
        assert bytes(view) == v16
        assert c.put(1, v16) and c.get(1) == v16   # 40 MiB holds two 16 MiB values
        assert c.put(2, v16) and c.get(2) == v16 and c.get(0) is None
        assert bytes(view) == v16
        view.release()
        c.check()


def test_max_item_bytes_is_a_limit_and_capacity_the_default_limit(cache_name):
    with sc.Cache.create(cache_name, num_samples=10, capacity_bytes=8 * MiB, max_item_bytes=3 * MiB) as c:
        assert c.put(0, b"a" * (3 * MiB)) and c.get(0) == b"a" * (3 * MiB)
        with pytest.raises(sc.ValueTooLargeError, match="at most 3145728"):
            c.put(1, b"a" * (3 * MiB + 1))
        c.check()
    with sc.Cache.create(cache_name + "b", num_samples=10, capacity_bytes=8 * MiB) as c:
        assert c.put(0, b"b" * (7 * MiB)) and c.get(0) == b"b" * (7 * MiB)
        with pytest.raises(sc.ValueTooLargeError, match="more than the capacity"):
            c.put(1, b"b" * (8 * MiB + 1))
        c.check()
