"""Sampling fidelity: what SHADE's biases cost in accuracy, per data set, and what buys
the hit ratio back safely.

Every run is real training through the real parts: the training set is packed into a PackedStore,
read through a real shared-memory Cache (policy "importance" for SHADE rows, "static" for the
uniform baseline) by CachedDataset in a stock DataLoader, ordered by the real ShadeSampler. Each
(data set, schedule, seed) starts every configuration from the same initial weights, and every
configuration makes the same number of optimizer steps, so Δ accuracy is paired.

Data sets (nothing is downloaded: scikit-learn ships digits, the others are generated here):
  digits      scikit-learn's 8x8 handwritten digits, 1197 train / 600 test, a small conv net, no
              augmentation (it memorizes the training set)
  gratings    shadecache.demo.synthetic 16x16 gratings, 4000 / 4000, an MLP, augmentation after the
              cache (it does not memorize)
  gratings-s  other gratings (data seed 1), 3000 / 4000, the same MLP, no augmentation (memorizes)
  tabular     sklearn make_classification, 32 features, 10 classes, 3% flipped labels,
              3000 / 2000, an MLP, no augmentation
Schedules: "cosine" (SGD with momentum, cosine decay to 0 over 12 epochs) and "short" (the same
SGD at a constant rate, stopped after 5 epochs).

    nice -n 10 python bench/fidelity.py run     # the sweep (resumable; bench/fidelity.jsonl)
    python bench/fidelity.py report --md BENCHMARKS.md    # table, PNG, BENCHMARKS.md section
"""
import argparse
import functools
import json
import os
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shadecache as sc  # noqa: E402
from shadecache.demo import synthetic  # noqa: E402
from shadecache.demo.experiment import Augment  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## Sampling fidelity"

# ---- data sets ---------------------------------------------------------------------------------


def _digits():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = d.images.astype(np.uint8)                       # 0..16
    perm = np.random.default_rng(0).permutation(len(x))
    tr, te = perm[:1197], perm[1197:]
    return dict(train=(x[tr], d.target[tr]), test=(x[te], d.target[te]), shape=(1, 8, 8),
                scale=16.0, model="conv", augment=None, batch=32)


def _gratings(n, seed, augment):
    x, y = synthetic.make_images(n, seed=seed)
    tx, ty = synthetic.make_images(4000, seed=seed + 10_000)
    return dict(train=(x, y), test=(tx, ty), shape=(256,), scale=None, model="mlp",
                augment=augment, batch=64)


def _tabular():
    from sklearn.datasets import make_classification
    x, y = make_classification(n_samples=5000, n_features=32, n_informative=16, n_redundant=4,
                               n_classes=10, n_clusters_per_class=2, flip_y=0.03,
                               class_sep=1.2, random_state=0)
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
    return dict(train=(x[:3000], y[:3000]), test=(x[3000:], y[3000:]), shape=(32,), scale=None,
                model="mlp", augment=None, batch=64)


DATASETS = {
    "digits": _digits,
    "gratings": functools.partial(_gratings, 4000, 0, {}),
    "gratings-s": functools.partial(_gratings, 3000, 1, None),
    "tabular": _tabular,
}
# what the published tables cover ("gratings", augmented, is slow here and runs only when named)
MEASURED = ("digits", "gratings-s", "tabular")
SCHEDULES = {"cosine": 12, "short": 5}          # epochs; "short" keeps a constant rate
LR = 0.05
PAD = 2048          # bytes per stored sample (see Prepared)


def decode_fn(data, dtype, shape, scale):
    a = np.frombuffer(data, dtype=dtype, count=int(np.prod(shape)))
    if scale is not None:
        a = a.astype(np.float32) / scale
    elif a.dtype == np.uint8:
        a = (a.astype(np.float32) - 127.5) / 127.5
    return torch.from_numpy(np.array(a, dtype=np.float32)).reshape(shape)


def to_tensor(x, spec):
    x = np.asarray(x)
    if spec["scale"] is not None:
        t = x.astype(np.float32) / spec["scale"]
    elif x.dtype == np.uint8:
        t = (x.astype(np.float32) - 127.5) / 127.5
    else:
        t = x.astype(np.float32)
    return torch.from_numpy(t).reshape((len(x),) + spec["shape"])


def make_model(spec, num_classes=10):
    if spec["model"] == "conv":
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(32 * 2 * 2, num_classes))
    d = int(np.prod(spec["shape"]))
    return nn.Sequential(nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, num_classes))


class Prepared:
    """One data set packed into a store in a temporary folder, with its test tensors."""

    def __init__(self, name, tmp):
        self.name = name
        self.spec = DATASETS[name]()
        x, y = self.spec["train"]
        self.train_x = to_tensor(x, self.spec)
        self.train_y = torch.from_numpy(np.asarray(y, dtype=np.int64))
        self.test_x = to_tensor(self.spec["test"][0], self.spec)
        self.test_y = torch.from_numpy(np.asarray(self.spec["test"][1], dtype=np.int64))
        self.dtype = np.asarray(x).dtype
        # every sample is padded to PAD bytes: the engine hands out memory in 64 KB slab pages,
        # so a cache of 5% of a data set of 64-byte digits could not be made that small
        items = [(np.ascontiguousarray(x[i]).tobytes().ljust(PAD, b"\0"), int(y[i]))
                 for i in range(len(x))]
        self.path = os.path.join(tmp, f"{name}.shc")
        sc.pack(items, self.path, progress=False)
        self.store = sc.PackedStore(self.path)
        self.n = len(self.store)
        self.item_bytes = len(items[0][0])
        self._capacity = {}

    def capacity(self, fraction):
        if fraction not in self._capacity:
            self._capacity[fraction] = sc.Cache.capacity_for(max(1, round(fraction * self.n)),
                                                             self.store.lengths)
        return self._capacity[fraction]


# ---- configurations ----------------------------------------------------------------------------
# label -> (ShadeSampler options, multiply the loss by sampler.weights(idx)). "default" is whatever
# ShadeSampler() does without options, recorded with each run.
CONFIGS = {
    "uniform": (dict(importance=False, pads=False, rep_factor=0.0), False),
    "default": ({}, False),
    "default + weights": ({}, True),
    "SHADE rep 1 (old default)": (dict(importance=True, temper=1.0, rep_factor=1.0,
                                       substitute=None), False),
    "SHADE rep 1 + weights": (dict(importance=True, temper=1.0, rep_factor=1.0,
                                   substitute=None), True),
    "SHADE ordering only (rep 0)": (dict(importance=True, temper=1.0, rep_factor=0.0,
                                         substitute=None), False),
    "reorder only (cached first)": (dict(importance=False, rep_factor=0.0), False),
    "permutation + substitute 5%": (dict(importance=False, rep_factor=1.0, substitute=0.05),
                                    False),
    "permutation + substitute 10%": (dict(importance=False, rep_factor=1.0, substitute=0.10),
                                     False),
    "permutation + substitute 10% + weights": (dict(importance=False, rep_factor=1.0,
                                                    substitute=0.10), True),
    "permutation + substitute 20%": (dict(importance=False, rep_factor=2.0, substitute=0.20),
                                     False),
    "temper 0.5 + substitute 10%": (dict(importance=True, temper=0.5, rep_factor=1.0,
                                         substitute=0.10), False),
}


def sampler_defaults():
    keep = ("rep_factor", "importance", "pads", "coverage_epochs", "temper", "substitute", "draw")
    return {k: v for k, v in sc.ShadeSampler.defaults().items() if k in keep}


# ---- one run -----------------------------------------------------------------------------------


def train_run(data: Prepared, label, schedule, seed, fraction, cache_name, train=True) -> dict:
    """Train one configuration from the seed's initial weights; returns its measurements.
    train=False replays the same sampler order through the cache without a model (the uniform
    sampler's order and the static policy do not depend on the losses)."""
    opts, use_w = CONFIGS[label]
    spec = data.spec
    epochs = SCHEDULES[schedule]
    bs = spec["batch"]
    torch.manual_seed(seed)
    model = make_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)
    steps_total = epochs * -(-data.n // bs)
    sched = None
    if schedule == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda k: 0.5 * (1.0 + np.cos(np.pi * min(k, steps_total) / steps_total)))
    policy = "static" if label == "uniform" else "importance"
    aug = spec["augment"]
    transform = None
    if aug is not None:
        side = int(round(np.sqrt(np.prod(spec["shape"]))))
        transform = Augment(side, **aug)
    with sc.Cache.create(cache_name, num_samples=data.n, capacity_bytes=data.capacity(fraction),
                         policy=policy, sizes=data.store.lengths) as cache:
        ds = sc.CachedDataset(data.store, cache, decode=functools.partial(
            decode_fn, dtype=data.dtype, shape=spec["shape"], scale=spec["scale"]),
            transform=transform)
        sampler = sc.ShadeSampler(ds, cache=cache, batch_size=bs, seed=seed, **opts)
        loader = DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=0)
        wsum = wcnt = 0.0
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y, idx in loader:
                if not train:
                    continue
                losses = F.cross_entropy(model(x), y, reduction="none")
                sampler.update(idx, losses.detach())
                if use_w:
                    w = sampler.weights(idx)
                    wsum += float(w.sum())
                    wcnt += len(w)
                    losses = losses * w
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
                if sched is not None:
                    sched.step()
            sampler.end_epoch(None if train else 0.0)
        st = ds.stats()
        cov = sampler.coverage()
        items = cache.stats()["items"]
    out = {"dataset": data.name, "label": label, "schedule": schedule, "seed": seed,
           "fraction": fraction, "hit_ratio": st["hit_ratio"], "bytes_read": st["bytes_read"],
           "min_coverage": cov["min"], "cached_fraction": items / data.n,
           "mean_weight": wsum / wcnt if wcnt else 1.0,
           "options": {k: v for k, v in {**sampler_defaults(), **opts}.items()}}
    if train:
        model.eval()
        with torch.no_grad():
            out["test_acc"] = 100.0 * (model(data.test_x).argmax(1) == data.test_y).float().mean().item()
            out["train_acc"] = 100.0 * (model(data.train_x).argmax(1) == data.train_y).float().mean().item()
    return out


def key(r):
    return f"{r['dataset']}|{r['schedule']}|{r['seed']}|{r['fraction']}|{r['label']}|{int(r.get('test_acc') is not None)}"


def run(args):
    from tqdm import tqdm
    done = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    done[key(r)] = r
    todo = []
    for dsn in args.datasets:
        for sch in args.schedules:
            for seed in range(args.seeds):
                for label in args.configs:
                    if label == "uniform":
                        # accuracy: one training run (the cache does not change a uniform order);
                        # uniform + static hit ratio at every size: replays of the same order
                        todo.append((dsn, sch, seed, 0.10, label, True))
                        todo += [(dsn, sch, seed, s, label, False) for s in args.sizes if s != 0.10]
                    else:
                        todo += [(dsn, sch, seed, s, label, True) for s in args.sizes]
    todo = [t for t in todo if f"{t[0]}|{t[1]}|{t[2]}|{t[3]}|{t[4]}|{int(t[5])}" not in done]
    print(f"{len(todo)} runs to do ({len(done)} already in {args.json})", flush=True)
    prepared = {}
    with tempfile.TemporaryDirectory(prefix="sc-fidelity-") as tmp, open(args.json, "a") as log:
        for k, (dsn, sch, seed, frac, label, train) in enumerate(
                tqdm(todo, desc="fidelity runs", unit="run", mininterval=5)):
            if dsn not in prepared:
                prepared[dsn] = Prepared(dsn, tmp)
            r = train_run(prepared[dsn], label, sch, seed, frac, f"sc-fid-{os.getpid()}-{k}",
                          train=train)
            log.write(json.dumps(r) + "\n")
            log.flush()
    return 0


# ---- report ------------------------------------------------------------------------------------


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ms(a, fmt="{:+.2f}"):
    a = np.asarray(a, dtype=float)
    sd = a.std(ddof=1) if a.size > 1 else 0.0
    return f"{fmt.format(a.mean())} ± {sd:.2f}"


class Results:
    """The runs of a sweep, indexed; Δ accuracy is paired by seed against the uniform run of the
    same data set and schedule; hit ratios are compared with uniform + static at the same size."""

    def __init__(self, runs):
        self.runs = runs
        self.by = {}
        for r in runs:
            self.by.setdefault((r["dataset"], r["schedule"], r["fraction"], r["label"]), {})[
                r["seed"]] = r
        self.datasets = [d for d in DATASETS if any(r["dataset"] == d for r in runs)]
        self.labels = [c for c in CONFIGS if c != "uniform" and any(r["label"] == c for r in runs)]

    def uniform_acc(self, ds, sch):
        return {s: r["test_acc"] for s, r in self.by.get((ds, sch, 0.10, "uniform"), {}).items()
                if "test_acc" in r}

    def static_hit(self, ds, sch, frac):
        rs = self.by.get((ds, sch, frac, "uniform"), {})
        return np.mean([r["hit_ratio"] for r in rs.values()]) if rs else float("nan")

    def cell(self, ds, sch, frac, label):
        """(Δ acc per seed, hit ratio, × static, coverage) or None if not run."""
        rs = self.by.get((ds, sch, frac, label))
        uni = self.uniform_acc(ds, sch)
        if not rs:
            return None
        seeds = sorted(set(rs) & set(uni))
        d = np.array([rs[s]["test_acc"] - uni[s] for s in seeds])
        hit = np.mean([r["hit_ratio"] for r in rs.values()])
        return dict(delta=d, hit=hit, x=hit / max(self.static_hit(ds, sch, frac), 1e-9),
                    cov=np.mean([r["min_coverage"] for r in rs.values()]),
                    train=np.mean([r["train_acc"] for r in rs.values()]))

    def fractions(self, label):
        return sorted({k[2] for k in self.by if k[3] == label})


def table(res: Results) -> str:
    out = []
    for ds in res.datasets:
        head = [f"\n**{ds}**: uniform sampling reaches "]
        parts = []
        for sch in SCHEDULES:
            u = list(res.uniform_acc(ds, sch).values())
            tr = [r["train_acc"] for r in res.by.get((ds, sch, 0.10, "uniform"), {}).values()
                  if "train_acc" in r]
            if u:
                sd = np.std(u, ddof=1) if len(u) > 1 else 0.0
                parts.append(f"{np.mean(u):.2f} ± {sd:.2f} % test accuracy "
                             f"({np.mean(tr):.1f} % on its training set) with the {sch} schedule")
        out.append(head[0] + "; ".join(parts) + "\n")
        out.append("| configuration | cache | hit ratio (cosine) | × uniform+static (cosine / short) "
                   "| coverage (min) | Δ accuracy cosine (points) | Δ accuracy short (points) |")
        out.append("|---|---|---|---|---|---|---|")
        for label in res.labels:
            for frac in res.fractions(label):
                c = {sch: res.cell(ds, sch, frac, label) for sch in SCHEDULES}
                if not all(c.values()):
                    continue
                cc, cs = c["cosine"], c["short"]
                out.append(f"| {label} | {frac:.0%} | {cc['hit']:.3f} | {cc['x']:.2f}× / "
                           f"{cs['x']:.2f}× | {cc['cov']:.3f} | {ms(cc['delta'])} | "
                           f"{ms(cs['delta'])} |")
    return "\n".join(out)


# what docs/importance.md offers a user, least to most aggressive: (label, how to ask for it,
# recommended)
SETTINGS = [  # (label, how to ask for it); status is decided by the measurements
    ("reorder only (cached first)", "rep_factor=0"),
    ("default", "ShadeSampler(...)"),
    ("temper 0.5 + substitute 10%", "temper=0.5"),
    ("permutation + substitute 20%", "rep_factor=2, substitute=0.2"),
    ("SHADE rep 1 (old default)", "temper=1, substitute=None (SHADE's weighting, systematic draw + coverage floor)"),
]


def settings_table(res: Results) -> str:
    """One line per setting at a 10% cache: hit ratio over uniform+static, mean and worst Δ
    accuracy over every (data set, schedule) cell measured. Recommended: no cell's mean below
    -0.3 points and more hits than uniform+static; the one with the most hits is marked."""
    rows = []
    for label, how in SETTINGS:
        cells = [(ds, sch, res.cell(ds, sch, 0.10, label)) for ds in res.datasets
                 for sch in SCHEDULES]
        cells = [(ds, sch, c) for ds, sch, c in cells if c is not None]
        if not cells:
            continue
        means = [float(c["delta"].mean()) for _, _, c in cells]
        w = int(np.argmin(means))
        x = float(np.mean([c["x"] for _, _, c in cells]))
        ok = means[w] >= -0.3 and x > 1.05
        status = ("the default" if label == "default" else "recommended" if ok else
                  "no hit-ratio gain" if x <= 1.05 else "not recommended (a cell below -0.3)")
        rows.append([label, how, status, x, np.mean(means), f"{means[w]:+.2f} ({cells[w][0]}, "
                     f"{cells[w][1]})", len(cells), ok])
    best = max((r for r in rows if r[-1]), key=lambda r: r[3], default=None)
    if best is not None and best[2] == "recommended":
        best[2] = "**most aggressive recommended**"
    out = ["| setting | arguments | status | × uniform+static (10% cache) | mean Δ accuracy "
           "(points) | worst cell (points) | cells |", "|---|---|---|---|---|---|---|"]
    out += [f"| {r[0]} | `{r[1]}` | {r[2]} | {r[3]:.2f}× | {r[4]:+.2f} | {r[5]} | {r[6]} |"
            for r in rows]
    return "\n".join(out)


def checks(res: Results, label="default"):
    out = []
    for ds in res.datasets:
        for sch in SCHEDULES:
            for frac in res.fractions(label):
                c = res.cell(ds, sch, frac, label)
                if c is None:
                    continue
                m = float(c["delta"].mean())
                out.append((f"{ds} {sch} {frac:.0%}: mean Δ accuracy >= -0.3 points", m >= -0.3,
                            f"{m:+.2f}"))
                if abs(frac - 0.10) < 1e-9:
                    out.append((f"{ds} {sch} 10%: hit ratio >= 1.8x uniform+static",
                                c["x"] >= 1.8, f"{c['x']:.2f}x"))
    return out


def pareto_plot(res: Results, path, default_label="default", recommended=()):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dss = res.datasets
    fig, axes = plt.subplots(1, len(dss), figsize=(4.6 * len(dss), 4.4), squeeze=False)
    marks = {"cosine": "o", "short": "s"}
    colors = {lab: plt.cm.tab10(i % 10) for i, lab in enumerate(res.labels)}
    for ax, ds in zip(axes[0], dss):
        for label in res.labels:
            for sch in SCHEDULES:
                c = res.cell(ds, sch, 0.10, label)
                if c is None:
                    continue
                se = c["delta"].std(ddof=1) / np.sqrt(c["delta"].size) if c["delta"].size > 1 else 0
                big = label == default_label
                ax.errorbar(c["x"], c["delta"].mean(), yerr=se, marker=marks[sch],
                            color=colors[label], markersize=10 if big else 6, capsize=2,
                            markeredgecolor="black" if big else None, linestyle="none",
                            label=label if (ds == dss[0] and sch == "cosine") else None)
        ax.axhline(-0.3, color="grey", linestyle=":", linewidth=1)
        ax.axhline(0.0, color="grey", linewidth=0.5)
        ax.axvline(1.8, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{ds} (10% cache)")
        ax.set_xlabel("hit ratio / uniform+static")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("Δ test accuracy vs uniform (points, mean ± s.e.)\n"
                          "circles: cosine schedule, squares: short constant-rate")
    fig.legend(loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_section(md, content):
    with open(md) as f:
        text = f.read()
    if SECTION in text:
        start = text.index(SECTION)
        nxt = text.find("\n## ", start + len(SECTION))
        end = len(text) if nxt < 0 else nxt + 1
        text = text[:start] + SECTION + "\n\n" + content.strip() + "\n\n" + text[end:].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + SECTION + "\n\n" + content.strip() + "\n"
    with open(md, "w") as f:
        f.write(text)


def report(args):
    res = Results([r for r in load(args.json) if r["dataset"] in args.datasets])
    tab = table(res)
    chk = checks(res)
    st = settings_table(res)
    print(st)
    print()
    print(tab)
    print()
    for name, ok, val in chk:
        print(f"{'PASS' if ok else 'FAIL'}: {name} (measured {val})")
    pareto_plot(res, args.png)
    print(f"\nplot: {args.png}")
    if args.md:
        d = sampler_defaults()
        body = [f"`nice -n 10 python bench/fidelity.py run` then `python bench/fidelity.py report "
                f"--md BENCHMARKS.md` ({len(res.runs)} runs; {args.note}). Real training through "
                f"a PackedStore, a shared-memory Cache and ShadeSampler (see the script's "
                f"docstring for the data sets and models); 5 seeds, paired initial weights, equal "
                f"steps; SGD with momentum 0.9, lr {LR}; \"cosine\": {SCHEDULES['cosine']} epochs "
                f"decaying to 0, \"short\": a constant rate stopped after "
                f"{SCHEDULES['short']} epochs. Δ accuracy is paired by seed against uniform "
                f"sampling (mean ± sd over seeds); hit ratios against uniform sampling with a "
                f"static cache of the same size. \"default\" is ShadeSampler's defaults: "
                f"{', '.join(f'{k}={v!r}' for k, v in d.items())}.",
                "", f"![Pareto]({os.path.relpath(args.png, os.path.dirname(os.path.abspath(args.md)))})",
                "", "Settings a user can choose (docs/importance.md), at a 10% cache:", "", st,
                "", "Per data set:", "", tab, "", "Targets at the defaults:", ""]
        body += [f"- {'PASS' if ok else 'FAIL'}: {n} (measured {v})" for n, ok, v in chk]
        write_section(args.md, "\n".join(body))
        print(f"{args.md} updated")
    return 0 if chk and all(ok for _, ok, _ in chk) else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run (or continue) the sweep; one JSON line per run")
    r.add_argument("--json", default=os.path.join(HERE, "fidelity.jsonl"))
    r.add_argument("--datasets", type=lambda s: s.split(","), default=list(MEASURED))
    r.add_argument("--schedules", type=lambda s: s.split(","), default=list(SCHEDULES))
    r.add_argument("--configs", type=lambda s: s.split(","), default=["uniform", "default"])
    r.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.05, 0.10, 0.20])
    r.add_argument("--seeds", type=int, default=5)
    r.set_defaults(func=run)
    q = sub.add_parser("report", help="tables, targets and the Pareto plot of a finished sweep")
    q.add_argument("--json", default=os.path.join(HERE, "fidelity.jsonl"))
    q.add_argument("--png", default=os.path.join(HERE, "fidelity.png"))
    q.add_argument("--md", default=None, help="write the table into this file's sampling fidelity section")
    q.add_argument("--datasets", type=lambda s: s.split(","), default=list(MEASURED))
    q.add_argument("--note", default="", help="a line for the Markdown (e.g. how long it took)")
    q.set_defaults(func=report)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for label in getattr(args, "configs", []):
        if label not in CONFIGS:
            p.error(f"unknown configuration {label!r}; known: {', '.join(CONFIGS)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
