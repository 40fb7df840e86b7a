"""The node's prefetcher is the node's, not the process's that started it (lookahead/prefetcher.py):
when its starter closes its node or is SIGKILLed while another job trains on the node, the same
prefetcher goes on reading ahead for that job, and it exits once no job lives on the board."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shadecache as sc
from shadecache.process import alive, start_time_of

N, SIZE = 600, 300


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "s.shc"
    rng = np.random.default_rng(0)
    sc.pack([(rng.bytes(SIZE), i % 10) for i in range(N)], path, progress=False)
    return str(path)


@pytest.fixture
def cache(store_path, cache_name):
    with sc.PackedStore(store_path) as store:
        c = sc.Cache.for_store(cache_name, store, capacity_bytes=sc.Cache.capacity_for(N // 2, store.lengths),
                               attach=False)
    yield c
    c.close()
    c.unlink()
    sc.cache.gc()


def _wait_for(cond, seconds):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < seconds:
        time.sleep(0.01)
    return cond()


def _node(store_path, cache, job):
    return sc.Node(sc.PackedStore(store_path), cache, job=job, read_plan="samples",
                   prefetch=dict(lookahead_samples=64))


def _reads_ahead_for(node, cache):
    """Publishes an epoch of `node`'s job with its cursor at the start: a prefetcher that serves
    the job reads the first samples of the order into the cache (nothing else reads here)."""
    sampler = node.sampler(batch_size=32, seed=1, stall_budget=0.0, importance=False)
    sampler.set_epoch(0)
    it = iter(sampler)
    first = next(it)
    return _wait_for(lambda: cache.stats()["items"] >= 32, 20), first


def test_a_starter_that_closes_its_node_leaves_the_prefetcher_to_a_job_still_training(store_path,
                                                                                      cache):
    a, b = _node(store_path, cache, "a"), _node(store_path, cache, "b")
    a.start_reading_ahead()
    pid = a.started_prefetcher.pid
    start = start_time_of(pid)
    a.close()                       # job a leaves; job b lives on the board
    assert b.prefetching and b.board.control.prefetcher_pid == pid
    read, _ = _reads_ahead_for(b, cache)
    assert read, f"the prefetcher read nothing ahead for job b: {cache.stats()['items']} items"
    b.close()                       # the last job leaves: the prefetcher exits on its own
    assert _wait_for(lambda: not alive(pid, start), 5), "the prefetcher outlived the last job"


def test_the_last_job_that_closes_its_node_stops_the_prefetcher_it_started(store_path, cache):
    a = _node(store_path, cache, "a")
    a.start_reading_ahead()
    p = a.started_prefetcher
    pid, start = p.pid, start_time_of(p.pid)
    a.close()
    assert not alive(pid, start)    # stopped and waited for, not left to exit later


_STARTER = """
import sys, time, shadecache as sc
cache = sc.Cache.attach(sys.argv[2])
node = sc.Node(sc.PackedStore(sys.argv[1]), cache, job="starter", read_plan="samples",
               prefetch=dict(lookahead_samples=64))
node.start_reading_ahead()
print(node.started_prefetcher.pid, flush=True)
time.sleep(120)
"""


def test_a_sigkilled_starter_leaves_the_prefetcher_serving_the_job_still_training(store_path, cache,
                                                                                 tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_STARTER), store_path, cache.name],
                               stdout=subprocess.PIPE, text=True, env=env)
    pid = int(starter.stdout.readline())
    start = start_time_of(pid)
    survivor = _node(store_path, cache, "survivor")
    try:
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
        time.sleep(1.0)             # more than the prefetcher's look for live jobs (0.2 s)
        assert alive(pid, start), "the prefetcher died with the job that started it"
        assert survivor.prefetching and survivor.board.control.prefetcher_pid == pid
        read, _ = _reads_ahead_for(survivor, cache)
        assert read, f"the prefetcher read nothing ahead for the survivor: {cache.stats()['items']} items"
    finally:
        survivor.close()
    assert _wait_for(lambda: not alive(pid, start), 5), "the prefetcher outlived the last job"
    if alive(pid, start):
        os.kill(pid, signal.SIGKILL)
