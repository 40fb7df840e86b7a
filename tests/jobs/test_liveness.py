"""A job lives as long as its training processes (docs/jobs.md, lookahead/jobs.py): the processes
they fork (DataLoader workers) neither keep a job alive nor the registry lock held, and a node
leaves its job when it closes."""
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import shadecache as sc
from shadecache import shm
from shadecache.lookahead import jobs as registry
from shadecache.lookahead.board import BoardLink, OrderBoard


def _files(name):
    return sorted(e for e in os.listdir(shm.SHM_DIR) if name in e and not e.startswith(shm.SEGMENT_PREFIX))


def _wait_for(cond, seconds):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < seconds:
        time.sleep(0.01)
    return time.monotonic() - t0


# A job that forks a child (as a DataLoader starts its workers) and prints its slot and the
# child's pid, then sleeps until killed.
_FORKING_JOB = """
import multiprocessing as mp, sys, time
from shadecache.lookahead.board import OrderBoard
b = OrderBoard.join(sys.argv[1], 50, job="forks")
child = mp.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
child.start()
print(b.slot, child.pid, flush=True)
time.sleep(60)
"""


def test_a_sigkilled_job_is_dead_at_once_though_its_forked_child_lives(cache_name):
    """The child shares the descriptor its parent holds the job's byte on (one open file
    description): unless it lets go at the fork, the job lives as long as the child does."""
    watcher = OrderBoard.join(cache_name, 50, job="watcher")
    p = subprocess.Popen([sys.executable, "-c", _FORKING_JOB, cache_name], stdout=subprocess.PIPE,
                         text=True)
    slot, child = map(int, p.stdout.readline().split())
    try:
        assert watcher.jobs.lives(slot)
        p.send_signal(signal.SIGKILL)
        p.wait()
        took = _wait_for(lambda: not watcher.jobs.lives(slot), 3)
        assert os.path.exists(f"/proc/{child}"), "the child should outlive its parent here"
        assert took < 0.5, f"the killed job counted as live for {took:.2f} s (its child holds it)"
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
        watcher.leave()
        watcher.close()
    assert _files(cache_name) == []


_PERSISTENT_WORKERS = """
import sys
from torch.utils.data import DataLoader
from shadecache.lookahead.board import OrderBoard
b = OrderBoard.join(sys.argv[1], 50, job="trains")
loader = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)
for x in loader:
    pass
print("trained", flush=True)
"""


def test_a_job_whose_dataloader_workers_persist_removes_its_files_at_a_clean_exit(cache_name):
    """The exit's leave runs before multiprocessing stops the workers: they must not count as the
    job's processes, or nobody is left to remove its files."""
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", _PERSISTENT_WORKERS, cache_name],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "trained" in out.stdout, out.stderr[-2000:]
    assert _files(cache_name) == []


def test_a_child_forked_while_the_registry_lock_is_held_does_not_keep_it(cache_name):
    """Another thread forks (a DataLoader starting its workers) while a merge holds the registry
    lock: the lock ends with the merge's block, not with the child."""
    b = OrderBoard.join(cache_name, 50, job="merges")
    inside, go = threading.Event(), threading.Event()

    def merge():
        with b.jobs.locked():
            inside.set()
            go.wait()

    t = threading.Thread(target=merge)
    t.start()
    inside.wait()
    child = mp.get_context("fork").Process(target=time.sleep, args=(3,))
    child.start()
    try:
        go.set()
        t.join()
        t0 = time.monotonic()
        with b.jobs.locked():
            took = time.monotonic() - t0
        assert took < 0.5, f"the registry lock was held {took:.2f} s after its block ended"
    finally:
        child.kill()
        child.join()
        b.leave()
        b.close()


def test_a_forked_copy_of_a_node_s_link_observes_the_job_and_holds_nothing(cache_name):
    link = BoardLink(cache_name, "parent-job", 50, 1, counted=True)
    board = link.create(50, 1)
    key = (board.identity[0], board.slot, board.generation)
    ctx = mp.get_context("fork")
    answer, go = ctx.SimpleQueue(), ctx.Event()

    def worker():
        b = link.get()              # what a forked DataLoader worker's data set does
        answer.put((b is not None and b.slot == key[1], link.member, registry.holding(*key)))
        go.wait(10)                 # attached while its parent's job ends

    child = ctx.Process(target=worker)
    child.start()
    try:
        attached, member, holds = answer.get()
        assert attached and not member and holds == 0
        link.close()                # the parent's node closes: the job ends with it
        assert _files(cache_name) == []
    finally:
        go.set()
        child.join(10)


def _node(store, cache, job):
    return sc.Node(store, cache, read_plan="samples", read_ahead=True, job=job)


def test_a_closed_node_leaves_its_job_and_the_last_node_of_a_job_ends_it(cache_name, tmp_path):
    path = tmp_path / "s.shc"
    sc.pack([(bytes([i]) * 64, i % 3) for i in range(40)], path, progress=False)
    with sc.PackedStore(path) as store, sc.Cache.for_store(cache_name, store, 1 << 20) as cache:
        a = _node(store, cache, "sweep-a")
        a.close()                    # a sweep's first job is done; its driver runs the next
        b = _node(store, cache, "sweep-b")
        assert [(j["name"], j["live"]) for j in b.board.jobs.describe()] == [("sweep-b", True)]
        b2 = _node(store, cache, "sweep-b")           # two nodes of one job in one process
        b.close()
        assert b2.board is not None and b2.board.jobs.find("sweep-b") is not None
        assert b.board is None                        # closed: not joined again
        b2.close()
        assert _files(cache_name) == []


_JOB = """
import sys
from shadecache.lookahead.board import OrderBoard
b = OrderBoard.join(sys.argv[1], 50, job=sys.argv[2])
print(b.slot, flush=True)
sys.stdin.readline()
"""


def test_a_join_that_fails_holds_nothing_of_the_job(cache_name):
    """A rank whose join fails after it took the job's byte (here: the job's file is damaged)
    must not keep the job looking alive once the job's real processes are gone."""
    p = subprocess.Popen([sys.executable, "-c", _JOB, cache_name, "damaged"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    slot = int(p.stdout.readline())
    watcher = OrderBoard.join(cache_name, 50, job="watcher")
    try:
        fd = os.open(shm.job_board_path(cache_name, slot), os.O_RDWR)
        os.pwrite(fd, (0).to_bytes(8, "little"), 16)          # its streams: 0 (a damaged header)
        os.close(fd)
        with pytest.raises(ValueError, match="damaged job board"):
            OrderBoard.join(cache_name, 50, job="damaged")
        p.kill()
        p.wait()
        assert not watcher.jobs.lives(slot), "the failed join kept the job's byte"
    finally:
        p.kill()
        p.wait()
        watcher.leave()
        watcher.close()
    assert _files(cache_name) == []


def test_a_link_whose_board_was_removed_closes_it(cache_name):
    link = BoardLink(cache_name, "gone", 50, 1)
    old = link.create(50, 1)
    old.unlink()                           # both names removed under the live job
    assert link.get() is None and old.closed
    link.close()


def test_a_link_unpickled_in_a_spawned_worker_observes(cache_name):
    """A spawned DataLoader worker gets the node's link by pickle: it attaches, never joins."""
    import pickle
    link = BoardLink(cache_name, "spawns", 50, 1, counted=True)
    board = link.create(50, 1)
    code = ("import pickle, sys; from shadecache.lookahead import jobs; "
            "link = pickle.loads(bytes.fromhex(sys.argv[1])); b = link.get(); "
            "print(b is not None, link.member, len(jobs._HELD))")
    out = subprocess.run([sys.executable, "-c", code, pickle.dumps(link).hex()],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["True", "False", "0"], out.stderr[-2000:]
    assert board.jobs.lives(board.slot)
    link.close()
    assert _files(cache_name) == []
