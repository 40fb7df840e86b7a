"""The prefetcher through the tier chain, on throttled shared storage: RAM 20% + SSD tier 30%.

    sudo python bench/prefetch_tiers.py            # root: a loop device, mkfs, mount, a cgroup
    python bench/prefetch_tiers.py --sizes 3072 --warm 2    # a shorter run

Shared storage, made here: a loop device with ext4, throttled by the cgroup v1 blkio controller to
--iops reads/s and --mibps MiB/s (this process and every process it starts, the prefetcher
included, are moved into the cgroup); the packed store lives on it and is read with O_DIRECT, so
every read reaches the device (no page cache between the job and its storage). What the job reads
from shared storage is the device's own count (/sys/block/loopN/stat, sectors read).

The node: a cache of 20% of the samples (importance policy, Cache.for_store) and an SSD tier of 30%
of the data on the machine's own disk, both fresh for each run. The job is the README's: an
sc.Node of the store, the cache and the SSD tier, ShadeSampler at its defaults, a CachedLoader
(batch 256, 2 threads), a training step of --step-ms per batch that releases the GIL (time.sleep),
per-sample losses (a fixed function of the id) reported with sampler.update. Each sample size runs
these ways, epoch 0 cold and --warm warm epochs each:
  none           sc.Node(..., read_ahead=False): no prefetcher
  default        sc.Node(...): the node reads ahead with its defaults (automatic lookahead)
  chain          a node without a prefetcher of its own and node.prefetcher(lookahead_samples=4096,
                 lookahead_bytes=64 MiB) started by hand (the README's lookahead before the node)
Printed per warm epoch: samples/s and the data read from shared storage as a multiple of the data
set's size; with --detail, per epoch, the loaders' reads from the store and the SSD tier, the
prefetcher's reads and insertions, and the cache's evictions. The target: reading ahead, every
warm epoch reads no more than without it and is at least as fast.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import shadecache as sc  # noqa: E402
import throttled_disk  # noqa: E402
from cluster import process_cpu_s  # noqa: E402

MODES = ("none", "default", "chain")


def pack(path: str, n: int, size: int) -> None:
    rng = np.random.default_rng(size)
    with sc.PackWriter(path) as w:
        for i in range(n):
            w.add(rng.bytes(size), i % 10)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def losses_of(ids: np.ndarray, epoch: int) -> np.ndarray:
    """Per-sample losses, a fixed function of the id and the epoch (what a model's would be)."""
    x = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return (x % np.uint64(1000)).astype(np.float64) / 1000.0 + 0.01 * epoch


def _cpu_ms(pid=None) -> int:
    """CPU time (user + system, ms) of this process (pid None) or of process `pid`, its threads
    included; 0 for a process that is gone."""
    if pid is None:
        t = os.times()
        return int(1000 * (t.user + t.system))
    try:
        return int(1000 * process_cpu_s(pid))
    except OSError:
        return 0


def _detail(ds, cache, board, layout=None, ssd=None, prefetcher=None) -> dict:
    """Counts so far: the loaders' reads from the store and the SSD tier, the prefetcher's reads
    (reads_issued: store and SSD tier), what it put in the cache, and the cache's evictions;
    the CPU time of the job's process (the loaders' threads in it) and of the prefetcher's;
    under the extent order (layout) also the extents the node holds whole now, in the cache
    and on the SSD tier together (a state, not a count)."""
    d = ds.stats()
    t = board.counters.totals()
    out = {"loader_store": d["store_reads"], "loader_ssd": d["ssd_hits"],
           "prefetcher": t["reads_issued"], "prefetched": t["prefetched"],
           "evictions": cache.stats()["evictions"], "job_cpu_ms": _cpu_ms(),
           "prefetcher_cpu_ms": 0 if prefetcher is None else _cpu_ms(prefetcher.proc.pid)}
    if layout is not None:
        n = len(layout)
        ssd.flush()
        held = np.asarray(cache.cached_mask(), dtype=bool) | np.asarray(ssd.holds(np.arange(n)), dtype=bool)
        counts = np.bincount(layout.extent_of, minlength=layout.extents)
        whole = np.bincount(layout.extent_of, weights=held, minlength=layout.extents) == counts
        out["extents_held_whole"] = int((whole & (counts > 0)).sum())
    return out


def run_mode(mode, store_path, disk, ssd_dir, args):
    """[(samples/s, bytes read from the device, detail) per epoch] of one fresh node; detail:
    _detail's counts in that epoch."""
    # The throttle's rates are given (as bench/peers.py does): the store's probe at open sees the
    # cgroup throttle's bursts (150k-230k IOPS measured on this disk throttled to 3,000), and each
    # mode would draw its order from a different measurement; --probe measures instead
    given = None if args.probe else {"iops": args.iops, "bandwidth": args.mibps << 20}
    # closed on every way out: an open file keeps the disk from unmounting
    with sc.PackedStore(store_path, direct=True, device=given) as store:
        n = len(store)
        name = f"sc-tiers-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        shutil.rmtree(ssd_dir, ignore_errors=True)
        ssd_bytes = int(0.30 * sum(sc.SSDTier.slot_bytes(int(v)) for v in store.lengths))
        cap = sc.Cache.capacity_for(round(0.20 * n), store.lengths)
        out = []
        with sc.Cache.for_store(name, store, capacity_bytes=cap, policy="importance", attach=False) as cache:
            ssd = sc.SSDTier(ssd_dir, capacity_bytes=ssd_bytes, cache=cache)
            # every mode has a board (counters); only "default" starts its prefetcher by itself
            node = sc.Node(store, cache, ssd=ssd, read_ahead=mode == "default")
            board = node.board or sc.OrderBoard.create(name, n)
            ds = node.dataset()
            sampler = sc.ShadeSampler(ds, batch_size=args.batch, seed=0, **args.sampler)
            loader = sc.CachedLoader(ds, batch_size=args.batch, sampler=sampler,
                                     **{"num_workers": 2, **args.loader})
            if args.detail:   # what the store measured at open decides the order "auto" draws
                measured = {k: (round(v) if isinstance(v, float) else v) for k, v in store.device.items()}
                print(f"    store: device {measured}, iops_bound {store.iops_bound}; sampler order "
                      f"{sampler.order_kind}" + ("" if sampler.extents is None else
                                                 f", extents of {sampler.extents.extent_bytes:,} B"),
                      flush=True)
            pf = None
            if mode == "chain":
                pf = node.prefetcher(lookahead_samples=4096, lookahead_bytes=64 << 20).start()
            try:
                for epoch in range(1 + args.warm):
                    sampler.set_epoch(epoch)
                    if mode == "default":
                        pf = node.started_prefetcher
                    layout = sampler.extents if args.detail else None
                    before = _detail(ds, cache, board, layout, ssd, pf)
                    r0, t0 = disk.counters().bytes, time.perf_counter()
                    seen, total = 0, 0.0
                    waits = []          # seconds the job waited for each batch
                    t_ask = time.perf_counter()
                    for x, y, idx in loader:
                        waits.append(time.perf_counter() - t_ask)
                        loss = losses_of(idx.numpy(), epoch)
                        sampler.update(idx, loss)
                        total += float(loss.sum())
                        seen += idx.numel()
                        if args.step_ms:
                            time.sleep(args.step_ms / 1000)
                        t_ask = time.perf_counter()
                    sampler.end_epoch(total / max(seen, 1))
                    dt = time.perf_counter() - t0
                    nbytes = disk.counters().bytes - r0
                    after = _detail(ds, cache, board, layout, ssd, pf)
                    delta = {k: after[k] - before[k] for k in after}
                    # where the epoch's time went: waiting for batches (all, and in batches
                    # that waited over a step), the rest being steps and the job's own work
                    w = np.asarray(waits)
                    delta["batch_wait_ms"] = int(1000 * w.sum())
                    delta["long_waits"] = int((w > max(args.step_ms, 1) / 1000).sum())
                    if "extents_held_whole" in after:
                        delta["extents_held_whole"] = after["extents_held_whole"]
                    if args.detail and len(sampler.repeats_history) > epoch:
                        # the stall budget's repeats: cached samples trained in place of misses
                        # the planner judged would stall (they depend on the measured pace, so
                        # on what else runs: the prefetcher, the machine)
                        delta["stall_repeats"] = sampler.repeats_history[epoch]["stall_repeats"]
                    out.append((seen / dt, nbytes, delta))
            finally:
                if mode == "chain" and pf is not None:
                    pf.stop()
                node.close()
                ssd.close()
            board.unlink()
            cache.check()
        return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="3072,102400", help="sample sizes in bytes")
    ap.add_argument("--data-mib", type=int, default=180, help="3 KB samples: this many MiB of data")
    ap.add_argument("--large-mib", type=int, default=400, help="samples >= 64 KB: this many MiB")
    ap.add_argument("--warm", type=int, default=3, help="warm epochs after the cold one")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=10.0, help="training step per batch")
    ap.add_argument("--iops", type=int, default=3000)
    ap.add_argument("--mibps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the three modes this often")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--detail", action="store_true", help="per epoch: who read what, evictions")
    ap.add_argument("--probe", action="store_true",
                    help="let the store measure the device at open instead of giving it the "
                         "throttle's rates")
    ap.add_argument("--sampler", type=json.loads, default={},
                    help='ShadeSampler options over its defaults, as JSON (e.g. \'{"order": "uniform"}\')')
    ap.add_argument("--loader", type=json.loads, default={},
                    help='CachedLoader options over the job\'s (e.g. \'{"prefetch_batches": 16}\')')
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = args.modes.split(",")
    why = throttled_disk.unavailable()
    if why:
        sys.exit(f"prefetch_tiers.py makes a throttled loop device and cannot here: {why}")
    # a SIGTERM (timeout, kill) unwinds: the disk's mount, loop device and cgroup are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = tempfile.mkdtemp(prefix="sc-tiers-", dir=args.workdir)
    rows = []
    try:
        image = max((args.large_mib if s >= 65536 else args.data_mib) for s in sizes) * 3 << 20
        with throttled_disk.ThrottledDisk(max(image, 1 << 30), read_iops=args.iops,
                                          read_bps=args.mibps << 20, image_dir=work) as disk:
            disk.enter()      # this process and every process it starts (the prefetcher)
            mnt = disk.mount
            for size in sizes:
                data_mib = args.large_mib if size >= 65536 else args.data_mib
                n = (data_mib << 20) // size
                store_path = os.path.join(mnt, f"s{size}.shc")
                pack(store_path, n, size)
                for rnd in range(args.rounds):
                    for mode in modes:
                        per = run_mode(mode, store_path, disk, os.path.join(work, "ssd"), args)
                        data = n * size
                        for e, (rate, nbytes, _) in enumerate(per):
                            rows.append((size, n, rnd, mode, e, rate, nbytes / data))
                        warm = per[1:]
                        print(f"{size} B x {n}, round {rnd}, {mode:>10}: warm epochs "
                              + ", ".join(f"{r:,.0f}/s {b / data:.3f}x" for r, b, _ in warm), flush=True)
                        if args.detail:
                            for e, (rate, nbytes, d) in enumerate(per):
                                print(f"    epoch {e}: {rate:,.0f}/s, read {nbytes / data:.3f}x, "
                                      + ", ".join(f"{k} {v:,}" for k, v in d.items()), flush=True)
                os.unlink(store_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| sample | round | prefetcher | warm epochs: samples/s | warm epochs: data read / data set |")
    print("|---|---|---|---|---|")
    for size in sizes:
        for rnd in range(args.rounds):
            for mode in modes:
                rs = [r for r in rows if r[0] == size and r[2] == rnd and r[3] == mode and r[4] > 0]
                print(f"| {size // 1024} KB x {rs[0][1]:,} | {rnd} | {mode} | "
                      + ", ".join(f"{r[5]:,.0f}" for r in rs) + " | "
                      + ", ".join(f"{r[6]:.3f}x" for r in rs) + " |")
    return rows


if __name__ == "__main__":
    main()
