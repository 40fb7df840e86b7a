"""Engine edge cases: empty pages of one class serving another, a forked view, the fifo tick of a
refused re-put, pinned values set aside, pins of a zombie, attach during a create, ids beyond
int64, the score of put. Each is an assertion on what a user is promised, and each failed on the
engine before its fix."""
import multiprocessing as mp
import os
import signal
import time

import pytest

import shadecache as sc
import shadecache.cache
from shadecache import _core
from shadecache.cache import list_caches, remove

KiB = 1 << 10
SMALL_PAGES = (64 << 10) - 32  # a max_item_bytes limit the tests pass as users do
POLICIES = tuple(sc.cache.POLICIES)  # every policy the engine defines


# ---- empty pages go to whichever class needs them -----------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_empty_pages_serve_another_class_when_the_cache_is_empty(cache_factory, policy):
    """(a) A small cache: 100 B and 1000 B values take a page each; both removed, every page is
    free again (the heap's too), and a value as large as the cache can hold must find its memory
    under every policy."""
    c = cache_factory(10, capacity=2 * (64 << 10), policy=policy, max_item_bytes=SMALL_PAGES)
    assert c.put(0, b"a" * 100) and c.put(1, b"b" * 1000)
    assert c.remove(0) and c.remove(1)
    s = c.stats()
    assert s["free_pages"] == s["num_pages"], s
    big = b"c" * c.max_item_bytes
    assert c.put(2, big), "an empty cache refused a value it can hold"
    assert c.get(2) == big
    c.check()


def test_importance_admission_counts_empty_pages_as_free(cache_factory):
    """(b) 8 pages filled with 1000 B values, all but one (score 0.9) removed: the cache holds one
    value, so a 20 KB value of score 0.5 is admitted (no value has to make room for it)."""
    c = cache_factory(1000, capacity=8 * (64 << 10), policy="importance", max_item_bytes=SMALL_PAGES)
    for i in range(600):  # more than 8 pages hold: every page ends up in the 1000 B class
        c.put(i, b"x" * 1000, score=0.1 + i * 1e-4)
    assert c.stats()["free_pages"] == 0
    kept = next(i for i in range(600) if c.contains(i))
    for j in range(600):
        if j != kept:
            c.remove(j)
    c.update_scores([kept], [0.9])
    assert c.stats()["items"] == 1
    assert c.put(500, b"y" * (20 * KiB), score=0.5), "admission refused although 7 pages are empty"
    assert c.contains(kept) and c.contains(500)
    c.check()


def test_empty_page_of_another_class_is_used_before_evicting(cache_factory):
    """(c) lru, 2 pages: page 0 holds one 100 B value, page 1 two 30 KB values. Once the 100 B
    value is removed, a third 30 KB value takes page 0 instead of evicting id 1."""
    c = cache_factory(10, capacity=2 * (64 << 10), policy="lru", max_item_bytes=SMALL_PAGES)
    assert c.put(0, b"a" * 100)
    assert c.put(1, b"b" * (30 * KiB)) and c.put(2, b"c" * (30 * KiB))
    assert c.remove(0)
    assert c.put(3, b"d" * (30 * KiB))
    assert c.contains(1) and c.contains(2) and c.contains(3), "evicted a value while a page was empty"
    assert c.stats()["evictions"] == 0
    c.check()


# ---- a forked child's inherited view --------------------------------------------------------------


def _child_reads_inherited_view(v, touch_first, ready, go, out):
    try:
        if touch_first:
            first = bytes(v)  # pins the value in this process before the parent lets go of it
            ready.set()
            go.wait(30)
            out.put(("bytes", first, bytes(v)))
        else:
            ready.set()
            go.wait(30)
            try:
                out.put(("bytes", None, bytes(v)))
            except ValueError as e:
                out.put(("refused", str(e)))
        v.release()
    except BaseException as e:
        out.put(("error", repr(e)))


@pytest.mark.parametrize("touch_first", [True, False], ids=["child-reads-first", "parent-rewrites-first"])
def test_forked_child_never_sees_a_rewrite_under_an_inherited_view(cache_factory, touch_first):
    """v = view(0); fork; the parent releases v and rewrites id 0. The child's copy of v shows the
    original bytes (it pinned them when it first read them) or refuses to be read (the value was
    rewritten before it looked): never the new bytes."""
    # 1 MiB: chunks of 1 KiB, so a 1000 B value is one slot, and its view pins it (a value in
    # chunks gets a private copy instead: tests/test_cache_views.py).
    c = cache_factory(10, capacity=1 << 20, policy="lru", max_item_bytes=SMALL_PAGES)
    assert c.stats()["chunk_size"] > 1000
    c.put(0, b"A" * 1000)
    v = c.view(0)
    ctx = mp.get_context("fork")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_child_reads_inherited_view, args=(v, touch_first, ready, go, out))
    p.start()
    assert ready.wait(30)
    v.release()
    assert c.put(0, b"B" * 1000)
    go.set()
    msg = out.get(timeout=30)
    p.join(30)
    assert p.exitcode == 0
    if touch_first:
        assert msg == ("bytes", b"A" * 1000, b"A" * 1000), msg[:1]
    else:
        assert msg[0] == "refused", "the child read bytes the parent rewrote after releasing its view"
        assert "sample 0" in msg[1]
    assert c.get(0) == b"B" * 1000
    c.put(1, b"x")  # a write frees what the child's view kept
    assert c.stats()["zombies"] == 0
    c.check()


# ---- fifo: a refused re-put ------------------------------------------------------------------------


def test_fifo_refused_reput_keeps_the_old_tick(cache_factory):
    """FIFO, a full cache whose every value a view pins: put(0, a value of another size) is
    refused (nothing can be evicted); the refused put must leave id 0's insert tick as it was, so
    check() passes."""
    c = cache_factory(1000, capacity=96 << 10, policy="fifo", max_item_bytes=SMALL_PAGES)
    assert c.stats()["chunk_size"] > 200  # one slot per value: a view pins it
    n = 0
    while c.stats()["evictions"] == 0:
        assert c.put(n, b"a" * 200)
        n += 1
    views = [c.view(i) for i in range(n) if c.contains(i)]
    assert not c.put(1, b"b" * (30 * KiB))
    c.check()
    for v in views:
        v.release()
    assert c.get(1) == b"a" * 200
    c.check()


# ---- pinned values passed over by eviction stay whole --------------------------------------------


def test_a_pinned_lowest_value_is_passed_over_and_kept(cache_factory):
    """importance: id 0 holds the lowest score and a view pins it; puts of higher scores fill the
    cache until they evict: they evict others, id 0 stays cached and whole, and the structure
    (the heap the pinned value was set aside from) checks out."""
    c = cache_factory(2000, capacity=1 << 20, policy="importance", max_item_bytes=SMALL_PAGES)
    value = b"v" * 900
    assert c.put(0, value, score=-1.0)
    with c.view(0):
        i = 1
        while c.stats()["evictions"] < 5:
            assert c.put(i, value, score=1.0 + i * 1e-3)
            i += 1
        c.check()
    c.check()
    assert c.get(0) == value and not c.contains(1)


# ---- pins of an exited, not yet reaped child -----------------------------------------------------


def _proc_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_pins_of_a_zombie_process_do_not_block_eviction(cache_factory):
    """A forked child views id 0 and exits; the parent has not waited for it (state Z). Its pin
    is dead: stats() does not count it, and the puts that need id 0's slot (lru: the oldest)
    evict it."""
    c = cache_factory(5000, capacity=1 << 20, policy="lru", max_item_bytes=SMALL_PAGES)
    assert c.put(0, b"a" * 900)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: view, tell the parent, exit without unpinning
        try:
            v = c.view(0)
            os.write(w, b"1" if v is not None else b"0")
        finally:
            os._exit(0)
    try:
        assert os.read(r, 1) == b"1"
        deadline = time.time() + 10
        while _proc_state(pid) != "Z":
            assert time.time() < deadline
            time.sleep(0.01)
        time.sleep(0.15)  # writers reap dead pins at most every 100 ms
        assert c.stats()["pinned"] == 0, "a zombie process's pin counts as live"
        i = 1
        while c.stats()["evictions"] == 0:
            assert c.put(i, b"b" * 900)
            i += 1
        assert not c.contains(0), "a zombie process's pin blocked eviction"
        assert c.stats()["zombies"] == 0
        c.check()
    finally:
        os.close(r)
        os.close(w)
        os.waitpid(pid, 0)


# ---- attach while a slow create is still running -------------------------------------------------


def _slow_create(name, delay_ms, done):
    _core._set_create_delay_ms(delay_ms)
    c = sc.Cache.create(name, num_samples=10, capacity_bytes=1 << 20)
    c.put(3, b"made")
    done.set()
    time.sleep(30)  # keep the segment alive until the parent kills us


def test_attach_waits_for_a_creator_that_is_still_creating(cache_name):
    """A creator whose create takes 3 s (posix_fallocate of a large segment): an attach that
    starts meanwhile waits for it and then works, instead of failing after 2 s."""
    ctx = mp.get_context("fork")
    done = ctx.Event()
    p = ctx.Process(target=_slow_create, args=(cache_name, 3000, done))
    p.start()
    try:
        deadline = time.time() + 10
        while cache_name not in list_caches():
            assert time.time() < deadline
            time.sleep(0.005)
        t0 = time.time()
        c = sc.Cache.attach(cache_name)
        waited = time.time() - t0
        assert waited > 1.0, "attach should have waited for the creator"
        assert done.wait(10)
        assert c.get(3) == b"made"
        c.close()
    finally:
        p.kill()
        p.join()
        remove(cache_name)


def test_attach_to_a_creator_that_died_mid_create_fails_clearly(cache_name):
    """The other side of the wait: a creator SIGKILLed mid-create leaves a segment no one can
    attach; attach says so at once (it does not wait for a dead creator)."""
    ctx = mp.get_context("fork")
    done = ctx.Event()
    p = ctx.Process(target=_slow_create, args=(cache_name, 5000, done))
    p.start()
    try:
        deadline = time.time() + 10
        while cache_name not in list_caches():
            assert time.time() < deadline
            time.sleep(0.005)
        time.sleep(0.2)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        t0 = time.time()
        with pytest.raises(sc.LayoutVersionError, match="died|never finished"):
            sc.Cache.attach(cache_name)
        assert time.time() - t0 < 5
    finally:
        remove(cache_name)


# ---- one rule for ids and scores at every entry point ---------------------------------------------


def test_ids_beyond_int64_are_index_errors_everywhere(cache_factory):
    """An id beyond int64 is out of range (IndexError) at every entry point, as one below
    num_samples is; a non-integer id is a TypeError."""
    c = cache_factory(10)
    c.put(1, b"x")
    for big in (2**63, 2**64 + 5, -(2**63) - 1):
        for call in (lambda: c.get(big), lambda: c.contains(big), lambda: c.remove(big),
                     lambda: c.view(big), lambda: c.get_into(big, bytearray(8)),
                     lambda: c.put(big, b"y"), lambda: c.get_many([1, big]),
                     lambda: c.put_many([big], [b"y"])):
            with pytest.raises(IndexError, match="out of range"):
                call()
    for bad in (1.0, "1", None):
        for call in (lambda: c.get(bad), lambda: c.contains(bad), lambda: c.put(bad, b"y"),
                     lambda: c.remove(bad), lambda: c.view(bad)):
            with pytest.raises(TypeError, match="integers"):
                call()
    assert c.get(1) == b"x"
    c.check()


def test_put_score_follows_the_put_many_rule(cache_factory):
    """put's score: a non-number is a TypeError and NaN a ValueError, as for put_many's scores;
    nothing is stored either way."""
    c = cache_factory(10, policy="importance")
    for bad in ("high", object()):
        with pytest.raises(TypeError, match="score"):
            c.put(0, b"x", score=bad)
        with pytest.raises(TypeError):
            c.put_many([0], [b"x"], scores=[bad])
    with pytest.raises(TypeError, match="score must be a real number, got list"):
        c.put(0, b"x", score=[1.0])
    with pytest.raises(ValueError, match="NaN"):
        c.put(0, b"x", score=float("nan"))
    assert not c.contains(0)
    assert c.put(0, b"x", score=0.5) and c.put(1, b"y", score=2)  # ints are numbers
    c.check()
