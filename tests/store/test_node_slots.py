"""The node-wide bound on object-store requests (shadecache/store/node_slots.py): across processes
and threads, released by the kernel when a holder is killed, and held at the proxy by readers in
several processes at once."""
import os
import signal
import time

import numpy as np
import pytest

import shadecache as sc
from shadecache.store.node_slots import NodeSlots


def test_threads_of_one_process_hold_distinct_slots(tmp_path):
    import threading
    slots = NodeSlots("endpoint-a", 2, str(tmp_path))
    got, release = [], threading.Event()

    def hold():
        with slots.acquire() as s:
            got.append(s)
            release.wait(10)
    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    while len(got) < 2:
        time.sleep(0.01)
    assert sorted(got) == [0, 1] and slots.held() == 2
    with pytest.raises(TimeoutError, match="2 slots, all held"):
        with slots.acquire(deadline=time.monotonic() + 0.2):
            pass
    release.set()
    for t in threads:
        t.join()
    with slots.acquire(deadline=time.monotonic() + 1):
        assert slots.held() == 1


def test_a_killed_holder_gives_its_slot_back(tmp_path):
    slots = NodeSlots("endpoint-b", 2, str(tmp_path))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child takes both slots and waits to be killed
        try:
            child = NodeSlots("endpoint-b", 2, str(tmp_path))
            a, b = child.acquire(), child.acquire()
            a.__enter__(), b.__enter__()
            os.write(w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    os.read(r, 1)
    with pytest.raises(TimeoutError):
        with slots.acquire(deadline=time.monotonic() + 0.2):
            pass
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    with slots.acquire(deadline=time.monotonic() + 2), slots.acquire(deadline=time.monotonic() + 2):
        assert slots.held() == 2


def test_a_forked_child_does_not_share_its_parents_slot(tmp_path):
    slots = NodeSlots("endpoint-c", 1, str(tmp_path))
    with slots.acquire():
        pid = os.fork()
        if pid == 0:
            try:   # the parent's slot is the parent's: the child cannot take it too
                with slots.acquire(deadline=time.monotonic() + 0.3):
                    os._exit(1)
            except TimeoutError:
                os._exit(0)
            os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    with slots.acquire(deadline=time.monotonic() + 1):
        pass


def test_processes_reading_at_once_stay_within_the_bound_at_the_proxy(s3, proxy, tmp_path):
    from s3_data import local_store, upload
    local = local_store(tmp_path / "a.shc", n=2000, low=1000, high=3000)
    url = upload(s3, tmp_path / "a.shc")
    bound = 3
    store = sc.S3Store(url, endpoint_url=proxy.endpoint, connections=bound, gap_bytes=0,
                       max_extent_bytes=16 << 10)
    proxy.reset()
    proxy.configure(latency=0.01)
    pids = []
    for k in range(4):   # 4 processes, each with up to `bound` requests of its own
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ids = np.random.default_rng(k).permutation(len(local))[:100]
                code = 0 if store.read_many(ids) == local.read_many(ids) else 3
            finally:
                os._exit(code)
        pids.append(pid)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    st = proxy.stats()
    assert st["gets"] > 4 * bound
    assert st["in_flight_max"] == bound, st
