"""The prefetcher's plan (shadecache/lookahead/plan.py) as the pure function it is: no process, no
board, no cache; the window, the cache's mask and the rule in, the next batch out."""
import numpy as np
import pytest

from shadecache.lookahead import plan
from shadecache.lookahead.board import READS_ADMITTED, READS_EVERY_MISS, READS_UNTIL_FULL

N = 100
LIMITS = plan.Limits(batch=4, max_batches=2, max_bytes=1000, item_bytes=64)
LENGTHS = np.full(N, 100, dtype=np.int64)


def roomy(**kw):
    """What the prefetcher has ahead: nothing, into a cache with room (fields overridable)."""
    return plan.Ahead(**{**dict(inflight=0, on_way=0, pending_bytes=0, full=False,
                                engine_full=False, free=1 << 20), **kw})


def everything_kept(ids):
    return np.ones(len(ids), dtype=bool)


def nothing_held(ids):
    return np.zeros(len(ids), dtype=bool)


def everything_admitted(ids, displaced):
    return np.ones(len(ids), dtype=bool)


def window(ids):
    ids = np.asarray(ids, dtype=np.int64)
    return ids, 1000 + np.arange(ids.size, dtype=np.int64)   # positions: the order they come in


def test_candidates_leave_out_what_is_cached_kept_elsewhere_or_on_its_way():
    ids, places = window([5, 6, 7, 8, 9, 10])
    cached = np.zeros(N, dtype=bool)
    cached[6] = True
    got, at = plan.candidates(ids, places, cached, lambda i: np.asarray(i) != 8, np.array([9]))
    assert got.tolist() == [5, 7, 10] and at.tolist() == [1000, 1002, 1005]


def test_the_first_candidates_up_to_the_batch_and_the_bytes_left():
    ids, places = window(range(10, 20))
    r = plan.next_reads(ids, places, LENGTHS, READS_EVERY_MISS, roomy(), LIMITS, nothing_held,
                        everything_admitted)
    assert r.ids.tolist() == [10, 11, 12, 13] and r.places.tolist() == [1000, 1001, 1002, 1003]
    assert r.nbytes.tolist() == [100] * 4 and r.evict == 0
    # 750 bytes read ahead and not offered yet: two more samples fit in the 1000 allowed
    r = plan.next_reads(ids, places, LENGTHS, READS_EVERY_MISS, roomy(pending_bytes=750), LIMITS,
                        nothing_held, everything_admitted)
    assert r.ids.tolist() == [10, 11]
    # unknown lengths: item_bytes each
    r = plan.next_reads(ids, places, None, READS_EVERY_MISS, roomy(pending_bytes=900), LIMITS,
                        nothing_held, everything_admitted)
    assert r.ids.tolist() == [10] and r.nbytes.tolist() == [64]


def test_nothing_while_max_batches_are_in_flight():
    ids, places = window(range(10, 20))
    r = plan.next_reads(ids, places, LENGTHS, READS_EVERY_MISS, roomy(inflight=2), LIMITS,
                        nothing_held, everything_admitted)
    assert r.ids.size == 0


def test_a_full_cache_without_a_copying_tier_makes_room_one_out_for_one_in():
    ids, places = window(range(10, 20))
    # the engine said it is full: every sample read needs one out
    r = plan.next_reads(ids, places, LENGTHS, READS_EVERY_MISS,
                        roomy(full=True, engine_full=True, free=10_000), LIMITS, nothing_held,
                        everything_admitted)
    assert r.ids.size == 4 and r.evict == 4
    # full by its bytes only: what its free bytes take is read without removing anything
    r = plan.next_reads(ids, places, LENGTHS, READS_EVERY_MISS,
                        roomy(full=True, engine_full=False, free=250), LIMITS, nothing_held,
                        everything_admitted)
    assert r.ids.size == 4 and r.evict == 2
    # a cache with room evicts nothing, whatever the rule
    r = plan.next_reads(ids, places, LENGTHS, READS_EVERY_MISS, roomy(), LIMITS, nothing_held,
                        everything_admitted)
    assert r.evict == 0


def test_with_a_copying_tier_a_full_cache_reads_only_what_it_would_admit_and_the_tier_lacks():
    ids, places = window(range(10, 20))
    seen = {}

    def held(i):
        return np.isin(i, [11, 14])

    def would_admit(i, displaced):
        seen["displaced"] = np.asarray(displaced).tolist()
        return np.asarray(i) % 2 == 0

    r = plan.next_reads(ids, places, LENGTHS, READS_ADMITTED, roomy(full=True, on_way=3), LIMITS,
                        held, would_admit)
    assert r.ids.tolist() == [10, 12, 16, 18] and r.evict == 0
    # each candidate counts the samples due before it, twice: 3 on their way, then its rank
    assert seen["displaced"] == [2 * (3 + k) for k in range(10)]
    # not full: every candidate, nothing asked
    seen.clear()
    r = plan.next_reads(ids, places, LENGTHS, READS_ADMITTED, roomy(), LIMITS, held, would_admit)
    assert r.ids.tolist() == [10, 11, 12, 13] and not seen


def test_under_the_extent_plan_a_full_cache_is_read_ahead_no_more():
    ids, places = window(range(10, 20))
    r = plan.next_reads(ids, places, LENGTHS, READS_UNTIL_FULL, roomy(full=True), LIMITS,
                        nothing_held, everything_admitted)
    assert r.ids.size == 0
    r = plan.next_reads(ids, places, LENGTHS, READS_UNTIL_FULL, roomy(), LIMITS, nothing_held,
                        everything_admitted)
    assert r.ids.tolist() == [10, 11, 12, 13]


def test_an_unknown_rule_is_refused():
    ids, places = window(range(10, 20))
    with pytest.raises(ValueError, match="unknown read rule"):
        plan.by_rule(ids, places, 9, roomy(full=True), nothing_held, everything_admitted)
