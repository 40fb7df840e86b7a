"""Eviction stays in the policy's order whatever the size mix: making room for a value evicts only
the values with the lowest keys cached (the lowest scores for importance, the least recently used
for lru, the first inserted for fifo, the farthest next use for clairvoyant), never a value of
another size class because its memory is in the wrong place. Memory moves between classes by
moving values (compaction), which evicts nothing.

Each test fills a cache with an image-like mix (log-normal, median 110 KB, sigma 1.2, clipped so
that one put needs a few percent of the cache at most), then watches a few hundred more puts: the
values each put evicted must all sit in the lowest 10% of the keys cached before it, and below
every key that stayed."""
import numpy as np
import pytest

import shadecache as sc
from values import make_value

KB, MiB = 1 << 10, 1 << 20
CAP = 64 * MiB
N = 3000


def _mix(rng):
    return np.clip(rng.lognormal(np.log(110 * KB), 1.2, N), KB, 2 * MiB).astype(np.int64)


def _put_watched(c, i, value, keys, label, **kw):
    """Puts `value` as id i and checks what it evicted against `keys` (the policy's key of each id
    before the put: evicted first = lowest). Returns how many it evicted."""
    before = c.cached_mask()
    c.put(i, value, **kw)
    after = c.cached_mask()
    after[i] = False
    evicted = before & ~after
    if not evicted.any():
        return 0
    stayed = before & after
    cached_keys = keys[before]
    tenth = np.quantile(cached_keys, 0.10)
    assert keys[evicted].max() <= tenth, f"{label}: evicted a key above the lowest 10% of those cached"
    assert keys[evicted].max() <= keys[stayed].min(), f"{label}: a value with a lower key stayed"
    return int(evicted.sum())


@pytest.mark.parametrize("given_sizes", [True, False], ids=["sizes", "no-sizes"])
def test_importance_evicts_only_the_lowest_scores(cache_name, given_sizes):
    rng = np.random.default_rng(1)
    sizes = _mix(rng)
    kw = dict(sizes=sizes) if given_sizes else {}
    with sc.Cache.create(cache_name, num_samples=N, capacity_bytes=CAP, policy="importance", **kw) as c:
        order = rng.permutation(N)
        scores = rng.random(N).astype(np.float32)
        for i in order[:1500]:
            c.put(int(i), make_value(int(i), 0, int(sizes[i])), score=float(scores[i]))
        evictions = 0
        for i in order[1500:1900]:
            table = c.scores()
            table[i] = scores[i]
            evictions += _put_watched(c, int(i), make_value(int(i), 1, int(sizes[i])), table, f"put of id {i}",
                                      score=float(scores[i]))
        s = c.stats()
        assert evictions > 100 and s["page_moves"] > 0, s  # memory did move between classes
        c.check()


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_lru_and_fifo_evict_in_their_order(cache_name, policy):
    rng = np.random.default_rng(2)
    sizes = _mix(rng)
    with sc.Cache.create(cache_name, num_samples=N, capacity_bytes=CAP, policy=policy) as c:
        tick = 0
        last = np.zeros(N)  # the clock value each id's key holds (inserts advance the clock)
        evictions = 0
        for step, i in enumerate(rng.permutation(N)[:2200]):
            i = int(i)
            if step % 3 == 0 and step:  # a hit: lru stamps it with the clock of the latest insert
                hit = int(rng.choice(np.flatnonzero(c.cached_mask())))
                assert c.get(hit) is not None
                if policy == "lru":
                    last[hit] = tick
            evictions += _put_watched(c, i, make_value(i, 0, int(sizes[i])), last.copy(), f"{policy} put of id {i}")
            tick += 1
            last[i] = tick
        assert evictions > 100
        c.check()


def test_clairvoyant_evicts_the_farthest_next_use(cache_name):
    rng = np.random.default_rng(3)
    sizes = _mix(rng)
    with sc.Cache.create(cache_name, num_samples=N, capacity_bytes=CAP, policy="clairvoyant") as c:
        positions = rng.permutation(N).astype(np.int64) + 10
        c.set_next_use(np.arange(N), positions)
        evictions = 0
        order = rng.permutation(N)
        for step, i in enumerate(order[:2000]):
            i = int(i)
            c.set_next_use([i], [step % 5])  # read soon: admitted
            positions[i] = step % 5
            keys = -positions.astype(np.float64)  # the farthest next use is the lowest key
            evictions += _put_watched(c, i, make_value(i, 0, int(sizes[i])), keys, f"put of id {i}")
        assert evictions > 100
        c.check()
