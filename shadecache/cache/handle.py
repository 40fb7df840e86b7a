"""The node cache: one shared-memory copy of cached samples for every process on a node.

    cache = Cache.create("job42-train", num_samples=N, capacity_bytes=8 << 30, policy="importance")
    cache = Cache.attach("job42-train")      # from any process; a Cache pickles by name

Readers (get, get_many, get_into, contains) take no lock and call straight into the engine.
Writers (put, put_many, update_scores, remove) take the segment's robust mutex with the GIL
released. The creating process owns the segment: it is removed by unlink(), by leaving a
`with Cache.create(...)` block, or when the creating process exits (those two only while the
segment under its name is still the one it created); `shadecache gc` removes the segments of
creators that were killed. A cache created with persist=True outlives every process
(warm restart): `Cache.create_or_attach` of a restarted job finds its values and scores, and
`shadecache gc` leaves it alone unless asked (--persisted, or --keep-for AGE).

capacity_bytes is the memory the cache takes: everything it allocates in /dev/shm (values, their
headers, the id index, scores, the eviction heap, policy state) stays within capacity_bytes (the
header and the table of views add at most 0.25 MiB), and at least 90% of it holds sample bytes
for any size mix. Values are kept as whole chunks plus a tail slot (no large value needs memory
side by side), so memory moves freely between sizes. `Cache.capacity_for(k, sizes)` says the
memory that holds k samples of a mix; giving the sizes at create (`sizes=`, e.g. a packed
store's `lengths`; `Cache.for_store` does) fits the tail slots to them.
"""
import errno
import functools
import os
from typing import List, Optional

import numpy as np

from .. import _core, shm
from ..errors import FingerprintError
from . import node

# Policy name -> the number the engine stores; the engine defines the list (csrc/cache/policies/).
POLICIES = {name: number for number, name in enumerate(_core.POLICIES) if name}
# Kept for callers that size buffers by it (the engine's pages no longer depend on it: their size
# follows capacity_bytes, and values of any size up to what the cache holds are kept in chunks).
DEFAULT_MAX_ITEM_BYTES = (1 << 20) - _core.SLOT_HEADER_SIZE
LARGEST_PAGE_ITEM_BYTES = (8 << 20) - _core.SLOT_HEADER_SIZE


def _page_item_bytes(max_item_bytes, sizes) -> int:
    """The max_item_bytes argument the engine takes (checked in [1, 1 GiB]; the page size no longer
    depends on it): the user's, else the largest of `sizes` within [DEFAULT_MAX_ITEM_BYTES,
    LARGEST_PAGE_ITEM_BYTES]. Only a max_item_bytes the user gave is a limit (item_limit)."""
    if max_item_bytes is not None:
        return _check_int("max_item_bytes", max_item_bytes, 1)
    largest = int(sizes.max()) if sizes.size else 0
    return max(DEFAULT_MAX_ITEM_BYTES, min(largest, LARGEST_PAGE_ITEM_BYTES))

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
    gather_rows(ids, out, ...)       hits copied into the rows of `out` (one call, GIL released)
    gather_flat(ids, len_hint)       hits copied back to back: (flat uint8 array, lengths)
    get_into(i, buf) -> int          copy into a writable buffer; the length, or -1 on a miss
    view(i) -> SampleView | None     zero copy: a read-only buffer into the cache, pinned (no
                                     process frees, rewrites or moves those bytes) until released;
                                     a value larger than stats()["chunk_size"] is a private copy
    contains(i) -> bool
    put(i, data, score=None) -> bool False when admission refuses it
    put_many(ids, values, scores=None) -> np.ndarray[bool]
    update_scores(ids, scores)       one lock per call
    set_next_use(ids, positions)     clairvoyant policy: next read position of each id (-1 none)
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
        self._segment = node.creator_of(self.name)   # which segment this is (unlink)
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
        self.set_next_use = core.set_next_use
        # The batch calls of the readers that fill whole batches (CachedLoader, the peer server).
        self.gather_rows = functools.partial(_core.gather_rows, core)
        self.gather_flat = functools.partial(_core.gather_flat, core)

    # ---- the caches of this node ----------------------------------------------------------------
    @staticmethod
    def list() -> List[str]:
        """Names of the caches on this node (what `shadecache ls` lists)."""
        return node.list_caches()

    @staticmethod
    def remove(name: str) -> bool:
        """Cache.remove(name), called on the class: removes the cache `name` from this node (its
        segment's name; processes that have it mapped keep using it until they close); False if
        there is none. On a cache, cache.remove(i) removes sample i."""
        return node.remove(name)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, num_samples: int, capacity_bytes: int, policy: str = "importance",
               max_item_bytes: Optional[int] = None, sizes=None, persist: bool = False,
               fingerprint: Optional[str] = None, blend: Optional[float] = None) -> "Cache":
        """Creates the cache `name` on this node. FileExistsError if the name is taken,
        sc.CapacityError if /dev/shm cannot hold it.

        capacity_bytes  the memory of the cache in /dev/shm (at most a fixed 0.25 MiB comes on top);
                     sc.Cache.capacity_for(k, sizes) is the memory that holds k samples. A capacity
                     too small for the per-sample index of num_samples is refused, naming the least.
        sizes        sample sizes in bytes (all of them, or a sample of them): the slots that hold
                     the values' tails are fitted to these sizes.
        max_item_bytes  an optional limit: the largest value accepted (default: any value the cache
                     can hold).
        persist      keep the segment (values and scores) after every process has exited.
        fingerprint  names the data set (a store's `fingerprint`); attach(fingerprint=) and
                     create_or_attach refuse a cache of another one.
        blend        clairvoyant only (default 0): how many read positions one point of
                     importance score is worth (see `policy_weight`)."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        num_samples = _check_int("num_samples", num_samples, 1)
        capacity_bytes = _check_int("capacity_bytes", capacity_bytes, 1)
        sizes = _check_sizes(sizes)
        page_item_bytes = _page_item_bytes(max_item_bytes, sizes)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
        if not isinstance(persist, bool):
            raise TypeError(f"persist must be a bool, got {type(persist).__name__}")
        if blend is not None and policy != "clairvoyant":
            raise ValueError(f"blend is a setting of the clairvoyant policy, not of {policy!r}")
        fingerprint = _check_fingerprint(fingerprint)
        core = _core.CacheCore.create(name, num_samples, capacity_bytes, page_item_bytes, POLICIES[policy],
                                      sizes, persist, fingerprint or "",
                                      0 if max_item_bytes is None else page_item_bytes)
        if not persist:   # removed when this process exits (node.py's gc if it is killed)
            shm.own(name, functools.partial(node.remove_if_created_here, name))
        cache = cls(core, owner=not persist)
        if blend is not None:
            try:
                cache.policy_weight = blend
            except BaseException:
                cache.close()
                cache.unlink()
                raise
        return cache

    @classmethod
    def attach(cls, name: str, fingerprint: Optional[str] = None) -> "Cache":
        """Attaches to the cache `name` created by another process. FileNotFoundError if none;
        sc.FingerprintError when `fingerprint` is given and the cache holds another data set."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        fingerprint = _check_fingerprint(fingerprint)
        cache = cls(_core.CacheCore.attach(name), owner=False)
        if fingerprint is not None and cache.fingerprint != fingerprint:
            found = cache.fingerprint or "none"
            cache.close()
            raise FingerprintError(f"cache {name!r} holds samples of data set {found}, not {fingerprint}: "
                                   f"another data set or another version of it; remove it with "
                                   f"`shadecache rm {name}` or use another name")
        return cache

    @classmethod
    def create_or_attach(cls, name: str, num_samples: int, capacity_bytes: int, **kw) -> "Cache":
        """The cache `name`: attached when it exists (a persisted cache a restarted job finds
        warm), created with these arguments otherwise. An existing cache must hold the same
        data set (`fingerprint`, when given) and num_samples, else sc.FingerprintError."""
        for _ in range(3):
            try:
                cache = cls.attach(name, fingerprint=kw.get("fingerprint"))
            except FileNotFoundError:
                try:
                    return cls.create(name, num_samples, capacity_bytes, **kw)
                except FileExistsError:
                    continue  # another process created it meanwhile: attach to that one
            if cache.num_samples != num_samples:
                cache.close()
                raise FingerprintError(f"cache {name!r} holds {cache.num_samples} sample ids, not {num_samples}")
            return cache
        raise FileExistsError(f"cache {name!r} appeared and vanished three times while attaching")

    @classmethod
    def for_store(cls, name: str, store, capacity_bytes: int, attach: bool = True, **kw) -> "Cache":
        """A cache for the samples of `store` (a PackedStore): num_samples, the sample sizes and
        the fingerprint come from the store. attach=True: a cache of that name is attached if it
        exists (refused when it holds another data set)."""
        kw.setdefault("sizes", store.lengths)
        kw.setdefault("fingerprint", store.fingerprint)
        make = cls.create_or_attach if attach else cls.create
        return make(name, len(store), capacity_bytes, **kw)

    @staticmethod
    def capacity_for(num_items: int, sizes, num_samples: Optional[int] = None,
                     policy: Optional[str] = None) -> int:
        """capacity_bytes (memory) that holds `num_items` samples whose sizes are distributed as
        `sizes` (every sample's size, e.g. a store's `lengths`, or a sample of them), in a cache
        of `num_samples` ids (default len(sizes)) created with the same sizes. The per-sample
        index is counted in: for `policy` (default: the one that keeps the most state per
        sample, lru, so the answer holds under any)."""
        num_items = _check_int("num_items", num_items, 0)
        sizes = _check_sizes(sizes)
        if sizes.size == 0:
            raise ValueError("sizes is empty: give the sizes of the samples to hold")
        num_samples = int(sizes.size) if num_samples is None else _check_int("num_samples", num_samples, 1)
        policy = "lru" if policy is None else policy
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
        return _core.CacheCore.capacity_for(num_items, sizes, num_samples, POLICIES[policy])

    @staticmethod
    def memory_for(num_samples: int, capacity_bytes: int, sizes=None, policy: str = "importance",
                   max_item_bytes: Optional[int] = None) -> int:
        """Bytes of shared memory a cache created with these arguments takes (segment_bytes):
        capacity_bytes and the fixed part every cache has."""
        sizes = _check_sizes(sizes)
        page_item_bytes = _page_item_bytes(max_item_bytes, sizes)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
        return _core.CacheCore.segment_bytes(_check_int("num_samples", num_samples, 1),
                                             _check_int("capacity_bytes", capacity_bytes, 1),
                                             page_item_bytes, POLICIES[policy], sizes)

    def __reduce__(self):
        # Spawned DataLoader workers and other processes get the cache by name, never by value.
        return (Cache.attach, (self.name,))

    def missed(self, ids) -> list:
        """Positions in `ids` (int64 array) of the ids this cache does not hold now: one native
        look-up per batch, no lock (a peer server's chunk fills these from the tiers below)."""
        return _core.peer_missed(self._core, ids)

    @property
    def engine(self):
        """The native engine object of this handle (_core.CacheCore), for the native calls of
        the layers above that work on shared memory directly (the peer layer seals replies
        straight from the segment: peer/server.py seal_reply)."""
        return self._core

    # ---- writers with argument shaping -------------------------------------------------------
    def update_scores(self, ids, scores) -> None:
        """Sets the importance of every id in `ids` (cached or not) under one lock."""
        if hasattr(ids, "detach"):  # a torch tensor: avoid importing torch here
            ids = ids.detach().cpu().numpy()
        if hasattr(scores, "detach"):
            scores = scores.detach().cpu().numpy()
        self._core.update_scores(ids, scores)

    def admits(self, ids, displaced=0) -> np.ndarray:
        """Bool mask: whether this cache, full, would admit each id by the time `displaced` (an
        int, or one per id) of its cached values have given way to others. The engine answers
        with the policy that decides puts (csrc/cache/admission.cc): the key the id would enter
        with must pass the policy's admits() against the lowest key left then. importance: a
        score above the lowest cached score left; clairvoyant: a key (next use, blended with the
        score) above the lowest left; static: none; lru and fifo: every id. A prediction for
        readers ahead (the prefetcher); put decides."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        k = np.ascontiguousarray(np.broadcast_to(np.asarray(displaced, dtype=np.int64), ids.shape))
        return np.asarray(self._core.would_admit(ids, k), dtype=bool)

    # ---- introspection ----------------------------------------------------------------------
    @property
    def policy(self) -> str:
        return self._core.policy

    @property
    def keys_on_next_use(self) -> bool:
        """Whether the policy keys on next use (clairvoyant): set_next_use matters."""
        return self._core.keys_on_next_use

    @property
    def policy_weight(self) -> float:
        """The clairvoyant blend: a value read next at position P has the key
        2^40 - P + policy_weight * score (0 by default: pure next use). Setting it rekeys every
        cached value (one lock); ValueError under any other policy or for a negative weight."""
        return self._core.policy_weight

    @policy_weight.setter
    def policy_weight(self, w: float) -> None:
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
            raise TypeError(f"policy_weight must be a number, got {type(w).__name__}")
        self._core.policy_weight = float(w)

    @property
    def capacity_bytes(self) -> int:
        return self._core.capacity_bytes

    @property
    def max_item_bytes(self) -> int:
        return self._core.max_item_bytes

    @property
    def persist(self) -> bool:
        """True when the segment outlives every process (created with persist=True)."""
        return self._core.persist

    @property
    def fingerprint(self) -> str:
        """The data set the cache was created for ("" when not named)."""
        return self._core.fingerprint

    @property
    def last_attach(self) -> float:
        """Unix time of the latest create or attach."""
        return self._core.last_attach_unix_ns / 1e9

    @property
    def closed(self) -> bool:
        return self._core.closed

    def stats(self) -> dict:
        """Counters and sizes: hits, misses, hit_ratio, inserts, evictions, rejected, items,
        bytes_used, capacity_bytes, page_moves, recoveries, ... (docs/cache.md lists them all).
        With a peer server serving this cache, "tiers": what it publishes (peer/status.py): GETs
        served from the cache, the SSD tier and the store, bytes, mean latency, the SSD tier's
        counters and the peers."""
        s = self._core.stats()
        from .. import status as tier_status
        tiers = tier_status.read(self.name)
        if tiers is not None:
            s["tiers"] = tiers
        return s

    def huge_pages(self) -> dict:
        """Whether this cache's shared memory is on huge pages (a large cache read at random
        is faster on them: far fewer TLB misses; docs/shared_memory.md, "Huge pages"): the mode
        /dev/shm gives new segments ("never", "within_size", ...), whether that means huge pages,
        and how much of this process's mapping is resident and how much of that huge-page mapped
        (read from /proc; a few milliseconds, so not part of stats())."""
        from . import huge_pages
        self._core.stats()   # raises sc.ClosedError on a closed cache, as every call does
        return huge_pages.report(_core.CacheCore.path(self.name))

    def __len__(self) -> int:
        return self._core.stats()["items"]

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
        """Removes the segment's name; processes that have it mapped keep using it until they close.
        FileNotFoundError when the name is gone, or names another cache now (this one's was
        removed and another made under the name, by another creator: that one is left alone)."""
        shm.disown(self.name)
        now = node.creator_of(self.name)
        if now is not None and self._segment is not None and now != self._segment:
            raise FileNotFoundError(errno.ENOENT, f"cache {self.name!r}: its segment has no name any "
                                    f"more; the name is another cache's now (made by pid {now[0]}), "
                                    "left alone")
        _core.CacheCore.unlink(self.name)

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self._creator_pid == os.getpid():   # its own segment, not one made since under its name
            node.remove_if_created_here(self.name)


def _check_sizes(sizes) -> np.ndarray:
    """Sample sizes as a uint64 array (empty for None); TypeError / ValueError for anything else."""
    if sizes is None:
        return np.zeros(0, dtype=np.uint64)
    a = np.asarray(sizes)
    if a.dtype == object or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
        raise TypeError(f"sizes must be integers (bytes per sample), got an array of {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"sizes must be one-dimensional, got shape {a.shape}")
    if a.size and int(a.min()) < 0:
        raise ValueError(f"sizes must be >= 0, got {int(a.min())}")
    return np.ascontiguousarray(a, dtype=np.uint64)


def _check_fingerprint(fingerprint) -> Optional[str]:
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise TypeError(f"fingerprint must be a str, got {type(fingerprint).__name__}")
    if fingerprint is not None and "\0" in fingerprint:
        # the segment stores it as a C string: "ab\0cd" would be kept, and matched, as "ab"
        raise ValueError("fingerprint may not contain a NUL byte")
    return fingerprint
