"""Sampling fidelity: what the sampler's repeats cost or buy in accuracy, with statistics that can
tell a cost from a gain of a few tenths of a point, and what they buy in time on a slow store.

Every run is real training through the real parts: the training set is packed into a PackedStore,
read through a real shared-memory Cache by CachedDataset and CachedLoader, ordered by the real
ShadeSampler. For one (data set, schedule, seed) every configuration starts from the same initial
weights and makes the same number of optimizer steps, so a configuration's accuracy is compared
with uniform sampling's seed by seed (paired).

Data sets: bench/fidelity_datasets.py (five kinds, generated here, test sets with at most 0.15
points of sampling noise). Schedules: SGD with momentum 0.9 for 12 epochs, at a constant rate or
decaying to 0 along a cosine. Configurations: the CONFIGS table below (one row per configuration;
a row added there is run and reported everywhere).

Statistics per cell (data set, schedule, configuration): over the seeds, the mean ± standard error
of Δ accuracy (configuration minus uniform, same seed), the paired t statistic (mean / standard
error), and the sampling noise of the test set.

    nice -n 10 python bench/fidelity.py run            # the sweep, resumable (bench/fidelity.jsonl)
    python bench/fidelity.py report --md BENCHMARKS.md  # tables, acceptance, PNG, the section
    python bench/fidelity.py slow                      # slow-store mode (root: a throttled disk)
    python bench/fidelity.py slow-report --md BENCHMARKS.md
"""
import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import shadecache as sc  # noqa: E402
import fidelity_datasets as fdata  # noqa: E402
from shadecache.read_plan import MIN_EXTENT_BYTES, ReadPlan  # noqa: E402

SECTION = "## Sampling fidelity"
DEFAULT_JSON = os.path.join(HERE, "fidelity.jsonl")
DEFAULT_PNG = os.path.join(HERE, "fidelity.png")
SLOW_SECTION = "## Repeats on a slow store"
CACHE_FRACTION = 0.10
LR = 0.05
# The fast store lives in memory (tmpfs): a file in the page cache is not fast on a shared
# machine, where another process's drop_caches sends its next reads to the disk (measured: the
# first epoch of a run after a gap waited 3-6x longer on reads than the next run's)
FAST_DIR = "/dev/shm"
PAD = 2048      # bytes per stored sample: the engine hands out memory in slab pages, so a cache of
#                 a tenth of 3,000 samples of 32 bytes could not be made that small


# ---- configurations: one row each ------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """sampler: ShadeSampler options over its defaults; weights: multiply each loss by
    sampler.weights(idx); policy: the cache's eviction policy; loader: CachedLoader options;
    order_seed: added to the run's seed for the sampler only (the same initial weights, another
    order); placement: the placement seed the store is packed with (its partition into extents),
    or "seed": the run's seed (each seed another random partition); plan: the node's read plan,
    ("auto",), ("samples",) or ("extents", extent bytes, window)."""
    sampler: dict
    weights: bool = False
    policy: str = "importance"
    loader: dict = field(default_factory=dict)
    order_seed: int = 0
    placement: int | str = 0
    plan: tuple = ("auto",)


def read_plan(cfg: Config, store):
    """The node's read plan of a configuration (sc.Node's read_plan=)."""
    if cfg.plan[0] != "extents":
        return cfg.plan[0]
    return ReadPlan.of_extents(store, extent_bytes=cfg.plan[1], window=cfg.plan[2])


UNIFORM = "uniform"
DEFAULTS = "defaults"
EXTENTS = "extents"
RESHUFFLED = "uniform reshuffled"
CONFIGS = {
    # the baseline: a seeded permutation per epoch, nothing reordered, repeated or deferred
    UNIFORM: Config(dict(importance=False, pads=False, rep_factor=0.0, substitute=0.0,
                         stalls=False), policy="static", plan=("samples",)),
    # whatever ShadeSampler() does without options (recorded with each run)
    DEFAULTS: Config({}),
    # the null comparison: uniform sampling with another seeded permutation per epoch, so its
    # Δ to uniform is what reshuffling alone does to a cell (the noise a change of order has to
    # be told from); same initial weights and steps
    RESHUFFLED: Config(dict(importance=False, pads=False, rep_factor=0.0,
                            substitute=0.0, stalls=False),
                       policy="static", order_seed=10_000, plan=("samples",)),
    # the accuracy budget at 10% of the epoch's slots (the default before these measurements);
    # the stall budget at its default
    "accuracy budget 10%": Config(dict(substitute=0.1, rep_factor=1.0)),
    # deferrals only: no repeats of either budget
    "no repeats": Config(dict(substitute=0.0, stall_budget=0.0)),
    # the stall budget at 10% of the epoch (slow store: what the default's 30% buys over it)
    "stall budget 10%": Config(dict(stall_budget=0.1)),
    # the extent order at its default window over the defaults: what "auto" draws on an
    # IOPS-bound store. Its extents are the smallest the default makes (64 KiB: 32 stored samples
    # here), so a window (16 extents) holds 512 samples, 8 batches and 13-17% of a training set;
    # the 3 KB run of bench/peers.py had 23 batches and 10% of its data per window: this is the
    # harsher mix
    EXTENTS: Config({}, plan=("extents", MIN_EXTENT_BYTES, 16)),
    # the same with four times the window: 2,048 samples, 32 batches, 51-68% of a training set
    "extents window 64": Config({}, plan=("extents", MIN_EXTENT_BYTES, 64)),
    # the extent order at its default window, each seed over its own placement: the order's
    # cost averaged over the partitions into extents a user's pack can draw, where every other
    # row measures it for the one partition of placement seed 0 (the order of a uniform row
    # does not depend on the placement)
    "extents placed by seed": Config({}, plan=("extents", MIN_EXTENT_BYTES, 16),
                                     placement="seed"),
    # the extent order at its default window over one other fixed placement (seed 1)
    "extents placement 1": Config({}, plan=("extents", MIN_EXTENT_BYTES, 16), placement=1),
}
SWEEP_CONFIGS = (UNIFORM, "accuracy budget 10%", DEFAULTS)
SCHEDULES = {"cosine": 12, "constant": 12}    # epochs; "cosine" decays to 0, "constant" does not


def sampler_defaults():
    keep = ("rep_factor", "importance", "pads", "coverage_epochs", "temper", "substitute", "draw",
            "stalls", "stall_budget")
    return {k: v for k, v in sc.ShadeSampler.defaults().items() if k in keep}


# ---- models and data ---------------------------------------------------------------------------
class SeqNet(nn.Module):
    """Embedding, one 1-D convolution, a max over time: a motif detector."""

    def __init__(self, vocab=64, dim=16, channels=32, num_classes=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, channels, 3, padding=1)
        self.out = nn.Linear(channels, num_classes)

    def forward(self, x):
        h = F.relu(self.conv(self.embed(x).transpose(1, 2)))
        return self.out(h.amax(2))


def make_model(spec, num_classes=10):
    if spec["model"] == "conv":
        c = spec["shape"][0]
        return nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(16 * (spec["shape"][1] // 4) ** 2,
                                                     num_classes))
    if spec["model"] == "seq":
        return SeqNet(num_classes=num_classes)
    return nn.Sequential(nn.Linear(int(np.prod(spec["shape"])), 128), nn.ReLU(),
                         nn.Linear(128, num_classes))


def to_tensor(x, spec):
    """Samples (numpy, the stored dtype) as the model's input."""
    x = np.asarray(x)
    if spec["model"] == "seq":
        return torch.from_numpy(x.astype(np.int64))
    t = (x.astype(np.float32) - 127.5) / 127.5 if x.dtype == np.uint8 else x.astype(np.float32)
    return torch.from_numpy(t).reshape((len(x),) + spec["shape"])


class BatchDecode:
    """CachedLoader's batch_transform: (B, PAD) uint8 rows -> the model's input batch."""

    def __init__(self, spec, nbytes):
        self.spec, self.nbytes = spec, nbytes

    def __call__(self, x):
        a = x.numpy()[:, :self.nbytes]
        return to_tensor(np.ascontiguousarray(a).view(self.spec["dtype"]), self.spec)


class Prepared:
    """One data set: its training set packed into a store under `folder`, its test tensors."""

    def __init__(self, name, folder, direct=False, device=None, placement_seed=0):
        self.name = name
        self.spec = fdata.DATASETS[name]()
        x, y = self.spec["train"]
        x = np.ascontiguousarray(x, dtype=self.spec["dtype"])
        self.train_x, self.train_y = to_tensor(x, self.spec), torch.from_numpy(np.asarray(y, np.int64))
        self.test_x = np.asarray(self.spec["test"][0])
        self.test_y = torch.from_numpy(np.asarray(self.spec["test"][1], dtype=np.int64))
        self.nbytes = x[0].nbytes
        pad = PAD if not direct else 4096   # O_DIRECT: one device request per sample
        items = [(x[i].tobytes().ljust(pad, b"\0"), int(y[i])) for i in range(len(x))]
        self.path = os.path.join(folder, f"{name}-{placement_seed}.shc")
        sc.pack(items, self.path, progress=False, seed=placement_seed)
        self.store = sc.PackedStore(self.path, direct=direct, device=device)
        self.n = len(self.store)
        self.capacity = sc.Cache.capacity_for(round(CACHE_FRACTION * self.n), self.store.lengths)
        self.placement_seed = placement_seed

    def close(self):
        """Close the store and remove its file."""
        self.store.close()
        os.unlink(self.path)

    def test_accuracy(self, model, chunk=20_000):
        model.eval()
        right = 0
        with torch.no_grad():
            for a in range(0, len(self.test_y), chunk):
                out = model(to_tensor(self.test_x[a:a + chunk], self.spec))
                right += int((out.argmax(1) == self.test_y[a:a + chunk]).sum())
            train = float((model(self.train_x).argmax(1) == self.train_y).float().mean())
        model.train()
        return 100.0 * right / len(self.test_y), 100.0 * train


# ---- one run -----------------------------------------------------------------------------------
def train_run(data: Prepared, label, schedule, seed, cache_name, prefetch=None,
              eval_each_epoch=False, on_epoch=None) -> dict:
    """Train configuration `label` from the seed's initial weights; returns its measurements.
    prefetch: a callable (node) -> context manager running the node's prefetcher (the node makes
    its order board), or None. on_epoch(epoch): called before each epoch, outside the
    timed part (the slow-store mode drops the store's pages there)."""
    cfg = CONFIGS[label]
    spec, bs, epochs = data.spec, data.spec["batch"], SCHEDULES[schedule]
    torch.manual_seed(seed)
    model = make_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)
    steps_total = epochs * -(-data.n // bs)
    sched = None
    if schedule == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda k: 0.5 * (1.0 + np.cos(np.pi * min(k, steps_total) / steps_total)))
    out = {"dataset": data.name, "label": label, "schedule": schedule, "seed": seed,
           "options": {**sampler_defaults(), **cfg.sampler}, "policy": cfg.policy,
           "placement_seed": data.placement_seed,
           "epoch_s": [], "acc": [], "wait_s": [], "per_epoch": []}
    with sc.Cache.create(cache_name, num_samples=data.n, capacity_bytes=data.capacity,
                         policy=cfg.policy, sizes=data.store.lengths) as cache:
        node = sc.Node(data.store, cache, read_plan=read_plan(cfg, data.store),
                       read_ahead=prefetch is not None)
        try:
            ds = node.dataset()
            sampler = sc.ShadeSampler(ds, batch_size=bs, seed=seed + cfg.order_seed, **cfg.sampler)
            loader = sc.CachedLoader(ds, batch_size=bs, sampler=sampler, num_workers=0,
                                     batch_transform=BatchDecode(spec, data.nbytes), **cfg.loader)
            ctx = prefetch(node) if prefetch is not None else _nothing()
            wsum = wcnt = 0.0
            with ctx:
                for epoch in range(epochs):
                    if on_epoch is not None:
                        on_epoch(epoch)
                    before = ds.stats()
                    t0 = time.perf_counter()
                    sampler.set_epoch(epoch)
                    for x, y, idx in loader:
                        losses = F.cross_entropy(model(x), y, reduction="none")
                        sampler.update(idx, losses.detach())
                        if cfg.weights:
                            w = sampler.weights(idx)
                            wsum += float(w.sum())
                            wcnt += len(w)
                            losses = losses * w
                        opt.zero_grad()
                        losses.mean().backward()
                        opt.step()
                        if sched is not None:
                            sched.step()
                    sampler.end_epoch()
                    out["epoch_s"].append(time.perf_counter() - t0)
                    out["wait_s"].append(ds.stats()["wait_s"] - before["wait_s"])
                    if eval_each_epoch or epoch == epochs - 1:
                        out["acc"].append(data.test_accuracy(model)[0])
            st = ds.stats()
            out["per_epoch"] = [{k: r.get(k, 0) for k in ("epoch", "samples", "hits",
                                                          "accuracy_repeats", "stall_deferrals",
                                                          "stall_repeats")}
                                for r in st.get("per_epoch", [])]
        finally:
            node.close()
    test_acc, train_acc = data.test_accuracy(model)
    cov = sampler.coverage()
    out["order"] = sampler.order_kind
    out["read_plan"] = node.read_plan.state()
    out.update(test_acc=test_acc, train_acc=train_acc, hit_ratio=st["hit_ratio"],
               bytes_read=st["bytes_read"], min_coverage=cov["min"],
               mean_weight=wsum / wcnt if wcnt else 1.0, wall_s=float(sum(out["epoch_s"])),
               test_n=len(data.test_y), threads=torch.get_num_threads())
    for k in ("accuracy_repeats", "stall_deferrals", "stall_repeats"):
        out[k] = int(sum(r[k] for r in out["per_epoch"]))
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def key(r):
    return f"{r['dataset']}|{r['schedule']}|{r['seed']}|{r['label']}"


def load(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(args):
    from tqdm import tqdm
    done = {key(r) for r in load(args.json)}
    # seed-major: an interrupted sweep leaves whole seeds, every cell with the same pairs
    todo = [(dsn, sch, seed, label) for seed in range(args.seeds) for dsn in args.datasets
            for sch in args.schedules for label in args.configs
            if f"{dsn}|{sch}|{seed}|{label}" not in done]
    print(f"{len(todo)} runs to do ({len(done)} already in {args.json})", flush=True)
    prepared = {}
    with tempfile.TemporaryDirectory(prefix="sc-fidelity-", dir=FAST_DIR) as tmp, \
            open(args.json, "a") as log:
        for k, (dsn, sch, seed, label) in enumerate(tqdm(todo, desc="fidelity runs", unit="run",
                                                         mininterval=10, file=sys.stdout)):
            placement = seed if CONFIGS[label].placement == "seed" else CONFIGS[label].placement
            if (dsn, placement) not in prepared:
                for old in [p for p in prepared if p[0] == dsn and p[1] != 0]:
                    prepared.pop(old).close()   # one seed's own placement at a time
                prepared[dsn, placement] = Prepared(dsn, tmp, placement_seed=placement)
            r = train_run(prepared[dsn, placement], label, sch, seed, f"sc-fid-{os.getpid()}-{k}")
            log.write(json.dumps(r) + "\n")
            log.flush()
    return 0


# ---- statistics and report ---------------------------------------------------------------------
def paired(deltas):
    """(mean, standard error, paired t) of per-seed differences; se and t are nan for one seed."""
    d = np.asarray(deltas, dtype=float)
    if d.size < 2:
        return (float(d.mean()) if d.size else float("nan")), float("nan"), float("nan")
    se = float(d.std(ddof=1) / np.sqrt(d.size))
    if se == 0:   # the same difference in every seed (0: the same accuracy, seed for seed)
        return float(d.mean()), 0.0, (0.0 if d.mean() == 0 else float("inf") * np.sign(d.mean()))
    return float(d.mean()), se, float(d.mean()) / se


class Results:
    """The runs of a sweep by (data set, schedule, label) and seed."""

    def __init__(self, runs):
        self.runs = runs
        self.by = {}
        for r in runs:
            self.by.setdefault((r["dataset"], r["schedule"], r["label"]), {})[r["seed"]] = r
        self.datasets = [d for d in fdata.DATASETS if any(r["dataset"] == d for r in runs)]
        self.labels = [c for c in CONFIGS if c != UNIFORM and any(r["label"] == c for r in runs)]

    def cell(self, ds, sch, label):
        """Paired statistics of `label` against uniform on (ds, sch), or None if not run."""
        rs, uni = self.by.get((ds, sch, label)), self.by.get((ds, sch, UNIFORM), {})
        if not rs:
            return None
        seeds = sorted(set(rs) & set(uni))
        d = [rs[s]["test_acc"] - uni[s]["test_acc"] for s in seeds]
        mean, se, t = paired(d)
        # against the mean of two uniform permutations per seed (uniform and uniform
        # reshuffled): a baseline with half the order's own noise (nan without the second)
        other = self.by.get((ds, sch, RESHUFFLED), {})
        both = [s for s in seeds if s in other]
        mean2, se2, t2 = paired([rs[s]["test_acc"] - (uni[s]["test_acc"] + other[s]["test_acc"]) / 2
                                 for s in both]) if label != RESHUFFLED else (np.nan,) * 3
        u = np.array([uni[s]["test_acc"] for s in seeds])
        return dict(n=len(seeds), mean=mean, se=se, t=t, n2=len(both), mean2=mean2, se2=se2, t2=t2,
                    uniform=float(u.mean()) if u.size else
                    float("nan"), uniform_se=float(u.std(ddof=1) / np.sqrt(u.size)) if u.size > 1
                    else float("nan"),
                    noise=fdata.test_noise(float(u.mean()), rs[seeds[0]]["test_n"]) if seeds
                    else float("nan"),
                    hit=float(np.mean([r["hit_ratio"] for r in rs.values()])),
                    uniform_hit=float(np.mean([r["hit_ratio"] for r in uni.values()])) if uni
                    else float("nan"),
                    coverage=float(np.mean([r["min_coverage"] for r in rs.values()])),
                    accuracy_repeats=float(np.mean([r.get("accuracy_repeats", 0) for r in rs.values()])),
                    stall_repeats=int(sum(r.get("stall_repeats", 0) for r in rs.values())),
                    stall_deferrals=int(sum(r.get("stall_deferrals", 0) for r in rs.values())),
                    options=rs[seeds[0]]["options"] if seeds else {})


def _pm(mean, se, fmt="{:+.2f}"):
    return f"{fmt.format(mean)} ± {se:.2f}" if np.isfinite(se) else fmt.format(mean)


def _vs_two(c) -> str:
    if not c["n2"] or not np.isfinite(c["mean2"]):
        return "-"
    return f"{_pm(c['mean2'], c['se2'])} ({c['t2']:+.1f}, {c['n2']} seeds)"


def table(res: Results) -> str:
    out = ["| data set (kind) | schedule | uniform accuracy % (± s.e.) | test noise | "
           "configuration | seeds | Δ accuracy (± s.e.) | paired t | Δ vs two uniform permutations "
           "(t) | hit ratio (uniform) | repeats / epoch (accuracy) | stall repeats |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ds in res.datasets:
        for sch in SCHEDULES:
            for label in res.labels:
                c = res.cell(ds, sch, label)
                if c is None:
                    continue
                n_ep = SCHEDULES[sch]
                out.append(f"| {ds} ({fdata.KINDS[ds]}) | {sch} | {_pm(c['uniform'], c['uniform_se'], '{:.2f}')} | "
                           f"{c['noise']:.2f} | {label} | {c['n']} | {_pm(c['mean'], c['se'])} | "
                           f"{c['t']:+.1f} | {_vs_two(c)} | {c['hit']:.3f} ({c['uniform_hit']:.3f}) | "
                           f"{c['accuracy_repeats'] / n_ep:.0f} | {c['stall_repeats']} |")
    return "\n".join(out)


def checks(res: Results, label=DEFAULTS):
    """Fast store, defaults, every data set and schedule: mean Δ >= -0.2, paired t >= -2,
    >= 12 seeds, no stall repeats."""
    out = []
    for ds in res.datasets:
        for sch in SCHEDULES:
            c = res.cell(ds, sch, label)
            if c is None:
                continue
            ok = c["mean"] >= -0.2 and (not np.isfinite(c["t"]) or c["t"] >= -2.0)
            out.append((f"{ds} {sch}: mean Δ >= -0.2 points and paired t >= -2", ok,
                        f"{_pm(c['mean'], c['se'])}, t = {c['t']:+.1f}, {c['n']} seeds"))
            out.append((f"{ds} {sch}: at least 12 paired seeds", c["n"] >= 12, f"{c['n']}"))
            out.append((f"{ds} {sch}: zero stall repeats", c["stall_repeats"] == 0,
                        f"{c['stall_repeats']}"))
            out.append((f"{ds} {sch}: test-set sampling noise <= {fdata.TEST_NOISE_POINTS} points",
                        c["noise"] <= fdata.TEST_NOISE_POINTS, f"{c['noise']:.3f}"))
    return out


def plot(res: Results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(res.datasets) * len(SCHEDULES)), 4.2))
    cells = [(ds, sch) for ds in res.datasets for sch in SCHEDULES]
    width = 0.8 / max(1, len(res.labels))
    for j, label in enumerate(res.labels):
        xs, ms, ses = [], [], []
        for i, (ds, sch) in enumerate(cells):
            c = res.cell(ds, sch, label)
            if c is not None:
                xs.append(i + (j - (len(res.labels) - 1) / 2) * width)
                ms.append(c["mean"])
                ses.append(c["se"] if np.isfinite(c["se"]) else 0.0)
        ax.errorbar(xs, ms, yerr=ses, marker="o", linestyle="none", capsize=3, label=label)
    ax.axhline(0.0, color="grey", linewidth=0.6)
    ax.axhline(-0.2, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"{ds}\n{sch}" for ds, sch in cells], fontsize=8)
    ax.set_ylabel("Δ test accuracy vs uniform\n(points, mean ± s.e. over paired seeds)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_section(md, section, content):
    """Replaces `section` (up to the next heading of the same or a higher level) in `md`, or
    appends it."""
    with open(md) as f:
        text = f.read()
    level = section.split(" ")[0]
    block = section + "\n\n" + content.strip() + "\n"
    if section + "\n" in text:
        start = text.index(section + "\n")
        end = len(text)
        for h in ("\n" + "#" * k + " " for k in range(1, len(level) + 1)):
            nxt = text.find(h, start + len(section))
            if nxt >= 0:
                end = min(end, nxt + 1)
        text = text[:start] + block + "\n" + text[end:].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    with open(md, "w") as f:
        f.write(text)


def report(args):
    # uniform (every row's baseline) and uniform reshuffled (the two-permutation column) always
    listed = None if args.configs is None else set(args.configs) | {UNIFORM, RESHUFFLED}
    res = Results([r for r in load(args.json) if r["dataset"] in args.datasets
                   and (listed is None or r["label"] in listed)])
    tab = table(res)
    chk = checks(res, args.check)
    print(tab)
    print()
    for name, ok, val in chk:
        print(f"{'PASS' if ok else 'FAIL'}: {name} (measured {val})")
    plot(res, args.png)
    print(f"\nplot: {args.png}")
    if args.md:
        d = sampler_defaults()
        seeds = sorted({r["seed"] for r in res.runs})
        js = os.path.relpath(args.json, os.path.dirname(HERE))
        files = "" if args.json == DEFAULT_JSON else f" --json {js}"
        shown = "" if args.png == DEFAULT_PNG else f" --png {os.path.relpath(args.png, os.path.dirname(HERE))}"
        check = "" if args.check == DEFAULTS else f" --check {args.check!r}"
        check += "" if args.configs is None else f" --configs {','.join(args.configs)!r}"
        body = [f"`nice -n 10 python bench/fidelity.py run{files} --configs "
                f"{','.join([UNIFORM] + res.labels)!r}` then `python bench/fidelity.py report{files}"
                f"{shown}{check} --md BENCHMARKS.md` ({len(res.runs)} runs, seeds {seeds[0]}-{seeds[-1]}; "
                f"{args.note}). Real training through a PackedStore (in tmpfs: the fast "
                f"store), a shared-memory Cache "
                f"({CACHE_FRACTION:.0%} of the samples), CachedLoader and ShadeSampler; the data "
                f"sets are described in bench/fidelity_datasets.py. SGD with momentum 0.9, lr "
                f"{LR}, {SCHEDULES['cosine']} epochs, at a constant rate or decaying to 0 along a "
                f"cosine. Δ accuracy: configuration minus uniform sampling on the same seed (same "
                f"initial weights, same steps), mean ± standard error over the seeds, paired t = "
                f"mean / standard error. Test noise: the sampling noise of the uniform accuracy on "
                f"that test set (points). \"defaults\": ShadeSampler's defaults "
                f"({', '.join(f'{k}={v!r}' for k, v in d.items())}); \"uniform\": a seeded "
                f"permutation per epoch, nothing reordered or repeated, static cache. Repeats / "
                f"epoch: cached samples trained again in place of misses by the accuracy budget, "
                f"mean per epoch. Stall repeats: summed over every seed and epoch (a fast store: "
                f"no miss waits long enough to be worth one).",
                "", f"![fidelity]({os.path.relpath(args.png, os.path.dirname(os.path.abspath(args.md)))})",
                "", tab, "", f"Acceptance of \"{args.check}\" (fast store):", ""]
        body += [f"- {'PASS' if ok else 'FAIL'}: {n} (measured {v})" for n, ok, v in chk]
        write_section(args.md, args.section, "\n".join(body))
        print(f"{args.md} updated")
    return 0 if chk and all(ok for _, ok, _ in chk) else 1


# ---- slow-store mode ---------------------------------------------------------------------------
SLOW_CONFIGS = (UNIFORM, DEFAULTS, "no repeats")
# The disk's reads per second at most: a cloud disk's rate. For the small models here, a disk fast
# enough to leave uniform only 3x I/O-bound would serve a sample in tens of microseconds, as fast
# as memory: not storage the stall budget waits on (shadecache/sampling/stalls.py, STORAGE_S).
MAX_IOPS = 2000
SLOW_SCHEDULE = "cosine"


def _prefetcher(node):
    return node.prefetcher()


def _drop_pages(path):
    """The store file's pages out of the page cache (this file only: the machine is shared)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def slow(args):
    """The slow-store mode: per data set, the training set packed on a throttled disk
    (bench/throttled_disk.py: ext4 on a loop device, reads limited by the cgroup v1 blkio
    controller, read-ahead off, the store read with O_DIRECT and its pages dropped each epoch),
    the node's prefetcher reading ahead, the same cache size for every configuration. The disk's
    IOPS limit is set from this machine's measured compute time so that uniform training is
    about --io-bound times slower than the same run on a fast store, at most MAX_IOPS
    (measured: the fast runs are in the log)."""
    import signal
    import throttled_disk
    from tqdm import tqdm
    # a SIGTERM unwinds (the disk's mount, loop device and cgroup are removed on the way out)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = throttled_disk.unavailable()
    if why:
        print(f"slow-store mode cannot run here: {why}")
        return 2
    done = {key(r) + f"|{r['store']}" for r in load(args.json)}
    with open(args.json, "a") as log:
        for dsn in args.datasets:
            with tempfile.TemporaryDirectory(prefix="sc-fidelity-slow-", dir=FAST_DIR) as tmp:
                fast = Prepared(dsn, tmp)

                def one(data, label, seed, store, prefetch=None, on_epoch=None, extra=None,
                        disk=None):
                    k = f"{dsn}|{SLOW_SCHEDULE}|{seed}|{label}|{store}"
                    if k in done:
                        return None
                    before = disk.counters() if disk is not None else None
                    r = train_run(data, label, SLOW_SCHEDULE, seed,
                                  f"sc-fids-{os.getpid()}-{len(done)}", prefetch=prefetch,
                                  eval_each_epoch=True, on_epoch=on_epoch)
                    r.update(store=store, **(extra or {}))
                    if disk is not None:   # what the throttled device itself served
                        seen = disk.counters() - before
                        r.update(device_bytes=seen.bytes, device_requests=seen.requests)
                    log.write(json.dumps(r) + "\n")
                    log.flush()
                    done.add(k)
                    return r
                # compute alone: uniform from the fast store (tmpfs), seed 0, sets the IOPS
                one(fast, UNIFORM, 0, "fast")
                ref = [r for r in load(args.json) if r["dataset"] == dsn and r["store"] == "fast"
                       and r["seed"] == 0][0]
                per_sample = ref["wall_s"] / (SCHEDULES[SLOW_SCHEDULE] * fast.n)
                iops = int(max(200, min(MAX_IOPS, (1 - CACHE_FRACTION)
                                        / (args.io_bound * per_sample))))
                size = fast.n * 4096 * 2 + (64 << 20)
                with throttled_disk.ThrottledDisk(size, read_iops=iops, read_bps=1 << 30,
                                                  read_ahead_kb=0) as disk:
                    data = Prepared(dsn, disk.mount, direct=True)
                    _drop_pages(data.path)
                    extra = {"read_iops": iops, "disk": disk.describe(),
                             "io_bound_target": args.io_bound}

                    def on_epoch(epoch, path=data.path):
                        _drop_pages(path)
                    todo = [(seed, label) for seed in range(args.seeds) for label in
                            ["fast-" + UNIFORM] + args.configs]
                    try:
                        for seed, label in tqdm(todo, desc=f"slow store: {dsn} ({iops} IOPS)",
                                                unit="run", file=sys.stdout):
                            if label.startswith("fast-"):
                                one(fast, UNIFORM, seed, "fast")
                                continue
                            disk.enter()          # this process and its prefetcher: throttled
                            try:
                                one(data, label, seed, "slow", prefetch=_prefetcher,
                                    on_epoch=on_epoch, extra=extra, disk=disk)
                            finally:
                                disk.leave()
                    finally:
                        data.store.close()    # an open file keeps the disk from unmounting
    return 0


def _time_to(r, target):
    """Seconds of training (cumulative epoch wall time) until the test accuracy first reached
    `target`, or None."""
    t = 0.0
    for s, a in zip(r["epoch_s"], r["acc"]):
        t += s
        if a >= target:
            return t
    return None


def _target(runs) -> str:
    """The I/O-bound factor the slow runs aimed at (--io-bound), as recorded with them."""
    got = sorted({r["io_bound_target"] for r in runs if "io_bound_target" in r})
    return "/".join(f"{v:g}" for v in got) or "?"


def is_default(r) -> bool:
    """Whether run r was made with ShadeSampler's current defaults (its recorded options)."""
    d = sampler_defaults()
    return r["label"] != UNIFORM and all(r["options"].get(k) == v for k, v in d.items())


def slow_cells(runs):
    """Per (data set, configuration): paired (by seed) figures against uniform on the slow store,
    and uniform's I/O-bound factor against the fast store."""
    by = {}
    for r in runs:
        by.setdefault((r["dataset"], r["store"], r["label"]), {})[r["seed"]] = r
    out = {}
    labels = [c for c in CONFIGS if c != UNIFORM and any(r["label"] == c for r in runs)]
    for ds in fdata.DATASETS:
        uni, fast = by.get((ds, "slow", UNIFORM), {}), by.get((ds, "fast", UNIFORM), {})
        for label in labels:
            cfg = by.get((ds, "slow", label), {})
            seeds = sorted(set(uni) & set(cfg))
            if not seeds:
                continue
            bound = [uni[s]["wall_s"] / fast[s]["wall_s"] for s in seeds if s in fast]
            reach = [_time_to(cfg[s], uni[s]["test_acc"] - 0.3) for s in seeds]
            hit = [t / uni[s]["wall_s"] for s, t in zip(seeds, reach) if t is not None]

            def mean(f, rs=cfg):
                return float(np.mean([f(rs[s]) for s in seeds]))
            out[(ds, label)] = dict(
                seeds=len(seeds), default=all(is_default(cfg[s]) for s in seeds),
                wall_ratio=paired([cfg[s]["wall_s"] / uni[s]["wall_s"] for s in seeds]),
                dacc=paired([cfg[s]["test_acc"] - uni[s]["test_acc"] for s in seeds]),
                io_bound=float(np.mean(bound)) if bound else float("nan"),
                uniform_wall=mean(lambda r: r["wall_s"], uni), wall=mean(lambda r: r["wall_s"]),
                reach=(float(np.mean(hit)) if hit else None, len(hit)),
                iops=uni[seeds[0]].get("read_iops"),
                order="/".join(sorted({cfg[s].get("order", "uniform") for s in seeds})),
                stall_repeats=mean(lambda r: r["stall_repeats"]),
                stall_deferrals=mean(lambda r: r["stall_deferrals"]),
                accuracy_repeats=mean(lambda r: r["accuracy_repeats"]),
                samples=mean(lambda r: sum(p.get("samples", 0) for p in r["per_epoch"])),
                reads=(mean(lambda r: r["device_requests"], uni), mean(lambda r: r["device_requests"])))
    return out


def slow_report(args):
    cells = slow_cells(load(args.json))
    lines = ["| data set | configuration | seeds | read IOPS | uniform I/O-bound (slow / fast "
             "wall) | wall s uniform / this | wall ratio (± s.e.) | Δ final accuracy (± s.e., t) | "
             "time to uniform's final − 0.3 (of uniform's wall; seeds there) | repeats per run "
             "accuracy / stall (of samples) | stall deferrals per run | device reads uniform / "
             "this |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    chk = []
    for (ds, label), c in cells.items():
        (wr, wse, _), (da, dse, dt) = c["wall_ratio"], c["dacc"]
        reach = ("not reached" if c["reach"][0] is None
                 else f"{c['reach'][0]:.2f}× ({c['reach'][1]}/{c['seeds']})")
        name = f"**{label}** (the defaults)" if c["default"] else label
        name += f", {c['order']} order"
        lines.append(f"| {ds} | {name} | {c['seeds']} | {c['iops']} | {c['io_bound']:.2f}× | "
                     f"{c['uniform_wall']:.1f} / {c['wall']:.1f} | {_pm(wr, wse, '{:.2f}')}× | "
                     f"{_pm(da, dse)} (t = {dt:+.1f}) | {reach} | {c['accuracy_repeats']:.0f} / "
                     f"{c['stall_repeats']:.0f} (of {c['samples']:.0f}) | "
                     f"{c['stall_deferrals']:.0f} | {c['reads'][0]:.0f} / {c['reads'][1]:.0f} |")
        if c["default"]:
            chk.append((f"{ds}: uniform >= 2x I/O-bound", c["io_bound"] >= 2.0,
                        f"{c['io_bound']:.2f}x"))
            chk.append((f"{ds}: defaults <= 0.75x uniform's wall time", wr <= 0.75, f"{wr:.2f}x"))
            chk.append((f"{ds}: defaults' final accuracy >= uniform's - 0.5", da >= -0.5,
                        f"{da:+.2f}"))
    tab = "\n".join(lines)
    print(tab)
    for n, ok, v in chk:
        print(f"{'PASS' if ok else 'FAIL'}: {n} (measured {v})")
    if args.md:
        runs = load(args.json)
        body = [f"`python bench/fidelity.py slow` then `python bench/fidelity.py slow-report --md "
                f"BENCHMARKS.md` ({args.note}). The training set on a throttled disk "
                f"(bench/throttled_disk.py: ext4 on a loop device, reads limited by the cgroup v1 "
                f"blkio controller to the IOPS given, read-ahead off, samples padded to 4 KiB and "
                f"read with O_DIRECT, the store's pages dropped before every epoch), the node's "
                f"prefetcher reading the published order ahead, a cache of "
                f"{CACHE_FRACTION:.0%} of the samples, CachedLoader, the {SLOW_SCHEDULE} schedule "
                f"({SCHEDULES[SLOW_SCHEDULE]} epochs). The IOPS limit is set per data set from "
                f"the compute time measured on this machine (uniform from a store in tmpfs, seed 0) "
                f"so that uniform sampling is about {_target(runs)}× I/O-bound, at most "
                f"{MAX_IOPS} reads/s (a cloud disk's rate); the column gives "
                f"the ratio measured seed by seed. Wall: the training loops' time for the same "
                f"epochs (evaluation excluded); ratios and Δ accuracy paired by seed (mean ± "
                f"standard error). Time to uniform's final accuracy − 0.3 points: this "
                f"configuration's training time until its test accuracy first reached it, as a "
                f"fraction of uniform's whole run. Device reads: requests the throttled device "
                f"completed per run. The order is the one the sampler drew (\"auto\", the default, "
                f"draws the extent order where the store is IOPS-bound).", "", tab, "", "Acceptance (slow store, the defaults):", ""]
        body += [f"- {'PASS' if ok else 'FAIL'}: {n} (measured {v})" for n, ok, v in chk]
        write_section(args.md, SLOW_SECTION, "\n".join(body))
        print(f"{args.md} updated")
    return 0 if chk and all(ok for _, ok, _ in chk) else 1


# ---- command line ------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lst = lambda s: [x for x in s.split(",") if x]   # noqa: E731
    r = sub.add_parser("run", help="run (or continue) the sweep; one JSON line per run")
    r.add_argument("--json", default=DEFAULT_JSON)
    r.add_argument("--datasets", type=lst, default=list(fdata.DATASETS))
    r.add_argument("--schedules", type=lst, default=list(SCHEDULES))
    r.add_argument("--configs", type=lst, default=list(SWEEP_CONFIGS))
    r.add_argument("--seeds", type=int, default=12)
    r.set_defaults(func=run)
    q = sub.add_parser("report", help="tables, acceptance and the plot of a sweep")
    q.add_argument("--json", default=DEFAULT_JSON)
    q.add_argument("--png", default=DEFAULT_PNG)
    q.add_argument("--md", default=None, help="write the section into this Markdown file")
    q.add_argument("--datasets", type=lst, default=list(fdata.DATASETS))
    q.add_argument("--note", default="", help="a line for the Markdown (e.g. how long it took)")
    q.add_argument("--configs", type=lst, default=None,
                   help="the configurations shown (default: every one run)")
    q.add_argument("--check", default=DEFAULTS, choices=list(CONFIGS),
                   help="the configuration whose acceptance is checked")
    q.add_argument("--section", default=SECTION, help="the Markdown heading to write")
    q.set_defaults(func=report)
    w = sub.add_parser("slow", help="slow-store mode: uniform and defaults on a throttled disk "
                                    "(root)")
    w.add_argument("--json", default=os.path.join(HERE, "fidelity-slow.jsonl"))
    w.add_argument("--datasets", type=lst, default=list(fdata.DATASETS))
    w.add_argument("--seeds", type=int, default=6)
    w.add_argument("--configs", type=lst, default=list(SLOW_CONFIGS))
    w.add_argument("--io-bound", type=float, default=3.0,
                   help="uniform's wall time on the slow store over the fast store's, aimed at")
    w.set_defaults(func=slow)
    v = sub.add_parser("slow-report", help="the slow-store table and acceptance")
    v.add_argument("--json", default=os.path.join(HERE, "fidelity-slow.jsonl"))
    v.add_argument("--md", default=None)
    v.add_argument("--note", default="")
    v.set_defaults(func=slow_report)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for name in getattr(args, "datasets", []):
        if name not in fdata.DATASETS:
            p.error(f"unknown data set {name!r}; known: {', '.join(fdata.DATASETS)}")
    for name in getattr(args, "schedules", []):
        if name not in SCHEDULES:
            p.error(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    for label in getattr(args, "configs", None) or []:
        if label not in CONFIGS:
            p.error(f"unknown configuration {label!r}; known: {', '.join(CONFIGS)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
