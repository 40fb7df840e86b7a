"""Many real processes (fork and spawn) on one cache smaller than the data; every read verified."""
import multiprocessing as mp
import os
import random

import numpy as np
import pytest

import shadecache as sc
from values import make_value, verify_value

N = 4000
SIZES = (300, 3000, 20_000)


def _worker(name, seed, ops, out, sizes=SIZES, n=N, batch=16):
    """Mixed put / put_many / get / get_many / update_scores; returns (reads verified, faults)."""
    cache = sc.Cache.attach(name)
    N, SIZES = n, sizes  # noqa: N806 (the large-value test runs this with its own)
    rng = random.Random(seed)
    verified, faults = 0, []
    for step in range(ops):
        op = rng.random()
        i = rng.randrange(N)
        if op < 0.3:
            cache.put(i, make_value(i, seed * 1_000_000 + step, rng.choice(SIZES)), score=rng.random())
        elif op < 0.4:
            ids = [rng.randrange(N) for _ in range(batch)]
            cache.put_many(ids, [make_value(j, seed * 1_000_000 + step, rng.choice(SIZES)) for j in ids])
        elif op < 0.45:
            ids = np.array([rng.randrange(N) for _ in range(64)])
            cache.update_scores(ids, np.random.default_rng(step).random(64))
        elif op < 0.5:   # the clairvoyant policy's keys (the other policies ignore them)
            ids = np.array([rng.randrange(N) for _ in range(64)])
            cache.set_next_use(ids, np.random.default_rng(step).integers(-1, 100 * N, 64))
        elif op < 0.75:
            v = cache.get(i)
            if v is not None:
                verified += 1
                if verify_value(i, v):
                    faults.append(verify_value(i, v))
        else:
            ids = [rng.randrange(N) for _ in range(32)]
            for j, v in zip(ids, cache.get_many(ids)):
                if v is not None:
                    verified += 1
                    if verify_value(j, v):
                        faults.append(verify_value(j, v))
    cache.close()
    out.put((seed, verified, faults[:5], len(faults)))


@pytest.mark.parametrize("ops,policy", [(3000, "importance"), (3000, "clairvoyant")])
def test_four_processes_fork_and_spawn(cache_name, ops, policy):
    # ~4000 ids x mean 7.8 KB = 31 MB of data for a 6 MiB cache: evictions and page moves happen.
    with sc.Cache.create(cache_name, num_samples=N, capacity_bytes=6 << 20, max_item_bytes=32 << 10,
                         policy=policy) as cache:
        procs, queues = [], []
        for k, method in enumerate(["fork", "fork", "spawn", "spawn"]):
            ctx = mp.get_context(method)
            q = ctx.Queue()
            p = ctx.Process(target=_worker, args=(cache_name, k + 1, ops, q))
            p.start()
            procs.append(p)
            queues.append(q)
        results = [q.get(timeout=240) for q in queues]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        total_verified = sum(r[1] for r in results)
        faults = [f for r in results for f in r[2]]
        assert not faults, faults
        assert total_verified > ops  # the readers really read something
        s = cache.stats()
        assert s["evictions"] > 0 and s["page_moves"] > 0 and s["inserts"] > 0, s
        cache.check()


MiB = 1 << 20


@pytest.mark.parametrize("policy", ["importance", "lru"])
def test_four_processes_large_values(cache_name, policy):
    """Values of 2, 16 and 64 MiB (chains of chunks) next to small ones, four processes at once."""
    sizes, n = (3000, 2 * MiB, 16 * MiB, 64 * MiB), 40
    with sc.Cache.create(cache_name, num_samples=n, capacity_bytes=160 * MiB, policy=policy) as cache:
        procs, queues = [], []
        for k, method in enumerate(["fork", "fork", "spawn", "spawn"]):
            ctx = mp.get_context(method)
            q = ctx.Queue()
            p = ctx.Process(target=_worker, args=(cache_name, k + 1, 20, q, sizes, n, 2))
            p.start()
            procs.append(p)
            queues.append(q)
        results = [q.get(timeout=240) for q in queues]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        faults = [f for r in results for f in r[2]]
        assert not faults, faults
        assert sum(r[1] for r in results) > 40
        s = cache.stats()
        assert s["evictions"] > 0 and s["inserts"] > 0, s
        cache.check()
        got = [v for v in cache.get_many(range(n)) if v is not None]
        assert all(verify_value(i, v) == "" for i, v in enumerate(cache.get_many(range(n))) if v is not None)
        assert any(len(v) >= 2 * MiB for v in got)


class _CachedRange:
    """A map-style data set that reads through the cache and fills it on a miss."""

    def __init__(self, cache):
        self.cache = cache

    def __len__(self):
        return 512

    def __getitem__(self, i):
        v = self.cache.get(i)
        hit = v is not None
        if not hit:
            v = make_value(i, 7, 2000)
            self.cache.put(i, v, score=float(i))
        assert verify_value(i, v) == ""
        return i, hit, os.getpid()


def _as_list(batch):
    return batch


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_two_workers_read_through_cache(cache_name, method):
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    with sc.Cache.create(cache_name, num_samples=512, capacity_bytes=4 << 20) as cache:
        ds = _CachedRange(cache)
        loader = DataLoader(ds, batch_size=32, num_workers=2, multiprocessing_context=method,
                            collate_fn=_as_list, persistent_workers=True)
        seen, pids = [], set()
        for epoch in range(2):
            for batch in loader:
                for i, hit, pid in batch:
                    seen.append((epoch, i, hit))
                    pids.add(pid)
        assert len(pids) == 2 and os.getpid() not in pids
        first = [hit for e, _, hit in seen if e == 0]
        second = [hit for e, _, hit in seen if e == 1]
        assert not any(first) and all(second), "epoch 2 is served from what the workers cached in epoch 1"
        s = cache.stats()
        assert s["items"] == 512 and s["hits"] == 512
        cache.check()
