"""The node's prefetcher is the node's, not the process's that started it (lookahead/prefetcher.py):
when its starter closes its node, exits, is SIGKILLed or gets a Ctrl-C while another job trains
on the node, the same prefetcher goes on reading ahead for that job; it exits once no job lives on
the board (stopped and reaped by a process that holds it, or on its own, stuck reads included);
one prefetcher per node, and a process stops only its own."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shadecache as sc
from shadecache import status
from shadecache.lookahead.prefetcher import ORPHANED_EXIT_S
from shadecache.process import alive, start_time_of

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from counting_store import pack_random  # noqa: E402

N, SIZE = 600, 300


@pytest.fixture
def store_path(tmp_path):
    return pack_random(tmp_path / "s.shc", N, SIZE)


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
    b.close()                       # the last job leaves: this process stops the prefetcher it handed over
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
        survivor.close()
        assert _wait_for(lambda: not alive(pid, start), 5), "the prefetcher outlived the last job"
    finally:
        survivor.close()
        _kill(pid, start)


def _kill(pid, start):
    if alive(pid, start):
        os.kill(pid, signal.SIGKILL)


def test_a_ctrl_c_at_the_starter_leaves_the_prefetcher_to_the_job_still_training(store_path, cache, tmp_path):
    """A Ctrl-C reaches the starter's whole process group; the prefetcher has a session of its own.
    The starter installs Python's Ctrl-C handler itself, as a script run from a terminal has it: a
    suite started in the background of a shell inherits SIGINT ignored, and Python then leaves it
    ignored (the starter slept through the signal). One that still does not exit says where it
    is (its stacks: faulthandler on SIGUSR1)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    stacks = tmp_path / "starter-stderr.txt"
    script = ("import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n" + textwrap.dedent(_STARTER))
    with open(stacks, "w") as err:
        starter = subprocess.Popen([sys.executable, "-c", script, store_path, cache.name],
                                   stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                   start_new_session=True)
    pid = start = survivor = None
    try:
        line = starter.stdout.readline()
        assert line.strip().isdigit(), f"the starter printed {line!r}; its stderr:\n{stacks.read_text()}"
        pid = int(line)
        start = start_time_of(pid)
        survivor = _node(store_path, cache, "survivor")
        os.killpg(starter.pid, signal.SIGINT)
        try:
            rc = starter.wait(30)
        except subprocess.TimeoutExpired:
            starter.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            pytest.fail("the starter did not exit within 30 s of a Ctrl-C; its stacks:\n" + stacks.read_text())
        assert rc == -signal.SIGINT, f"the starter ended with {rc}, not by the Ctrl-C (KeyboardInterrupt)"
        time.sleep(0.5)
        assert alive(pid, start), "a Ctrl-C at the job that started it ended the node's prefetcher"
        assert survivor.board.control.prefetcher_pid == pid
        survivor.close()                        # the last job leaves
        survivor = None
        assert _wait_for(lambda: not alive(pid, start), 5), "the prefetcher outlived the last job"
    finally:   # whatever failed above: nothing left running
        if starter.poll() is None:
            starter.kill()
        starter.wait()
        starter.stdout.close()
        if survivor is not None:
            survivor.close()
        if pid is not None:
            _kill(pid, start)


def test_a_starter_whose_prefetcher_died_does_not_stop_the_one_another_job_started(store_path, cache):
    a, b = _node(store_path, cache, "a"), _node(store_path, cache, "b")
    try:
        a.start_reading_ahead()
        first = a.started_prefetcher.pid
        os.kill(first, signal.SIGKILL)
        assert _wait_for(lambda: not b.prefetching, 5)
        b.start_reading_ahead()                 # what b's sampler does within half a second
        second = b.started_prefetcher.pid
        assert second != first
        a.close()                               # reaps its own; the stop word is not a's to set
        assert b.prefetching and b.board.control.prefetcher_pid == second
        assert not b.board.control.stop_requested
    finally:
        a.close()
        b.close()
    assert not alive(second, 0)


def test_a_prefetcher_registered_over_by_another_exits(store_path, cache):
    """Two prefetchers never read for one node: the one no longer registered (another, whose
    start outlasted its starter's wait, registered over it) leaves at its next pass."""
    a = _node(store_path, cache, "a")
    try:
        a.start_reading_ahead()
        p = a.started_prefetcher
        a.board.control.set_prefetcher(os.getpid())   # a live process that is not it
        assert p.proc.wait(10) == 0
    finally:
        a.board.control.set_prefetcher(0)
        a.close()


def test_the_last_node_of_a_process_stops_and_reaps_the_prefetcher_it_handed_over(store_path, cache):
    a, b = _node(store_path, cache, "a"), _node(store_path, cache, "b")   # two jobs, one process
    a.start_reading_ahead()
    pid = a.started_prefetcher.pid
    a.close()                                   # b still trains: handed over
    assert b.prefetching
    b.close()
    assert not alive(pid, 0)
    with pytest.raises(ChildProcessError):       # reaped: no zombie left in this process
        os.waitpid(pid, os.WNOHANG)


_HUNG_STARTER = """
import sys, time, shadecache as sc
sys.path.insert(0, sys.argv[4])
from counting_store import CountingStore
cache = sc.Cache.attach(sys.argv[2])
node = sc.Node(CountingStore(sys.argv[1], sys.argv[3], delay_s=600.0), cache, job="starter",
               read_plan="samples", prefetch=dict(lookahead_samples=64))
node.start_reading_ahead()
print(node.started_prefetcher.pid, flush=True)
sys.stdin.readline()
node.close()
"""


def test_a_prefetcher_stuck_in_a_read_exits_after_the_last_job_left(store_path, cache, tmp_path):
    """Its starter exits normally (the prefetcher handed to the survivor), its store never
    answers; the survivor leaves: the stuck prefetcher exits ORPHANED_EXIT_S later."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HUNG_STARTER), store_path, cache.name,
                                str(tmp_path / "count"), HERE], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env)
    pid = int(starter.stdout.readline())
    start = start_time_of(pid)
    survivor = _node(store_path, cache, "survivor")
    try:
        starter.stdin.write("\n")
        starter.stdin.flush()
        assert starter.wait(30) == 0
        assert alive(pid, start)
        sampler = survivor.sampler(batch_size=32, seed=1, stall_budget=0.0, importance=False)
        sampler.set_epoch(0)
        next(iter(sampler))                     # published: the prefetcher's read hangs
        assert _wait_for(lambda: survivor.board.flags.on_way(np.arange(N)).any(), 30), \
            "the prefetcher put no read on its way"
        survivor.close()
        t0 = time.monotonic()
        assert _wait_for(lambda: not alive(pid, start), ORPHANED_EXIT_S + 10), \
            "a prefetcher stuck in a read outlived the last job"
        assert time.monotonic() - t0 >= ORPHANED_EXIT_S - 2   # its loop was stuck: the backstop ended it
    finally:
        survivor.close()
        _kill(pid, start)


_EXITS_WITHOUT_CLOSE = """
import sys, shadecache as sc
cache = sc.Cache.attach(sys.argv[2])
node = sc.Node(sc.PackedStore(sys.argv[1]), cache, job="leaves", read_plan="samples")
node.start_reading_ahead()
print(node.started_prefetcher.pid, flush=True)
"""


def test_a_process_that_exits_without_closing_its_node_stops_its_prefetcher_cleanly(store_path, cache):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXITS_WITHOUT_CLOSE), store_path, cache.name],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and "Exception" not in out.stderr and "Error" not in out.stderr, out.stderr
    pid = int(out.stdout)
    assert _wait_for(lambda: not alive(pid, 0), 5)
    # stopped, not killed: a prefetcher that ends cleanly removes its status file
    assert not os.path.exists(status.path_of(cache.name, status.PREFETCHER))
