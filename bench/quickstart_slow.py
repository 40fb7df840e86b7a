"""The README's quick start on a slow store: its defaults against uniform sampling, same epochs.

    sudo python bench/quickstart_slow.py                 # 5 seeds, ~8 min
    sudo python bench/quickstart_slow.py --seeds 1 --epochs 3   # a short run

What a user gets from README's quick start, nothing started by hand: `sc.Node(store, cache)` (it
reads ahead by default: its prefetcher starts when the sampler publishes its first order),
`node.sampler(...)` at its defaults, a stock DataLoader with 2 workers over `node.dataset()`, a
cache of 10% of the samples. The store is a packed file on an ext4 loop device throttled to
--iops reads/s by the cgroup v1 blkio controller (bench/throttled_disk.py), read with O_DIRECT.
The data set is the demo's (shadecache/demo/synthetic.py: 16x16 noisy gratings, 10 classes; not one
of bench/fidelity.py's), the model a small MLP, the learning rate on a cosine schedule.

Rows, each seed run for both, paired:
  uniform    the same node and loader, ShadeSampler(importance=False, pads=False, rep_factor=0,
             substitute=0, stalls=False) over a static cache: a seeded permutation per epoch
  defaults   node.sampler(batch_size=B, seed=seed): what README's quick start does
and once, uniform on a fast store (tmpfs), to say how I/O-bound uniform is on the slow one.
Targets: uniform at least 2x I/O-bound; the defaults' wall time <= 0.75x uniform's for the same
epochs; their final accuracy >= uniform's - 0.5 points.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import shadecache as sc  # noqa: E402
import throttled_disk  # noqa: E402
from shadecache.demo import synthetic  # noqa: E402
from shadecache.demo.experiment import make_model  # noqa: E402

UNIFORM = dict(importance=False, pads=False, rep_factor=0.0, substitute=0.0, stalls=False)
SIZE = 16


def pack(path: str, n: int, seed: int) -> None:
    images, labels = synthetic.make_images(n, seed=seed, size=SIZE)
    with sc.PackWriter(path) as w:
        for x, y in zip(images, labels):
            w.add(x.tobytes(), int(y))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def decode(data) -> np.ndarray:
    return synthetic.decode(data, size=SIZE)


def run(store_path: str, config: str, seed: int, args, test) -> dict:
    """One training run through a fresh node; wall time of the epochs, final test accuracy."""
    torch.manual_seed(seed)
    with sc.PackedStore(store_path, direct=args.direct) as store:
        n = len(store)
        name = f"sc-qs-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        cap = sc.Cache.capacity_for(max(1, n // 10), store.lengths)
        policy = "static" if config == "uniform" else "importance"
        with sc.Cache.for_store(name, store, capacity_bytes=cap, policy=policy, attach=False) as cache:
            node = sc.Node(store, cache)
            sampler = node.sampler(batch_size=args.batch, seed=seed,
                                   **(UNIFORM if config == "uniform" else {}))
            loader = torch.utils.data.DataLoader(node.dataset(decode=decode), batch_size=args.batch,
                                                 sampler=sampler, num_workers=2,
                                                 persistent_workers=True)
            model = make_model(SIZE * SIZE, 10)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            steps = args.epochs * len(loader)
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda k: 0.5 * (1.0 + np.cos(np.pi * min(k, steps) / steps)))
            wall = 0.0
            for epoch in range(args.epochs):
                sampler.set_epoch(epoch)
                t0 = time.perf_counter()
                for x, y, idx in loader:
                    losses = F.cross_entropy(model(x.float().flatten(1)), y, reduction="none")
                    sampler.update(idx, losses.detach())
                    losses.mean().backward()
                    opt.step()
                    opt.zero_grad()
                    sched.step()
                wall += time.perf_counter() - t0
                sampler.end_epoch()
            del loader
            stats = node.stats()
            repeats = sum(h["stall_repeats"] for h in sampler.repeats_history)
            node.close()
    with torch.no_grad():
        acc = float((model(test[0]).argmax(1) == test[1]).float().mean()) * 100
    return {"config": config, "seed": seed, "wall_s": wall, "acc": acc,
            "store_reads": stats["store_reads"], "stall_repeats": repeats}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="training samples")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--test-n", type=int, default=20000, help="held-out samples (accuracy's noise)")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iops", type=int, default=2000)
    ap.add_argument("--direct", type=int, default=1, help="read the slow store with O_DIRECT")
    args = ap.parse_args(argv)
    why = throttled_disk.unavailable()
    if why:
        print(f"cannot run here: {why}")
        return 2
    images, labels = synthetic.make_images(args.test_n, seed=10_000, size=SIZE)
    test = (torch.from_numpy((images.reshape(len(images), -1).astype(np.float32) - 127.5) / 127.5),
            torch.from_numpy(labels.astype(np.int64)))
    rows = []
    with tempfile.TemporaryDirectory(prefix="sc-qs-", dir="/dev/shm") as fast_dir:
        fast = os.path.join(fast_dir, "train.shc")
        pack(fast, args.n, seed=1)
        ref = run(fast, "uniform", 0, argparse.Namespace(**{**vars(args), "direct": 0}), test)
        print(f"fast store (tmpfs), uniform, seed 0: {ref['wall_s']:.1f} s, {ref['acc']:.2f}%",
              flush=True)
        size = os.path.getsize(fast) * 2 + (64 << 20)
        with throttled_disk.ThrottledDisk(size, read_iops=args.iops, read_bps=1 << 30) as disk:
            slow = os.path.join(disk.mount, "train.shc")
            pack(slow, args.n, seed=1)
            disk.set_read_ahead(0)
            for seed in range(args.seeds):
                for config in ("uniform", "defaults"):
                    disk.drop_caches()
                    disk.enter()
                    try:
                        r = run(slow, config, seed, args, test)
                    finally:
                        disk.leave()
                    rows.append(r)
                    print(f"  seed {seed} {config:9s} {r['wall_s']:7.1f} s  acc {r['acc']:6.2f}%  "
                          f"store reads {r['store_reads']:,}  stall repeats {r['stall_repeats']:,}",
                          flush=True)
    uni = {r["seed"]: r for r in rows if r["config"] == "uniform"}
    dfl = {r["seed"]: r for r in rows if r["config"] == "defaults"}
    bound = np.mean([r["wall_s"] for r in uni.values()]) / ref["wall_s"]
    ratio = [dfl[s]["wall_s"] / uni[s]["wall_s"] for s in uni]
    dacc = [dfl[s]["acc"] - uni[s]["acc"] for s in uni]
    print()
    print(f"| row | value | target | result |\n|---|---|---|---|")
    print(f"| uniform I/O-bound (slow wall / fast wall) | {bound:.2f}x | >= 2x | "
          f"{'PASS' if bound >= 2 else 'FAIL'} |")
    print(f"| defaults' wall time / uniform's (paired, {len(ratio)} seeds) | {np.mean(ratio):.2f}x "
          f"({min(ratio):.2f}-{max(ratio):.2f}) | <= 0.75x | {'PASS' if np.mean(ratio) <= 0.75 else 'FAIL'} |")
    print(f"| defaults' final accuracy - uniform's | {np.mean(dacc):+.2f} "
          f"({min(dacc):+.2f}..{max(dacc):+.2f}) | >= -0.5 | {'PASS' if np.mean(dacc) >= -0.5 else 'FAIL'} |")
    print(f"\ncommand: sudo python bench/quickstart_slow.py --n {args.n} --seeds {args.seeds} "
          f"--epochs {args.epochs} --iops {args.iops} --test-n {args.test_n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
