"""`shadecache demo`: real training through the cache, uniform + LRU against SHADE, on this CPU.

It makes a small image data set locally (shadecache.demo.synthetic: noisy oriented gratings, 10
classes), packs it into a store file, and trains a small network with DataLoader workers reading
through a shared-memory cache that holds about 15% of the data: first with uniform sampling and an
LRU cache, then with ShadeSampler and importance eviction. It prints hit ratio, bytes read from the
store, samples/s, coverage and final accuracy, and writes a PNG. The training loop itself is
shadecache.demo.experiment.train_run, which the benchmarks and tests reuse.
"""
import argparse
import os
import tempfile
import time

import torch

from ..demo.experiment import RunConfig, build_data, format_table, plot_runs, train_run


def sampler_defaults_text() -> str:
    import shadecache as sc
    d = sc.ShadeSampler.defaults()
    return ", ".join(f"{k}={d[k]!r}" for k in ("substitute", "pads", "stall_budget", "coverage_epochs"))


def run_demo(args) -> int:
    torch.set_num_threads(1)
    runs = []
    with tempfile.TemporaryDirectory(prefix="shadecache-demo-") as tmp:
        t0 = time.perf_counter()
        print(f"making {args.samples} training + {args.test_samples} test images "
              f"(16x16 gratings, 10 classes) and packing them into {tmp}/train.shc ...")
        path, tx, ty = build_data(tmp, args.samples, args.test_samples, seed=args.seed)
        import shadecache as sc
        store = sc.PackedStore(path)
        common = dict(cache_fraction=args.cache_fraction, epochs=args.epochs,
                      batch_size=args.batch_size, num_workers=args.workers, seed=args.seed)
        # SHADE's row as SHADE runs: cached samples first and repeats in place of misses (the
        # accuracy budget at 10%); ShadeSampler's defaults repeat only when the store is too slow
        configs = [RunConfig("uniform + LRU", sampler="uniform", policy="lru", **common),
                   RunConfig("SHADE (rep 1) + importance", sampler="shade", policy="importance",
                             rep_factor=1.0, extra={"sampler": {"substitute": 0.1}}, **common)]
        for k, cfg in enumerate(configs):
            runs.append(train_run(store, cfg, (tx, ty), f"shadecache-demo-{os.getpid()}-{k}",
                                  progress=not args.quiet))
            r = runs[-1]
            print(f"  {cfg.label:<28} hit ratio {r['total_hit_ratio']:.3f}  "
                  f"accuracy {r['final_acc']:.2f}%")
        print()
        print(f"{args.samples} samples, cache holds {args.cache_fraction:.0%} of them, "
              f"{args.epochs} epochs, batch {args.batch_size}, {args.workers} DataLoader workers")
        where = _store_text(path)
        print(format_table(runs, store=where))
        stalls = sum(r["stall_repeats"] for r in runs)
        print(f"wall clock: the training loops' time over the {args.epochs} epochs (evaluation "
              f"excluded), reading a {where}; stall repeats: {stalls}"
              + (" (the store kept up with training)" if stalls == 0 else ""))
        print("SHADE row: cached samples first, and up to 10% of each epoch repeats cached "
              "samples in place of misses (substitute=0.1, rep_factor=1). ShadeSampler's defaults "
              f"({sampler_defaults_text()}) keep uniform's order and repeat only where the store "
              "cannot keep up with training (docs/importance.md, \"Repeats on two budgets\")")
        plot_runs(runs, args.plot, title="shadecache demo: uniform + LRU vs SHADE")
        print(f"\nplot written to {args.plot}  ({time.perf_counter() - t0:.0f} s in all)")
    return 0


def _store_text(path: str) -> str:
    """'PackedStore on <mount> (<file system>)' for the store file at `path`: the store whose
    speed the wall-clock column measures."""
    real = os.path.realpath(path)
    best, fstype = "/", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return f"PackedStore on {best} ({fstype})"


def register(subparsers):
    p = subparsers.add_parser("demo", help="train a small model through the cache: uniform + LRU "
                                           "vs SHADE (no download, CPU, under a minute)")
    p.add_argument("--samples", type=int, default=10000, help="training images (default 10000)")
    p.add_argument("--test-samples", type=int, default=4000)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--cache-fraction", type=float, default=0.15,
                   help="cache size as a fraction of the samples it can hold (default 0.15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="shadecache-demo.png", help="PNG to write")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_demo)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="shadecache-demo")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo"] + list(argv or []))
    return args.func(args)
