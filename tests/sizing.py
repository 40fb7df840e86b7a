"""Capacities for tests that need a cache to hold an exact number of values.

capacity_bytes is memory (the index, heap and slot headers come out of it), so how many values of a
size a capacity holds follows from the engine's geometry. Tests that reason about "the 17th put
evicts" ask for the capacity that holds exactly that many, found by trying caches.
"""
import os
import uuid

import shadecache as sc


def _holds(cap, size, num_samples, policy):
    name = f"t-{os.getpid()}-size-{uuid.uuid4().hex[:8]}"
    with sc.Cache.create(name, num_samples=num_samples, capacity_bytes=cap, policy=policy) as c:
        value = b"x" * size
        for i in range(num_samples):
            if not c.put(i, value, score=float(i + 1)) or c.stats()["evictions"]:
                return i
        return num_samples


def capacity_holding(count, size, num_samples=1000, policy="importance", exact=True):
    """A capacity_bytes whose cache holds exactly `count` values of `size` bytes before the next
    put evicts (or, under static, is refused); exact=False: the most it can up to `count` (memory
    comes in pages, so a value of several chunks may not have an exact count)."""
    lo = sc.Cache.capacity_for(1, [size], num_samples=num_samples, policy=policy)
    hi = sc.Cache.capacity_for(count + 1, [size], num_samples=num_samples, policy=policy)
    while _holds(hi, size, num_samples, policy) <= count:
        hi *= 2
    while hi - lo > 64:  # the largest capacity that holds no more than `count`
        mid = (lo + hi) // 2
        if _holds(mid, size, num_samples, policy) <= count:
            lo = mid
        else:
            hi = mid
    held = _holds(lo, size, num_samples, policy)
    assert held == count or (not exact and 0 < held < count), f"no capacity holds exactly {count} of {size} B"
    return lo
