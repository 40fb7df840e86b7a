"""Fixtures for bench_cache.py: the stores of bench/cache_table.py, built once per test class.

Sizes come from cache_table.Config (the published run); SHADECACHE_BENCH_TINY=1 selects the
seconds-long Config.tiny(), SHADECACHE_BENCH_WORKING_SET_GIB and SHADECACHE_BENCH_REPS override the
working set and the number of rounds. Each fixture is
class-scoped so only one comparison's stores (a few GiB of shared memory) exist at a time.
"""
import itertools
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import cache_table  # noqa: E402


def bench_config():
    cfg = cache_table.Config.tiny() if os.environ.get("SHADECACHE_BENCH_TINY") else cache_table.Config()
    ws = os.environ.get("SHADECACHE_BENCH_WORKING_SET_GIB")
    if ws:
        cfg.working_set_bytes = int(float(ws) * (1 << 30))
    reps = os.environ.get("SHADECACHE_BENCH_REPS")
    if reps:
        cfg.reps = int(reps)
    return cfg


@pytest.fixture(scope="session")
def cfg():
    return bench_config()


@pytest.fixture(scope="class")
def small(cfg):
    with cache_table.small_setup(cfg) as s:
        yield s


@pytest.fixture(scope="class")
def large(cfg):
    with cache_table.large_setup(cfg) as s:
        yield s


@pytest.fixture(scope="class")
def full_lru(cfg):
    with cache_table.full_cache_setup(cfg, "lru") as full:
        yield full


@pytest.fixture(scope="class")
def full_importance(cfg):
    with cache_table.full_cache_setup(cfg, "importance") as full:
        yield full


@pytest.fixture(scope="class")
def scored(cfg):
    with cache_table.scores_setup(cfg) as s:
        yield s


def per_round(make_args):
    """A pytest-benchmark `setup` that hands round k the arguments of repetition k (cycling), so
    no round re-reads the values the round before it pulled into the CPU caches."""
    reps = itertools.count()

    def setup():
        return make_args(next(reps)), {}

    return setup
