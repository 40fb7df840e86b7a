"""The tiers below a node's cache, as its peer server sees them, published for the CLI.

The peer server of a node (one per cache) writes `/dev/shm/shadecache-tiers.<cache name>.json`
once a second and removes it when it stops: its address and pid, its counters (GETs served from
the cache, the SSD tier and the store, bytes, mean latency per GET), its SSD tier's stats and the
peers it was told of. `Cache.stats()["tiers"]`, `shadecache stats` and `shadecache ls` read it.
The file is written whole (temporary name, then rename); a file whose writer is gone is reported
with "stale": true rather than trusted silently.
"""
import json
import os
import threading

DIR = "/dev/shm"
PREFIX = "shadecache-tiers."   # not "shadecache.": list_caches() must not take it for a segment


def path_of(cache_name: str) -> str:
    return os.path.join(DIR, f"{PREFIX}{cache_name}.json")


def write(cache_name: str, status: dict) -> None:
    path = path_of(cache_name)
    # The server writes from its publishing thread and from its main thread (new peers): each
    # writer needs its own temporary name, or one rename takes the other's file away.
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f, default=str)
    os.replace(tmp, path)


def _load(path: str):
    """The status dict in `path` with "stale" set; None when there is no file. ValueError when
    it does not parse as one (writers rename whole files into place, so no live writer of this
    version leaves such a file)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        return None
    if not isinstance(d, dict):
        raise ValueError(f"{path} is not a status object")
    try:
        d["stale"] = not _alive(int(d.get("pid")))
    except (TypeError, ValueError):
        d["stale"] = True
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


def sweep() -> list:
    """Removes the status files whose writer is gone (a server killed with SIGKILL cannot remove
    its own) and the temporary files such a writer left; returns the paths removed (`gc`)."""
    removed = []
    for entry in os.listdir(DIR):
        if not entry.startswith(PREFIX):
            continue
        path = os.path.join(DIR, entry)
        if entry.endswith(".json"):
            try:
                d = _load(path)
                gone = d is not None and d["stale"]
            except ValueError:   # garbage (an older server's torn write): nobody can read it
                gone = True
        elif entry.endswith(".tmp"):
            # <cache>.json.<pid>.<thread>.tmp: gone when the writing process is
            pid = entry[:-len(".tmp")].split(".json.")[-1].split(".")[0]
            gone = pid.isdigit() and not _alive(int(pid))
        else:
            continue
        if gone:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
