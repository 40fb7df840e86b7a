"""The tiers below a node's cache, as its peer server sees them, published for the CLI.

The peer server of a node (one per cache) writes `/dev/shm/shadecache-tiers.<cache name>.json`
once a second and removes it when it stops: its address and pid, its counters (GETs served from
the cache, the SSD tier and the store, bytes, mean latency per GET), its SSD tier's stats and the
peers it was told of. `Cache.stats()["tiers"]`, `shadecache stats` and `shadecache ls` read it.
The file is written whole (a random temporary name, then rename), 0600; a file whose writer is
gone is reported with "stale": true rather than trusted silently, and `shadecache gc` removes it
(shm.sweep). A file that is not this user's, is open to group or others, or is a link is never
read (node_files.py): `read` warns, naming its owner, and reports no status, so a status another
user planted never shows as a live server.
"""
import json
import os
import warnings

from .. import node_files, shm

path_of = shm.status_path   # /dev/shm/shadecache-tiers.<cache>.json (shm.py names every file there)


def write(cache_name: str, status: dict) -> None:
    """Publishes `status`. PermissionError naming the owner when another user's file (or
    anything but a regular file) holds the name: it is left as it is, for a root server too
    (node_files.replace; the server goes on without a status file)."""
    # The server writes from its publishing thread and from its main thread (new peers): each
    # write has its own random temporary name, or one rename takes the other's file away.
    data = json.dumps(status, default=str).encode()
    node_files.replace(shm.SHM_DIR, os.path.basename(path_of(cache_name)), data, "tier status file")


def _load(path: str):
    """The status dict in `path` with "stale" set; None when there is no file. ValueError when
    it does not parse as one (shm.read_status); PermissionError when it is not this user's own
    (node_files)."""
    d = shm.read_status(path)
    if d is not None:
        d["stale"] = shm.writer_gone(d)
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
