"""The value budget with large values next to small ones, and what a fingerprint may hold; each failed
before its fix."""
import pytest

import shadecache as sc


def test_large_put_into_a_full_cache_evicts_only_what_it_needs(cache_name):
    """A large put into a full cache with views pinning some values evicts, in the policy's order,
    about its own size in values and passes over the pinned ones (an allocator that needed memory
    side by side evicted every unpinned value and then refused the put)."""
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=4_000_000, policy="lru",
                         sizes=[100_000] * 10 + [530_000] * 4) as c:
        i = 0
        while c.stats()["evictions"] == 0:
            assert c.put(i, bytes([i]) * 100_000)
            i += 1
        held = c.stats()["items"]
        cached = [j for j in range(i) if c.contains(j)]
        views = [c.view(j) for j in cached[:3]]  # the three least recent: next in line
        try:
            assert c.put(50, b"L" * 2_000_000)
            assert c.get(50) == b"L" * 2_000_000
            evicted = c.stats()["evictions"] - 1
            assert 20 <= evicted <= 23, evicted
            assert all(c.contains(j) for j in cached[:3])
            assert c.stats()["items"] == held - evicted + 1
        finally:
            for v in views:
                v.release()
        c.check()


def test_fingerprint_with_nul_byte_refused(cache_name):
    """A fingerprint is stored as a C string: 'ab\\0cd' was kept as 'ab', so attach with the same
    fingerprint raised FingerprintError and attach(fingerprint='ab') succeeded."""
    with pytest.raises(ValueError):
        sc.Cache.create(cache_name, num_samples=10, capacity_bytes=1 << 20, fingerprint="ab\x00cd")
