"""Jobs side by side on one cache, in processes of their own (tests/jobs/job_process.py): each
reads from the store what the others have not, every epoch of each an exact permutation of its
own; a job SIGKILLed mid-run leaves the others to finish, no pin of its own, no file."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import shadecache as sc
from shadecache import shm
from shadecache.cache import gc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from counting_store import reads  # noqa: E402

N, SIZE = 1500, 512


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "jobs.shc"
    rng = np.random.default_rng(0)
    sc.pack([(rng.bytes(SIZE), i % 10) for i in range(N)], path, progress=False)
    return str(path)


def _start(cfg):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, os.path.join(HERE, "job_process.py"), json.dumps(cfg)],
                            stdout=subprocess.PIPE, text=True, env=env)


def _lines(p):
    return [json.loads(line) for line in p.stdout if line.startswith("{")]


def _run(store_path, cache_name, count_file, jobs, epochs=2, **extra):
    with sc.PackedStore(store_path) as store:
        capacity = sc.Cache.capacity_for(N // 5, store.lengths)
        cache = sc.Cache.for_store(cache_name, store, capacity_bytes=capacity, attach=False)
    size0 = os.stat(f"/dev/shm/shadecache.{cache_name}").st_size
    procs = [_start({"path": store_path, "count_file": count_file, "cache": cache_name, "job": f"j{k}",
                     "epochs": epochs, **j, **extra}) for k, j in enumerate(jobs)]
    outs = [_lines(p) for p in procs]
    assert [p.wait(120) for p in procs] == [0] * len(procs)
    size1 = os.stat(f"/dev/shm/shadecache.{cache_name}").st_size
    cache.close()
    cache.unlink()
    return outs, (size0, size1)


def _epochs(out):
    return [r for r in out if "epoch" in r]


def test_jobs_side_by_side_read_the_store_about_once_and_each_keeps_its_permutations(store_path,
                                                                                     cache_name, tmp_path):
    jobs = [dict(seed=0, batch=32), dict(seed=1, batch=64), dict(seed=2, batch=48)]
    alone, _ = _run(store_path, cache_name + "-a", str(tmp_path / "alone"), jobs[:1])
    together, sizes = _run(store_path, cache_name, str(tmp_path / "together"), jobs)
    read_alone, read_together = reads(str(tmp_path / "alone")), reads(str(tmp_path / "together"))
    # read apart, three jobs would read about three times what one does
    assert read_together <= 1.5 * read_alone, (read_alone, read_together)
    assert sizes[0] == sizes[1]                     # one copy in RAM, whatever the jobs
    orders = []
    for out in together:
        for e in _epochs(out):
            assert sorted(e["ids"]) == list(range(N)), "an epoch that is not a permutation"
            orders.append(e["ids"])
    assert len({tuple(o) for o in orders}) == len(orders)    # each job its own order
    hits_alone = sum(e["hits"] for e in _epochs(alone[0]))
    assert all(sum(e["hits"] for e in _epochs(out)) >= hits_alone for out in together)
    assert not [e for e in os.listdir(shm.SHM_DIR) if cache_name in e]


def test_a_job_killed_mid_run_leaves_the_others_to_finish_and_nothing_behind(store_path, cache_name,
                                                                           tmp_path):
    with sc.PackedStore(store_path) as store:
        capacity = sc.Cache.capacity_for(N // 5, store.lengths)
        cache = sc.Cache.for_store(cache_name, store, capacity_bytes=capacity, attach=False)
    common = {"path": store_path, "count_file": str(tmp_path / "count"), "cache": cache_name}
    victim = _start({**common, "job": "victim", "seed": 9, "batch": 32, "epochs": 1, "hold": True})
    first = json.loads(victim.stdout.readline())
    others = [_start({**common, "job": f"o{k}", "seed": k, "batch": 32, "epochs": 3, "step_s": 0.002})
              for k in range(2)]
    try:
        while True:                                   # the victim holds a pinned view now
            row = json.loads(victim.stdout.readline())
            if "holding" in row:
                break
        pinned = cache.stats()["pinned"]
        assert pinned >= 1
        victim_file = shm.job_board_path(cache_name, first["slot"])
        assert os.path.exists(victim_file)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        t0 = time.monotonic()
        while os.path.exists(victim_file) and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert time.monotonic() - t0 < 1.5, "the other jobs did not remove the killed job's board"
        outs = [_lines(p) for p in others]
        assert [p.wait(120) for p in others] == [0, 0]
        for out in outs:
            eps = _epochs(out)
            assert len(eps) == 3 and all(sorted(e["ids"]) == list(range(N)) for e in eps)
        cache.put_many(np.arange(N), [b"x" * SIZE] * N)   # writers reap dead processes' pins
        assert cache.stats()["pinned"] == 0
        cache.check()
    finally:
        for p in [victim] + others:
            p.kill()
            p.wait()
        cache.close()
        cache.unlink()
    gc()
    assert not [e for e in os.listdir(shm.SHM_DIR) if cache_name in e]
