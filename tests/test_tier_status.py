"""The node's tier status file (shadecache/tier_status.py), written by two threads of a server."""
import json
import os
import threading
import uuid

from shadecache import tier_status


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
    assert not [p for p in os.listdir(tier_status.DIR) if p.startswith(f"{tier_status.PREFIX}{name}")]
