"""One SIGKILL at each step of the allocator's moves, driven there on purpose.

tests/cache/test_cache_crash.py kills writers at every crash point under random churn; the points of
compaction (a page emptied by moving its values: heads, chunks) and of the heap's pages (taken
and given back) fire only in particular states, so each gets a workload that reaches it here: a
forked writer arms the point, makes the one call that passes through it, and dies there. The
next locker repairs; then check() passes, no value that was cached before is lost or torn (a
moved value is either at its old place or its new one), and the cache keeps working.
"""
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import shadecache as sc
from shadecache import _core
from crashing import attach_armed
from values import make_value, verify_value

MiB = 1 << 20


def _die_at(name, point, op):
    """Runs `op(cache)` in a forked writer armed at `point`; asserts it died there."""
    def child():
        cache = attach_armed(name, _core.CRASH_POINTS[point], 1)
        op(cache)
        cache.close()

    p = mp.get_context("fork").Process(target=child)
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL, f"the writer did not die at {point} (exit {p.exitcode})"


def _cached(c):
    return {i: v for i, v in enumerate(c.get_many(range(c.num_samples))) if v is not None}


def _head_class_with_holes(c):
    """LRU cache full of values smaller than a chunk, then every other one removed: the class
    has pages' worth of free slots, no page is empty, none is free."""
    size = c.stats()["chunk_size"] // 2
    i = 0
    while c.stats()["evictions"] == 0:
        assert c.put(i, make_value(i, 0, size))
        i += 1
    for j in range(0, i, 2):
        c.remove(j)
    assert c.stats()["free_pages"] <= 1
    return size


def _chunks_with_holes(c):
    """LRU cache full of values of exactly 8 chunks (heads of 48 bytes, many to a page), then
    every other one removed: the chunk class has pages' worth of free chunks, the head class
    fewer free slots than a page holds, no page is free."""
    chunk = c.stats()["chunk_size"]
    i = 0
    while c.stats()["evictions"] == 0:
        assert c.put(i, make_value(i, 0, 8 * chunk))
        i += 1
    for j in range(0, i, 2):
        c.remove(j)
    assert c.stats()["free_pages"] <= 1
    return chunk


@pytest.mark.parametrize("point", ["compact_mid", "relocate_after_copy", "relocate_after_publish"])
def test_a_writer_killed_while_moving_heads_loses_nothing(cache_name, point):
    with sc.Cache.create(cache_name, num_samples=4000, capacity_bytes=MiB, policy="lru") as c:
        size = _head_class_with_holes(c)
        before = _cached(c)
        big = make_value(3999, 1, 3 * size + 7)  # another head class: a page must be emptied for it
        _die_at(cache_name, point, lambda cache: cache.put(3999, big))
        c.check()  # the next locker repaired
        s = c.stats()
        assert s["recoveries"] == 1
        after = _cached(c)
        after.pop(3999, None)
        assert after == before, "a value was lost or changed while it moved"
        assert c.put(3999, big) and c.get(3999) == big
        c.check()


@pytest.mark.parametrize("point", ["chunk_move_after_copy", "chunk_move_mid_relink"])
def test_a_writer_killed_while_moving_a_chunk_loses_at_most_that_value(cache_name, point):
    with sc.Cache.create(cache_name, num_samples=4000, capacity_bytes=MiB, policy="lru") as c:
        chunk = _chunks_with_holes(c)
        before = _cached(c)
        small = make_value(3999, 1, chunk // 2)  # a head class with no page yet: chunks must move
        _die_at(cache_name, point, lambda cache: cache.put(3999, small))
        c.check()
        assert c.stats()["recoveries"] == 1
        after = _cached(c)
        after.pop(3999, None)
        for i, v in after.items():
            assert v == before[i], f"id {i} changed"
        lost = set(before) - set(after)
        # Killed mid-relink, the value whose chunk moved was torn under its odd seq: repair drops
        # it (a miss, never torn bytes). Killed after the copy, its chunk was not named yet.
        assert len(lost) == (1 if point == "chunk_move_mid_relink" else 0), sorted(lost)
        assert c.put(3999, small) and c.get(3999) == small
        c.check()


def test_a_writer_killed_while_the_heap_takes_a_page(cache_name):
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=MiB) as c:
        assert c.stats()["heap_pages"] == 0  # an empty cache holds no heap page
        _die_at(cache_name, "heap_grow_mid", lambda cache: cache.put(5, b"first"))
        c.check()
        s = c.stats()
        assert s["recoveries"] == 1 and s["heap_pages"] == 0 and s["free_pages"] == s["num_pages"], s
        assert c.get(5) is None
        assert c.put(5, b"first") and c.get(5) == b"first" and c.stats()["heap_pages"] == 1
        c.check()


def test_a_writer_killed_while_the_heap_gives_back_a_page(cache_name):
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=MiB) as c:
        assert c.put(5, b"only") and c.put(6, b"two")
        c.remove(6)
        _die_at(cache_name, "heap_shrink_mid", lambda cache: cache.remove(5))
        c.check()
        s = c.stats()
        assert s["recoveries"] == 1 and s["items"] == 0 and s["heap_pages"] == 0, s
        assert s["free_pages"] == s["num_pages"]
        assert c.put(5, b"again") and c.get(5) == b"again"
        c.check()


def test_every_crash_point_is_reached_by_a_test():
    """Each point the engine defines is armed by a test somewhere (a new point needs its test)."""
    import pathlib

    text = "".join(p.read_text() for p in pathlib.Path(__file__).parent.glob("test_*.py"))
    generic = {"put_after_alloc", "put_mid_write", "put_after_write", "put_after_publish",
               "evict_after_unpublish", "evict_after_free", "scores_mid", "next_use_mid"}
    for name in _core.CRASH_POINTS:
        assert name in generic or f'"{name}"' in text, f"crash point {name} has no test"


def test_values_survive_every_move_under_views(cache_name):
    """Compaction with a view on one value of a page: that page is never emptied and the viewed
    bytes never change, while the other values move and stay intact."""
    with sc.Cache.create(cache_name, num_samples=4000, capacity_bytes=MiB, policy="lru") as c:
        size = _head_class_with_holes(c)
        before = _cached(c)
        keep = min(before)
        with c.view(keep) as v:
            for k in range(20):
                assert c.put(3900 + k, make_value(3900 + k, 1, 3 * size + 7))
            assert bytes(v) == before[keep]
            s = c.stats()
            assert s["relocations"] > 0 and s["page_moves"] > 0, s
            c.check()
        for i, v in _cached(c).items():
            assert verify_value(i, v) == ""
            if i in before:
                assert v == before[i]
        c.check()


def test_compaction_evicts_nothing_out_of_order(cache_name):
    """The moves that give a page to another class evict nothing: with holes worth pages, a put of
    a new size is served without a single eviction."""
    with sc.Cache.create(cache_name, num_samples=4000, capacity_bytes=MiB, policy="lru") as c:
        size = _head_class_with_holes(c)
        ev = c.stats()["evictions"]
        items = c.stats()["items"]
        assert c.put(3999, make_value(3999, 1, 3 * size + 7))
        s = c.stats()
        assert s["evictions"] == ev and s["items"] == items + 1 and s["page_moves"] >= 1, s
        c.check()
        assert np.count_nonzero(c.cached_mask()) == items + 1


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _read_forever(name, expected, stop, out):
    """Reads id 0 until told to stop; reports every read that is neither a miss nor `expected`."""
    cache = sc.Cache.attach(name)
    reads = torn = 0
    while not stop.is_set():
        v = cache.get(0)
        if v is not None:
            reads += 1
            torn += v != expected
    out.put((reads, torn))
    cache.close()


def test_a_reader_paused_mid_copy_across_a_repair_never_returns_reused_chunks(cache_name):
    """A reader copying a value in chunks is frozen (SIGSTOP) mid-copy; the writer evicting that
    value is killed after the unpublish (evict_after_unpublish), the next writer repairs and puts
    another value into the freed chunks, and the reader is thawed. Its seq recheck must see that
    the value went: repair changes a dropped head's seq as an eviction does, or the reader returns
    the old value's first chunks followed by the new value's bytes."""
    ctx = mp.get_context("fork")
    with sc.Cache.create(cache_name, num_samples=4, capacity_bytes=48 * MiB, policy="lru") as c:
        chunk = c.stats()["chunk_size"]
        k = 5000                                   # chunks per value: heads of 2 per page ...
        a = make_value(0, 1, k * chunk + chunk - 96)
        b = make_value(1, 1, k * chunk + chunk - 96)
        fresh = make_value(2, 1, k * chunk)        # ... and of 3 per page: another head class
        stop, out = ctx.Event(), ctx.Queue()
        reader = ctx.Process(target=_read_forever, args=(cache_name, a, stop, out))
        reader.start()
        rng = np.random.default_rng(3)
        try:
            for _ in range(10):
                assert c.put(0, a) and c.put(1, b)   # a's head shares its page with b's: the page stays
                time.sleep(0.05 + rng.random() * 0.05)
                os.kill(reader.pid, signal.SIGSTOP)
                while _state(reader.pid) != "T":
                    time.sleep(0.001)
                _die_at(cache_name, "evict_after_unpublish", lambda cache: cache.remove(0))
                assert c.put(2, fresh)             # repairs, then takes a's chunks
                os.kill(reader.pid, signal.SIGCONT)
                time.sleep(0.05)
                assert c.remove(2) and c.get(0) is None
                c.check()
        finally:
            os.kill(reader.pid, signal.SIGCONT)
            stop.set()
            reads, torn = out.get(timeout=30)
            reader.join(30)
        assert reads > 0
        assert torn == 0, f"{torn} of {reads} reads returned a value whose chunks were reused"
        assert c.stats()["recoveries"] == 10
