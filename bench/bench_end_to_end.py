"""End to end: CachedDataset with every sample cached vs an in-memory list, same DataLoader (the target:
at least 90% of the in-memory samples/s with num_workers=2).

Both data sets hand the DataLoader the same items, (decode(bytes), label, index), from the same
bytes, through the same batched `__getitems__`, with the same sampler order, batch size, workers
and collate; the only difference is where the bytes come from: a Python list in each worker's
memory, or the node's shared-memory Cache (one get_many per batch, the per-process counters). The
store is never read in the timed epochs (asserted). Each configuration runs a warm-up epoch, then
rounds of timed epochs alternate between the two (taking turns to go first); the ratio reported is
the median of the per-round ratios, which is robust to the slow drifts of a shared machine.

    python bench/bench_end_to_end.py                 # prints the table, updates BENCHMARKS.md
    python bench/bench_end_to_end.py --no-md --rounds 3
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shadecache as sc  # noqa: E402


def decode(data):
    return np.frombuffer(data, dtype=np.uint8)


class InMemoryList(Dataset):
    """The alternative a user would write when everything fits: a list of bytes."""

    def __init__(self, values, labels):
        self.values = values
        self.labels = labels

    def __len__(self):
        return len(self.values)

    def __getitems__(self, ids):
        return [(decode(self.values[i]), self.labels[i], i) for i in ids]

    def __getitem__(self, i):
        return self.__getitems__([i])[0]


def epochs_per_s(loader, epochs):
    t0 = time.perf_counter()
    n = 0
    for _ in range(epochs):
        for x, y, idx in loader:
            n += len(idx)
    return n / (time.perf_counter() - t0)


def measure(n, item_bytes, workers, batch, rounds, epochs, tmp):
    rng = np.random.default_rng(item_bytes)
    values = [rng.integers(0, 256, item_bytes, dtype=np.uint8).tobytes() for _ in range(n)]
    labels = [int(x) for x in rng.integers(0, 10, n)]
    path = os.path.join(tmp, f"e2e-{item_bytes}.shc")
    w = sc.PackWriter(path)
    for v, lab in zip(values, labels):
        w.add(v, lab)
    w.close()
    store = sc.PackedStore(path)
    order = torch.from_numpy(np.random.default_rng(1).permutation(n))
    with sc.Cache.create(f"sc-e2e-{uuid.uuid4().hex[:8]}", num_samples=n,
                         capacity_bytes=4 * n * (item_bytes + 64) + (64 << 20), policy="lru",
                         max_item_bytes=max(item_bytes, 64)) as cache:
        cds = sc.CachedDataset(store, cache, decode=decode)
        for a in range(0, n, 256):                       # every sample cached before timing
            cds.__getitems__(list(range(a, min(n, a + 256))))
        assert cache.cached_mask().all(), "the cache must hold every sample for this benchmark"
        mem = InMemoryList(values, labels)
        kw = dict(batch_size=batch, sampler=order.tolist(), num_workers=workers,
                  persistent_workers=workers > 0)
        loaders = {"CachedDataset (all cached)": DataLoader(cds, **kw),
                   "in-memory list": DataLoader(mem, **kw)}
        for ld in loaders.values():
            epochs_per_s(ld, 1)                           # warm-up: start workers, touch pages
        cds.reset_stats()
        rates = {k: [] for k in loaders}
        names = list(loaders)
        for r in range(rounds):
            for k in (names if r % 2 == 0 else names[::-1]):   # alternate who goes first
                rates[k].append(epochs_per_s(loaders[k], epochs))
        st = cds.stats()
        assert st["misses"] == 0 and st["bytes_read"] == 0, f"store was read while timing: {st}"
        del loaders
    a, b = rates["CachedDataset (all cached)"], rates["in-memory list"]
    # the ratio of each round (both ran back to back) is robust to the machine's slow drifts
    ratio = statistics.median(x / y for x, y in zip(a, b))
    return {k: statistics.median(v) for k, v in rates.items()}, ratio


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[256, 3072])
    p.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[2, 0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--epochs", type=int, default=1, help="timed epochs per round")
    p.add_argument("--no-md", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="sc-e2e-") as tmp:
        for workers in args.workers:
            for size in args.sizes:
                med, ratio = measure(args.samples, size, workers, args.batch_size,
                                     args.rounds, args.epochs, tmp)
                cached, mem = med["CachedDataset (all cached)"], med["in-memory list"]
                if workers == 2:
                    ok &= ratio >= 0.90
                rows.append(f"| {workers} | {size} | {cached:,.0f} | {mem:,.0f} | {ratio:.1%} |")
                print(rows[-1], flush=True)
    table = ("| num_workers | sample bytes | CachedDataset, all cached (samples/s) | "
             "in-memory list (samples/s) | ratio (median of per-round ratios) |\n"
             "|---|---|---|---|---|\n" + "\n".join(rows))
    verdict = (f"{'PASS' if ok else 'FAIL'}: with num_workers=2, CachedDataset reaches >= 90% of "
               f"the in-memory list's samples/s")
    print()
    print(table)
    print(verdict)
    if not args.no_md:
        from hit_ratio import write_block
        md = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "BENCHMARKS.md")
        body = (f"**End to end** (`python bench/bench_end_to_end.py`): {args.samples} samples, "
                f"batch {args.batch_size}, the same DataLoader, sampler order and batched "
                f"`__getitems__` over a fully cached CachedDataset and over a Python list of the "
                f"same bytes; {args.rounds} rounds of {args.epochs} "
                f"epoch(s) after a warm-up epoch, the two taking turns to go first; samples/s are "
                f"medians, the ratio is the median of the per-round ratios; the store is never "
                f"read while timing "
                f"(asserted).\n\n{table}\n\n- {verdict}")
        write_block(md, "end_to_end", body)
        print("BENCHMARKS.md updated")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
