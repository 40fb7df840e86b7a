"""The batch path of CachedLoader against np.take, by CPU time.

Wall-clock rates on this shared machine swing with the other sessions' load; the CPU time of one
thread (time.process_time, torch.set_num_threads(1)) much less. For each sample size, --mib MiB of
random samples are put in a Cache and kept in an in-memory (N, S) numpy array; every contender
serves the same batches of a permutation of all ids, in rounds, taking turns:

  np.take            np.take(arr, ids, axis=0) per batch (a fresh (B, S) array); numpy asks for
                     transparent huge pages for its large array
  np.take 4 KiB      the same over a copy of the array denied huge pages (MADV_NOHUGEPAGE): what
                     the TLB costs np.take, for comparison with a cache on /dev/shm's 4 KiB pages
  gather_rows        _core.gather_rows(core, ids, out): the bare native call, one reused buffer
  gather_rows+alloc  the same into a fresh torch tensor per batch
  CachedLoader w=0   the whole loader (sampler: the permutation as an int64 array), x, y, idx

    python bench/bench_gather_cpu.py                # ~2 minutes
    python bench/bench_gather_cpu.py --quick        # seconds
"""
import argparse
import mmap
import os
import statistics
import sys
import time
import uuid

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shadecache as sc  # noqa: E402
from shadecache import _core
from shadecache.cache import huge_pages  # noqa: E402


class ArrayStore:
    """A store over the in-memory array (the loader reads labels and sizes from it; no miss)."""

    def __init__(self, arr, labels):
        self.arr, self.labels = arr, labels
        self.lengths = np.full(len(arr), arr.shape[1], np.int64)

    def __len__(self):
        return len(self.arr)

    def read_many(self, ids):
        return [self.arr[i].tobytes() for i in ids]

    def label(self, i):
        return int(self.labels[i])


def measure(size, args):
    n = max(1024, (args.mib << 20) // size)
    b = args.batch_size
    rng = np.random.default_rng(size)
    arr = rng.integers(0, 256, (n, size), dtype=np.uint8)
    perm = np.random.default_rng(1).permutation(n)[: n // b * b]
    batches = [perm[a:a + b] for a in range(0, perm.size, b)]
    cap = int(n * (size + 64) * 1.25) + (64 << 20)
    with sc.Cache.create(f"sc-bench-gcpu-{uuid.uuid4().hex[:8]}", num_samples=n, capacity_bytes=cap,
                         max_item_bytes=max(size, 4096)) as cache:
        for a in tqdm(range(0, n, 8192), desc=f"fill {size} B", disable=not args.progress):
            ids = np.arange(a, min(n, a + 8192))
            cache.put_many(ids, [arr[i].tobytes() for i in ids])
        core = cache._core
        ds = sc.CachedDataset(ArrayStore(arr, rng.integers(0, 10, n)), cache)
        out = np.empty((b, size), np.uint8)
        small_pages = mmap.mmap(-1, n * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        small_pages.madvise(mmap.MADV_NOHUGEPAGE)
        arr4k = np.frombuffer(small_pages, dtype=np.uint8).reshape(n, size)
        arr4k[:] = arr

        def take():
            for ids in batches:
                np.take(arr, ids, axis=0)

        def take4k():
            for ids in batches:
                np.take(arr4k, ids, axis=0)

        def gather():
            for ids in batches:
                _core.gather_rows(core, ids, out)

        def gather_alloc():
            for ids in batches:
                _core.gather_rows(core, ids, torch.empty((b, size), dtype=torch.uint8).numpy())

        ld = sc.CachedLoader(ds, batch_size=b, sampler=perm, num_workers=0)

        def loader():   # one loader, an epoch per call, as a training job iterates it
            for x, y, idx in ld:
                pass

        fs = {"np.take": take, "np.take 4 KiB": take4k, "gather_rows": gather, "gather_rows+alloc": gather_alloc,
              "CachedLoader w=0": loader}
        _core.gather_rows(core, batches[0], out)
        assert (out == arr[batches[0]]).all()
        for f in fs.values():
            f()
        rates = {k: [] for k in fs}
        for r in tqdm(range(args.rounds), desc="rounds", disable=not args.progress):
            names = list(fs)[r % len(fs):] + list(fs)[:r % len(fs)]
            for k in names:
                t0 = time.process_time()
                fs[k]()
                rates[k].append(perm.size / (time.process_time() - t0))
    return n, rates


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[256, 3072])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    if args.quick:
        args.mib, args.rounds, args.batch_size = 1, 1, 64
    torch.set_num_threads(1)
    rows = []
    for size in args.sizes:
        n, rates = measure(size, args)
        for k, v in rates.items():
            r = statistics.median(x / y for x, y in zip(v, rates["np.take"]))
            rows.append(f"| {size} B | {k} | {statistics.median(v):,.0f} | {r:.2f}× |")
    print(huge_pages.describe() + "; np.take's array: numpy's own (transparent huge pages when THP allows)")
    print("| size | contender | samples/s of CPU time | vs np.take (median of per-round ratios) |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
