"""The experiment harness behind `shadecache demo` and bench/hit_ratio.py: one training run through
the real cache, store, sampler and DataLoader (`train_run`), and the table and plot of several.

It makes no data of its own and parses no arguments: `build_data` packs a synthetic data set
(shadecache.demo.synthetic) into a store, `train_run` trains one `RunConfig` for one seed, and the
callers (the demo command, the benchmarks, the tests) decide what to compare.
"""
import functools
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from . import synthetic


@dataclass
class RunConfig:
    """One training run. sampler: "uniform" (a permutation per epoch) or "shade"."""
    label: str
    sampler: str = "shade"
    policy: str = "importance"          # cache policy: importance, lru, fifo, static, clairvoyant
    rep_factor: float = 1.0
    coverage_epochs: int = 2            # ShadeSampler's floor; 0 turns the guardrail off
    cache_fraction: float = 0.15        # of the samples (sc.Cache.capacity_for)
    epochs: int = 8
    batch_size: int = 64
    num_workers: int = 0
    lr: float = 2e-3
    augment: dict = field(default_factory=dict)   # Augment's options; None: no augmentation
    seed: int = 0
    extra: dict = field(default_factory=dict)


class Augment:
    """A label-preserving random view of a grating, made after the cache (the cache holds raw
    bytes): a circular shift of up to `shift` pixels each way (a phase change; the blob moves) and
    fresh pixel noise. Uses torch's RNG, which DataLoader seeds per worker from the main seed."""

    def __init__(self, size: int = 16, shift: int = 2, noise: float = 0.15):
        self.size, self.shift, self.noise = size, shift, noise

    def __call__(self, x):
        img = torch.from_numpy(np.asarray(x, dtype=np.float32)).view(self.size, self.size)
        dy, dx = torch.randint(-self.shift, self.shift + 1, (2,)).tolist()
        img = torch.roll(img, shifts=(dy, dx), dims=(0, 1))
        return (img + self.noise * torch.randn_like(img)).reshape(-1)


def decode_batch(x: torch.Tensor) -> torch.Tensor:
    """synthetic.decode on a whole (B, size*size) uint8 batch: the same float32 values."""
    return (x.float() - 127.5) / 127.5


def make_model(in_features: int, num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, 128), nn.ReLU(), nn.Linear(128, num_classes))


def build_data(workdir: str, n_train: int, n_test: int, seed: int = 0, size: int = 16, **kw):
    """Make the data set, pack the training part into `workdir/train.shc`.

    Returns (store path, test images as a float32 tensor (n_test, size*size), test labels)."""
    import shadecache as sc
    train = synthetic.SyntheticImages(n_train, seed=seed, size=size, **kw)
    path = os.path.join(workdir, "train.shc")
    sc.pack(train, path, progress=False)
    timgs, tlabels = synthetic.make_images(n_test, seed=seed + 10_000, size=size, **kw)
    tx = torch.from_numpy((timgs.reshape(n_test, -1).astype(np.float32) - 127.5) / 127.5)
    return path, tx, torch.from_numpy(tlabels)


def _accuracy(model, tx, ty) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(tx).argmax(1) == ty).float().mean().item()
    model.train()
    return 100.0 * acc


def train_run(store, cfg: RunConfig, test, cache_name: str, progress: bool = False,
              size: int = 16, num_classes: int = 10) -> dict:
    """Train one configuration from scratch; returns its measurements.

    The model's initial weights depend only on cfg.seed, and every configuration makes the same
    number of optimizer steps (epochs x N / batch_size), so accuracies compare at equal steps.
    """
    import shadecache as sc
    from tqdm import tqdm
    n = len(store)
    tx, ty = test
    sizes = store.lengths
    capacity = sc.Cache.capacity_for(max(1, int(round(cfg.cache_fraction * n))), sizes)
    torch.manual_seed(cfg.seed)
    model = make_model(size * size, num_classes)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    # cosine decay to zero over the run: the final accuracy is the end of a schedule, not a
    # snapshot of a noisy constant-rate walk, so runs compare at equal steps with less noise
    steps_total = cfg.epochs * -(-n // cfg.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: 0.5 * (1.0 + np.cos(np.pi * min(k, steps_total) / steps_total)))
    out = {"config": asdict(cfg), "acc": [], "hit_ratio": [], "bytes_read": [],
           "coverage": [], "not_in_window": [], "cached_fraction": [], "max_items": 0,
           "trace": []}   # trace: every id the loader served, in order (offline bounds)
    with sc.Cache.create(cache_name, num_samples=n, capacity_bytes=capacity,
                         policy=cfg.policy, sizes=sizes) as cache, \
            _board_for_policy(cache, n) as _board:
        aug = cfg.extra.get("augment", cfg.augment)
        # Without per-sample augmentation nothing per sample runs in Python: CachedLoader copies
        # each batch out of shared memory in this process and decodes it in one vectorized op.
        # The per-sample Augment (Python, torch RNG per worker) stays on DataLoader workers.
        # extra={"loader": "dataloader"} forces the DataLoader (to compare the two).
        batched = aug is None and cfg.extra.get("loader", "cached") == "cached"
        # the demo's store is local and small: every configuration reads it sample by sample,
        # with no prefetcher (the comparison is of samplers and policies, not of reading ahead)
        node = sc.Node(store, cache, read_plan="samples", read_ahead=False)
        if batched:
            ds = node.dataset()
        else:
            ds = node.dataset(decode=functools.partial(synthetic.decode, size=size),
                              transform=Augment(size, **aug) if aug is not None else None)
        shade = cfg.sampler == "shade"
        kw = dict(rep_factor=cfg.rep_factor if shade else 0.0, importance=shade, pads=shade,
                  coverage_epochs=cfg.coverage_epochs, seed=cfg.seed)
        kw.update(cfg.extra.get("sampler", {}))    # experiments: any other ShadeSampler option
        sampler = sc.ShadeSampler(ds, batch_size=cfg.batch_size, **kw)
        if batched:
            loader = sc.CachedLoader(ds, batch_size=cfg.batch_size, sampler=sampler,
                                     num_workers=0, batch_transform=decode_batch)
        else:
            loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler,
                                num_workers=cfg.num_workers,
                                persistent_workers=cfg.num_workers > 0)
        train_time = 0.0
        samples = 0
        bar = tqdm(total=cfg.epochs * len(loader), desc=cfg.label, disable=not progress,
                   leave=False, unit="batch")
        for epoch in range(cfg.epochs):
            sampler.set_epoch(epoch)
            before = ds.stats()
            t0 = time.perf_counter()
            for x, y, idx in loader:
                losses = F.cross_entropy(model(x), y, reduction="none")
                sampler.update(idx, losses.detach())
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
                sched.step()
                samples += len(idx)
                out["trace"].extend(idx.tolist())
                bar.update(1)
            train_time += time.perf_counter() - t0
            sampler.end_epoch()
            after = ds.stats()
            served = after["samples"] - before["samples"]
            out["hit_ratio"].append((after["hits"] - before["hits"]) / max(served, 1))
            out["bytes_read"].append(after["bytes_read"] - before["bytes_read"])
            cov = sampler.coverage()
            out["coverage"].append(cov["last"])
            # samples not drawn within the last max(K, 2) epochs (0 whenever the floor holds)
            out["not_in_window"].append(int((sampler.last_drawn
                                             <= epoch - max(cfg.coverage_epochs, 2)).sum()))
            out["cached_fraction"].append(cache.stats()["items"] / n)
            out["max_items"] = max(out["max_items"], cache.stats()["items"])
            out["acc"].append(_accuracy(model, tx, ty))
            bar.set_postfix(acc=f"{out['acc'][-1]:.1f}", hit=f"{out['hit_ratio'][-1]:.2f}")
        bar.close()
        del loader   # stop persistent workers before the cache goes away
        st = ds.stats()
    out.update(final_acc=out["acc"][-1], total_hit_ratio=st["hit_ratio"],
               total_bytes_read=st["bytes_read"], samples_per_s=samples / train_time,
               wall_s=train_time, stall_repeats=sum(h["stall_repeats"]
                                                    for h in sampler.repeats_history),
               min_coverage=min(out["coverage"]), steps=cfg.epochs * len(sampler) // cfg.batch_size)
    return out


def _board_for_policy(cache, n):
    """The order board a policy that keys on next use (clairvoyant) reads the sampler's order
    from (the sampler publishes into it by itself); nothing for the other policies."""
    import contextlib

    import shadecache as sc
    if not cache.keys_on_next_use:
        return contextlib.nullcontext()
    return sc.OrderBoard.create(cache.name, n)


def plot_runs(runs, path: str, title: str = ""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    panels = (("acc", "test accuracy (%)"), ("hit_ratio", "cache hit ratio"),
              ("bytes_read", "MB read from the store"), ("coverage", "coverage (distinct/N)"))
    for ax, (key, ylabel) in zip(axes, panels):
        for r in runs:
            ys = np.asarray(r[key], dtype=float)
            if key == "bytes_read":
                ys = ys / 1e6
            ax.plot(np.arange(1, len(ys) + 1), ys, marker="o", label=r["config"]["label"])
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(runs, store: str = "") -> str:
    """The runs' table; `store` names the store they read (the wall-clock column's heading)."""
    wall = f"wall clock, s ({store})" if store else "wall clock, s"
    head = (f"| run | hit ratio | MB read from store | samples/s | {wall} | coverage (min) | "
            "final accuracy |\n|---|---|---|---|---|---|---|")
    rows = [f"| {r['config']['label']} | {r['total_hit_ratio']:.3f} | "
            f"{r['total_bytes_read'] / 1e6:.2f} | {r['samples_per_s']:,.0f} | "
            f"{r['wall_s']:.2f} | {r['min_coverage']:.3f} | {r['final_acc']:.2f}% |" for r in runs]
    return "\n".join([head] + rows)
