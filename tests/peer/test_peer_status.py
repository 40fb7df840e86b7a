"""The node's tier status file (shadecache/peer/status.py), written by two threads of a server."""
import json
import os
import threading
import uuid

from shadecache import shm
from shadecache import status as tier_status


def test_two_threads_of_one_process_write_the_status_at_once():
    """The peer server writes from its publishing thread and from its main thread (new peers);
    with one temporary name per process one rename took the other's file away and the
    FileNotFoundError ended the server."""
    name = f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    errors = []

    def writer(k):
        try:
            for i in range(300):
                tier_status.write(name, {"pid": os.getpid(), "writer": k, "i": i})
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        with open(tier_status.path_of(name)) as f:
            assert json.load(f)["pid"] == os.getpid()
        assert tier_status.read(name)["stale"] is False
    finally:
        tier_status.remove(name, os.getpid())
    assert not os.path.exists(tier_status.path_of(name))
    assert not [p for p in os.listdir(shm.SHM_DIR) if p.startswith(f"{shm.STATUS_PREFIX}{name}")]


def test_gc_removes_what_killed_jobs_leave_beside_their_segments():
    """A server killed with SIGKILL leaves its tier status file, a killed job its order board:
    gc removes a status file whose writer is gone and a board whose creator is gone."""
    import subprocess
    import sys

    name = f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # a job that makes its board and ends without its exit handlers (as a SIGKILL ends it)
    dead = subprocess.Popen([sys.executable, "-c", "import os, sys; from shadecache.lookahead.board "
                             "import OrderBoard; OrderBoard.create(sys.argv[1], 10); os._exit(0)", name])
    assert dead.wait() == 0
    tier_status.write(name, {"pid": dead.pid})
    assert tier_status.read(name)["stale"] and os.path.exists(shm.board_path(name))
    from shadecache.cache import gc
    removed = gc()
    assert not os.path.exists(tier_status.path_of(name)) and not os.path.exists(shm.board_path(name))
    assert f"{shm.STATUS_PREFIX}{name}.json" in removed and f"{shm.BOARD_PREFIX}{name}" in removed


def test_gc_removes_a_status_file_that_does_not_parse():
    """A status file torn by an older server (two threads renaming one temporary name) is
    garbage that read() ignores: gc removes it too rather than keeping it for ever."""
    from shadecache.cache import gc

    name = f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(os.open(tier_status.path_of(name), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write('{"pid": 1}{"pid": 1}')
    assert tier_status.read(name) is None
    assert f"{shm.STATUS_PREFIX}{name}.json" in gc()
    assert not os.path.exists(tier_status.path_of(name))
