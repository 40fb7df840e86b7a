"""A job that is not alone on its cache follows the node (sampling/follow.py): its next batch takes
first what the node holds or is reading, its epoch still an exact permutation of its own; alone,
its order is what it was before jobs."""
import numpy as np
import pytest

import shadecache as sc
from shadecache.lookahead.board import OrderBoard
from shadecache.sampling.follow import follow

N, B = 400, 20


def test_follow_brings_the_cached_samples_then_those_on_their_way_into_the_window():
    order = np.arange(12, dtype=np.int64)
    cached, on_way = np.zeros(12, bool), np.zeros(12, bool)
    cached[[1, 6, 9]] = True
    on_way[[3, 10, 6]] = True            # 6: cached and on its way counts as cached
    before = order.copy()
    changed, moves = follow(order, 0, 5, cached, on_way)
    assert order[:5].tolist() == [1, 6, 9, 3, 10]          # cached in their order, then coming
    assert sorted(order.tolist()) == list(range(12))       # the same samples, each once
    assert order[5:].tolist() == [5, 0, 7, 8, 2, 4, 11]    # what left, where the others came from
    assert changed.tolist() == np.flatnonzero(order != before).tolist()
    replay = before.copy()
    for places, sources in moves:
        replay[places] = replay[sources]
    assert np.array_equal(replay, order)                   # the moves say what happened
    again = order.copy()
    assert follow(again, 0, 5, cached, on_way)[0].size == 0 and np.array_equal(again, order)
    assert follow(order, 5, 4, np.zeros(12, bool), np.zeros(12, bool))[0].size == 0   # nothing


def test_follow_looks_for_cached_samples_only_within_its_horizon():
    """The search for what the node holds stops `horizon` positions after k (what bounds a bend's
    cost whatever the epoch's length): a cached sample beyond it stays where it is."""
    order = np.arange(20, dtype=np.int64)
    cached = np.zeros(20, bool)
    cached[[4, 9, 15]] = True
    changed, _ = follow(order, 2, 3, cached, np.zeros(20, bool), horizon=10)
    assert order[2:5].tolist() == [4, 9, 2]     # 4 and 9 are within 2..11, 15 is not
    assert order[15] == 15 and sorted(order.tolist()) == list(range(20))


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "f.shc"
    sc.pack([(bytes([i % 251]) * 64, i % 10) for i in range(N)], path, progress=False)
    with sc.PackedStore(path) as s:
        yield s


def _epoch(store, cache, other_job: bool, seed=3):
    other = OrderBoard.join(cache.name, N, job="other") if other_job else None
    node = sc.Node(store, cache, read_plan="samples", read_ahead=False, job="mine")
    try:
        if other is None:
            OrderBoard.join(cache.name, N, job="mine")       # the job's board, alone on it
        sampler = node.sampler(batch_size=B, seed=seed)
        sampler.set_epoch(0)
        taken = list(iter(sampler))
        return np.asarray(taken), sampler
    finally:
        mine = node.board
        mine.leave()
        mine.close()
        if other is not None:
            other.leave()
            other.close()


def test_with_another_job_the_epoch_takes_the_cached_samples_first(store, cache_name):
    capacity = sc.Cache.capacity_for(N // 4, store.lengths)
    with sc.Cache.for_store(cache_name, store, capacity_bytes=capacity, attach=False) as cache:
        held = np.arange(0, N, 4)[:N // 4 - 5]
        cache.put_many(held, store.read_many(held.tolist()))
        held = np.flatnonzero(np.asarray(cache.cached_mask(), bool))
        alone, s_alone = _epoch(store, cache, other_job=False)
        shared, s_shared = _epoch(store, cache, other_job=True)
    assert sorted(alone.tolist()) == sorted(shared.tolist()) == list(range(N))   # permutations
    first = shared[:held.size]
    assert np.isin(first, held).all()                 # every cached sample before any other
    assert not np.isin(alone[:held.size], held).all() # alone: the order as drawn
    assert s_alone.follow_history == [] and s_shared.follow_history[0] > 0
    assert np.array_equal(alone, np.asarray(sc.ShadeSampler(N, batch_size=B, seed=3).order()))
