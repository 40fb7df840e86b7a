"""Pinned zero-copy views: cache.view(i) exposes a cached value's bytes in shared memory, and
while the view is held those bytes never change, whatever any process does.

Every test uses real processes (fork and spawn) and real SIGKILLs: writers churn the cache
(evictions, page moves between size classes, re-puts and removes of the viewed ids), crash at the
engine's crash points, die holding views of their own, or inherit their parent's views by fork.
The held bytes are compared with the originals (and values are self-describing, see values.py).
"""
import gc
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import shadecache as sc
from shadecache import _core
from crashing import attach_armed
from values import make_value, verify_value

MiB = 1 << 20
SMALL_PAGES = (64 << 10) - 32  # a max_item_bytes limit, passed as users do
# A value smaller than the cache's chunk_size is one slot, which a view pins (zero copy); a larger
# one is a chain of chunks, whose view is a private copy. A 1 MiB cache has 1 KiB chunks, a 4 MiB
# one 4 KiB chunks: the tests that pin pick their sizes (or caches) accordingly.


def _pins(c):
    s = c.stats()
    return s["pinned"], s["zombies"]


def _release_and_expect_clean(cache, views, probe_id, probe=b"x"):
    """Releases every view, makes one write (which frees the zombies), and checks that nothing is
    pinned, no zombie is left and the cache is consistent."""
    for v in views:
        v.release()
    cache.put(probe_id, probe)
    assert _pins(cache) == (0, 0)
    cache.check()


def _view_all(cache, ids):
    """Views of `ids` (a dict id -> SampleView) and numpy arrays over them (id -> array)."""
    views = {i: cache.view(i) for i in ids}
    return views, {i: np.frombuffer(v, np.uint8) for i, v in views.items()}


def _addr(v):
    return np.frombuffer(v, np.uint8).ctypes.data


def _segment_ranges(name):
    """(start, end) of every mapping of the cache's shared-memory file in this process."""
    path = _core.CacheCore.path(name)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip().split(" (deleted)")[0] == path:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def _version(value):
    return int.from_bytes(value[8:16], "little")


# ---- 1. basics -------------------------------------------------------------------------------


def test_view_basics_buffer_protocol_zero_copy_and_release(cache_name):
    """view(i) shows exactly get(i)'s bytes for every size (0 B too), returns None on a miss and
    rejects bad ids like get(); the buffer is read-only, 1-D, format 'B', and zero copy for a value
    smaller than a chunk (two views of one id share one address, inside the mapped segment,
    unlike a copy), a private copy for a larger one (nothing pinned); len/id/released work;
    `with` releases; release() is idempotent, refused (BufferError) while a memoryview or numpy
    array is exported, and afterwards exporting raises ValueError naming "released"; a garbage
    collected view unpins; stats() counts pinned slots."""
    sizes = [0, 1, 31, 100, 1000, 4096, 20_000, 60_000, SMALL_PAGES]
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=2 * MiB,
                         max_item_bytes=SMALL_PAGES, policy="lru") as c:
        assert _pins(c) == (0, 0)
        values = {}
        for k, size in enumerate(sizes):
            values[k] = make_value(k, 3, size) if size >= 20 else bytes(range(size))
            assert c.put(k, values[k])
        for k, value in values.items():
            v = c.view(k)
            assert v is not None
            assert len(v) == len(value) and v.id == k and v.released is False
            assert bytes(v) == c.get(k) == value
            mv = memoryview(v)
            assert mv.readonly and mv.ndim == 1 and mv.format == "B" and mv.itemsize == 1
            assert mv.nbytes == len(value) and mv.tobytes() == value
            if len(value):
                with pytest.raises(TypeError):
                    mv[0] = (mv[0] + 1) % 256
                a = np.frombuffer(v, np.uint8)
                assert not a.flags.writeable
                with pytest.raises(ValueError):
                    a[0] = 1
                assert a.tobytes() == value
                del a
            mv.release()
            v.release()
            assert v.released
            assert c.get(k) == value, "a failed write through the view changed nothing"

        # Misses and bad ids.
        assert c.view(50) is None
        c.put(51, b"x")
        c.remove(51)
        assert c.view(51) is None
        for bad in (100, 10**12, -1):
            with pytest.raises(IndexError, match="sample id"):
                c.view(bad)
        for bad in ("3", 3.0, None):
            with pytest.raises(TypeError):
                c.view(bad)

        # Zero copy: both views of id 4 (1000 B, below the chunk size) expose the same
        # shared-memory bytes; a copy lives elsewhere.
        assert sizes[4] < c.stats()["chunk_size"] < sizes[7]
        v1, v2 = c.view(4), c.view(4)
        a1, a2 = np.frombuffer(v1, np.uint8), np.frombuffer(v2, np.uint8)
        assert a1.ctypes.data == a2.ctypes.data
        copy = np.frombuffer(bytes(v1), np.uint8)
        assert copy.ctypes.data != a1.ctypes.data and copy.tobytes() == a1.tobytes()
        ranges = _segment_ranges(cache_name)
        assert ranges, "the segment is mapped in this process"
        assert any(lo <= a1.ctypes.data and a1.ctypes.data + len(v1) <= hi for lo, hi in ranges), \
            "the view points into the mapped shared-memory segment"
        v6 = c.view(3)
        assert _addr(v6) != a1.ctypes.data
        assert c.stats()["pinned"] == 3
        # A value in chunks (id 7, 60 KB): each view is a private copy, outside the segment.
        w1, w2 = c.view(7), c.view(7)
        assert bytes(w1) == bytes(w2) == values[7] and _addr(w1) != _addr(w2)
        assert not any(lo <= _addr(w1) < hi for lo, hi in ranges)
        assert c.stats()["pinned"] == 3
        w1.release()
        w2.release()

        # release() refused while buffers are exported, then works; idempotent.
        mv = memoryview(v1)
        with pytest.raises(BufferError):
            v1.release()
        assert not v1.released and bytes(v1) == values[4]
        mv.release()
        with pytest.raises(BufferError):
            v1.release()  # the numpy array a1 still holds an export
        del a1
        v1.release()
        assert v1.released
        v1.release()
        assert v1.released
        with pytest.raises(ValueError, match="released"):
            memoryview(v1)
        assert a2.tobytes() == values[4], "the other view of id 4 is unaffected"
        del a2, copy
        v2.release()
        v6.release()
        assert _pins(c) == (0, 0)

        # Context manager releases at exit, even on an exception.
        with c.view(2) as v:
            assert v.id == 2 and bytes(v) == values[2]
            assert c.stats()["pinned"] == 1
        assert v.released and c.stats()["pinned"] == 0
        with pytest.raises(RuntimeError):
            with c.view(5) as v:
                raise RuntimeError("boom")
        assert v.released and c.stats()["pinned"] == 0

        # Garbage collection releases a view.
        v = c.view(3)
        assert c.stats()["pinned"] == 1
        del v
        gc.collect()
        assert c.stats()["pinned"] == 0
        c.check()


def test_replace_and_remove_keep_the_viewed_bytes(cache_name):
    """A re-put of a viewed id (same size class, where the engine would otherwise overwrite in
    place, and another class) stores the new value elsewhere and remove() makes it a miss, while
    the view keeps the old bytes; the old slots count as zombies until the views are released and
    the next write frees them."""
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=MiB,
                         max_item_bytes=SMALL_PAGES, policy="lru") as c:
        old = {i: make_value(i, 0, 1000) for i in range(3)}
        for i, value in old.items():
            c.put(i, value)
        views, arrays = _view_all(c, old)
        addrs = {i: a.ctypes.data for i, a in arrays.items()}
        assert _pins(c) == (3, 0)
        new0 = make_value(0, 1, 1000)  # same size: same class
        new1 = make_value(1, 1, 9000)  # another class
        assert c.put(0, new0) and c.put(1, new1) and c.remove(2)
        assert c.get(0) == new0 and c.get(1) == new1 and c.get(2) is None
        assert not c.contains(2)
        for i, value in old.items():
            assert bytes(views[i]) == value and arrays[i].tobytes() == value
            assert arrays[i].ctypes.data == addrs[i]
        assert _pins(c) == (3, 3)
        # A fresh view of a re-put id shows the new value at another address.
        v0 = c.view(0)
        assert bytes(v0) == new0 and _addr(v0) != addrs[0]
        assert _pins(c) == (4, 3)
        # Re-put the new value again while both views are held: both unchanged.
        c.put(0, make_value(0, 2, 1000))
        assert bytes(v0) == new0 and bytes(views[0]) == old[0]
        c.check()
        del arrays
        for v in list(views.values()) + [v0]:
            v.release()
        assert c.stats()["pinned"] == 0
        c.put(50, b"any write frees the zombies")
        assert _pins(c) == (0, 0)
        assert c.get(0) == make_value(0, 2, 1000) and c.get(1) == new1 and c.get(2) is None
        assert c.stats()["items"] == 3
        c.check()


def test_eviction_skips_pinned_values(cache_name):
    """LRU: the two oldest values are viewed, so each put past capacity evicts the oldest UNpinned
    value; after a whole cache's worth of puts the viewed ones are still cached and intact."""
    with sc.Cache.create(cache_name, num_samples=5000, capacity_bytes=MiB, policy="lru") as c:
        vals = {i: make_value(i, 0, 900) for i in range(5000)}
        c.put(0, vals[0])
        c.put(1, vals[1])
        v0, v1 = c.view(0), c.view(1)
        assert c.stats()["pinned"] == 2
        k = 2
        while c.stats()["evictions"] == 0:
            assert c.put(k, vals[k])
            k += 1
        assert c.contains(0) and c.contains(1) and not c.contains(2) and c.contains(k - 1)
        items = c.stats()["items"]
        for j in range(k, k + items):
            assert c.put(j, vals[j])
        cached = set(np.flatnonzero(c.cached_mask()).tolist())
        assert {0, 1} <= cached and not cached & set(range(2, k)), sorted(cached)[:10]
        assert bytes(v0) == vals[0] and bytes(v1) == vals[1]
        assert c.get(0) == vals[0] and c.get(1) == vals[1]
        v0.release()
        v1.release()
        c.check()


def test_page_moves_skip_pages_holding_pinned_values(cache_name):
    """A 4 MiB cache full of 3 KB values, two of them viewed, then flooded with 60 KB values: the
    memory of the 3 KB values moves to the large ones (pages emptied by evicting and by moving
    values), but a page holding a pinned value is never emptied: the viewed ids stay cached, with
    their original bytes at their original address."""
    with sc.Cache.create(cache_name, num_samples=2000, capacity_bytes=4 * MiB,
                         max_item_bytes=SMALL_PAGES, policy="lru") as c:
        assert c.stats()["chunk_size"] > 3000
        small = {i: make_value(i, 0, 3000) for i in range(1300)}
        for i, value in small.items():
            c.put(i, value)
        pinned_ids = (0, 650)
        views = [c.view(i) for i in pinned_ids]
        addrs = [_addr(v) for v in views]
        for k in range(60):
            c.put(1000 + 400 + k, make_value(1400 + k, 1, 60_000))
        for i, v, a in zip(pinned_ids, views, addrs):
            assert bytes(v) == small[i] and _addr(v) == a
            assert c.get(i) == small[i], f"pinned id {i} was evicted"
        big = [c.get(1400 + k) for k in range(60)]
        assert sum(b is not None for b in big) >= 50
        assert all(verify_value(1400 + k, b) == "" for k, b in enumerate(big) if b is not None)
        c.check()
        _release_and_expect_clean(c, views, 1999)


# ---- 2. stability under cross-process churn ----------------------------------------------------

N_CHURN = 3000
CHURN_SIZES = (200, 1000, 4000, 15_000, 60_000)
INITIAL = 200
VIEWED = list(range(0, INITIAL, 4))  # 50 ids
UNTOUCHED = VIEWED[:10]              # the churner never writes these
REPLACED = VIEWED[10:30]             # re-put during churn and at the end
REMOVED = VIEWED[30:]                # re-put and removed during churn, removed at the end
FINAL_VERSION = 777


def _final_value(i):
    return make_value(i, FINAL_VERSION, 1000 if i % 8 == 0 else 3000)


def _churn(name, seconds, out):
    """Spawned writer: random puts / put_many of 200 B .. 60 KB (evictions, page moves), re-puts
    and removes of the viewed ids; at the end clears the churn ids, re-puts REPLACED with their
    final value and removes REMOVED. Reports the number of ops and anything that went wrong."""
    cache = sc.Cache.attach(name)
    rng = random.Random(2024)
    touched = REPLACED + REMOVED
    errors, ops = [], 0
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        step += 1
        r = rng.random()
        if r < 0.7:
            i = rng.randrange(INITIAL, N_CHURN)
            cache.put(i, make_value(i, step, rng.choice(CHURN_SIZES)))
        elif r < 0.8:
            ids = [rng.randrange(INITIAL, N_CHURN) for _ in range(8)]
            cache.put_many(ids, [make_value(i, step, rng.choice(CHURN_SIZES)) for i in ids])
        elif r < 0.93:
            i = rng.choice(touched)
            cache.put(i, make_value(i, step, rng.choice((1000, 1000, 200, 4000))))
        else:
            cache.remove(rng.choice(touched))
        if step % 50 == 0:
            i = rng.randrange(INITIAL, N_CHURN)
            v = cache.get(i)
            if v is not None and verify_value(i, v):
                errors.append(verify_value(i, v))
        ops += 1
    for i in range(N_CHURN):
        if i not in VIEWED:
            cache.remove(i)
    for i in REPLACED:
        if not cache.put(i, _final_value(i)):
            errors.append(f"final put of {i} refused")
    for i in REMOVED:
        cache.remove(i)
    cache.close()
    out.put((ops, errors[:5]))


def test_views_stable_while_another_process_churns(cache_name):
    """The test process holds views (and numpy arrays) of 50 of 200 values while a spawned process
    churns a 4 MiB cache for 2 s (evictions, page moves, re-puts and removes of the viewed ids).
    Checked continuously during the churn and after it: every view still holds exactly its
    original bytes; viewed ids nobody wrote are still cached (never evicted, their pages never
    moved); get() returns the re-put values and misses removed ones; stats count 50 pinned slots
    and 40 zombies; after release and one put: no pins, no zombies, check() passes."""
    with sc.Cache.create(cache_name, num_samples=N_CHURN, capacity_bytes=4 * MiB,
                         max_item_bytes=SMALL_PAGES, policy="lru") as cache:
        orig = {i: make_value(i, 0, 1000) for i in range(INITIAL)}
        for i, value in orig.items():
            assert cache.put(i, value)
        views, arrays = _view_all(cache, VIEWED)
        addrs = {i: a.ctypes.data for i, a in arrays.items()}
        expect = {i: np.frombuffer(orig[i], np.uint8).copy() for i in VIEWED}
        assert _pins(cache) == (50, 0)

        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=_churn, args=(cache_name, 2.0, out))
        p.start()
        rounds, bad = 0, []
        while p.is_alive() and out.empty():
            for i in VIEWED:
                if not np.array_equal(arrays[i], expect[i]):
                    bad.append(i)
            rounds += 1
            if bad:
                break
            time.sleep(0.001)
        ops, errors = out.get(timeout=120)
        p.join(timeout=60)
        assert p.exitcode == 0
        assert not bad, f"viewed bytes changed during churn: ids {sorted(set(bad))}"
        assert not errors, errors
        assert ops > 1000 and rounds > 5, (ops, rounds)

        for i in VIEWED:
            assert bytes(views[i]) == orig[i], f"view of {i} changed"
            assert arrays[i].ctypes.data == addrs[i] and np.array_equal(arrays[i], expect[i])
        for i in UNTOUCHED:
            assert cache.get(i) == orig[i], f"pinned, never rewritten id {i} was evicted or moved"
        for i in REPLACED:
            assert cache.get(i) == _final_value(i), f"id {i}: get does not return the re-put value"
        for i in REMOVED:
            assert cache.get(i) is None
        s = cache.stats()
        assert s["evictions"] > 0 and s["page_moves"] > 0, s
        assert s["pinned"] == 50 and s["zombies"] == len(REPLACED) + len(REMOVED), s
        cache.check()

        del arrays
        for v in views.values():
            v.release()
        assert all(v.released for v in views.values())
        cache.put(INITIAL + 1, make_value(INITIAL + 1, 9, 500))
        assert _pins(cache) == (0, 0)
        cache.check()
        for i in UNTOUCHED:
            assert cache.get(i) == orig[i]
        for i, v in enumerate(cache.get_many(range(N_CHURN))):
            assert v is None or verify_value(i, v) == ""


# ---- 3. writers SIGKILLed at the crash points while views are held -----------------------------

N_CRASH = 1500
CRASH_SIZES = (200, 1000, 1000, 6000, 30_000, 60_000)
CRASH_VIEWED = list(range(0, 60, 2))  # 30 ids, all re-put by the test before the kills


def _crash_writer(name, seed, point, countdown):
    """Forked writer: arms `point`, then churns (puts, put_many, update_scores, removes, re-puts
    and removes of the viewed ids in their own size class) until the crash point kills it."""
    cache = attach_armed(name, point, countdown)
    rng = random.Random(seed)
    step = 0
    while True:
        step += 1
        r = rng.random()
        if r < 0.35:
            i = rng.randrange(60, N_CRASH)
            cache.put(i, make_value(i, seed * 100_000 + step, rng.choice(CRASH_SIZES)))
        elif r < 0.5:
            ids = [rng.randrange(60, N_CRASH) for _ in range(8)]
            cache.put_many(ids, [make_value(i, seed * 100_000 + step, rng.choice(CRASH_SIZES)) for i in ids])
        elif r < 0.7:
            i = rng.choice(CRASH_VIEWED)
            cache.put(i, make_value(i, seed * 100_000 + step, rng.choice((1000, 1000, 6000))))
        elif r < 0.8:
            cache.remove(rng.choice(CRASH_VIEWED + list(range(60, N_CRASH, 7))))
        else:
            cache.update_scores(np.array([rng.randrange(N_CRASH) for _ in range(32)]), np.random.rand(32))


def test_writers_sigkilled_at_crash_points_never_touch_viewed_bytes(cache_name):
    """Writers SIGKILLed at every crash point (twice each) and at random moments, while the test
    process holds 30 views whose ids were all replaced (so their slots are zombies that only the
    pins keep, exactly what a repair that rebuilds free lists from the index could reclaim). After
    each kill the next locker repairs, check() passes, the viewed bytes are intact, and the pins
    and zombies are all still accounted for."""
    points = sorted(_core.CRASH_POINTS.values())
    assert len(points) >= 8
    ctx = mp.get_context("fork")
    rng = random.Random(11)
    with sc.Cache.create(cache_name, num_samples=N_CRASH, capacity_bytes=MiB,
                         max_item_bytes=SMALL_PAGES, policy="lru") as cache:
        orig = {i: make_value(i, 0, 1000) for i in range(60)}
        for i, value in orig.items():
            cache.put(i, value)
        views, arrays = _view_all(cache, CRASH_VIEWED)
        for i in CRASH_VIEWED:
            cache.put(i, make_value(i, 1, 1000))  # the pinned originals become zombies
        assert _pins(cache) == (30, 30)
        rec0 = cache.stats()["recoveries"]

        plan = [(p, True) for p in points for _ in range(2)] + [(0, False)] * 8
        self_kills = 0
        for k, (point, armed) in enumerate(plan):
            w = ctx.Process(target=_crash_writer, args=(cache_name, k + 1, point, rng.randint(1, 12)))
            w.start()
            if armed:
                w.join(timeout=2)
                self_kills += w.exitcode is not None
            else:
                time.sleep(rng.uniform(0.002, 0.03))
            if w.exitcode is None:
                os.kill(w.pid, signal.SIGKILL)
                w.join()
            assert w.exitcode == -signal.SIGKILL, f"writer {k} ended with {w.exitcode}"
            cache.put(60 + k, make_value(60 + k, 5, 1000))  # the next locker repairs
            cache.check()
            for i in CRASH_VIEWED:
                assert arrays[i].tobytes() == orig[i], f"after kill {k} (point {point}): view of {i} changed"
            assert _pins(cache) == (30, 30), (k, point, cache.stats())
        assert self_kills >= len(points), f"only {self_kills} writers died at their crash point"
        assert cache.stats()["recoveries"] - rec0 >= self_kills

        # Churn from this process too: the repaired free lists never hand out a pinned slot.
        for step in range(3000):
            i = rng.randrange(60, N_CRASH)
            cache.put(i, make_value(i, 6, rng.choice(CRASH_SIZES)))
        for i in CRASH_VIEWED:
            assert bytes(views[i]) == orig[i] and arrays[i].tobytes() == orig[i]
        del arrays
        for v in views.values():
            v.release()
        cache.put(0, make_value(0, 9, 1000))
        assert _pins(cache) == (0, 0)
        cache.check()
        for i, v in enumerate(cache.get_many(range(N_CRASH))):
            assert v is None or verify_value(i, v) == ""


# ---- 4. a pinner that dies ---------------------------------------------------------------------


def _pin_and_die(name, out):
    """Forked: takes 20 views (ids 0..19), replaces ids 0..9 (their pinned slots become zombies),
    reports its own view of the stats, then SIGKILLs itself without releasing anything."""
    cache = sc.Cache.attach(name)
    views = [cache.view(i) for i in range(20)]
    for i in range(10):
        cache.put(i, make_value(i, 1, 1000))
    ok = all(bytes(v) == make_value(v.id, 0, 1000) for v in views)
    out.put((ok, cache.stats()["pinned"], cache.stats()["zombies"]))
    time.sleep(0.2)  # let the queue's feeder thread flush
    os.kill(os.getpid(), signal.SIGKILL)


def test_pins_of_a_killed_process_are_not_leaked(cache_name):
    """A forked child takes 20 views, replaces 10 of the ids and SIGKILLs itself. The dead pins are
    never counted (stats()["pinned"] is just the test process's own view), and churn evicts the
    values the dead child pinned and frees its zombies like any others, while the live view of
    the test process keeps its value cached and intact; check() passes."""
    with sc.Cache.create(cache_name, num_samples=3000, capacity_bytes=MiB,
                         max_item_bytes=SMALL_PAGES, policy="lru") as cache:
        for i in range(60):
            # id 50 (the live view of this process) sits in another size class, so no page holds
            # both a live pin and the dead child's pins (both sizes below the 1 KiB chunks).
            cache.put(i, make_value(i, 0, 500 if i == 50 else 1000))
        mine = cache.view(50)
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        p = ctx.Process(target=_pin_and_die, args=(cache_name, out))
        p.start()
        ok, child_pinned, child_zombies = out.get(timeout=30)
        p.join(timeout=30)
        assert p.exitcode == -signal.SIGKILL
        assert ok and child_pinned == 21 and child_zombies == 10, (ok, child_pinned, child_zombies)
        assert cache.stats()["pinned"] == 1, cache.stats()
        cache.check()

        rng = random.Random(5)
        dead_live = range(10, 20)
        done = False
        for step in range(40_000):
            i = rng.randrange(100, 3000)
            cache.put(i, make_value(i, 2, rng.choice((1000, 1000, 3000, 20_000))))
            if step % 200 == 199:
                if not any(cache.contains(j) for j in dead_live) and cache.stats()["zombies"] == 0:
                    done = True
                    break
        s = cache.stats()
        assert done, f"values pinned by the dead process are never evicted / freed: {s}, " \
                     f"still cached: {[j for j in dead_live if cache.contains(j)]}"
        assert s["pinned"] == 1 and s["zombies"] == 0 and s["evictions"] > 0, s
        assert bytes(mine) == make_value(50, 0, 500) and cache.get(50) == make_value(50, 0, 500)
        cache.check()
        mine.release()
        cache.put(51, b"y")
        assert _pins(cache) == (0, 0)
        cache.check()


def _view_once_and_exit(name):
    c = sc.Cache.attach(name)
    try:
        c.view(0).release()
    except sc.CapacityError:
        os._exit(3)
    os._exit(0)


def test_records_of_exited_processes_are_reused(cache_name):
    """Processes that took a view and exited (DataLoader workers re-created every epoch) leave
    their pin record claimed; once all MAX_VIEW_PROCESSES records are used, a new process takes
    over the record of one that is gone instead of being refused."""
    ctx = mp.get_context("fork")
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=MiB, max_item_bytes=1000) as c:
        c.put(0, b"v" * 100)
        for k in range(sc.Cache.MAX_VIEW_PROCESSES + 8):
            p = ctx.Process(target=_view_once_and_exit, args=(cache_name,))
            p.start()
            p.join()
            assert p.exitcode == 0, f"process #{k + 1} was refused a view"
        with c.view(0) as v:
            assert bytes(v) == b"v" * 100 and c.stats()["pinned"] == 1
        c.check()


def _torn_rewrite(name, sample_id, value):
    attach_armed(name, _core.CRASH_POINTS["put_mid_write"], 1).put(sample_id, value)


def _read_until(name, sample_id, allowed, deadline, q):
    """Gets and views `sample_id` until `deadline`; reports (attempts, values not in `allowed`)."""
    c = sc.Cache.attach(name)
    bad = tries = 0
    while time.time() < deadline:
        tries += 1
        got = c.get(sample_id)
        bad += got is not None and got not in allowed
        v = c.view(sample_id)
        if v is not None:
            bad += bytes(v) not in allowed
            v.release()
    q.put((tries, bad))


def test_repair_of_a_torn_rewrite_under_a_stale_pin_never_exposes_torn_bytes(cache_name):
    """A writer killed half way through rewriting id X in place leaves X's slot torn (seq odd)
    while the index still names it; a reader that raced it left a pin entry on that slot. The
    repair frees the slot (a torn slot is never under a view that was handed out: a writer checks
    the pins before it writes) and no get or view ever returns its half-written bytes, before,
    during or after the repair."""
    n, size = 2_000_000, 4000
    x = n - 1  # the repair clears stale index entries in id order: X last, the widest window
    old, new = b"A" * size, b"B" * size
    ctx = mp.get_context("fork")
    with sc.Cache.create(cache_name, num_samples=n, capacity_bytes=32 * MiB, max_item_bytes=size) as c:
        assert c.stats()["chunk_size"] > size  # one slot: rewritten in place
        c.put(x, old)
        w = ctx.Process(target=_torn_rewrite, args=(cache_name, x, new))
        w.start()
        w.join()
        assert w.exitcode == -signal.SIGKILL
        token = c._core._stale_pin(x)
        assert token
        q = ctx.Queue()
        r = ctx.Process(target=_read_until, args=(cache_name, x, (old, new), time.time() + 2.0, q))
        r.start()
        time.sleep(0.3)
        assert c.put(0, b"z")  # the next locker repairs
        tries, bad = q.get(timeout=30)
        r.join()
        assert c.stats()["recoveries"] == 1
        assert tries > 0 and bad == 0, f"{bad} torn values in {tries} get+view rounds"
        assert c.get(x) is None and _pins(c) == (1, 0)
        c.check()
        c._core._stale_unpin(token)
        c.put(1, b"y")
        assert _pins(c) == (0, 0)
        c.check()


def _write_without_proc(name):
    """Forked writer that cannot open /proc (every fd in use), then replaces and churns."""
    import resource

    c = sc.Cache.attach(name)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    fds = []
    try:
        while True:
            fds.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    c.put(0, b"N" * 1000)  # the viewed value becomes a zombie
    for i in range(1, 400):  # reclaim runs, meets the pin, reaps: the owner must count as alive
        c.put(i, bytes([i % 256]) * 1000)
    os._exit(0)


def test_a_pinner_whose_start_time_cannot_be_read_is_not_reaped(cache_name):
    """A writer that cannot read /proc/<pid>/stat (fd limit, hidepid) must treat the pinning
    process as alive: reaping a live owner would free and reuse the slot under its view."""
    with sc.Cache.create(cache_name, num_samples=1000, capacity_bytes=MiB, max_item_bytes=1000) as c:
        c.put(0, b"O" * 1000)
        with c.view(0) as v:
            p = mp.get_context("fork").Process(target=_write_without_proc, args=(cache_name,))
            p.start()
            p.join()
            assert p.exitcode == 0
            assert bytes(v) == b"O" * 1000 and c.stats()["pinned"] == 1
        c.put(1, b"y")
        assert _pins(c) == (0, 0)
        c.check()


# ---- 5. the per-process view limit -------------------------------------------------------------


def _take_views(name, n, out):
    """Spawned: takes views of ids 0, 1, ... until one is refused (or n are taken); reports how
    many it took, the refusal's message and the pinned count while it holds them."""
    cache = sc.Cache.attach(name)
    views, extra = [], "none refused"
    for i in range(n):
        try:
            views.append(cache.view(i))
        except sc.CapacityError as e:
            extra = str(e)
            break
    took = sum(v is not None for v in views)
    pinned = cache.stats()["pinned"]
    for v in views:
        v.release()
    out.put((took, extra, pinned))


def test_per_process_view_limit(cache_name, cache_factory):
    """One process holds at most Cache.MAX_VIEWS_PER_PROCESS (512) views of one cache: the 513th
    raises sc.CapacityError naming the limit and pins nothing; releasing (or collecting) one lets
    view() work again. The limit is per process and per cache: another cache, and another
    (spawned) process, still take views meanwhile."""
    limit = sc.Cache.MAX_VIEWS_PER_PROCESS
    assert limit == 512
    with sc.Cache.create(cache_name, num_samples=2000, capacity_bytes=2 * MiB) as c:
        for i in range(1100):
            c.put(i, i.to_bytes(4, "little") * 4)
        views = [c.view(i) for i in range(limit)]
        assert all(v is not None for v in views)
        assert c.stats()["pinned"] == limit
        with pytest.raises(sc.CapacityError, match="512"):
            c.view(limit)
        with pytest.raises(sc.CapacityError, match="512"):
            c.view(0)  # another view of an already viewed id counts too
        assert c.stats()["pinned"] == limit, "a refused view pins nothing"

        other = cache_factory(10)
        other.put(1, b"other cache")
        ov = other.view(1)
        assert ov is not None and bytes(ov) == b"other cache"
        ov.release()

        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=_take_views, args=(cache_name, 600, out))
        p.start()
        took, extra, pinned = out.get(timeout=120)
        p.join(timeout=60)
        assert p.exitcode == 0
        # The child took its own 512 (the parent's 512 do not count against it): 1024 pinned slots
        # (distinct slots: the child viewed ids 0..511, which the parent also pins; count slots).
        assert took == limit, (took, extra)
        assert "512" in extra, extra
        assert limit <= pinned <= 2 * limit

        views[0].release()
        v = c.view(limit)
        assert v is not None and bytes(v) == limit.to_bytes(4, "little") * 4
        with pytest.raises(sc.CapacityError):
            c.view(limit + 1)
        views[1] = None
        gc.collect()
        v2 = c.view(limit + 1)
        assert v2 is not None and v2.id == limit + 1
        for x in views[2:] + [v, v2]:
            x.release()
        assert c.stats()["pinned"] == 0
        c.check()


# ---- 6. close with open views --------------------------------------------------------------------


def test_close_with_open_views(cache_name):
    """close() with views open: the handle refuses new calls (view() too) with sc.ClosedError, but
    the views (and a numpy array exported from one) stay readable with unchanged bytes, even while
    another handle re-puts, removes and churns those ids; the pins still count; releasing them
    afterwards works, pins and zombies go to 0 on the next write."""
    c = sc.Cache.create(cache_name, num_samples=1000, capacity_bytes=4 * MiB, max_item_bytes=SMALL_PAGES,
                        policy="lru")
    try:
        vals = {i: make_value(i, 0, 2000) for i in range(10)}
        for i, value in vals.items():
            c.put(i, value)
        v1, v2 = c.view(1), c.view(2)
        a1 = np.frombuffer(v1, np.uint8)
        c.close()
        assert c.closed
        with pytest.raises(sc.ClosedError):
            c.view(3)
        with pytest.raises(sc.ClosedError):
            c.get(1)
        assert bytes(v1) == vals[1] and bytes(v2) == vals[2] and a1.tobytes() == vals[1]

        other = sc.Cache.attach(cache_name)
        assert other.stats()["pinned"] == 2
        other.put(1, make_value(1, 1, 2000))
        other.remove(2)
        assert other.get(1) == make_value(1, 1, 2000) and other.get(2) is None
        rng = random.Random(3)
        for step in range(3000):
            i = rng.randrange(10, 1000)
            other.put(i, make_value(i, step, rng.choice((500, 2000, 30_000))))
        assert other.stats()["page_moves"] > 0
        assert bytes(v1) == vals[1] and bytes(v2) == vals[2] and a1.tobytes() == vals[1]
        # The new value of id 1 is not pinned: churn may evict it, but the old one never comes back.
        assert other.get(1) in (None, make_value(1, 1, 2000)) and other.get(2) is None
        assert _pins(other) == (2, 2)

        with pytest.raises(BufferError):
            v1.release()
        del a1
        v1.release()
        v2.release()
        v2.release()
        assert v1.released and v2.released
        with pytest.raises(ValueError, match="released"):
            memoryview(v1)
        other.put(999, b"z")
        assert _pins(other) == (0, 0)
        other.check()
        other.close()
    finally:
        c.unlink()


def test_views_outliving_their_cache_at_interpreter_exit(cache_name):
    """A process that closes and unlinks its cache while views (and a numpy array of one) are
    still alive, reads them, and exits without releasing them, exits cleanly (no crash when the
    views are collected at shutdown)."""
    script = f"""
import gc, numpy as np, shadecache as sc
c = sc.Cache.create("{cache_name}", num_samples=10, capacity_bytes=1 << 20, max_item_bytes=4000)
assert c.put(1, b"still here" * 100) and c.put(2, b"two")
v, w = c.view(1), c.view(2)
assert v is not None and w is not None
a = np.frombuffer(v, np.uint8)
c.close()
c.unlink()
del c
gc.collect()
assert bytes(v) == b"still here" * 100 and a.tobytes() == bytes(v) and bytes(w) == b"two"
w.release()
print("ok", len(v))
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok 1000" in res.stdout
    assert cache_name not in _core.CacheCore.list()


# ---- 7. fork inheritance -------------------------------------------------------------------------


def _inherited(name, views, orig, out, go):
    """Forked: reads the inherited views, releases half and drops the others (garbage collected),
    takes 5 views of its own, reports the pin count, then (on `go`) replaces or removes every id
    the parent views and churns; then exits normally."""
    try:
        cache = sc.Cache.attach(name)
        readable = all(bytes(v) == orig[v.id] for v in views)
        for v in views[:5]:
            v.release()
        released = all(v.released for v in views[:5])
        views.clear()
        gc.collect()
        own = [cache.view(i) for i in range(20, 25)]
        out.put(("pinned", readable, released, cache.stats()["pinned"]))
        go.wait(30)
        rng = random.Random(9)
        for i in range(10):
            cache.put(i, make_value(i, 1, 1000))     # same class as the original
            cache.put(i, make_value(i, 2, 5000))     # another class
            if i % 2:
                cache.remove(i)
        for step in range(4000):
            i = rng.randrange(100, 2000)
            cache.put(i, make_value(i, step, rng.choice((200, 1000, 5000, 30_000))))
        out.put(("done", cache.stats()["page_moves"], len(own)))
    except BaseException as e:  # report instead of dying silently
        out.put(("error", repr(e)))
        raise


def test_fork_child_does_not_release_the_parents_pins(cache_name):
    """A forked child inherits the parent's view objects but not its pins: releasing them in the
    child, garbage collecting them there, or the child exiting leaves the parent's pin count and
    bytes unchanged while the child replaces/removes those ids and churns the cache. The child's
    own views count while it lives and stop counting once it has exited."""
    with sc.Cache.create(cache_name, num_samples=2000, capacity_bytes=MiB,
                         max_item_bytes=SMALL_PAGES, policy="lru") as cache:
        orig = {i: make_value(i, 0, 1000) for i in range(30)}
        for i, value in orig.items():
            cache.put(i, value)
        views = [cache.view(i) for i in range(10)]
        assert cache.stats()["pinned"] == 10
        ctx = mp.get_context("fork")
        out, go = ctx.Queue(), ctx.Event()
        p = ctx.Process(target=_inherited, args=(cache_name, views, orig, out, go))
        p.start()
        msg = out.get(timeout=30)
        assert msg[0] == "pinned", msg
        _, readable, released, child_pinned = msg
        assert readable and released
        assert child_pinned == 15, "the parent's 10 pins survive the child's releases; + its own 5"
        assert cache.stats()["pinned"] == 15
        assert all(not v.released and bytes(v) == orig[v.id] for v in views)
        go.set()
        msg = out.get(timeout=60)
        p.join(timeout=30)
        assert msg[0] == "done", msg
        assert p.exitcode == 0
        assert msg[1] > 0, "the child's churn moved pages"

        s = cache.stats()
        assert s["pinned"] == 10, s
        assert s["zombies"] == 10, s
        for v in views:
            assert bytes(v) == orig[v.id], f"view of {v.id} changed after the child released it"
        for i in range(10):
            g = cache.get(i)
            assert g is None or (verify_value(i, g) == "" and _version(g) == 2), f"id {i}: stale value"
        cache.check()
        _release_and_expect_clean(cache, views, 1999, b"w")


# ---- 8. torch ------------------------------------------------------------------------------------


def test_torch_frombuffer_is_zero_copy_and_keeps_the_pin(cache_name):
    """torch.frombuffer(view) shares the view's memory (same data pointer as numpy's, no copy);
    the tensor keeps the view object, so dropping the view while the tensor lives keeps the pin and
    the bytes survive a re-put of the id; dropping the tensor unpins."""
    torch = pytest.importorskip("torch")
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=4 * MiB, max_item_bytes=SMALL_PAGES,
                         policy="lru") as c:
        value = make_value(7, 0, 3000)
        c.put(7, value)
        v = c.view(7)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The given buffer is not writable"
            t = torch.frombuffer(v, dtype=torch.uint8)
        assert t.dtype == torch.uint8 and t.numel() == len(value)
        assert t.data_ptr() == _addr(v)
        assert bytes(t.numpy().tobytes()) == value
        del v
        gc.collect()
        assert c.stats()["pinned"] == 1, "the tensor keeps the view (and its pin) alive"
        assert c.put(7, make_value(7, 1, 3000)) and c.put(7, make_value(7, 2, 9000))
        assert t.numpy().tobytes() == value
        assert c.get(7) == make_value(7, 2, 9000)
        del t
        gc.collect()
        assert c.stats()["pinned"] == 0
        c.put(8, b"next write")
        assert _pins(c) == (0, 0)
        c.check()
