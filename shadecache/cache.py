"""The node cache: one shared-memory copy of cached samples for every process on a node.

    cache = Cache.create("job42-train", num_samples=N, capacity_bytes=8 << 30, policy="importance")
    cache = Cache.attach("job42-train")      # from any process; a Cache pickles by name

Readers (get, get_many, get_into, contains) take no lock and call straight into the engine.
Writers (put, put_many, update_scores, remove) take the segment's robust mutex with the GIL
released. The creating process owns the segment: it is removed by unlink(), by leaving a
`with Cache.create(...)` block, or when the creating process exits; `shadecache gc` removes the
segments of creators that were killed.
"""
import atexit
import os
import weakref
from typing import List, Optional, Sequence

import numpy as np

from . import _core
from .errors import ClosedError

# Policy name -> the number the engine stores; the engine defines the list (csrc/cache/policies/).
POLICIES = {name: number for number, name in enumerate(_core.POLICIES) if name}
# The largest value that fits a 1 MiB slab page next to its slot header. Larger values need a
# larger max_item_bytes (and so larger pages: memory moves between size classes a page at a time).
DEFAULT_MAX_ITEM_BYTES = (1 << 20) - _core.SLOT_HEADER_SIZE

# Segments created by this process, unlinked at interpreter exit (in the creating pid only: a
# forked DataLoader worker inherits this set and must not remove its parent's cache).
_OWNED = {}


def _unlink_owned_at_exit():
    for name, pid in list(_OWNED.items()):
        if pid == os.getpid():
            try:
                _core.CacheCore.unlink(name)
            except OSError:
                pass


atexit.register(_unlink_owned_at_exit)


def _check_int(name, value, minimum=0):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class Cache:
    """A named sample cache in POSIX shared memory, keyed by dense ids 0..num_samples-1.

    get(i) -> bytes | None           a copy of sample i, None on a miss
    get_many(ids) -> list            one native call for a batch
    get_into(i, buf) -> int          copy into a writable buffer; the length, or -1 on a miss
    view(i) -> SampleView | None     zero copy: a read-only buffer into the cache, pinned (no
                                     process frees, rewrites or moves those bytes) until released
    contains(i) -> bool
    put(i, data, score=None) -> bool False when admission refuses it
    put_many(ids, values, scores=None) -> np.ndarray[bool]
    update_scores(ids, scores)       one lock per call
    remove(i) -> bool
    """

    # A process may hold this many views of one cache at once, and this many processes may hold
    # views of one cache at once (the pin table in the segment has that many records).
    MAX_VIEWS_PER_PROCESS = _core.MAX_VIEWS_PER_PROCESS
    MAX_VIEW_PROCESSES = _core.MAX_VIEW_PROCESSES

    def __init__(self, core, owner: bool):
        self._core = core
        self.name = core.name
        self.num_samples = core.num_samples
        self._creator_pid = os.getpid() if owner else None
        # The hot paths are the engine's own methods: no Python frame between the caller and C++.
        self.get = _core.fast_get(core)  # same as core.get, minus pybind11's dispatch
        self.get_many = core.get_many
        self.get_into = core.get_into
        self.view = _core.fast_view(core)  # same as core.view, minus pybind11's dispatch
        self.contains = core.contains
        self.put = core.put
        self.put_many = core.put_many
        self.remove = core.remove
        self.cached_mask = core.cached_mask
        self.scores = core.scores
        self.check = core.check

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, num_samples: int, capacity_bytes: int, policy: str = "importance",
               max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES) -> "Cache":
        """Creates the cache `name` on this node. FileExistsError if the name is taken,
        sc.CapacityError if /dev/shm cannot hold it."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        num_samples = _check_int("num_samples", num_samples, 1)
        capacity_bytes = _check_int("capacity_bytes", capacity_bytes, 1)
        max_item_bytes = _check_int("max_item_bytes", max_item_bytes, 1)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
        core = _core.CacheCore.create(name, num_samples, capacity_bytes, max_item_bytes, POLICIES[policy])
        _OWNED[name] = os.getpid()
        return cls(core, owner=True)

    @classmethod
    def attach(cls, name: str) -> "Cache":
        """Attaches to the cache `name` created by another process. FileNotFoundError if none."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        return cls(_core.CacheCore.attach(name), owner=False)

    def __reduce__(self):
        # Spawned DataLoader workers and other processes get the cache by name, never by value.
        return (Cache.attach, (self.name,))

    # ---- writers with argument shaping -------------------------------------------------------
    def update_scores(self, ids, scores) -> None:
        """Sets the importance of every id in `ids` (cached or not) under one lock."""
        if hasattr(ids, "detach"):  # a torch tensor: avoid importing torch here
            ids = ids.detach().cpu().numpy()
        if hasattr(scores, "detach"):
            scores = scores.detach().cpu().numpy()
        self._core.update_scores(ids, scores)

    # ---- introspection ----------------------------------------------------------------------
    @property
    def policy(self) -> str:
        return self._core.policy

    @property
    def capacity_bytes(self) -> int:
        return self._core.capacity_bytes

    @property
    def max_item_bytes(self) -> int:
        return self._core.max_item_bytes

    @property
    def closed(self) -> bool:
        return self._core.closed

    def stats(self) -> dict:
        """Counters and sizes: hits, misses, hit_ratio, inserts, evictions, rejected, items,
        bytes_used, capacity_bytes, page_moves, recoveries, ... (docs/cache.md lists them all)."""
        return self._core.stats()

    def __len__(self) -> int:
        return self.stats()["items"]

    def __repr__(self) -> str:
        if self.closed:
            return f"<shadecache.Cache {self.name!r} closed>"
        s = self.stats()
        return (f"<shadecache.Cache {self.name!r} policy={s['policy']} items={s['items']} "
                f"bytes_used={s['bytes_used']}/{s['capacity_bytes']}>")

    # ---- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Later calls raise sc.ClosedError. The segment is unmapped in this process now, or,
        while views of it are held or other threads are inside calls, when the last of those ends."""
        self._core.close()

    def unlink(self) -> None:
        """Removes the segment's name; processes that have it mapped keep using it until they close."""
        _core.CacheCore.unlink(self.name)
        _OWNED.pop(self.name, None)

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self._creator_pid == os.getpid():
            self.unlink()


def list_caches() -> List[str]:
    """Names of the shadecache segments on this node."""
    return sorted(_core.CacheCore.list())


def remove(name: str) -> bool:
    """Removes segment `name`; False if it did not exist."""
    _OWNED.pop(name, None)
    return _core.CacheCore.unlink(name)


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
    # An exited creator that its parent has not waited for yet (a zombie) maps nothing: gone.
    return start != 0 and not _core.process_gone(pid, start)


def gc() -> List[str]:
    """Removes every segment whose creator is gone; returns the names removed."""
    removed = []
    for name in list_caches():
        if creator_alive(name) is False:
            if remove(name):
                removed.append(name)
    return removed
