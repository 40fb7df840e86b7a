"""Node housekeeping: the caches of this node, described, removed, and collected when their creator
is gone (`shadecache ls | rm | gc`; the Cache.list / Cache.remove(name) of the class).

A segment names its creator (pid and start time); a creator that is gone (killed, or exited
without removing it) leaves the segment for gc(), which also removes what such a job leaves beside
it (shm.sweep: order boards of creators that are gone, status files of peer servers that are
gone). A persisted cache outlives its creator on purpose: gc keeps it unless asked.
"""
import os
import time
from typing import List, Optional

from .. import _core, shm
from ..process import alive, start_time_of


def list_caches() -> List[str]:
    """Names of the shadecache segments on this node."""
    return sorted(_core.CacheCore.list())


def remove(name: str) -> bool:
    """Removes segment `name`; False if it did not exist, PermissionError (naming the owner) if
    it is another user's."""
    shm.disown(name)
    return _core.CacheCore.unlink(name)


def creator_of(name: str) -> Optional[tuple]:
    """(pid, start time) that segment `name` names as its creator: which segment holds the name
    now (one made again under it names another). None when there is none or it is unreadable."""
    try:
        info = _core.CacheCore.read_creator(name)
    except (OSError, ValueError):
        return None
    return None if info is None else (int(info[0]), int(info[1]))


def remove_if_created_here(name: str) -> bool:
    """Removes segment `name` when this process created it (its creator record names this pid and
    start time); False otherwise. What an owner removes at exit or leaving a `with` block: its own
    segment may have been removed (`shadecache rm`) and another made under the name since, by
    another job whose processes attach it by name; that one is left alone. (A remove and create
    between this look and the unlink is not excluded: two calls in other processes within
    microseconds.)"""
    if creator_of(name) != (os.getpid(), start_time_of(os.getpid())):
        shm.disown(name)
        return False
    return remove(name)


def creator_alive(name: str) -> Optional[bool]:
    """Whether the process that created `name` still runs (pid and start time both match, and it
    has not exited).
    None if the segment vanished or is not readable."""
    try:
        info = _core.CacheCore.read_creator(name)
    except (OSError, ValueError):
        return None
    if info is None:
        return None
    pid, start = info
    return start != 0 and alive(pid, start)


def describe(name: str) -> dict:
    """What `shadecache ls` shows of cache `name`, read without counting as an attach."""
    core = _core.CacheCore.attach(name, touch=False)
    try:
        d = core.stats()
        d.update(persist=core.persist, fingerprint=core.fingerprint,
                 last_attach=core.last_attach_unix_ns / 1e9, created=core.created_unix_ns / 1e9)
        return d
    finally:
        core.close()


def gc(persisted: bool = False, keep_for: Optional[float] = None) -> List[str]:
    """Removes every segment of this user whose creator is gone; returns the names removed. A
    persisted cache is kept unless `persisted` is True, or `keep_for` (seconds) is given and it
    was last attached longer ago than that. Another user's files are never removed (their
    segments cannot be attached, so their creators are never known to be gone; a name that
    becomes theirs while gc runs is skipped)."""
    removed = []
    now = time.time()
    for name in list_caches():
        if creator_alive(name) is not False:
            continue
        try:
            info = describe(name)
        except Exception:  # a foreign or half-made segment: its creator is gone, remove it
            info = {"persist": False}
        if info["persist"] and not persisted and not (keep_for is not None and now - info["last_attach"] > keep_for):
            continue
        try:
            if remove(name):
                removed.append(name)
        except PermissionError:
            # The name changed hands since the look above (another gc of ours removed it, then
            # another user made a segment under it): theirs now, left alone; the sweep goes on.
            continue
    # What a killed job leaves beside its segments (boards, status files), by shm.py's rules.
    removed.extend(shm.sweep(list_caches()))
    return removed
