"""The cache's score table as the merge of the live jobs' own (lookahead/job_scores.py): one job's
scores never overwrite another's, each rule's merge, a job alone as before jobs, a killed job's
scores leaving the merge."""
import math
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import shadecache as sc
from shadecache.lookahead.board import OrderBoard

N = 40
IDS = np.arange(N, dtype=np.int64)


def _norm(scores, batch):
    lo, hi = math.log(10), math.log(batch - 1 + 10)
    return np.clip((np.asarray(scores, np.float64) - lo) / (hi - lo), 0, 1)


@pytest.fixture
def two_jobs(cache_name, request):
    rule = getattr(request, "param", "uses")
    cache = sc.Cache.create(cache_name, num_samples=N, capacity_bytes=1 << 20, policy="importance")
    a = OrderBoard.join(cache_name, N, job="A", score_merge=rule)
    b = OrderBoard.join(cache_name, N, job="B")
    a.scores.set_batch(64)
    b.scores.set_batch(256)
    yield cache, a, b
    for x in (b, a):
        x.leave()
        x.close()
    cache.close()
    cache.unlink()


def _scores(rng, batch):
    return rng.uniform(math.log(10), math.log(batch + 9), N).astype(np.float32)


@pytest.mark.parametrize("two_jobs", ["max", "sum", "last"], indirect=True)
def test_one_jobs_scores_never_overwrite_anothers(two_jobs):
    cache, a, b = two_jobs
    rng = np.random.default_rng(0)
    sa, sb = _scores(rng, 64), _scores(rng, 256)
    a.merge.scores(cache, IDS, sa)
    b.merge.scores(cache, IDS, sb)
    assert np.array_equal(a.scores.read(IDS), sa) and np.array_equal(b.scores.read(IDS), sb)
    got = np.asarray(cache.scores())[IDS]
    rule = a.score_merge
    if rule == "last":        # no merge: the last writer's own scores (the behaviour before jobs)
        assert np.array_equal(got, sb)
    else:
        both = [_norm(sa, 64), _norm(sb, 256)]
        want = np.max(both, axis=0) if rule == "max" else np.sum(both, axis=0)
        assert np.allclose(got, want, atol=1e-6)


def test_the_uses_rule_ranks_a_sample_by_the_jobs_that_still_read_it(two_jobs):
    cache, a, b = two_jobs
    sa = np.full(N, math.log(10), np.float32)              # A's lowest score: normalised 0
    sb = np.full(N, math.log(256 - 1 + 10), np.float32)    # B's highest: 1
    a.merge.scores(cache, IDS, sa)
    b.merge.scores(cache, IDS, sb)
    a.orders.publish(0, 0, IDS, epoch_length=N)
    b.orders.publish(0, 0, IDS[::-1].copy(), epoch_length=N)
    a.merge.uses(cache, IDS)
    assert np.allclose(np.asarray(cache.scores())[IDS], 1.0 + 2.0)   # both read all of them
    a.orders.consumed(0, 0, 10)                                       # A took ids 0..9
    a.merge.uses(cache, IDS[:10])
    b.orders.consumed(0, 0, 5)                                        # B took 39..35
    b.merge.uses(cache, IDS[-5:])
    got = np.asarray(cache.scores())
    assert np.allclose(got[:10], 2.0)        # only B still reads them
    assert np.allclose(got[10:35], 3.0)      # both
    assert np.allclose(got[35:], 1.0)        # only A


def test_alone_the_cache_holds_the_jobs_own_scores(cache_name):
    with sc.Cache.create(cache_name, num_samples=N, capacity_bytes=1 << 20) as cache:
        a = OrderBoard.join(cache_name, N, job="alone")
        a.scores.set_batch(64)
        s = _scores(np.random.default_rng(1), 64)
        a.merge.scores(cache, IDS, s)
        a.orders.publish(0, 0, IDS, epoch_length=N)
        a.merge.uses(cache, IDS)
        assert np.array_equal(np.asarray(cache.scores())[IDS], s)
        a.leave()
        a.close()


_KILLED = """
import sys, numpy as np
from shadecache.lookahead.board import OrderBoard
b = OrderBoard.join(sys.argv[1], int(sys.argv[2]), job="killed")
b.scores.set_batch(64)
b.scores.write(np.arange(int(sys.argv[2])), np.full(int(sys.argv[2]), 4.0, np.float32))
b.orders.publish(0, 0, np.arange(int(sys.argv[2])), epoch_length=int(sys.argv[2]))
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_killed_jobs_scores_leave_the_merge(cache_name):
    with sc.Cache.create(cache_name, num_samples=N, capacity_bytes=1 << 20) as cache:
        a = OrderBoard.join(cache_name, N, job="stays")
        a.scores.set_batch(64)
        s = _scores(np.random.default_rng(2), 64)
        a.merge.scores(cache, IDS, s)
        p = subprocess.Popen([sys.executable, "-c", _KILLED, cache_name, str(N)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            assert a.merge.jobs_changed(cache)               # a job came: merged over both
            a.orders.publish(0, 0, IDS, epoch_length=N)
            a.merge.uses(cache, IDS)
            assert np.allclose(np.asarray(cache.scores())[IDS], 2 + _norm(s, 64) + _norm(np.full(N, 4.0), 64))
            p.send_signal(signal.SIGKILL)
            p.wait()
            deadline = time.monotonic() + 2
            while not a.all_jobs.free_dead() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert a.merge.jobs_changed(cache)               # a job went: its part is gone
            assert np.array_equal(np.asarray(cache.scores())[IDS], s)   # alone again: its own
        finally:
            p.kill()
            p.wait()
            a.leave()
            a.close()


def test_a_merge_after_the_node_file_was_removed_writes_the_jobs_own_scores(two_jobs):
    """The node's file removed under two live jobs (by hand): a job's next score write must not
    crash its sampler mid-epoch; with no registry to merge under it writes its own scores."""
    import os

    from shadecache import shm
    cache, a, b = two_jobs
    sa = _scores(np.random.default_rng(1), 64)
    os.unlink(shm.board_path(cache.name))
    a.merge.scores(cache, IDS, sa)
    assert np.array_equal(np.asarray(cache.scores())[IDS], sa)
