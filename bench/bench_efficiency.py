"""How much of a cache's memory holds sample bytes, measured from outside the engine.

    python bench/bench_efficiency.py              # every row (~5 minutes here); prints the tables
    python bench/bench_efficiency.py --quick      # the small rows only
    python bench/bench_efficiency.py --hit-ratio  # SHADE's hit ratio at a 10% cache of the mix

For each row a cache is created with `capacity_bytes` (with the sample sizes, as
`Cache.for_store` passes a store's `lengths`, and without), filled with 3x what its capacity
holds under the importance policy and random scores (random ids of the row's size mix), then put
5x more with new random scores (fragmentation). After each phase:
- values   = the bytes `get_many` returns (each value checked), over capacity_bytes;
- RAM      = the blocks /dev/shm allocated to the cache's file (st_blocks * 512), over
             capacity_bytes; the promise is RAM <= capacity_bytes + max(1 MiB, 2%).
check() runs after every row.

--hit-ratio: a data set of log-normal sizes, each sample with a fixed importance (log-normal), read
as SHADE's sampler reads it (with replacement, in proportion to importance), through a cache whose
RAM is 10% of the data set: the cache is created with the largest capacity_bytes whose segment
(Cache.memory_for) fits that RAM, with the sizes, under the importance policy; a miss puts the
sample with its importance. The hit ratio of the last two of three epochs. `--engine DIR` runs it
with the shadecache of another checkout (built in place), to compare engines at the same RAM.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# --engine DIR: that checkout's shadecache (read before anything imports it).
_ENGINE = sys.argv[sys.argv.index("--engine") + 1] if "--engine" in sys.argv[:-1] else REPO
sys.path.insert(0, os.path.abspath(_ENGINE))

import shadecache as sc  # noqa: E402
from shadecache import _core  # noqa: E402

KB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
POOL = np.random.default_rng(0).integers(0, 256, 16 * MiB + 64, dtype=np.uint8).tobytes()


def value(i, version, size):
    """Sample i's bytes: its id and version in the first 16, then a slice of a random pool."""
    head = int(i).to_bytes(8, "little") + int(version).to_bytes(8, "little")
    off = (i * 7919 + version * 104729) % (len(POOL) - size)
    return (head + POOL[off:off + max(0, size - 16)])[:size]


def ram(cache):
    return os.stat(_core.CacheCore.path(cache.name)).st_blocks * 512


def held(cache, sizes, versions):
    total = 0
    for k in range(0, cache.num_samples, 2048):
        ids = np.arange(k, min(cache.num_samples, k + 2048))
        for i, v in zip(ids, cache.get_many(ids)):
            if v is not None:
                assert len(v) == sizes[i] and v == value(i, versions[i], int(sizes[i])), f"id {i} is wrong"
                total += len(v)
    return total


def put_random(cache, sizes, versions, count, version, rng):
    n = cache.num_samples
    for k in range(0, count, 256):
        ids = rng.integers(0, n, min(256, count - k))
        ok = cache.put_many(ids, [value(i, version, int(sizes[i])) for i in ids],
                            scores=rng.random(len(ids)).astype(np.float32))
        versions[ids[ok]] = version  # an id twice in a batch: the later put is the one kept


def measure_row(label, sizes, cap, given_sizes, seed=1, phases=((3, 0), (5, 1))):
    rng = np.random.default_rng(seed)
    name = f"bench-eff-{os.getpid()}"
    kw = dict(sizes=sizes) if given_sizes else {}
    t0 = time.perf_counter()
    out = {"label": label, "cap": cap, "sizes": given_sizes, "n": len(sizes)}
    versions = np.full(len(sizes), -1, dtype=np.int64)
    with sc.Cache.create(name, num_samples=len(sizes), capacity_bytes=cap, policy="importance", **kw) as c:
        mean = float(np.mean(sizes))
        for times, version in phases:
            put_random(c, sizes, versions, int(times * cap / mean) + 1, version, rng)
            out[f"values{version}"] = held(c, sizes, versions) / cap
            out[f"ram{version}"] = ram(c) / cap
            out[f"items{version}"] = c.stats()["items"]
        c.check()
        out["segment"] = c.stats()["segment_bytes"]
    out["seconds"] = time.perf_counter() - t0
    return out


def lognormal(n, seed=0, largest=16 * MiB):
    """Image-like sizes: median 110 KB, sigma 1.2, 1 KB to `largest`."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(110 * KB), 1.2, n), KB, largest).astype(np.int64)


def rows(quick):
    """(label, sizes, capacity_bytes, target) for every row of the acceptance table."""
    out = []
    cap = 64 * MiB if quick else 256 * MiB
    out.append(("log-normal, median 110 KB, sigma 1.2, 1 KB..16 MiB", lognormal(3 * cap // (226 * KB)), cap, 0.90))
    big = 64 * MiB
    for size, target in ((MiB, 0.90), (3 * KB, 0.93), (4 * KB, 0.93), (110 * KB, 0.93)):
        out.append((f"fixed {_b(size)}", np.full(max(64, 3 * big // size), size, np.int64), big, target))
    out.append(("fixed 256 B, num_samples twice what fits", np.full(2 * big // 256, 256, np.int64), big, 0.80))
    small = 4 * MiB
    out.append(("fixed 4 KB, 4 MiB cache (10% of the set)", np.full(10 * small // (4 * KB), 4 * KB, np.int64), small, 0.90))
    return out


def shifting_row(cap, given_sizes):
    """3 KB samples, then 100 KB ones (a mix that shifts): sizes given are the 3 KB ones."""
    n_small, n_big = 3 * cap // (3 * KB), 3 * cap // (100 * KB)
    sizes = np.concatenate([np.full(n_small, 3 * KB), np.full(n_big, 100 * KB)]).astype(np.int64)
    name = f"bench-eff-{os.getpid()}"
    kw = dict(sizes=np.full(16, 3 * KB)) if given_sizes else {}
    versions = np.full(len(sizes), 0, dtype=np.int64)
    t0 = time.perf_counter()
    with sc.Cache.create(name, num_samples=len(sizes), capacity_bytes=cap, policy="importance", **kw) as c:
        rng = np.random.default_rng(5)
        for lo, hi in ((0, n_small), (n_small, n_small + n_big)):
            for k in range(lo, hi, 256):
                ids = np.arange(k, min(hi, k + 256))
                c.put_many(ids, [value(i, 0, int(sizes[i])) for i in ids], scores=rng.random(len(ids)).astype(np.float32))
        out = {"label": "3 KB, then 100 KB (a shifting mix)", "cap": cap, "sizes": given_sizes, "n": len(sizes),
               "values0": held(c, sizes, versions) / cap, "ram0": ram(c) / cap, "items0": c.stats()["items"],
               "segment": c.stats()["segment_bytes"]}
        c.check()
    out["values1"], out["ram1"], out["items1"] = out["values0"], out["ram0"], out["items0"]
    out["seconds"] = time.perf_counter() - t0
    return out


def _b(n):
    for unit, k in (("GiB", GiB), ("MiB", MiB), ("KB", KB)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def efficiency_table(quick):
    results = []
    for label, sizes, cap, target in rows(quick):
        for given in (True, False):
            r = measure_row(label, sizes, cap, given)
            r["target"] = target
            results.append(r)
            print(r, flush=True)
    for given in (True, False):
        r = shifting_row(64 * MiB, given)
        r["target"] = 0.90
        results.append(r)
        print(r, flush=True)
    print()
    print("| samples | capacity_bytes | sizes given | items | values / capacity after 3x | after 5x more "
          "| RAM (st_blocks) / capacity | target | met |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        allowance = max(MiB, r["cap"] // 50) / r["cap"]
        ok = min(r["values0"], r["values1"]) >= r["target"] and max(r["ram0"], r["ram1"]) <= 1 + allowance
        print(f"| {r['label']} | {_b(r['cap'])} | {'yes' if r['sizes'] else 'no'} | {r['items1']} | "
              f"{100 * r['values0']:.1f}% | {100 * r['values1']:.1f}% | {100 * max(r['ram0'], r['ram1']):.1f}% | "
              f">= {100 * r['target']:.0f}% | {'yes' if ok else 'NO'} |")


def capacity_for_ram(n, sizes, ram_bytes):
    """The largest capacity_bytes whose segment fits `ram_bytes` (any engine: Cache.memory_for;
    sizes None: created without them)."""
    lo, hi = 1, ram_bytes
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            fits = sc.Cache.memory_for(n, mid, sizes=sizes, policy="importance") <= ram_bytes
        except ValueError:  # too small for this engine
            fits = False
        if fits:
            lo = mid
        else:
            hi = mid - 1
    return lo


def hit_ratio(n=4000, fraction=0.10, epochs=3, seed=3, given_sizes=True):
    """SHADE's reads through a cache of `fraction` of the data set's bytes in RAM."""
    rng = np.random.default_rng(seed)
    sizes = lognormal(n, seed=seed)
    importance = rng.lognormal(0.0, 1.0, n).astype(np.float32)
    budget = int(fraction * sizes.sum())
    cap = capacity_for_ram(n, sizes if given_sizes else None, budget)
    name = f"bench-hit-{os.getpid()}"
    hits = reads = 0
    kw = dict(sizes=sizes) if given_sizes else {}
    with sc.Cache.create(name, num_samples=n, capacity_bytes=cap, policy="importance", **kw) as c:
        c.update_scores(np.arange(n), importance)
        p = importance / importance.sum()
        for epoch in range(epochs):
            for i in rng.choice(n, size=n, p=p):
                got = c.get(int(i))
                if epoch:
                    reads += 1
                    hits += got is not None
                if got is None:
                    try:
                        c.put(int(i), value(int(i), 0, int(sizes[i])), score=float(importance[i]))
                    except sc.ValueTooLargeError:
                        pass
        s = c.stats()
        used_ram = ram(c)
        c.check()
    print(f"engine {os.path.dirname(os.path.dirname(sc.__file__))} (layout version {_core.LAYOUT_VERSION}), "
          f"sizes {'given' if given_sizes else 'not given'}: RAM budget {budget / MiB:.1f} MiB "
          f"(10% of {sizes.sum() / MiB:.0f} MiB), capacity_bytes {cap / MiB:.1f} MiB, "
          f"segment blocks {used_ram / MiB:.1f} MiB, sample bytes cached {s['bytes_used'] / MiB:.1f} MiB "
          f"({100 * s['bytes_used'] / used_ram:.1f}% of the RAM), {s['items']} samples; "
          f"hit ratio {hits / reads:.3f} over {reads} reads")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 64 MiB log-normal row instead of 256 MiB")
    ap.add_argument("--hit-ratio", action="store_true", help="only the hit-ratio row")
    ap.add_argument("--engine", default=REPO, help="a checkout whose shadecache to measure (default: this one)")
    args = ap.parse_args()
    if args.hit_ratio:
        hit_ratio(given_sizes=True)
        hit_ratio(given_sizes=False)
        return
    efficiency_table(args.quick)


if __name__ == "__main__":
    main()
