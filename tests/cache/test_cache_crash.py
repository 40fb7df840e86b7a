"""Writers SIGKILLed at every step of put / evict / page move / score update, 200+ times.

Two kinds of kill: a writer arms one of the engine's crash points and kills itself exactly
there (every step of every write is covered), or the test kills it from outside after a random
delay (wherever it happens to be). After each kill a survivor keeps reading and writing, the next
locker repairs, check() passes, and no read ever returns wrong bytes.
"""
import multiprocessing as mp
import os
import random
import signal
import time

import numpy as np
import pytest

import shadecache as sc
from shadecache import _core
from crashing import attach_armed
from values import make_value, verify_value

N = 3000
SIZES = (200, 1500, 6000, 14_000)
KILLS = int(os.environ.get("SHADECACHE_CRASH_KILLS", "240"))


def _write_forever(name, seed, point, countdown, sizes=SIZES, n=N, batch=8):
    cache = attach_armed(name, point, countdown)
    N, SIZES = n, sizes  # noqa: N806 (the large-value test runs this with its own)
    rng = random.Random(seed)
    step = 0
    while True:
        step += 1
        op = rng.random()
        if op < 0.4:
            ids = [rng.randrange(N) for _ in range(batch)]
            cache.put_many(ids, [make_value(i, seed * 100_000 + step, rng.choice(SIZES)) for i in ids],
                           scores=[rng.random() for _ in ids])
        elif op < 0.7:
            i = rng.randrange(N)
            cache.put(i, make_value(i, seed * 100_000 + step, rng.choice(SIZES)), score=rng.random() * 2)
        elif op < 0.8:
            cache.update_scores(np.array([rng.randrange(N) for _ in range(64)]), np.random.rand(64))
        elif op < 0.9:   # the clairvoyant policy's keys (checked, then ignored by the others)
            cache.set_next_use(np.array([rng.randrange(N) for _ in range(64)]),
                               np.array([rng.randrange(-1, 10 * N) for _ in range(64)]))
        else:
            cache.remove(rng.randrange(N))


def _survivor(name, stop, out, sizes=SIZES, n=N):
    """Reads (verifying every value) and writes until told to stop; reports faults."""
    cache = sc.Cache.attach(name)
    N, SIZES = n, sizes  # noqa: N806
    rng = random.Random(12345)
    reads = faults = 0
    first = []
    step = 0
    while not stop.is_set():
        step += 1
        ids = [rng.randrange(N) for _ in range(16)]
        for i, v in zip(ids, cache.get_many(ids)):
            if v is not None:
                reads += 1
                err = verify_value(i, v)
                if err:
                    faults += 1
                    first.append(err)
        if step % 8 == 0:
            i = rng.randrange(N)
            cache.put(i, make_value(i, 999_000_000 + step, rng.choice(SIZES)), score=rng.random())
    out.put((reads, faults, first[:5]))


# The full count under importance (the acceptance run); each other policy (its own eviction keys,
# lazy LRU rekeys, static's refusals) a quarter as many.
@pytest.mark.parametrize("policy,kills", [("importance", KILLS), ("lru", KILLS // 4), ("fifo", KILLS // 4),
                                          ("static", KILLS // 4), ("clairvoyant", KILLS // 4)])
def test_sigkill_writers_at_every_step(cache_name, policy, kills):
    # Points this churn does not reach (each has its own test in test_cache_crash_points.py): the
    # heap here never grows past its first page nor gives one back; a static cache frees memory
    # only by removes, so it (almost) never empties a page by moving values; and only clairvoyant
    # keys on next use.
    never = {"heap_grow_mid", "heap_shrink_mid"}
    if policy == "static":
        never |= {"compact_mid", "relocate_after_copy", "relocate_after_publish", "chunk_move_after_copy",
                  "chunk_move_mid_relink"}
    if policy != "clairvoyant":
        never.add("next_use_mid")
    points = sorted(v for k, v in _core.CRASH_POINTS.items() if k not in never)
    ctx = mp.get_context("fork")
    rng = random.Random(7)
    with sc.Cache.create(cache_name, num_samples=N, capacity_bytes=2 << 20, max_item_bytes=16 << 10,
                         policy=policy) as cache:
        stop, out = ctx.Event(), ctx.Queue()
        survivor = ctx.Process(target=_survivor, args=(cache_name, stop, out))
        survivor.start()
        armed_kills = outside_kills = self_kills = 0
        for k in range(kills):
            armed = k % 2 == 0
            point = points[(k // 2) % len(points)] if armed else 0
            w = ctx.Process(target=_write_forever, args=(cache_name, k + 1, point, rng.randint(1, 40)))
            w.start()
            if armed:
                w.join(timeout=5)
            else:
                time.sleep(rng.uniform(0.001, 0.02))
            self_kills += armed and w.exitcode is not None  # killed itself at the armed point
            if w.exitcode is None:
                os.kill(w.pid, signal.SIGKILL)
                w.join()
            assert w.exitcode == -signal.SIGKILL, f"writer {k} ended with {w.exitcode}, not by SIGKILL"
            armed_kills += armed
            outside_kills += not armed
            # The next locker repairs whatever the dead writer left; the structure must be whole.
            cache.put(k % N, make_value(k % N, 5, 100), score=0.5)
            cache.check()
        stop.set()
        reads, faults, first = out.get(timeout=60)
        survivor.join(timeout=30)
        assert survivor.exitcode == 0
        assert faults == 0, first
        assert reads > 1000
        s = cache.stats()
        # Every kill at an armed point happened with the mutex held, so each one needed a repair.
        assert s["recoveries"] >= self_kills >= armed_kills * 3 // 4, s
        assert armed_kills + outside_kills == kills
        cache.check()
        # Everything still readable is intact.
        for i, v in enumerate(cache.get_many(range(N))):
            assert v is None or verify_value(i, v) == ""


MiB = 1 << 20
LARGE_SIZES = (3000, 300_000, 2 * MiB, 16 * MiB, 64 * MiB)
LARGE_N = 40


@pytest.mark.parametrize("policy,kills", [("importance", 24), ("lru", 12)])
def test_sigkill_writers_with_large_values(cache_name, policy, kills):
    """The same kills with values of 2, 16 and 64 MiB in chains of thousands of chunks next to
    small ones: every step of a put, an eviction and a chunk's move (the points this workload of
    40 ids does not reach have their own tests in test_cache_crash_points.py)."""
    unreached = ("next_use_mid", "compact_mid", "relocate_after_copy", "relocate_after_publish", "heap_grow_mid",
                 "heap_shrink_mid")
    points = sorted(v for k, v in _core.CRASH_POINTS.items() if k not in unreached)
    assert _core.CRASH_POINTS["chunk_move_mid_relink"] in points and _core.CRASH_POINTS["put_mid_write"] in points
    ctx = mp.get_context("fork")
    rng = random.Random(11)
    with sc.Cache.create(cache_name, num_samples=LARGE_N, capacity_bytes=160 * MiB, policy=policy) as cache:
        stop, out = ctx.Event(), ctx.Queue()
        survivor = ctx.Process(target=_survivor, args=(cache_name, stop, out, LARGE_SIZES, LARGE_N))
        survivor.start()
        self_kills = 0
        for k in range(kills):
            armed = k % 2 == 0
            point = points[(k // 2) % len(points)] if armed else 0
            w = ctx.Process(target=_write_forever,
                            args=(cache_name, k + 1, point, rng.randint(1, 4), LARGE_SIZES, LARGE_N, 2))
            w.start()
            if armed:
                w.join(timeout=8)
            else:
                time.sleep(rng.uniform(0.01, 0.3))
            self_kills += armed and w.exitcode is not None
            if w.exitcode is None:
                os.kill(w.pid, signal.SIGKILL)
                w.join()
            assert w.exitcode == -signal.SIGKILL, f"writer {k} ended with {w.exitcode}, not by SIGKILL"
            cache.put(k % LARGE_N, make_value(k % LARGE_N, 5, 100), score=0.5)
            cache.check()
        stop.set()
        reads, faults, first = out.get(timeout=120)
        survivor.join(timeout=60)
        assert survivor.exitcode == 0
        assert faults == 0, first
        assert reads > 50
        assert cache.stats()["recoveries"] >= self_kills >= kills // 4
        cache.check()
        large_seen = 0
        for i, v in enumerate(cache.get_many(range(LARGE_N))):
            assert v is None or verify_value(i, v) == ""
            large_seen += v is not None and len(v) >= 2 * MiB
        assert large_seen > 0
