"""Sampling fidelity (issue 11): what SHADE's biases cost in accuracy, per data set, and what buys
the hit ratio back safely.

Every run is real training through the real parts: the training set is packed into a PackedStore,
read through a real shared-memory Cache (policy "importance" for SHADE rows, "static" for the
uniform baseline) by CachedDataset in a stock DataLoader, ordered by the real ShadeSampler. Each
(data set, schedule, seed) starts every configuration from the same initial weights, and every
configuration makes the same number of optimizer steps, so Δ accuracy is paired.

Data sets (nothing is downloaded: scikit-learn ships digits, the others are generated here):
  digits      scikit-learn's 8x8 handwritten digits, 1197 train / 600 test, a small conv net, no
              augmentation (it memorizes the training set)
  gratings    shadecache.synthetic 16x16 gratings, 4000 / 4000, an MLP, augmentation after the
              cache (it does not memorize)
  gratings-s  other gratings (data seed 1), 3000 / 4000, the same MLP, no augmentation (memorizes)
  tabular     sklearn make_classification, 32 features, 10 classes, 3% flipped labels,
              3000 / 2000, an MLP, no augmentation
Schedules: "cosine" (SGD with momentum, cosine decay to 0 over 12 epochs) and "short" (the same
SGD at a constant rate, stopped after 5 epochs).

    nice -n 10 python bench/fidelity.py run --json bench/fidelity.json     # the sweep (resumable)
    python bench/fidelity.py report --json bench/fidelity.json              # table, PNGs, BENCHMARKS.md
"""
import argparse
import functools
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shadecache as sc  # noqa: E402
from shadecache import synthetic  # noqa: E402
from shadecache.demo import Augment, capacity_for_fraction  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## Sampling fidelity (issue 11)"

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
            self._capacity[fraction] = capacity_for_fraction(self.n, self.item_bytes, fraction)
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
    import inspect
    sig = inspect.signature(sc.ShadeSampler.__init__)
    return {k: v.default for k, v in sig.parameters.items()
            if k in ("rep_factor", "importance", "pads", "coverage_epochs", "temper",
                     "substitute", "draw")}


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
                         policy=policy, max_item_bytes=data.item_bytes) as cache:
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run (or continue) the sweep; one JSON line per run")
    r.add_argument("--json", default=os.path.join(HERE, "fidelity.jsonl"))
    r.add_argument("--datasets", type=lambda s: s.split(","), default=list(DATASETS))
    r.add_argument("--schedules", type=lambda s: s.split(","), default=list(SCHEDULES))
    r.add_argument("--configs", type=lambda s: s.split(","), default=["uniform", "default"])
    r.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.05, 0.10, 0.20])
    r.add_argument("--seeds", type=int, default=5)
    r.set_defaults(func=run)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for label in getattr(args, "configs", []):
        if label not in CONFIGS:
            p.error(f"unknown configuration {label!r}; known: {', '.join(CONFIGS)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
