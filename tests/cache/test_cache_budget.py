"""The value budget with large values next to small ones, and what a fingerprint may hold; each failed
before its fix."""
import pytest

import shadecache as sc


def test_large_put_over_budget_takes_free_run_once_budget_holds(cache_name):
    """do_alloc_run only retries do_take_run after an eviction that frees a whole page. Over the
    value budget, with free pages side by side but a view on each slab page, it evicted every
    unpinned value (27) and then refused the put: 20 evictions make budget room and 12 free pages
    lie side by side."""
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=3_000_000, policy="lru",
                         sizes=[100_000] * 10 + [530_000] * 4) as c:
        assert c.stats()["page_size"] == 1 << 20
        for i in range(30):
            assert c.put(i, bytes([i]) * 100_000)
        assert c.stats()["free_pages"] >= 2 and c.stats()["bytes_used"] == 3_000_000
        views = [c.view(i) for i in (0, 10, 20)]  # one pinned value on each slab page
        try:
            assert c.put(50, b"L" * 2_000_000)  # a 2-page run
            assert c.get(50) == b"L" * 2_000_000
            assert c.stats()["evictions"] == 20
        finally:
            for v in views:
                v.release()
        c.check()


def test_fingerprint_with_nul_byte_refused(cache_name):
    """A fingerprint is stored as a C string: 'ab\\0cd' was kept as 'ab', so attach with the same
    fingerprint raised FingerprintError and attach(fingerprint='ab') succeeded."""
    with pytest.raises(ValueError):
        sc.Cache.create(cache_name, num_samples=10, capacity_bytes=1 << 20, fingerprint="ab\x00cd")
