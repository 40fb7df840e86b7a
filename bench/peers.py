"""shadecache against what a user would pick instead, on storage shaped like a cloud network disk.

    sudo python bench/peers.py                  # the table: 3 data sets x 3 systems x 3 epochs
    sudo python bench/peers.py --quick          # seconds: small data sets, 2 epochs (the tests')

Each system reads the same samples from an ext4 file system on a loop device throttled by the
cgroup v1 blkio controller to 3,000 reads/s and 200 MiB/s (bench/throttled_disk.py), the page
cache dropped before every epoch, with a local budget of 20% of the data in RAM and 30% on local
disk, batches of 256, 3 epochs; each system runs in a child process placed in the throttled
cgroup, and the bytes read are what the block device itself served (/sys/block/<dev>/stat).

- shadecache: the store packed on the throttled disk (dense, shuffled placement), a Cache of 20%
  in /dev/shm, an SSD tier of 30% on local disk (admitting and evicting by the cache's scores), a CachedDataset, ShadeSampler with its default
  order (the extent order where the store is IOPS-bound, measured at open), sc.CachedLoader with
  2 assembly threads (--loader dataloader: a DataLoader with 2 worker processes). rep_factor=0: no cached sample is repeated in place of a miss, so every epoch trains
  every sample once, as the others do.
- Mosaic Streaming (mosaicml-streaming): MDS shards of 8 MiB on the throttled disk as its
  `remote`, `local` on local disk with cache_limit = the whole local budget (50% of the data), its
  default shuffle (py1e) with shuffle_block_size = 4 shards' samples (its docs: the block must fit
  the cache; the default, 262,144 samples, thrashed a cache of half its shards), 2 workers.
- LitData: chunks of 8 MiB on the throttled disk, read as a remote ("local:" url) into a cache
  directory on local disk with max_cache_size = the local budget, shuffle=True, its
  StreamingDataLoader with 2 workers.
Every choice is printed. Samples are handed to the loop as bytes (no decode) by all three.

Needs root (loop device, mount, cgroup, drop_caches) and, for the peers, the `peers` extra
(`pip install -e .[peers]`, best in a virtual environment of its own: mosaicml-streaming pins
numpy < 2.2). `import streaming` imports torchvision for its image data sets, and the torchvision
wheel on the package index is built for CUDA torch: next to the CPU torch it fails to import. Its
image data sets are not used here, so this script puts an empty `streaming.vision` module in place
first (`_import_streaming`).

Writes bench/out/peers.json; prints the table and the acceptance checks.

On object storage (`--storage s3`, no root needed): the three systems read their own formats from
the same SeaweedFS (bench/seaweed.py) behind the same proxy (bench/s3_proxy.py: 20 ms before each
response, 50 MB/s a connection, 100 MB/s in all), bytes and GETs counted at the proxy; RAM 20% +
local disk 30% of the data as above.
- shadecache: the store as an object (sc.S3Store through the proxy, its directory kept in the
  SSD tier's directory), the same cache, SSD tier, sampler (extent order: the store is
  IOPS-bound at S3's cost of a request) and loader.
- Streaming: `remote` = s3://bucket/.../mds with S3_ENDPOINT_URL the proxy (its docs' way to an
  S3-compatible endpoint), the same cache_limit and shuffle; its downloader's pooled client is
  dropped before the workers fork (BASELINES.md: forked workers sharing it hung).
- LitData: input_dir s3://bucket/.../litdata, storage_options endpoint_url the proxy, the same
  max_cache_size; with a plain-http endpoint its obstore client needs allow_http (BASELINES.md).

    python bench/peers.py --storage s3 [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
import uuid

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

import throttled_disk  # noqa: E402

SYSTEMS = ("shadecache", "streaming", "litdata")
DATASETS = {   # name: (samples, bytes per sample)
    "3k": (60_000, 3_000),
    "100k": (4_000, 100_000),
    "256": (200_000, 256),
}
QUICK = {"3k": (6_000, 3_000), "100k": (400, 100_000), "256": (20_000, 256)}
BATCH = 256
WORKERS = 2
RAM_SHARE, SSD_SHARE = 0.20, 0.30
SHARD_BYTES = 8 << 20
READ_IOPS, READ_BPS = 3000, 200 << 20


# ---- the data ----------------------------------------------------------------------------------

def samples(n: int, size: int):
    """Sample i: `size` bytes cut from a seeded random pool (distinct, cheap); label i % 100."""
    pool = np.random.default_rng(0).bytes(max(64 << 20, 2 * size))
    span = len(pool) - size
    for i in range(n):
        o = (i * 4099 + 17) % span
        yield pool[o:o + size], i % 100


def _import_streaming():
    """mosaicml-streaming, without the torchvision its image data sets need (module docstring)."""
    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming
    return streaming


def write_shadecache(root, n, size):
    import shadecache as sc
    path = os.path.join(root, "train.shc")
    with sc.PackWriter(path) as w:
        for data, label in samples(n, size):
            w.add(data, label)
    return {"path": path}


def write_streaming(root, n, size):
    streaming = _import_streaming()
    out = os.path.join(root, "mds")
    with streaming.MDSWriter(out=out, columns={"x": "bytes", "y": "int"}, size_limit=SHARD_BYTES,
                             compression=None, hashes=[]) as w:
        for data, label in samples(n, size):
            w.write({"x": data, "y": label})
    return {"remote": out, "samples_per_shard": max(1, SHARD_BYTES // (size + 16))}


def write_litdata(root, n, size):
    from litdata.streaming.writer import BinaryWriter
    out = os.path.join(root, "litdata")
    w = BinaryWriter(out, chunk_bytes=SHARD_BYTES)
    for i, (data, label) in enumerate(samples(n, size)):
        w.add_item(i, {"x": data, "y": label})
    w.done()
    w.merge()
    return {"remote": out}


WRITERS = {"shadecache": write_shadecache, "streaming": write_streaming, "litdata": write_litdata}


# ---- one system, in a throttled child process ----------------------------------------------------

def _collate(batch):
    """(bytes, label) per sample, made in the worker: LitData hands out memoryviews of its chunk
    buffers, which cannot cross to the main process (its workers died pickling them, and the
    loop waited forever); bytes(b) of a bytes object is that object, no copy."""
    out = []
    for item in batch:
        if isinstance(item, dict):
            out.append((bytes(item["x"]), int(item["y"])))
        else:
            out.append((bytes(item[0]), int(item[1])))
    return out


class _Epochs:
    """Runs epochs and reports each: seconds, samples, what the device (or, on object storage,
    the proxy) served."""

    def __init__(self, device, proxy=None):
        self.device = device
        self.proxy = proxy

    def counters(self):
        if self.proxy:   # bytes of GET bodies and GETs that passed the proxy
            import urllib.request
            with urllib.request.urlopen(self.proxy + "/__proxy/stats", timeout=10) as r:
                st = json.loads(r.read())
            return st["get_bytes"], st["gets"]
        with open(f"/sys/block/{self.device}/stat") as f:
            fields = f.read().split()
        return int(fields[2]) * 512, int(fields[0])

    def run(self, epochs, one_epoch, report):
        for e in range(epochs):
            try:
                throttled_disk.drop_caches()
            except OSError:   # not root: the local caches' pages stay (object storage only)
                if not self.proxy:
                    raise
            b0, r0 = self.counters()
            t0 = time.perf_counter()
            count = one_epoch(e)
            dt = time.perf_counter() - t0
            b1, r1 = self.counters()
            report({"epoch": e, "seconds": dt, "samples": count, "bytes": b1 - b0,
                    "requests": r1 - r0})


def _count(loader) -> int:
    n = 0
    for batch in loader:
        n += len(batch)
    return n


def run_shadecache(cfg, epochs, report):
    import torch
    import shadecache as sc

    # The throttle's rates are given (device=): the store's probe at open measures the cgroup
    # throttle's bursts on this disk as often as its rate (139k-246k IOPS and up to 1 GB/s were
    # measured on a disk throttled to 3,000 and 200 MiB/s); --probe measures them instead.
    given = None if cfg.get("probe") else {"iops": READ_IOPS, "bandwidth": READ_BPS,
                                           "source": "given: the throttle's rates"}
    if cfg.get("url"):   # on object storage: its cost of a request is S3's (store/s3.py)
        store = sc.S3Store(cfg["url"], endpoint_url=cfg["endpoint"], cache_dir=cfg["ssd_dir"] + "-directory")
    else:
        store = sc.PackedStore(cfg["path"], device=given)
    data_bytes = store.data_bytes
    name = f"peers-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    cache = sc.Cache.create(name, num_samples=len(store), capacity_bytes=int(RAM_SHARE * data_bytes),
                            policy="importance")
    ssd_share = cfg.get("ssd_share", SSD_SHARE)
    # cache=: the tier evicts and admits by the cache's importance scores (its docs' usage; without
    # one it evicts in id order and admits every newcomer, rewriting itself each epoch)
    ssd = (sc.SSDTier(cfg["ssd_dir"], capacity_bytes=int(ssd_share * data_bytes), cache=cache)
           if ssd_share else None)
    # --prefetch: the node reads ahead (its prefetcher starts when the sampler publishes)
    prefetch = bool(cfg.get("prefetch"))
    node = sc.Node(store, cache, ssd=ssd, read_ahead=prefetch,
                   prefetch=dict(lookahead_samples=4096, lookahead_bytes=64 << 20))
    ds = node.dataset(decode=bytes)
    sampler = sc.ShadeSampler(ds, batch_size=BATCH, rep_factor=0, seed=0)
    if cfg.get("loader") == "dataloader":
        loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler,
                                             num_workers=WORKERS, collate_fn=_collate,
                                             persistent_workers=True)
        described = f"torch DataLoader, batch {BATCH}, {WORKERS} worker processes (persistent)"
    else:   # one process: its assembly threads share the extent mates staged for their turn
        loader = sc.CachedLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=WORKERS,
                                 collate=_collate)
        described = f"sc.CachedLoader, batch {BATCH}, {WORKERS} assembly threads"
    report({"config": {
        "store": f"{cfg.get('url') or cfg['path']} (format {store.version}, placement {store.placement})",
        "device": {k: (round(v) if isinstance(v, float) else v) for k, v in store.device.items()},
        "gap_bytes": store.gap_bytes, "iops_bound": store.iops_bound,
        "cache": f"{cache.capacity_bytes} bytes in /dev/shm (RAM {RAM_SHARE:.0%}), policy importance",
        "ssd_tier": (f"{ssd.capacity_bytes} bytes at {cfg['ssd_dir']} (SSD {ssd_share:.0%}), "
                     f"scores from the cache, values of one file at most {ssd.gap_bytes} B apart "
                     "read together"
                     if ssd is not None else "none (--ssd-share 0)"),
        "sampler": {"order": sampler.order_kind, "extent_window": sampler.extent_window,
                    "extent_bytes": None if sampler.extents is None else sampler.extents.extent_bytes,
                    "rep_factor": 0, "pads": True, "temper": sampler.temper},
        "loader": described + ", samples as bytes",
        "prefetcher": ("the node's (its own process), 4096 samples / 64 MiB ahead" if prefetch
                       else "none"), "read_plan": node.read_plan.describe()}})

    def tier_counts():
        t = ds.stats()["tiers"]
        return {"ram_hits": ds.stats()["hits"], "ssd_hits": t["ssd"]["hits"],
                "ssd_requests": ssd.stats()["read_requests"] if ssd is not None else 0,
                "store_samples": t["store"]["hits"], "ssd_items": ssd.stats()["items"] if ssd else 0,
                "ssd_written": ssd.stats()["writes"] if ssd else 0}

    def prefetcher_counts(e):
        """The prefetcher's reads for epoch e (store and SSD tier) and what it put in the cache:
        the board's row of that epoch (it counts a read in the epoch of the window it read)."""
        board = node.board
        rows = [r for r in board.counters.epoch_counters() if r["epoch"] == e] if board is not None else []
        return {"prefetcher_reads": sum(r["reads_issued"] for r in rows),
                "prefetched": sum(r["prefetched"] for r in rows)}

    def one_epoch(e):
        sampler.set_epoch(e)
        before = tier_counts()
        n = _count(loader)
        sampler.end_epoch()
        after = tier_counts()
        report({"epoch_tiers": e, **{k: after[k] - before[k] if k not in ("ssd_items",) else after[k]
                                     for k in after}, **prefetcher_counts(e)})
        return n
    try:
        _Epochs(cfg["device"], cfg.get("proxy")).run(epochs, one_epoch, report)
        report({"tiers": {k: v for k, v in ds.stats().items() if isinstance(v, (int, float))}})
    finally:
        del loader
        node.close()
        if ssd is not None:
            ssd.close()
        cache.close()
        cache.unlink()


def run_streaming(cfg, epochs, report):
    import torch
    streaming = _import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    if cfg.get("endpoint"):
        os.environ["S3_ENDPOINT_URL"] = cfg["endpoint"]
    block = 4 * cfg["samples_per_shard"]
    budget = int((RAM_SHARE + SSD_SHARE) * cfg["data_bytes"])
    budget = max(budget, 4 * SHARD_BYTES + (1 << 20))   # its docs: at least a few shards
    ds = streaming.StreamingDataset(remote=cfg["remote"], local=cfg["local_dir"], shuffle=True,
                                    shuffle_seed=0, shuffle_algo="py1e", shuffle_block_size=block,
                                    cache_limit=budget, batch_size=BATCH, num_canonical_nodes=1)
    _drop_streaming_client(ds)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS,
                                         collate_fn=_collate, persistent_workers=True)
    report({"config": {
        "endpoint": cfg.get("endpoint", "local"),
        "version": streaming.__version__, "remote": cfg["remote"], "local": cfg["local_dir"],
        "shards": f"MDS, {SHARD_BYTES >> 20} MiB, no compression, no hashes",
        "cache_limit": budget, "shuffle": "py1e", "shuffle_block_size": block,
        "num_canonical_nodes": 1, "predownload": "default (8 x batch)",
        "loader": f"torch DataLoader, batch {BATCH}, {WORKERS} workers (persistent), samples as bytes"}})
    _Epochs(cfg["device"], cfg.get("proxy")).run(epochs, lambda e: _count(loader), report)
    del loader


def _drop_streaming_client(ds):
    """Streaming's downloaders keep a pooled boto3 client; made in this process before the
    DataLoader forks its workers, it is shared by them (BASELINES.md: hangs and a corrupt shard).
    Drop it here so that each worker makes its own."""
    for stream in getattr(ds, "streams", []):
        for name in ("_downloader", "downloader"):
            d = getattr(stream, name, None)
            if d is not None and hasattr(d, "clean_up"):
                d.clean_up()


def run_litdata(cfg, epochs, report):
    import litdata
    from litdata.streaming.resolver import Dir

    budget = int((RAM_SHARE + SSD_SHARE) * cfg["data_bytes"])
    # its cache must hold what every worker pre-downloads (workers x max_pre_download chunks) and
    # the chunk being read, or the workers wait for room forever
    budget = max(budget, (2 * WORKERS + 1) * SHARD_BYTES)
    allow_http = None
    if cfg.get("endpoint", "").startswith("http://"):
        # its obstore client options drop allow_http, and every chunk GET of a plain-http
        # endpoint fails (BASELINES.md): added here, before the workers fork
        import litdata.streaming.downloader as downloader
        opts = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
        if isinstance(opts, dict):
            downloader._OBSTORE_CLIENT_OPTIONS = allow_http = {**opts, "allow_http": True}
    if cfg.get("endpoint"):
        storage = {"endpoint_url": cfg["endpoint"], "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
                   "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
                   "region_name": os.environ.get("AWS_REGION", "us-east-1")}
        url = cfg["remote"]
    else:
        storage, url = {}, "local:" + cfg["remote"]
    ds = litdata.StreamingDataset(input_dir=Dir(path=cfg["local_dir"], url=url), shuffle=True, seed=0,
                                  max_cache_size=budget, storage_options=storage)
    loader = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS,
                                         collate_fn=_collate)
    report({"config": {
        "version": litdata.__version__, "input_dir": f"{url} cached at {cfg['local_dir']}",
        "storage_options": {k: v for k, v in storage.items() if "secret" not in k},
        "obstore_client_options": allow_http,
        "chunks": f"{SHARD_BYTES >> 20} MiB", "max_cache_size": budget, "shuffle": True,
        "loader": f"StreamingDataLoader, batch {BATCH}, {WORKERS} workers, samples as bytes"}})
    _Epochs(cfg["device"], cfg.get("proxy")).run(epochs, lambda e: _count(loader), report)
    del loader


RUNNERS = {"shadecache": run_shadecache, "streaming": run_streaming, "litdata": run_litdata}


def child_main(system, cfg_json, epochs):
    cfg = json.loads(cfg_json)
    out = os.fdopen(os.dup(1), "w", buffering=1)

    def report(obj):
        out.write(json.dumps(obj) + "\n")
    RUNNERS[system](cfg, int(epochs), report)
    return 0


# ---- the parent ------------------------------------------------------------------------------------

def available(system) -> str | None:
    """Why `system` cannot run here, or None."""
    try:
        if system == "streaming":
            _import_streaming()
        elif system == "litdata":
            import litdata  # noqa: F401
    except Exception as e:   # an import error of any kind: that system is left out, said why
        return f"{type(e).__name__}: {e}"
    return None


def run_system(disk, system, cfg, epochs, timeout, data_bytes, cap_bps=None):
    """The child's report lines, printed as they come; a child past `timeout` is killed and what
    it reported is kept (with a "failed" row)."""
    import threading

    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_child", system,
                             json.dumps(cfg), str(epochs)], stdout=subprocess.PIPE, stderr=err,
                            text=True, preexec_fn=disk.enter_in_child if disk is not None else None,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                [REPO, os.environ.get("PYTHONPATH", "")])))
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    rows = []
    try:
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            rows.append(row)
            if "config" in row:
                print(f"  {system} configuration: {json.dumps(row['config'])}", flush=True)
            if "epoch" in row:
                # what the throttle allows for these bytes and requests: the epoch's ceiling
                floor_s = (row["bytes"] / cap_bps if cap_bps else
                           max(row["bytes"] / READ_BPS, row["requests"] / READ_IOPS))
                ceiling = row["samples"] / floor_s if floor_s else float("inf")
                print(f"    epoch {row['epoch']}: {row['samples'] / row['seconds']:9,.0f} samples/s, "
                      f"read {row['bytes'] / data_bytes:5.2f}x the data in "
                      f"{row['requests']:,} requests ({row['seconds']:.1f} s; the throttle allows "
                      f"{ceiling:,.0f}/s at these bytes and requests)", flush=True)
            if "epoch_tiers" in row:
                print(f"      tiers: {json.dumps({k: v for k, v in row.items() if k != 'epoch_tiers'})}",
                      flush=True)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0:
        err.seek(0)
        why = "killed after the time limit" if rc == -9 else f"status {rc}"
        tail = err.read()[-2000:]
        print(f"  {system} FAILED ({why}): {tail}", flush=True)
        rows.append({"failed": f"{why}: {tail[-300:]}"})
    return rows


def summarize(rows, data_bytes):
    epochs = [r for r in rows if "epoch" in r]
    out = {"config": next((r["config"] for r in rows if "config" in r), {}),
           "epochs": epochs, "tiers": next((r["tiers"] for r in rows if "tiers" in r), None),
           "failed": next((r["failed"] for r in rows if "failed" in r), None),
           "epoch_tiers": [r for r in rows if "epoch_tiers" in r]}
    if epochs:
        cold, warm = epochs[0], epochs[1:]
        out["cold"] = {"samples_per_s": cold["samples"] / cold["seconds"],
                       "read_x": cold["bytes"] / data_bytes}
        if warm:
            out["warm"] = {"samples_per_s": [w["samples"] / w["seconds"] for w in warm],
                           "read_x": [w["bytes"] / data_bytes for w in warm]}
    return out


def main(argv=None) -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        return child_main(*sys.argv[2:5])
    import signal
    # a SIGTERM (a timeout around the whole run) unwinds: the disk, its cgroup and the caches go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small data sets (the tests' version)")
    ap.add_argument("--datasets", default="3k,100k,256")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per system and data set")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "peers.json"))
    ap.add_argument("--workdir", default="/var/tmp", help="local disk: image, caches, SSD tier")
    ap.add_argument("--loader", choices=("cachedloader", "dataloader"), default="cachedloader",
                    help="shadecache's loader (the peers use their own)")
    ap.add_argument("--probe", action="store_true",
                    help="shadecache measures the device at open instead of being given the throttle's rates")
    ap.add_argument("--ssd-share", type=float, default=SSD_SHARE,
                    help="shadecache's SSD tier, a share of the data (0: none)")
    ap.add_argument("--prefetch", action="store_true", help="shadecache: with the node's prefetcher")
    ap.add_argument("--storage", choices=("disk", "s3"), default="disk",
                    help="s3: the data on SeaweedFS behind the S3-shaped proxy (module docstring)")
    args = ap.parse_args(argv)
    if args.storage == "s3":
        return main_s3(args)
    why = throttled_disk.unavailable()
    if why:
        raise SystemExit(f"cannot run: {why}")
    sizes = QUICK if args.quick else DATASETS
    names = [d for d in args.datasets.split(",") if d]
    systems = [s for s in args.systems.split(",") if s]
    results = {"machine": os.uname().release, "quick": args.quick, "datasets": {}}
    skipped = {s: available(s) for s in systems}
    for s, why in skipped.items():
        if why:
            print(f"{s}: left out ({why})", flush=True)
    systems = [s for s in systems if not skipped[s]]
    for name in names:
        n, size = sizes[name]
        data_bytes = n * size
        image = int(max(512 << 20, 3.5 * data_bytes + (256 << 20)))
        local = tempfile.mkdtemp(prefix="shadecache-peers-", dir=args.workdir)
        row = {"samples": n, "sample_bytes": size, "data_bytes": data_bytes, "systems": {}}
        try:
            with throttled_disk.ThrottledDisk(image, READ_IOPS, READ_BPS, image_dir=args.workdir) as disk:
                with open(f"/sys/block/{disk.name}/queue/read_ahead_kb") as f:
                    ra = int(f.read())
                print(f"\n== {name}: {n:,} samples x {size:,} B = {data_bytes / 2**20:.0f} MiB; "
                      f"{disk.describe()}; read-ahead {ra} KiB; page cache dropped before every "
                      f"epoch; RAM {RAM_SHARE:.0%} + local disk {SSD_SHARE:.0%} of the data", flush=True)
                row["disk"] = disk.describe()
                for system in systems:
                    root = os.path.join(disk.mount, system)
                    os.makedirs(root)
                    t = time.perf_counter()
                    cfg = WRITERS[system](root, n, size)
                    os.sync()
                    cfg.update(device=disk.name, data_bytes=data_bytes, loader=args.loader,
                               ssd_share=args.ssd_share, probe=args.probe,
                               local_dir=os.path.join(local, system + "-cache"),
                               ssd_dir=os.path.join(local, system + "-ssd"))
                    size_b, alloc_b = _on_disk(root)
                    print(f"  {system}: written in {time.perf_counter() - t:.0f} s; "
                          f"{size_b / data_bytes:.3f}x the raw data in file bytes, "
                          f"{alloc_b / data_bytes:.3f}x in blocks allocated", flush=True)
                    rows = run_system(disk, system, cfg, args.epochs, args.timeout, data_bytes)
                    row["systems"][system] = summarize(rows, data_bytes)
                    row["systems"][system].update(file_x=size_b / data_bytes,
                                                  blocks_x=alloc_b / data_bytes)
                    shutil.rmtree(root, ignore_errors=True)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        results["datasets"][name] = row
    print_table(results)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


S3_LATENCY, S3_CONN_BPS, S3_TOTAL_BPS = 0.020, 50e6, 100e6


def main_s3(args) -> int:
    """The three systems on object storage (module docstring)."""
    from s3_proxy import ProxyProcess
    from seaweed import SeaweedServer

    sizes = QUICK if args.quick else DATASETS
    names = [d for d in args.datasets.split(",") if d]
    systems = [s for s in args.systems.split(",") if s]
    skipped = {s: available(s) for s in systems}
    for s, why in skipped.items():
        if why:
            print(f"{s}: left out ({why})", flush=True)
    systems = [s for s in systems if not skipped[s]]
    results = {"machine": os.uname().release, "quick": args.quick, "storage": "s3", "datasets": {}}
    work = tempfile.mkdtemp(prefix="shadecache-peers-s3-", dir=args.workdir)
    try:
        with SeaweedServer(work) as s3, ProxyProcess(s3.port, latency=S3_LATENCY, conn_bps=S3_CONN_BPS,
                                                     total_bps=S3_TOTAL_BPS) as proxy:
            os.environ.update(s3.env)
            os.environ.setdefault("SHADECACHE_SLOT_DIR", os.path.join(work, "slots"))
            shape = (f"SeaweedFS at {s3.endpoint} behind the proxy at {proxy.endpoint}: "
                     f"{S3_LATENCY * 1e3:.0f} ms before each response, {S3_CONN_BPS / 1e6:.0f} MB/s a "
                     f"connection, {S3_TOTAL_BPS / 1e6:.0f} MB/s in all")
            from shadecache.store.object_client import ObjectClient
            client = ObjectClient(endpoint_url=s3.endpoint)   # multipart uploads, straight to the server
            for name in names:
                n, size = sizes[name]
                data_bytes = n * size
                row = {"samples": n, "sample_bytes": size, "data_bytes": data_bytes, "systems": {},
                       "storage": shape}
                print(f"\n== {name}: {n:,} samples x {size:,} B = {data_bytes / 2**20:.0f} MiB; {shape}; "
                      f"RAM {RAM_SHARE:.0%} + local disk {SSD_SHARE:.0%} of the data", flush=True)
                for system in systems:
                    root = os.path.join(work, name, system)
                    os.makedirs(root)
                    t = time.perf_counter()
                    cfg = WRITERS[system](root, n, size)
                    prefix = f"{name}/{system}"
                    for folder, _, files in os.walk(root):
                        for f in files:
                            full = os.path.join(folder, f)
                            client.upload_file(full, s3.bucket, f"{prefix}/{os.path.relpath(full, root)}")
                    remote = {"shadecache": "url", "streaming": "remote", "litdata": "remote"}[system]
                    rel = os.path.relpath(cfg.get("path") or cfg["remote"], root)
                    cfg[remote] = f"s3://{s3.bucket}/{prefix}/{rel}"
                    local = os.path.join(work, name, system + "-local")
                    cfg.update(device=None, proxy=proxy.endpoint, endpoint=proxy.endpoint,
                               data_bytes=data_bytes, loader=args.loader, ssd_share=args.ssd_share,
                               probe=False, prefetch=args.prefetch, local_dir=os.path.join(local, "cache"),
                               ssd_dir=os.path.join(local, "ssd"))
                    size_b, alloc_b = _on_disk(root)
                    shutil.rmtree(root, ignore_errors=True)
                    print(f"  {system}: written and uploaded in {time.perf_counter() - t:.0f} s "
                          f"({size_b / data_bytes:.3f}x the raw data)", flush=True)
                    rows = run_system(None, system, cfg, args.epochs, args.timeout, data_bytes,
                                      cap_bps=S3_TOTAL_BPS)
                    row["systems"][system] = summarize(rows, data_bytes)
                    row["systems"][system].update(file_x=size_b / data_bytes)
                    shutil.rmtree(local, ignore_errors=True)
                results["datasets"][name] = row
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    out = args.out.replace(".json", "-s3.json") if args.out.endswith("peers.json") else args.out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {out}")
    return 0


def _on_disk(root):
    """(bytes of the files under root, bytes of the blocks the file system allocated for them)."""
    size = alloc = 0
    for folder, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(folder, f))
            size, alloc = size + st.st_size, alloc + st.st_blocks * 512
    return size, alloc


def _best_peer_warm(row):
    peers = [s for s in row["systems"] if s != "shadecache" and "warm" in row["systems"][s]]
    if not peers:
        return None, None
    best = max(peers, key=lambda s: np.mean(row["systems"][s]["warm"]["samples_per_s"]))
    return best, float(np.mean(row["systems"][best]["warm"]["samples_per_s"]))


def print_table(results):
    print("\n| data | system | warm samples/s | warm read / data | cold samples/s | cold read / data |")
    print("|---|---|---|---|---|---|")
    for name, row in results["datasets"].items():
        for system, s in row["systems"].items():
            warm = s.get("warm")
            w = (f"{min(warm['samples_per_s']):,.0f}-{max(warm['samples_per_s']):,.0f}" if warm else "-")
            wr = (f"{min(warm['read_x']):.2f}-{max(warm['read_x']):.2f}x" if warm else "-")
            c = s.get("cold", {})
            print(f"| {row['samples']:,} x {row['sample_bytes']:,} B | {system} | {w} | {wr} | "
                  f"{c.get('samples_per_s', 0):,.0f} | {c.get('read_x', 0):.2f}x |")
    print("\nacceptance (warm = mean of the warm epochs; read = the worst warm epoch):")
    targets = {"3k": (1.2, 0.6), "100k": (1.5, 0.55), "256": (1.0, None)}
    for name, row in results["datasets"].items():
        ours = row["systems"].get("shadecache")
        best, peer_rate = _best_peer_warm(row)
        if not ours or "warm" not in ours:
            continue
        rate = float(np.mean(ours["warm"]["samples_per_s"]))
        speed, read = targets.get(name, (None, None))
        line = f"  {name}: shadecache {rate:,.0f}/s"
        if best:
            line += f" = {rate / peer_rate:.2f}x {best} ({peer_rate:,.0f}/s; target >= {speed}x)"
        if read is not None:
            line += f"; warm read {max(ours['warm']['read_x']):.2f}x the data (target <= {read}x)"
        if name == "3k":
            line += f"; cold read {ours['cold']['read_x']:.2f}x (target <= 1.05x)"
        if name == "256" and "file_x" in ours:
            line += f"; the store on disk {ours['file_x']:.3f}x the raw data (target <= 1.05x)"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
