"""How much of a cache's byte budget holds sample bytes.

    python bench/bench_efficiency.py            # ~5 minutes; prints the table
    python bench/bench_efficiency.py --quick    # 8 and 64 MiB caches only

Each row packs a real store (PackWriter), creates the cache from the store
(`sc.Cache.for_store`: num_samples, the store's lengths as `sizes`, its fingerprint) with a
budget of `capacity_bytes`, and fills it through `CachedDataset.fetch_bytes` in batches of 256
ids, reading 1.5x the budget (lru: the last part evicts). Measured after the fill:
- efficiency  = value bytes cached / capacity_bytes (stats()["efficiency"]; target >= 95% for
                fixed sizes, >= 90% for the log-normal mix and the 3 KB -> 100 KB change);
- memory      = value bytes / segment_bytes: the whole shared memory the cache takes (slot
                headers, page ends and the per-sample arrays come on top of the budget).
check() runs after every row.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import shadecache as sc  # noqa: E402

KB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
FIXED = [256, 3 * KB, 4096, 110 * KB, MiB]


def pack_sizes(path, sizes):
    """A store whose sample i has sizes[i] bytes (the id in the first 8 bytes, then filler)."""
    pool = np.random.default_rng(0).integers(0, 256, int(max(sizes)) + 8, dtype=np.uint8).tobytes()
    with sc.PackWriter(path) as w:
        for i, n in enumerate(tqdm(sizes.tolist(), desc=f"pack {os.path.basename(path)}", leave=False,
                                   mininterval=1.0)):
            w.add(i.to_bytes(8, "little")[:n] + pool[8:n] if n >= 8 else pool[:n])


def fill(ds, ids, batch=256):
    for k in range(0, len(ids), batch):
        ds.fetch_bytes(ids[k:k + batch])


def measure(cache):
    s = cache.stats()
    cache.check()
    return s


def row(label, cap, s, seconds):
    return (label, cap, s["items"], s["efficiency"], s["value_bytes"] / s["segment_bytes"], seconds)


def fixed_row(tmp, size, cap):
    n = max(64, int(1.5 * cap // size))
    sizes = np.full(n, size, dtype=np.int64)
    return filled_row(os.path.join(tmp, f"fixed-{size}-{cap}.shc"), sizes, cap, f"{_b(size)} fixed")


def filled_row(path, sizes, cap, label):
    """Packs samples of `sizes` at `path`, fills a cache of `cap` made for that store (LRU) with
    all of them through CachedDataset, and measures it; the store file is removed after."""
    pack_sizes(path, sizes)
    t0 = time.perf_counter()
    try:
        with sc.PackedStore(path) as store, \
                sc.Cache.for_store(f"bench-eff-{os.getpid()}", store, cap, attach=False, policy="lru") as c:
            fill(sc.CachedDataset(store, c), np.arange(len(sizes)))
            return row(label, cap, measure(c), time.perf_counter() - t0)
    finally:
        os.unlink(path)


def lognormal_sizes(n, seed=0):
    # median 110 KB, sigma 1.2: about 1% of the samples over 2.3 MB, the largest several MB
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(110 * KB), 1.2, n), 64, None).astype(np.int64)


def lognormal_row(tmp, cap, clip=None):
    n = max(64, int(1.5 * cap // (110 * KB * 2)))
    sizes = lognormal_sizes(n)
    if clip:
        sizes = np.minimum(sizes, clip)
    label = f"log-normal, clipped at {_b(clip)}" if clip else f"log-normal (max {_b(int(sizes.max()))})"
    return filled_row(os.path.join(tmp, f"lognormal-{cap}.shc"), sizes, cap, label)


def change_row(tmp, cap, fitted):
    """A cache filled with 3 KB samples, then 100 KB ones. fitted: created with the 3 KB sizes
    (the data set it was made for); else without sizes (classes learned, capacity = memory)."""
    n_small, n_big = int(1.5 * cap // (3 * KB)), int(1.5 * cap // (100 * KB))
    sizes = np.concatenate([np.full(n_small, 3 * KB), np.full(n_big, 100 * KB)]).astype(np.int64)
    path = os.path.join(tmp, f"change-{cap}.shc")
    pack_sizes(path, sizes)
    t0 = time.perf_counter()
    try:
        with sc.PackedStore(path) as store:
            kw = dict(sizes=np.full(16, 3 * KB)) if fitted else {}
            with sc.Cache.create(f"bench-eff-{os.getpid()}", len(store), cap, policy="lru", **kw) as c:
                ds = sc.CachedDataset(store, c)
                fill(ds, np.arange(n_small))
                fill(ds, np.arange(n_small, n_small + n_big))
                label = "3 KB then 100 KB" + (" (fitted to 3 KB)" if fitted else " (no sizes given)")
                return row(label, cap, measure(c), time.perf_counter() - t0)
    finally:
        os.unlink(path)


def _b(n):
    for unit, k in (("GiB", GiB), ("MiB", MiB), ("KB", KB)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 and 64 MiB caches only")
    args = ap.parse_args()
    caps = [8 * MiB, 64 * MiB] + ([] if args.quick else [GiB])
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-eff-", dir=os.environ.get("BENCH_DIR")) as tmp:
        for cap in caps:
            for size in FIXED:
                rows.append(fixed_row(tmp, size, cap))
                print(rows[-1], flush=True)
        for cap in caps:
            rows.append(lognormal_row(tmp, cap, clip=MiB - 64))
            print(rows[-1], flush=True)
            rows.append(lognormal_row(tmp, cap))
            print(rows[-1], flush=True)
        for cap in caps:
            for fitted in (True, False):
                rows.append(change_row(tmp, cap, fitted))
                print(rows[-1], flush=True)
    print()
    print("| samples | capacity_bytes | items | efficiency (values / capacity) | values / segment | target | met |")
    print("|---|---|---|---|---|---|---|")
    for label, cap, items, eff, mem, _ in rows:
        target = 0.95 if "fixed" in label else 0.90
        print(f"| {label} | {_b(cap)} | {items} | {100 * eff:.1f}% | {100 * mem:.1f}% | "
              f">= {100 * target:.0f}% | {'yes' if eff >= target else 'NO'} |")


if __name__ == "__main__":
    main()
