"""Hit ratio, store traffic, coverage and accuracy of real training through the cache.

A closed loop: a real network (shadecache.demo.experiment.make_model) learns a real image data set made
locally (shadecache.demo.synthetic), packed into a PackedStore and read through a real shared-memory
Cache by CachedDataset and a stock DataLoader; the sampler reads the cache's state each epoch and
the losses drive the scores that eviction uses. Every configuration makes the same number of
optimizer steps from the same initial weights per seed, so accuracies compare at equal steps.

Training uses augmentation applied after the cache (the cache holds raw bytes), as real training
does; a few rows are repeated without it (see NO_AUG_ROWS).

Rows: uniform + LRU, ShadeSampler's defaults + importance eviction, uniform + static,
SHADE rep_factor 1/2/3 + importance eviction (SHADE's draw, no substitution budget), SHADE rep 1 +
LRU, all with the coverage floor (K=2, the default), and SHADE rep 3 + importance with the floor
off (to show what it guards against). Columns: hit ratio, MB read from the store, coverage (lowest
distinct fraction over epochs), final accuracy, and its difference to uniform sampling (paired by
seed), each mean +- sd over seeds.

    python bench/hit_ratio.py                      # full run (~10 min on 2 vCPUs), updates BENCHMARKS.md
    python bench/hit_ratio.py --seeds 1 --sizes 0.1 --no-md    # a quick look
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shadecache as sc  # noqa: E402
from shadecache.demo.experiment import RunConfig, build_data, train_run  # noqa: E402

ROWS = [  # (label, sampler, policy, rep_factor, coverage_epochs)
    ("uniform + LRU", "uniform", "lru", 0.0, 2),
    ("ShadeSampler defaults + importance", "shade", "importance", None, None),
    ("uniform + static", "uniform", "static", 0.0, 2),
    ("SHADE rep 1 + importance", "shade", "importance", 1.0, 2),
    ("SHADE rep 2 + importance", "shade", "importance", 2.0, 2),
    ("SHADE rep 3 + importance", "shade", "importance", 3.0, 2),
    ("SHADE rep 1 + LRU", "shade", "lru", 1.0, 2),
    ("SHADE rep 3 + importance, floor off", "shade", "importance", 3.0, 0),
]
# The clairvoyant policy (evict by next use, then importance), once the engine has it.
if "clairvoyant" in sc.POLICIES:
    ROWS += [("uniform + clairvoyant", "uniform", "clairvoyant", 0.0, 2),
             ("SHADE rep 1 + clairvoyant", "shade", "clairvoyant", 1.0, 2),
             ("ShadeSampler defaults + clairvoyant", "shade", "clairvoyant", None, None)]
    # SHADE's draw (by importance, with replacement: multinomial, as SHADE's torch.multinomial)
    # in an order that ignores the cache (pads=False: no cached-first ordering). "rep 1" keeps
    # SHADE's substitution (a cached draw may replace one miss: the draw still sees the cache);
    # "rep 0" is fully cache-blind. SHADE's 17.9 % vs 43 % premise is about such orders.
    ROWS += [(f"SHADE rep {r} cache-blind order + {pol}", "shade", pol, float(r), 2)
             for r in (1, 0) for pol in ("importance", "clairvoyant")]
BASE_ROWS = ("uniform + LRU", "uniform + static")   # every table compares with these
BELADY_OF = "SHADE rep 1 + importance"   # the offline bound is computed on this row's exact reads
# The same loop WITHOUT augmentation, at the 10% cache only: there the small network memorizes the
# training set within a few epochs, so any repetition (substitution) costs test accuracy.
NO_AUG_ROWS = [ROWS[0], ROWS[1], ROWS[3], ROWS[5]]
# The SHADE rows name their setting in full (SHADE's draw by scores, no substitution budget), so
# they measure the same thing whatever ShadeSampler's defaults are; the "defaults" row takes them.
SHADE_AS_LABELLED = {"temper": 1.0, "substitute": None}
# Rows whose label says "cache-blind order": SHADE's own draw (multinomial by importance, with
# replacement) and no cached-first ordering (pads=False), on top of SHADE_AS_LABELLED.
CACHE_BLIND = {"pads": False, "draw": "multinomial"}


def sampler_options(label: str) -> dict:
    """The ShadeSampler options a row's label names beyond the row's tuple."""
    return dict(SHADE_AS_LABELLED, **(CACHE_BLIND if "cache-blind" in label else {}))


def sampler_defaults():
    return sc.ShadeSampler.defaults()
SECTION = "## Importance-aware caching in training"


def belady_epoch_horizon(trace, capacity: int, epoch_len: int) -> int:
    """Hits of Belady (MIN with bypass) that sees only the current epoch's future: a next use
    in a later epoch counts as none, and at each epoch start every cached item's key becomes its
    first position in that epoch (what an order published at the epoch's start tells). The best
    any policy can do knowing only the published epoch; O(T x capacity), for --horizon only."""
    trace = np.asarray(trace, dtype=np.int64)
    t = trace.size
    srt = np.lexsort((np.arange(t), trace))
    nxt = np.full(t, t, dtype=np.int64)
    same = trace[srt[1:]] == trace[srt[:-1]]
    nxt[srt[:-1][same]] = srt[1:][same]
    nxt = np.where(nxt // epoch_len == np.arange(t) // epoch_len, nxt, t).tolist()
    cached, hits = {}, 0
    for j, x in enumerate(trace.tolist()):
        if j % epoch_len == 0:
            first = {}
            for k, y in enumerate(trace[j:j + epoch_len].tolist()):
                first.setdefault(y, j + k)
            cached = {y: first.get(y, t) for y in cached}
        if x in cached:
            hits += 1
        elif len(cached) >= capacity:
            y = max(cached, key=cached.get)
            if cached[y] <= nxt[j]:
                continue          # bypass
            del cached[y]
        cached[x] = nxt[j]
    return hits


def ms(values, fmt="{:.3f}"):
    a = np.asarray(values, dtype=float)
    sd = a.std(ddof=1) if a.size > 1 else 0.0
    return f"{fmt.format(a.mean())} ± {fmt.format(sd)}"


def run_all(args):
    results = {}   # (size, label) -> list of run dicts, one per seed
    todo = [(size, seed, row, True) for size in args.sizes for seed in range(args.seeds)
            for row in ROWS if row[0] in args.rows]
    if not args.skip_no_aug:
        todo += [(0.10, seed, row, False) for seed in range(args.seeds) for row in NO_AUG_ROWS
                 if row[0] in args.rows]
    from tqdm import tqdm
    with tempfile.TemporaryDirectory(prefix="sc-hit-ratio-") as tmp:
        path, tx, ty = build_data(tmp, args.samples, args.test_samples, seed=args.data_seed)
        store = sc.PackedStore(path)
        for k, (size, seed, (label, sampler, policy, rep, floor), aug) in enumerate(
                tqdm(todo, desc="training runs", unit="run")):
            extra = {"sampler": sampler_options(label)} if rep is not None else {}
            if rep is None:   # the defaults as they are (train_run's "shade" sets pads=True)
                d = sampler_defaults()
                rep, floor = d["rep_factor"], d["coverage_epochs"]
                extra = {"sampler": {k: d[k] for k in ("pads", "substitute", "temper", "stalls",
                                                       "stall_budget")}}
            cfg = RunConfig(label, sampler=sampler, policy=policy, rep_factor=rep,
                            coverage_epochs=floor, cache_fraction=size, epochs=args.epochs,
                            batch_size=args.batch_size, num_workers=args.workers, seed=seed,
                            augment={} if aug else None, extra=extra)
            r = train_run(store, cfg, (tx, ty), f"sc-hit-ratio-{os.getpid()}-{k}")
            # Belady (offline MIN) on the exact reads of this run, for a cache of as many items
            # as this run's cache held at most
            r["belady_hit_ratio"] = (sc.belady_hits(r["trace"], r["max_items"])
                                     / max(1, len(r["trace"])))
            if args.horizon and policy == "clairvoyant":
                r["horizon_hit_ratio"] = belady_epoch_horizon(
                    r["trace"], r["max_items"], len(r["trace"]) // args.epochs) / len(r["trace"])
            del r["trace"]
            results.setdefault((size if aug else "no-aug", label), []).append(r)
    return results


def summarize(results, args):
    lines = []
    checks = []
    for size in args.sizes:
        uni = [r["final_acc"] for r in results[(size, "uniform + LRU")]]
        static_hit = np.mean([r["total_hit_ratio"] for r in results[(size, "uniform + static")]])
        held = np.mean([r["cached_fraction"][-1] for r in results[(size, "uniform + LRU")]])
        lines.append(f"\n**cache = {size:.0%} of the samples** (holds {held:.1%} of them at the "
                     f"end)\n")
        lines.append("| configuration | hit ratio | vs uniform+static | MB read from store | "
                     "coverage (min/epoch) | not drawn for 2 epochs (max) | final accuracy % | "
                     "Δ accuracy vs uniform (points) |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for label, *_ in ROWS:
            if (size, label) not in results:   # --rows left it out
                continue
            rs = results[(size, label)]
            hit = [r["total_hit_ratio"] for r in rs]
            acc = [r["final_acc"] for r in rs]
            delta = np.asarray(acc) - np.asarray(uni)
            lines.append(f"| {label} | {ms(hit)} | {np.mean(hit) / max(static_hit, 1e-9):.2f}× | "
                         f"{ms([r['total_bytes_read'] / 1e6 for r in rs], '{:.2f}')} | "
                         f"{ms([r['min_coverage'] for r in rs])} | "
                         f"{max(max(r.get('not_in_window', [0])) for r in rs)} | "
                         f"{ms(acc, '{:.2f}')} | {ms(delta, '{:+.2f}')} |")
            guarded = label.startswith(("SHADE", "ShadeSampler")) and "floor off" not in label
            if guarded:
                checks.append((f"{size:.0%} {label}: accuracy loss vs uniform <= 0.5 points",
                               float(delta.mean()) >= -0.5, f"{delta.mean():+.2f}"))
        for label, *_ in ROWS:   # the offline bound on each clairvoyant run's own reads
            if ("clairvoyant" in label or "cache-blind" in label) and (size, label) in results:
                bel = [r["belady_hit_ratio"] for r in results[(size, label)]]
                lines.append(f"| Belady bound (offline) on the reads of {label} | {ms(bel)} | "
                             f"{np.mean(bel) / max(static_hit, 1e-9):.2f}× | | | | | |")
                hz = [r["horizon_hit_ratio"] for r in results[(size, label)]
                      if "horizon_hit_ratio" in r]
                if hz:
                    lines.append(f"| Belady seeing only the current epoch, on the reads of "
                                 f"{label} | {ms(hz)} | {np.mean(hz) / max(static_hit, 1e-9):.2f}× "
                                 f"| | | | | |")
        if (size, BELADY_OF) in results and all("belady_hit_ratio" in r for r in results[(size, BELADY_OF)]):
            bel = [r["belady_hit_ratio"] for r in results[(size, BELADY_OF)]]
            lines.append(f"| Belady bound (offline) on the reads of {BELADY_OF} | {ms(bel)} | "
                         f"{np.mean(bel) / max(static_hit, 1e-9):.2f}× | | | | | |")
        for setting, imp_row, cv_row in (
                ("SHADE rep 1", BELADY_OF, "SHADE rep 1 + clairvoyant"),
                ("defaults", "ShadeSampler defaults + importance",
                 "ShadeSampler defaults + clairvoyant"),
                *((f"SHADE rep {r} cache-blind", f"SHADE rep {r} cache-blind order + importance",
                   f"SHADE rep {r} cache-blind order + clairvoyant") for r in (1, 0))):
            if abs(size - 0.10) > 1e-9 or (size, cv_row) not in results \
                    or (size, imp_row) not in results:
                continue
            imp = np.mean([r["total_hit_ratio"] for r in results[(size, imp_row)]])
            cv = results[(size, cv_row)]
            cvh = np.mean([r["total_hit_ratio"] for r in cv])
            bel = np.mean([r["belady_hit_ratio"] for r in cv])
            checks.append((f"10% {setting}: clairvoyant >= 1.5x importance", cvh >= 1.5 * imp,
                           f"{cvh / max(imp, 1e-9):.2f}x"))
            checks.append((f"10% {setting}: clairvoyant >= 80% of Belady on its own reads",
                           cvh >= 0.8 * bel, f"{cvh / max(bel, 1e-9):.0%}"))
            dacc = np.asarray([r["final_acc"] for r in cv]) - np.asarray(
                [r["final_acc"] for r in results[(size, imp_row)]])
            checks.append((f"10% {setting}: clairvoyant accuracy within 0.5 points of importance "
                           f"(paired by seed)", dacc.mean() >= -0.5, ms(dacc, "{:+.2f}")))
        if (size, "uniform + clairvoyant") in results:
            u = np.mean([r["total_hit_ratio"] for r in results[(size, "uniform + clairvoyant")]])
            checks.append((f"{size:.0%} uniform: clairvoyant >= static", u >= static_hit,
                           f"{u:.3f} vs {static_hit:.3f}"))
        if abs(size - 0.10) < 1e-9 and (size, "SHADE rep 1 + importance") in results:
            r1 = results[(size, "SHADE rep 1 + importance")]
            ratio = np.mean([r["total_hit_ratio"] for r in r1]) / max(static_hit, 1e-9)
            checks.insert(0, ("10% SHADE rep 1 hit ratio >= 1.8x uniform+static", ratio >= 1.8,
                              f"{ratio:.2f}x"))
            d1 = np.mean([r["final_acc"] for r in r1]) - np.mean(uni)
            checks.insert(1, ("10% SHADE rep 1 accuracy within 0.5 points of uniform",
                              abs(d1) <= 0.5 or d1 > 0, f"{d1:+.2f}"))
    if ("no-aug", ROWS[0][0]) in results:
        uni = [r["final_acc"] for r in results[("no-aug", ROWS[0][0])]]
        lines.append("\n**without augmentation** (cache = 10% of the samples; not a target: the "
                     "network memorizes the training set, see the note below)\n")
        lines.append("| configuration | hit ratio | coverage (min/epoch) | final accuracy % | "
                     "Δ accuracy vs uniform (points) |")
        lines.append("|---|---|---|---|---|")
        for label, *_ in NO_AUG_ROWS:
            if ("no-aug", label) not in results:
                continue
            rs = results[("no-aug", label)]
            acc = [r["final_acc"] for r in rs]
            lines.append(f"| {label} | {ms([r['total_hit_ratio'] for r in rs])} | "
                         f"{ms([r['min_coverage'] for r in rs])} | {ms(acc, '{:.2f}')} | "
                         f"{ms(np.asarray(acc) - np.asarray(uni), '{:+.2f}')} |")
    return "\n".join(lines), checks


def plot(results, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    xs = np.asarray(args.sizes) * 100
    for label, *_ in ROWS:
        if any((s, label) not in results for s in args.sizes):
            continue
        hit = [[r["total_hit_ratio"] for r in results[(s, label)]] for s in args.sizes]
        mb = [[r["total_bytes_read"] / 1e6 for r in results[(s, label)]] for s in args.sizes]
        dacc = [np.asarray([r["final_acc"] for r in results[(s, label)]])
                - np.asarray([r["final_acc"] for r in results[(s, "uniform + LRU")]])
                for s in args.sizes]
        style = "--" if "floor off" in label else "-"
        for ax, vals in zip(axes, (hit, mb, dacc)):
            m = np.array([np.mean(v) for v in vals])
            sd = np.array([np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in vals])
            ax.errorbar(xs, m, yerr=sd, marker="o", linestyle=style, capsize=3, label=label)
    axes[0].set_ylabel("hit ratio")
    axes[1].set_ylabel("MB read from the store")
    axes[2].set_ylabel("final accuracy − uniform (points)")
    axes[2].axhline(-0.5, color="grey", linestyle=":", linewidth=1)
    for ax in axes:
        ax.set_xlabel("cache size (% of samples)")
        ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"real training through the cache: {args.samples} samples, {args.epochs} epochs, "
                 f"{args.seeds} seeds (mean ± sd)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_md(table, checks, args, png, elapsed):
    md = args.md
    body = [
            f"`python bench/hit_ratio.py` ({elapsed / 60:.1f} min). Real training: a 256-128-10 MLP "
            f"learns 16x16 noisy oriented gratings (10 classes, shadecache.demo.synthetic), "
            f"{args.samples} training samples packed into a PackedStore, read through a real "
            f"Cache by CachedDataset in a stock DataLoader (num_workers={args.workers}), "
            f"batch {args.batch_size}, {args.epochs} epochs, Adam with a cosine schedule, "
            f"augmentation after the cache (random circular shift of up to 2 pixels and fresh "
            f"pixel noise, `experiment.Augment`); accuracy on "
            f"{args.test_samples} held-out samples; seeds 0..{args.seeds - 1} (same initial "
            f"weights per seed in every row, so Δ accuracy is paired). Every row makes the same "
            f"number of steps. Cache sizes are fractions of the samples: "
            f"`sc.Cache.capacity_for(fraction * N, store.lengths)`, the cache created with the "
            f"store's sizes (slot headers and page ends come on top of the budget). Coverage = distinct "
            f"samples trained in an epoch / N (lowest epoch). rep_factor = extra copies a cached "
            f"draw may take in place of a miss. The floor (K=2) is ShadeSampler's default.",
            "", f"![hit ratio]({os.path.relpath(png, os.path.dirname(md))})", "", table, "",
            "Targets:", ""]
    body += [f"- {'PASS' if ok else 'FAIL'}: {name} (measured {val})" for name, ok, val in checks]
    write_block(md, "hit_ratio", "\n".join(body))


def write_block(md: str, key: str, content: str):
    """Replace the block `key` inside its section of BENCHMARKS.md (marked by HTML
    comments), or add it at the end of the section; nothing outside the section is touched."""
    with open(md) as f:
        text = f.read()
    start = text.index(SECTION) + len(SECTION)
    nxt = text.find("\n## ", start)
    end = len(text) if nxt < 0 else nxt + 1
    section = text[start:end]
    begin, stop = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    block = f"{begin}\n{content}\n{stop}"
    if begin in section and stop in section:
        a = section.index(begin)
        b = section.index(stop) + len(stop)
        section = section[:a] + block + section[b:]
    else:
        section = section.replace("_pending_", "").rstrip("\n") + "\n\n" + block + "\n"
    section = section.rstrip("\n") + "\n\n"
    with open(md, "w") as f:
        f.write(text[:start] + section + text[end:].lstrip("\n"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.05, 0.10, 0.20, 0.40])
    p.add_argument("--samples", type=int, default=10000)
    p.add_argument("--test-samples", type=int, default=5000)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=0,
                   help="DataLoader workers (0: the hit ratios do not depend on it, and the run "
                        "stays within ~10 minutes on 2 vCPUs)")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--png", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "hit_ratio.png"))
    p.add_argument("--json", default=None, help="also dump every run's measurements here")
    p.add_argument("--no-md", action="store_true", help="do not update BENCHMARKS.md")
    p.add_argument("--md", default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "BENCHMARKS.md"), help="the file whose training section to write")
    p.add_argument("--from-json", default=None, help="render the table of a saved --json run")
    p.add_argument("--elapsed", type=float, default=0.0, help="with --from-json: its minutes")
    p.add_argument("--rows", type=lambda s: [x.strip() for x in s.split(",")], default=None,
                   help="run only these rows (labels, comma-separated; "
                        "the uniform + LRU and uniform + static baselines always run)")
    p.add_argument("--horizon", action="store_true",
                   help="also the Belady bound that sees only the current epoch, on the reads of "
                        "each clairvoyant row (slow: about 20 s a run)")
    p.add_argument("--skip-no-aug", action="store_true",
                   help="skip the rows trained without augmentation")
    args = p.parse_args(argv)
    labels = [r[0] for r in ROWS]
    if args.rows is None:
        args.rows = labels
    else:
        unknown = [r for r in args.rows if r not in labels]
        if unknown:
            p.error(f"unknown rows {unknown}; rows are {labels}")
        args.rows = list(BASE_ROWS) + [r for r in args.rows if r not in BASE_ROWS]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if args.from_json:   # re-render a finished run
        with open(args.from_json) as f:
            raw = json.load(f)
        results = {}
        for key, runs in raw.items():
            size, label = key.split("|", 1)
            results[(size if size == "no-aug" else float(size), label)] = runs
        args.seeds = len(next(iter(results.values())))
        args.sizes = sorted({k[0] for k in results if k[0] != "no-aug"})
        elapsed = args.elapsed * 60
    else:
        results = run_all(args)
        elapsed = time.perf_counter() - t0
    table, checks = summarize(results, args)
    print(table)
    print()
    for name, ok, val in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {name} (measured {val})")
    plot(results, args, args.png)
    print(f"\nplot: {args.png}   ({elapsed / 60:.1f} min)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{s}|{label}": v for (s, label), v in results.items()}, f)
    if not args.no_md:
        write_md(table, checks, args, args.png, elapsed)
        print("BENCHMARKS.md updated")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
