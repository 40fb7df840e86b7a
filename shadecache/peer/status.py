"""The tiers below a node's cache, as its peer server sees them, published for the CLI.

The peer server of a node (one per cache) writes `/dev/shm/shadecache-tiers.<cache name>.json`
once a second and removes it when it stops: its address and pid, its counters (GETs served from
the cache, the SSD tier and the store, bytes, mean latency per GET), its SSD tier's stats and the
peers it was told of. `Cache.stats()["tiers"]`, `shadecache stats` and `shadecache ls` read it.
The file is written whole (temporary name, then rename); a file whose writer is gone is reported
with "stale": true rather than trusted silently, and `shadecache gc` removes it (shm.sweep).
"""
import json
import os
import threading

from .. import shm

path_of = shm.status_path   # /dev/shm/shadecache-tiers.<cache>.json (shm.py names every file there)


def write(cache_name: str, status: dict) -> None:
    path = path_of(cache_name)
    # The server writes from its publishing thread and from its main thread (new peers): each
    # writer needs its own temporary name, or one rename takes the other's file away.
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f, default=str)
    os.replace(tmp, path)


def _load(path: str):
    """The status dict in `path` with "stale" set; None when there is no file; ValueError when it
    does not parse as one (shm.read_status)."""
    d = shm.read_status(path)
    if d is not None:
        d["stale"] = shm.writer_gone(d)
    return d


def read(cache_name: str):
    """The published status of `cache_name`'s tiers, or None when no server publishes one."""
    try:
        return _load(path_of(cache_name))
    except ValueError:
        return None


def remove(cache_name: str, pid: int) -> None:
    """Removes the file if process `pid` wrote it (a restarted server may have replaced it)."""
    d = read(cache_name)
    if d is not None and d.get("pid") == pid:
        try:
            os.unlink(path_of(cache_name))
        except FileNotFoundError:
            pass
