"""What a node's own processes publish for people and the CLI: the peer server's tiers and
counters, the prefetcher's tiers and read rule.

Each of those processes (one per cache and role) writes
`/dev/shm/shadecache-tiers.<cache name>.json` (the peer server: its address and pid, its counters
(GETs served from the cache, the SSD tier and the store, bytes, mean latency per GET), the tiers it
reads through, its SSD tier's stats and the peers it was told of) or
`/dev/shm/shadecache-prefetch.<cache name>.json` (the prefetcher: its pid, the tiers it reads
through, its read rule and reach) once a second or when it starts, and removes it when it stops.
`shadecache stats` and `shadecache ls` read them; node.tiers() in a test asks each process this
way which tiers it reads through. A file is written whole (a random temporary name, then rename),
0600; a file whose writer is gone is reported with "stale": true rather than trusted silently, and
`shadecache gc` removes it (shm.sweep). A file that is not this user's, is open to group or
others, or is a link is never read (node_files.py): `read` warns, naming its owner, and reports no
status, so a status another user planted never shows as a live process.
"""
import json
import os
import warnings

from . import node_files, shm

SERVER, PREFETCHER = shm.SERVER, shm.PREFETCHER   # the roles: one file each per cache


def path_of(cache_name: str, role: str = SERVER) -> str:
    """The status file of `role` for `cache_name` (shm.py names every file in /dev/shm)."""
    return shm.status_path(cache_name, role)


def write(cache_name: str, status: dict, role: str = SERVER) -> None:
    """Publishes `status`. PermissionError naming the owner when another user's file (or
    anything but a regular file) holds the name: it is left as it is, for a root server too
    (node_files.replace; the process goes on without a status file)."""
    # The server writes from its publishing thread and from its main thread (new peers): each
    # write has its own random temporary name, or one rename takes the other's file away.
    data = json.dumps(status, default=str).encode()
    node_files.replace(shm.SHM_DIR, os.path.basename(path_of(cache_name, role)), data,
                       "tier status file")


def _load(path: str):
    """The status dict in `path` with "stale" set; None when there is no file. ValueError when
    it does not parse as one (shm.read_status); PermissionError when it is not this user's own
    (node_files)."""
    d = shm.read_status(path)
    if d is not None:
        d["stale"] = shm.writer_gone(d)
    return d


def read(cache_name: str, role: str = SERVER):
    """The published status of `cache_name`'s `role`, or None when none is published (or the
    file is refused: a RuntimeWarning says why and whose it is)."""
    try:
        return _load(path_of(cache_name, role))
    except ValueError:
        return None
    except PermissionError as e:
        warnings.warn(f"shadecache: {e}", RuntimeWarning, stacklevel=2)
        return None


def remove(cache_name: str, pid: int, role: str = SERVER) -> None:
    """Removes the file if process `pid` wrote it (a restarted process may have replaced it)."""
    d = read(cache_name, role)
    if d is not None and d.get("pid") == pid:
        try:
            os.unlink(path_of(cache_name, role))
        except FileNotFoundError:
            pass
