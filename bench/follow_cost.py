"""The cost of following the node (sampling/follow.py) as ShadeSampler._follow pays it, per batch.

    python bench/follow_cost.py                          # 10 million samples, a reach of 1 million
    python bench/follow_cost.py --samples 1000000 --reach 0

A job with others on its cache bends its order before each batch that is due (every reach/REBEND
positions, HORIZON reaches ahead): this times those bends over --batches batches of an order of
--samples ids, --cached of them cached, and prints the mean per batch and per epoch.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from shadecache.sampling.follow import REBEND, follow, horizon  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--cached", type=float, default=0.2, help="share of the samples cached")
    p.add_argument("--reach", type=int, default=None, help="the prefetcher's reach (default: half the cached)")
    p.add_argument("--batches", type=int, default=2000)
    a = p.parse_args()
    n, b = a.samples, a.batch
    rng = np.random.default_rng(0)
    order = rng.permutation(n).astype(np.int64)
    cached = np.zeros(n, bool)
    cached[rng.choice(n, int(n * a.cached), replace=False)] = True
    flags = np.zeros(n, np.uint8)
    flags[rng.choice(n, min(n, 2000), replace=False)] = 2
    reach = int(cached.sum()) // 2 if a.reach is None else a.reach
    window = max(b, reach)
    k, due, spent = 0, 0, 0.0
    for _ in range(a.batches):
        if k >= due:
            t = time.perf_counter()
            on_way = flags >= 2                  # what the sampler reads: the flags and the mask
            mask = cached.copy()
            follow(order, k, window, mask, on_way, horizon=horizon(window))
            spent += time.perf_counter() - t
            due = k + max(b, window // REBEND)
        k += b
    per_batch = spent / a.batches
    print(f"{n:,} samples, batch {b}, reach {reach:,}: {per_batch * 1e3:.2f} ms a batch in follow, "
          f"{n // b * per_batch / 60:.1f} min an epoch")


if __name__ == "__main__":
    main()
