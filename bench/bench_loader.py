"""CachedLoader against the loaders a user would otherwise run.

For each sample size (256 B and 3 KB by default), a data set of --mib MiB (larger than the CPU
caches) is packed into a store on local disk (the temporary directory) and loaded into a
shared-memory Cache. Every contender then serves the same random order, in batches of
--batch-size, in rounds; within a round the contenders take turns (the order rotates), and each
ratio is the median of the per-round ratios (this machine is shared and noisy). Each loader is
made once and iterated once per round, as a training job iterates its loader every epoch.

Every sample cached (CachedLoader and np.take: a pass over a permutation of all samples; the
DataLoaders: the first --samples ids of it):
  CachedLoader (num_workers 0 and 2)             x: (B, S) uint8 tensor, y, idx
  DataLoader(in-memory list, num_workers=2)      the stock loader over a Python list of the bytes
                                                 (batched __getitems__, persistent workers)
  np.take                                        the same ids gathered from an in-memory numpy
                                                 array (B, S) per batch: the copy itself
  ... and both loaders with a vectorized batch transform (x.float() / 255; the DataLoader's on
  each batch in the loop, the CachedLoader's as batch_transform)
Half of the samples cached (a random half; admit=False keeps it half across rounds), the rest read
from the store file (local disk, page cache warm after the first round); every contender serves
the first --samples ids of the permutation:
  CachedLoader vs DataLoader(CachedDataset, num_workers=2)

    python bench/bench_loader.py                    # ~5 minutes; prints the tables
    python bench/bench_loader.py --quick            # seconds: tiny sizes (used by the tests)
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shadecache as sc  # noqa: E402
from shadecache.cache import huge_pages  # noqa: E402


class InMemoryList(Dataset):
    """The alternative a user would write when everything fits: a list of bytes (as in
    bench_end_to_end.py), fetched a batch at a time."""

    def __init__(self, values, labels):
        self.values = values
        self.labels = labels

    def __len__(self):
        return len(self.values)

    def __getitems__(self, ids):
        return [(np.frombuffer(self.values[i], dtype=np.uint8), self.labels[i], i) for i in ids]

    def __getitem__(self, i):
        return self.__getitems__([i])[0]


def to_float(x):
    """The vectorized batch transform of the benchmark: uint8 -> float32 in [0, 1]."""
    return x.float().mul_(1.0 / 255)


def drain(loader, transform=None):
    """Samples/s of one pass; every batch is touched (its transform applied, if any)."""
    t0 = time.perf_counter()
    n = 0
    for x, y, idx in loader:
        if transform is not None:
            x = transform(x)
        n += len(idx)
    return n / (time.perf_counter() - t0)


def take_rate(arr, batches):
    t0 = time.perf_counter()
    n = 0
    for ids in batches:
        n += len(np.take(arr, ids, axis=0))
    return n / (time.perf_counter() - t0)


def build(size, n, tmp, progress):
    rng = np.random.default_rng(size)
    arr = rng.integers(0, 256, (n, size), dtype=np.uint8)
    labels = rng.integers(0, 10, n)
    path = os.path.join(tmp, f"loader-{size}.shc")
    with sc.PackWriter(path) as w:
        for i in tqdm(range(n), desc=f"pack {size} B", unit="sample", disable=not progress,
                      mininterval=1):
            w.add(arr[i], int(labels[i]))
    return arr, labels, sc.PackedStore(path)


def fill(cache, store, ids, progress):
    for a in tqdm(range(0, len(ids), 8192), desc="fill cache", disable=not progress, mininterval=1):
        chunk = ids[a:a + 8192]
        cache.put_many(chunk, store.read_many(chunk))


def rounds_of(contenders, rounds, progress):
    """Runs each contender once per round, the order rotating; returns name -> rates."""
    names = list(contenders)
    rates = {k: [] for k in names}
    for r in tqdm(range(rounds), desc="rounds", disable=not progress):
        turn = names[r % len(names):] + names[:r % len(names)]
        for k in turn:
            rates[k].append(contenders[k]())
    return rates


def ratio(rates, a, b):
    return statistics.median(x / y for x, y in zip(rates[a], rates[b]))


def measure(size, args, tmp):
    n = max(1024, (args.mib << 20) // size)
    m = min(n, args.samples)                   # samples per timed pass
    arr, labels, store = build(size, n, tmp, args.progress)
    # CachedLoader and np.take gather the same ids: a permutation of the whole data set, so each
    # pass touches far more than the CPU caches hold. The slower loaders get its first m ids (a
    # working set m/n as large: if anything, that favours them).
    full = np.random.default_rng(1).permutation(n)
    sampler = full            # an int64 array, as np.take gets its ids (a list costs ~20 ns/id more)
    batches = [full[a:a + args.batch_size] for a in range(0, n, args.batch_size)]
    part = full[:m].tolist()
    values = [arr[i].tobytes() for i in range(n)]
    mem = InMemoryList(values, labels.tolist())
    cap = int(n * (size + 64) * 1.25) + (64 << 20)
    kw = dict(batch_size=args.batch_size, sampler=sampler)
    kw_part = dict(batch_size=args.batch_size, sampler=part)
    out = {}
    with sc.Cache.create(f"sc-bench-loader-{uuid.uuid4().hex[:8]}", num_samples=n,
                         capacity_bytes=cap, max_item_bytes=max(size, 4096)) as cache:
        fill(cache, store, np.arange(n), args.progress)
        assert cache.cached_mask().all(), "the cache must hold every sample"
        ds = sc.CachedDataset(store, cache)
        dl_mem = DataLoader(mem, num_workers=2, persistent_workers=True, **kw_part)
        # Every loader is made once and iterated once per round, as a training job iterates its
        # loader every epoch (the DataLoaders keep their workers: persistent_workers=True).
        cl = {w: sc.CachedLoader(ds, num_workers=w, **kw) for w in (0, 2)}
        cl_t = {w: sc.CachedLoader(ds, num_workers=w, batch_transform=to_float, **kw) for w in (0, 2)}
        contenders = {
            "CachedLoader w=0": lambda: drain(cl[0]),
            "CachedLoader w=2": lambda: drain(cl[2]),
            "DataLoader(list) w=2": lambda: drain(dl_mem),
            "np.take": lambda: take_rate(arr, batches),
            "CachedLoader w=0 +T": lambda: drain(cl_t[0]),
            "CachedLoader w=2 +T": lambda: drain(cl_t[2]),
            "DataLoader(list) w=2 +T": lambda: drain(dl_mem, to_float),
        }
        for f in contenders.values():
            f()                                 # warm-up: workers started, pages touched
        ds.reset_stats()
        rates = rounds_of(contenders, args.rounds, args.progress)
        st = ds.stats()
        assert st["misses"] == 0 and st["bytes_read"] == 0, f"store read while all cached: {st}"
        out["cached"] = rates
        del dl_mem
    # half of the samples cached, the rest from the store on local disk
    with sc.Cache.create(f"sc-bench-loader-{uuid.uuid4().hex[:8]}", num_samples=n,
                         capacity_bytes=cap, max_item_bytes=max(size, 4096)) as cache:
        half = np.sort(np.random.default_rng(2).permutation(n)[:n // 2])
        fill(cache, store, half, args.progress)
        ds = sc.Node(store, cache, admission=sc.ReadThrough(), read_ahead=False, read_plan="samples").dataset()
        dl_cds = DataLoader(ds, num_workers=2, persistent_workers=True, **kw_part)
        cl = {w: sc.CachedLoader(ds, num_workers=w, **kw_part) for w in (0, 2)}
        contenders = {
            "CachedLoader w=0": lambda: drain(cl[0]),
            "CachedLoader w=2": lambda: drain(cl[2]),
            "DataLoader(CachedDataset) w=2": lambda: drain(dl_cds),
        }
        for f in contenders.values():
            f()
        ds.reset_stats()
        rates = rounds_of(contenders, args.rounds, args.progress)
        st = ds.stats()
        assert 0.4 < st["hit_ratio"] < 0.6, f"expected about half hits: {st}"
        out["half"] = rates
        del dl_cds
    store.close()
    return n, m, out


def table(size, n, res):
    c, h = res["cached"], res["half"]
    med = {k: statistics.median(v) for k, v in c.items()}
    hmed = {k: statistics.median(v) for k, v in h.items()}
    best = max(("CachedLoader w=0", "CachedLoader w=2"), key=lambda k: med[k])
    bestT = max(("CachedLoader w=0 +T", "CachedLoader w=2 +T"), key=lambda k: med[k])
    bestH = max(("CachedLoader w=0", "CachedLoader w=2"), key=lambda k: hmed[k])
    rows = []
    checks = []

    def row(name, fig, alt, altfig, r, target):
        verdict = "—" if target is None else ("PASS" if r >= target else "FAIL")
        if target is not None:
            checks.append(r >= target)
        tgt = "(info)" if target is None else f"≥ {target:g}×"
        rows.append(f"| {size} B | {name} | {fig:,.0f} | {alt} | {altfig:,.0f} | {r:.2f}× | {tgt} | {verdict} |")

    dl = "DataLoader(list) w=2"
    for k in ("CachedLoader w=0", "CachedLoader w=2"):
        row(f"`{k}`, all cached", med[k], f"`{dl}`", med[dl], ratio(c, k, dl), 3 if k == best else None)
    for k in ("CachedLoader w=0", "CachedLoader w=2"):
        row(f"`{k}`, all cached", med[k], "`np.take`", med["np.take"], ratio(c, k, "np.take"),
            0.9 if k == best else None)
    for k in ("CachedLoader w=0 +T", "CachedLoader w=2 +T"):
        row(f"`{k}` (batch transform), all cached", med[k], f"`{dl} +T`", med[dl + " +T"],
            ratio(c, k, dl + " +T"), 3 if k == bestT else None)
    dc = "DataLoader(CachedDataset) w=2"
    for k in ("CachedLoader w=0", "CachedLoader w=2"):
        row(f"`{k}`, half cached, misses from local disk", hmed[k], f"`{dc}`", hmed[dc],
            ratio(h, k, dc), 1 if k == bestH else None)
    return rows, checks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[256, 3072])
    p.add_argument("--mib", type=int, default=256, help="data set size per sample size (MiB)")
    p.add_argument("--samples", type=int, default=100_000,
                   help="samples per timed pass of the DataLoaders and of the half-cached rows")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    if args.quick:
        args.mib, args.samples, args.rounds, args.batch_size = 1, 4096, 1, 64
    torch.set_num_threads(1)
    # default_collate warns once that the list's np.frombuffer arrays are read-only (harmless)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    all_rows, all_checks = [], []
    with tempfile.TemporaryDirectory(prefix="shadecache-loaderbench-") as tmp:
        for size in args.sizes:
            n, m, res = measure(size, args, tmp)
            rows, checks = table(size, n, res)
            print(f"{size} B: {n} samples ({n * size / 2**20:.0f} MiB); {m} per DataLoader pass", flush=True)
            all_rows += rows
            all_checks += checks
    print()
    print(huge_pages.describe() + "; np.take's array: numpy's own (transparent huge pages when THP allows)")
    print("| size | CachedLoader | samples/s | alternative | samples/s | ratio | target | result |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(all_rows))
    ok = all(all_checks)
    print(f"\n{'All targets hold' if ok else 'Some targets do not hold'} "
          f"({sum(all_checks)}/{len(all_checks)}).")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
