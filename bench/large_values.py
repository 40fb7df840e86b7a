"""Large values: a 16 MiB `get` against a plain 16 MiB bytes copy.

    python bench/large_values.py             # ~1 minute; prints the table (docs/benchmark_history.md, "Large values")
    python bench/large_values.py --tiny      # the smoke run

A value larger than a chunk is whole chunks plus a tail slot; a get copies the chunks out (those
side by side, as a value written into free pages has them, in one memcpy) under the head's seqlock,
so it should run at the copy's bandwidth. The contenders read the same
amount from working sets of the same size (larger than the L3), round-robin, medians of
per-repetition ratios (workload.run_interleaved):
- cache.get(i) of 16 MiB values (ids in a random order);
- a plain bytes copy of 16 MiB from random offsets of a multiprocessing.shared_memory mapping
  (`bytes(buf[o:o+n])`, the reference of bench/cache_table.py's 100 KB row).
Target: get >= 0.9x the plain copy's bandwidth. Every value read is checked outside the timing.
"""
import argparse
import os
import sys
from multiprocessing import shared_memory

import numpy as np
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

import shadecache as sc  # noqa: E402
import baselines  # noqa: E402
from workload import random_offsets, run_interleaved, timed  # noqa: E402

MiB = 1 << 20


def get_loop(get, ids):
    for i in ids:
        get(i)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--size-mib", type=int, default=16)
    args = ap.parse_args()
    size = args.size_mib * MiB
    count, reps, per_rep = (4, 3, 4) if args.tiny else (32, 15, 16)
    name = f"bench-large-{os.getpid()}"
    rng = np.random.default_rng(1)
    values = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in tqdm(range(count), desc="values")]
    shm = shared_memory.SharedMemory(create=True, size=count * size)
    try:
        with sc.Cache.create(name, num_samples=count, capacity_bytes=count * (size + MiB)) as cache:
            for i, v in enumerate(values):
                assert cache.put(i, v)
                shm.buf[i * size:(i + 1) * size] = v
            orders = [rng.permutation(count)[:per_rep].tolist() for _ in range(reps)]
            offsets = [random_offsets(count * size, size, per_rep, align=64, seed=r) for r in range(reps)]
            get = cache.get
            t = run_interleaved({
                "get": lambda r: timed(get_loop, get, orders[r]),
                "copy": lambda r: timed(baselines.plain_copy_loop, shm.buf, offsets[r], size),
            }, reps)
            for i in orders[0]:
                assert cache.get(i) == values[i]
            cache.check()
            gbps = {k: per_rep * size / t[k] / 1e9 for k in ("get", "copy")}
            ratio = t.speedup("get", "copy")
            print(f"| contender ({args.size_mib} MiB values, {count * size >> 20} MiB working set) | GB/s |")
            print("|---|---|")
            print(f"| `Cache.get` | {gbps['get']:.2f} |")
            print(f"| plain bytes copy from a shared-memory mapping | {gbps['copy']:.2f} |")
            print(f"\nget / copy bandwidth: {ratio:.2f}x (target >= 0.9x): {'holds' if ratio >= 0.9 else 'MISSED'}")
    finally:
        shm.close()
        shm.unlink()


if __name__ == "__main__":
    main()
