"""Jobs on one cache (docs/jobs.md): who a job is, its registration on the cache's board, what is
noticed and removed when a job dies (SIGKILL), what `gc` and `shadecache stats` do with jobs."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import shadecache as sc
from shadecache import shm
from shadecache.cache import gc
from shadecache.lookahead import jobs as registry
from shadecache.lookahead.board import OrderBoard
from shadecache.lookahead.board_layout import MAX_JOBS

# A job in a process of its own: registers `job` on the board of cache argv[1] (N samples),
# says so, and sleeps until it is killed or told to go.
_JOB = """
import sys
from shadecache.lookahead.board import OrderBoard
b = OrderBoard.join(sys.argv[1], int(sys.argv[2]), job=sys.argv[3])
print(b.slot, flush=True)
sys.stdin.readline()
"""


def _job(name, n, job):
    p = subprocess.Popen([sys.executable, "-c", _JOB, name, str(n), job], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    slot = int(p.stdout.readline())
    return p, slot


def _files(name):
    return sorted(e for e in os.listdir(shm.SHM_DIR) if name in e and not e.startswith(shm.SEGMENT_PREFIX))


def test_the_job_name_comes_from_where_the_job_was_launched(monkeypatch):
    for var in (registry.JOB_ENV, registry.TORCHRUN_ENV):
        monkeypatch.delenv(var, raising=False)
    pgid = os.getpgid(0)
    assert registry.job_name().startswith(f"pgid-{pgid}-")          # the launching process's group
    monkeypatch.setenv(registry.TORCHRUN_ENV, "none")               # torchrun without --rdzv-id
    assert registry.job_name().startswith(f"pgid-{pgid}-")
    monkeypatch.setenv(registry.TORCHRUN_ENV, "sweep-7")
    assert registry.job_name() == "sweep-7"
    monkeypatch.setenv(registry.JOB_ENV, "mine")
    assert registry.job_name() == "mine" and registry.job_name("given") == "given"
    with pytest.raises(ValueError, match="job name"):
        registry.job_name("")
    with pytest.raises(ValueError, match="job name"):
        registry.job_name("x" * 64)
    with pytest.raises(TypeError, match="job must be a str"):
        registry.job_name(7)


def test_a_new_session_is_another_job():
    """Two commands of a shell are two process groups: two jobs by default."""
    code = "from shadecache.lookahead.jobs import job_name; print(job_name())"
    env = {k: v for k, v in os.environ.items() if k not in (registry.JOB_ENV, registry.TORCHRUN_ENV)}
    mine = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           start_new_session=True).stdout
    assert mine.strip() == registry.launching_process()      # a subprocess: the same group
    assert other.strip() != mine.strip()


def test_each_job_has_its_own_board_and_a_rank_of_a_job_joins_it(cache_name):
    a = OrderBoard.join(cache_name, 50, streams=2, job="A")
    b = OrderBoard.join(cache_name, 50, job="B")
    a2 = OrderBoard.join(cache_name, 50, streams=2, job="A")    # another rank of job A
    try:
        assert (a.slot, a.streams) == (a2.slot, 2) and b.slot != a.slot
        assert a.path != b.path and a.flags is not b.flags
        a.orders.publish(0, 0, [1, 2, 3])
        assert a2.orders.published(0).tolist() == [1, 2, 3] and b.orders.published(0).size == 0
        b.flags.mark_on_way([7])                                  # the flags are every job's
        assert a.flags.on_way([7]).tolist() == [True]
        assert [j["name"] for j in a.jobs.describe()] == ["A", "B"]
    finally:
        for x in (a2, b, a):
            x.leave()
            x.close()
    assert _files(cache_name) == []


def test_a_sigkilled_job_is_noticed_within_a_second_and_what_was_only_its_own_removed(cache_name):
    mine = OrderBoard.join(cache_name, 50, job="survivor")
    p, slot = _job(cache_name, 50, "victim")
    try:
        victim_file = shm.job_board_path(cache_name, slot)
        assert os.path.exists(victim_file) and mine.jobs.lives(slot)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        t0 = time.monotonic()
        while os.path.exists(victim_file) and time.monotonic() - t0 < 5:
            mine.all_jobs.free_dead()          # what a live job's sampler calls every batch
            time.sleep(0.01)
        assert time.monotonic() - t0 < 1.0, "the dead job was not noticed within a second"
        assert not os.path.exists(victim_file) and mine.jobs.generation(slot) == 0
        assert os.path.exists(shm.board_path(cache_name))   # the survivor's board stays
    finally:
        mine.leave()
        mine.close()
    assert _files(cache_name) == []


def test_gc_removes_the_boards_a_killed_job_left(cache_name):
    p, slot = _job(cache_name, 50, "alone")
    assert _files(cache_name) == sorted([os.path.basename(shm.board_path(cache_name)),
                                         os.path.basename(shm.job_board_path(cache_name, slot))])
    gc()
    assert len(_files(cache_name)) == 2                  # a live job's: kept
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    removed = gc()
    assert _files(cache_name) == [] and len([r for r in removed if cache_name in r]) == 2


def test_a_job_that_exits_takes_its_board_and_the_last_job_the_node_file(cache_name):
    mine = OrderBoard.join(cache_name, 50, job="stays")
    p, slot = _job(cache_name, 50, "goes")
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.wait(30) == 0
    assert _files(cache_name) == sorted([os.path.basename(shm.board_path(cache_name)),
                                         os.path.basename(mine.path)])
    assert mine.jobs.generation(slot) == 0
    mine.leave()
    mine.close()
    assert _files(cache_name) == []


def test_the_last_job_to_leave_removes_the_board_of_a_job_killed_before_it_looked(cache_name):
    mine = OrderBoard.join(cache_name, 50, job="last")
    p, slot = _job(cache_name, 50, "killed")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert os.path.exists(shm.job_board_path(cache_name, slot))   # nobody has looked yet
    mine.leave()
    mine.close()
    assert _files(cache_name) == []


def test_a_node_that_asks_for_another_merge_rule_is_refused(cache_name, tmp_path):
    path = tmp_path / "s.shc"
    sc.pack([(bytes([i]) * 64, i % 3) for i in range(40)], path, progress=False)
    with sc.PackedStore(path) as store, sc.Cache.for_store(cache_name, store, 1 << 20) as cache:
        first = sc.Node(store, cache, read_plan="samples", job="a", score_merge="max")
        try:
            with pytest.raises(ValueError, match="merge their scores by 'max'"):
                sc.Node(store, cache, read_plan="samples", job="b", score_merge="sum")
            with pytest.raises(ValueError, match="score_merge must be one of"):
                sc.Node(store, cache, read_plan="samples", job="c", score_merge="median")
            second = sc.Node(store, cache, read_plan="samples", job="b")   # the board's rule
            assert second.board.score_merge == "max"
            second.board.leave()
        finally:
            first.board.leave()
            first.close()


def test_more_jobs_than_a_cache_takes_are_refused(cache_name):
    boards = [OrderBoard.join(cache_name, 10, job=f"j{k}") for k in range(MAX_JOBS)]
    try:
        with pytest.raises(sc.CapacityError, match=f"{MAX_JOBS} jobs registered"):
            OrderBoard.join(cache_name, 10, job="one too many")
    finally:
        for b in boards:
            b.leave()
            b.close()
    assert _files(cache_name) == []


def test_stats_lists_the_jobs_on_a_cache(cache_name, tmp_path):
    with sc.Cache.create(cache_name, num_samples=50, capacity_bytes=1 << 20):
        mine = OrderBoard.join(cache_name, 50, job="listed")
        p, slot = _job(cache_name, 50, "other")
        try:
            mine.counters.count_job(samples=10, hits=4, store_reads=6, store_bytes=600, wait_ns=2 * 10**9)
            out = subprocess.run([sys.executable, "-m", "shadecache.cli", "stats", cache_name],
                                 capture_output=True, text=True, check=True)
            jobs = {j["name"]: j for j in json.loads(out.stdout)["jobs"]}
            assert set(jobs) == {"listed", "other"} and jobs["other"]["slot"] == slot
            assert (jobs["listed"]["hits"], jobs["listed"]["store_reads"]) == (4, 6)
            assert jobs["listed"]["hit_ratio"] == pytest.approx(0.4) and jobs["listed"]["wait_s"] == 2.0
            assert "listed" in out.stderr and "HIT RATIO" in out.stderr     # the table for people
        finally:
            p.kill()
            p.wait()
            mine.leave()
            mine.close()
    gc()



def test_a_job_name_that_is_not_utf8_is_refused_naming_it(monkeypatch):
    """A non-UTF-8 byte in $SHADECACHE_JOB reaches Python as a lone surrogate: a name the registry
    could not read back (each process of the job would register a job of its own)."""
    monkeypatch.setenv(registry.JOB_ENV, os.fsdecode(b"run-\xff"))
    with pytest.raises(ValueError, match=r"job name 'run-\\udcff' is not valid UTF-8"):
        registry.job_name()
    with pytest.raises(ValueError, match="not valid UTF-8"):
        registry.job_name("a\ud800b")
    assert registry.job_name("läuft-✓") == "läuft-✓"          # any UTF-8 text is a name


def test_the_default_job_name_outlives_the_process_group_leader():
    """A launcher that backgrounds its ranks and exits: a rank that composes its node after the
    launcher is gone names the same job as one that composed it before."""
    code = ("import sys, time; from shadecache.lookahead.jobs import job_name; "
            "time.sleep(float(sys.argv[1])); print(job_name(), flush=True)")
    env = {k: v for k, v in os.environ.items() if k not in (registry.JOB_ENV, registry.TORCHRUN_ENV)}
    launcher = (f"{sys.executable} -c '{code}' 0 & {sys.executable} -c '{code}' 1.5 & "
                "sleep 0.5; exit 0")
    p = subprocess.Popen(["bash", "-c", launcher], start_new_session=True, env=env,
                         stdout=subprocess.PIPE, text=True)
    assert p.wait(10) == 0                     # the group's leader is gone; its ranks run on
    names = p.stdout.read().split()            # EOF once both ranks have exited
    assert len(names) == 2 and names[0] == names[1], names


def test_a_node_that_does_not_read_ahead_is_refused_another_merge_rule_too(cache_name, tmp_path):
    """Without read_ahead the node finds the board when first used: a board of another rule is an
    error there, not a job that runs without a board."""
    path = tmp_path / "s.shc"
    sc.pack([(bytes([i]) * 64, i % 3) for i in range(40)], path, progress=False)
    with sc.PackedStore(path) as store, sc.Cache.for_store(cache_name, store, 1 << 20) as cache:
        first = sc.Node(store, cache, read_plan="samples", job="a", score_merge="max")
        try:
            late = sc.Node(store, cache, read_plan="samples", job="b", score_merge="sum",
                           read_ahead=False)
            with pytest.raises(ValueError, match="merge their scores by 'max'"):
                late.board
            assert [j["name"] for j in first.board.jobs.describe()] == ["a"]
            late.close()
        finally:
            first.board.leave()
            first.close()


def test_gc_decides_and_removes_job_boards_under_the_registry_lock(cache_name):
    """gc's look at a job board and its removal are one step under the lock jobs register under:
    a job that registers at a dead job's slot between the two never has its new board removed."""
    import threading
    keeper = OrderBoard.join(cache_name, 50, job="keeper")
    p, slot = _job(cache_name, 50, "killed")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    dead = shm.job_board_path(cache_name, slot)
    try:
        with keeper.jobs.locked():          # a registration under way
            sweeper = threading.Thread(target=gc)
            sweeper.start()
            sweeper.join(0.3)
            assert sweeper.is_alive() and os.path.exists(dead), "gc did not wait for the lock"
        sweeper.join(10)
        assert not os.path.exists(dead) and os.path.exists(keeper.path)
    finally:
        keeper.leave()
        keeper.close()
    assert _files(cache_name) == []


def test_a_rank_joins_a_live_job_whose_board_file_was_removed(cache_name):
    """Every later rank of the job used to wait for the removed file forever (join's retries)."""
    mine = OrderBoard.join(cache_name, 50, job="removed")
    try:
        os.unlink(mine.path)                # by hand, or by a gc that raced the registration
        code = ("import sys; from shadecache.lookahead.board import OrderBoard as O; "
                "b = O.join(sys.argv[1], 50, job='removed'); print(b.slot)")
        out = subprocess.run([sys.executable, "-c", code, cache_name], capture_output=True,
                             text=True, timeout=20)
        assert out.stdout.split() == [str(mine.slot)], out.stderr[-2000:]
        assert os.path.exists(mine.path) and not mine.is_current()   # made again; mine moves on
    finally:
        mine.leave()
        mine.close()
    assert _files(cache_name) == []
