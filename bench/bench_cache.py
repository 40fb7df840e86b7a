"""pytest-benchmark view of the cache's speed targets: the Cache next to each alternative, one
benchmark group per comparison.

    python -m pytest bench/bench_cache.py --benchmark-only

Every round runs one repetition's whole loop (the sizes of cache_table.Config: gets, get_many
calls of 64, puts or update_scores calls; extra_info["ops_per_round"] says how many), over ids not
used by the round before. pytest-benchmark reports seconds per round; the ratios and the PASS/FAIL
against each target come from bench/cache_table.py, which runs the same loops side by side.
"""
import pytest

import baselines
import cache_table as ct
from conftest import per_round


def _run(benchmark, group, ops, loop, make_args, cfg):
    benchmark.group = group
    benchmark.extra_info["ops_per_round"] = ops
    benchmark.pedantic(loop, setup=per_round(make_args), rounds=cfg.reps, iterations=1)


class TestSmallValues:
    """3 KB values, working set far beyond the CPU caches."""

    def test_get_cache(self, benchmark, small, cfg):
        _run(benchmark, "get 3 KB", cfg.gets_per_rep, ct.cache_get_loop,
             lambda r: (small.cache, small.ids[r % cfg.reps]), cfg)

    def test_get_shm_dict(self, benchmark, small, cfg):
        _run(benchmark, "get 3 KB", cfg.gets_per_rep, baselines.shm_dict_get_loop,
             lambda r: (small.shm.buf, small.shm.index, small.ids[r % cfg.reps]), cfg)

    def test_get_lmdb_txn_per_get(self, benchmark, small, cfg):
        _run(benchmark, "get 3 KB", cfg.gets_per_rep, baselines.lmdb_get_loop,
             lambda r: (small.lmdb.env, small.lmdb_keys[r % cfg.reps]), cfg)

    def test_plain_copy(self, benchmark, small, cfg):
        _run(benchmark, "get 3 KB", cfg.gets_per_rep, baselines.plain_copy_loop,
             lambda r: (small.shm.buf, small.offsets[r % cfg.reps], cfg.small), cfg)

    def test_get_many_cache(self, benchmark, small, cfg):
        ops = len(small.batches[0]) * cfg.batch
        _run(benchmark, "get_many(64) 3 KB", ops, ct.cache_get_many_loop,
             lambda r: (small.cache, small.batches[r % cfg.reps]), cfg)

    def test_mget_redis(self, benchmark, small, cfg):
        if small.redis is None:
            pytest.skip(small.redis_skip)
        ops = len(small.batches[0]) * cfg.batch
        _run(benchmark, "get_many(64) 3 KB", ops, baselines.redis_mget_loop,
             lambda r: (small.redis.client, small.redis_keys[r % cfg.reps]), cfg)


class TestLargeValues:
    """100 KB values: the cache against a plain bytes copy from a shm mapping."""

    def test_get_cache(self, benchmark, large, cfg):
        _run(benchmark, "get 100 KB", cfg.large_gets_per_rep, ct.cache_get_loop,
             lambda r: (large.cache, large.ids[r % cfg.reps]), cfg)

    def test_plain_copy(self, benchmark, large, cfg):
        _run(benchmark, "get 100 KB", cfg.large_gets_per_rep, baselines.plain_copy_loop,
             lambda r: (large.shm.buf, large.offsets[r % cfg.reps], cfg.large), cfg)

    def test_get_shm_dict(self, benchmark, large, cfg):
        _run(benchmark, "get 100 KB", cfg.large_gets_per_rep, baselines.shm_dict_get_loop,
             lambda r: (large.shm.buf, large.shm.index, large.ids[r % cfg.reps]), cfg)


def _put_rounds(benchmark, full, cfg):
    """Each round puts fresh uncached ids; the puts of a round are checked after it."""
    benchmark.group = "put 3 KB into a full cache"
    benchmark.extra_info["ops_per_round"] = cfg.puts_per_rep
    done = []

    def setup():
        ids, vals, scores = full.prepare(cfg.puts_per_rep)
        if done:
            full.verify(*done.pop())
        done.append((full.cache.stats(), ids))
        return (ids, vals, scores), {}

    benchmark.pedantic(full.run, setup=setup, rounds=cfg.reps, iterations=1)
    full.verify(*done.pop())


class TestFullPuts:
    def test_put_lru(self, benchmark, full_lru, cfg):
        _put_rounds(benchmark, full_lru, cfg)

    def test_put_importance(self, benchmark, full_importance, cfg):
        _put_rounds(benchmark, full_importance, cfg)


class TestUpdateScores:
    """64 ids per call on a cache holding 1M items."""

    def test_update_scores_cached(self, benchmark, scored, cfg):
        _run(benchmark, "update_scores 64 ids", cfg.score_calls_per_rep * cfg.batch,
             ct.cache_update_scores_loop,
             lambda r: (scored.cache, *scored.batches["cached"][r % cfg.reps]), cfg)

    def test_update_scores_ghost(self, benchmark, scored, cfg):
        _run(benchmark, "update_scores 64 ids", cfg.score_calls_per_rep * cfg.batch,
             ct.cache_update_scores_loop,
             lambda r: (scored.cache, *scored.batches["ghost"][r % cfg.reps]), cfg)
