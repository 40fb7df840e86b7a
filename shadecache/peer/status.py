"""The tiers below a node's cache, as its peer server sees them, published for the CLI.

The peer server of a node (one per cache) writes `/dev/shm/shadecache-tiers.<cache name>.json`
once a second and removes it when it stops: its address and pid, its counters (GETs served from
the cache, the SSD tier and the store, bytes, mean latency per GET), its SSD tier's stats and the
peers it was told of. `Cache.stats()["tiers"]`, `shadecache stats` and `shadecache ls` read it.
The file is written whole (a random temporary name, then rename), 0600; a file whose writer is
gone is reported with "stale": true rather than trusted silently. A file that is not this user's,
is open to group or others, or is a link is never read (node_files.py): `read` warns, naming its
owner, and reports no status, so a status another user planted never shows as a live server.
"""
import json
import os
import warnings

from .. import node_files

DIR = "/dev/shm"
PREFIX = "shadecache-tiers."   # not "shadecache.": list_caches() must not take it for a segment


def path_of(cache_name: str) -> str:
    return os.path.join(DIR, f"{PREFIX}{cache_name}.json")


_MAX_BYTES = 1 << 20   # far more than any status; a larger file is not one


def write(cache_name: str, status: dict) -> None:
    """Publishes `status`. PermissionError naming the owner when another user's file (or
    anything but a regular file) holds the name: it is left as it is, for a root server too
    (node_files.replace; the server goes on without a status file)."""
    # The server writes from its publishing thread and from its main thread (new peers): each
    # write has its own random temporary name, or one rename takes the other's file away.
    data = json.dumps(status, default=str).encode()
    node_files.replace(DIR, os.path.basename(path_of(cache_name)), data, "tier status file")


def _load(path: str):
    """The status dict in `path` with "stale" set; None when there is no file. ValueError when
    it does not parse as one (writers rename whole files into place, so no live writer of this
    version leaves such a file); PermissionError when it is not this user's own (node_files)."""
    try:
        fd = node_files.open_file(path, os.O_RDONLY | os.O_NONBLOCK, "tier status file")
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MAX_BYTES + 1)
    d = json.loads(raw) if len(raw) <= _MAX_BYTES else None   # ValueError when not JSON
    if not isinstance(d, dict):
        raise ValueError(f"{path} is not a status object")
    try:
        d["stale"] = not _alive(int(d.get("pid")))
    except (TypeError, ValueError):
        d["stale"] = True
    return d


def read(cache_name: str):
    """The published status of `cache_name`'s tiers, or None when no server publishes one (or
    the file is refused: a RuntimeWarning says why and whose it is)."""
    try:
        return _load(path_of(cache_name))
    except ValueError:
        return None
    except PermissionError as e:
        warnings.warn(f"shadecache: {e}", RuntimeWarning, stacklevel=2)
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
    """Removes this user's status files whose writer is gone (a server killed with SIGKILL cannot
    remove its own) and the temporary files such a writer left; returns the paths removed (`gc`).
    Another user's files are left alone, and links are never followed."""
    removed = []
    for entry in os.listdir(DIR):
        if not entry.startswith(PREFIX):
            continue
        path = os.path.join(DIR, entry)
        if not node_files.owned(path):
            continue
        if entry.endswith(".json"):
            try:
                d = _load(path)
                gone = d is not None and d["stale"]
            except (ValueError, PermissionError):   # garbage (an older server's torn write), a
                gone = True                         # link or a 0644 file: nobody trusts it
        elif entry.endswith(".tmp"):
            # <cache>.json.<pid>.<random>.tmp: gone when the writing process is
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
