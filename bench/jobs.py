"""Several training jobs on one node: shadecache's shared cache against each job alone, the score
merge rules against each other and LRU, a job SIGKILLed mid-epoch, and Mosaic Streaming and
LitData running the same jobs side by side.

    python bench/jobs.py run        # acceptance 1-3: alone, together under each rule, a kill
    python bench/jobs.py accuracy   # acceptance 4: final accuracy alone and with three others
    /var/tmp/peers/bin/python bench/jobs.py peers   # acceptance 5: Streaming and LitData

The jobs (JOBS): four configurations of one training run that differ in seed, learning rate and
batch size, as a hyperparameter sweep's would; each is a process of its own (a job of its own:
sc.Node(job=...)), training a small MLP on the first FEATURES bytes of each sample with
ShadeSampler's defaults but stall_budget=0 (deferrals only: every epoch an exact permutation).

Storage (run, peers): the store on an ext4 loop device throttled by the cgroup v1 blkio
controller (bench/throttled_disk.py, 3,000 reads/s and 200 MiB/s), read with O_DIRECT (shadecache)
so that the bytes the device served are the bytes the jobs read; the cache holds a fifth of the
data (the store is 5x the cache). Bytes are the block device's own counters. Needs root.

Every choice is printed with the results; the results go to bench/out/jobs-*.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

import throttled_disk  # noqa: E402

JOBS = [dict(seed=0, lr=0.10, batch=64), dict(seed=1, lr=0.05, batch=128),
        dict(seed=2, lr=0.02, batch=256), dict(seed=3, lr=0.01, batch=96)]
SAMPLES, SAMPLE_BYTES, FEATURES = 20_000, 4096, 256
CACHE_SHARE = 0.2                 # the store holds 5x the cache
EPOCHS = 3
READ_IOPS, READ_BPS = 3000, 200 << 20
RULES = ("uses", "max", "sum", "last")
DROP_EVERY_S = 0.5                # peers: the page cache dropped this often (PageCacheDropper)
TICK_S = 0.25                     # the jobs' timelines: samples trained, every TICK_S


# ---- the data -----------------------------------------------------------------------------------
def samples(n: int, size: int):
    """Sample i: `size` bytes whose first FEATURES bytes tell its label (i % 10) through a noisy
    pattern (a task a small MLP learns), the rest filler."""
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 256, (10, FEATURES), dtype=np.uint8)
    filler = rng.bytes(size)
    for i in range(n):
        y = i % 10
        noise = rng.integers(-60, 61, FEATURES)
        x = np.clip(patterns[y].astype(np.int64) + noise, 0, 255).astype(np.uint8).tobytes()
        yield x + filler[:size - FEATURES], y


def write_store(folder: str, n: int, size: int) -> str:
    import shadecache as sc
    path = os.path.join(folder, "train.shc")
    with sc.PackWriter(path, seed=0) as w:
        for data, label in samples(n, size):
            w.add(data, label)
    return path


# ---- one job (a child process) ------------------------------------------------------------------
def _model(lr):
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def train_step(model, opt, sampler, x, y, idx) -> None:
    """One SHADE step: the per-sample losses to the sampler (its scores), their mean's gradient
    to the model."""
    import torch.nn.functional as F
    losses = F.cross_entropy(model(x), y, reduction="none")
    sampler.update(idx, losses.detach())
    opt.zero_grad()
    losses.mean().backward()
    opt.step()


class Ticker:
    """(seconds since start, samples trained) every TICK_S, written as they come."""

    def __init__(self, report):
        self.report, self.count, self.t0 = report, 0, time.monotonic()
        self._next = self.t0

    def add(self, k: int) -> None:
        self.count += k
        now = time.monotonic()
        if now >= self._next:
            self._next = now + TICK_S
            self.report({"tick": [time.time(), self.count]})


def job_child(cfg: dict) -> int:
    """One job: a node over the store and the cache the parent made, its sampler, its loop."""
    import torch
    import shadecache as sc
    torch.set_num_threads(1)
    out = os.fdopen(os.dup(1), "w", buffering=1)

    def report(obj):
        out.write(json.dumps(obj) + "\n")
    store = sc.PackedStore(cfg["path"], direct=True,
                           device={"iops": READ_IOPS, "bandwidth": READ_BPS, "source": "given"})
    cache = sc.Cache.attach(cfg["cache"])
    node = sc.Node(store, cache, job=cfg["job"], read_plan="samples",
                   score_merge=cfg.get("rule") or None)
    ds = node.dataset()
    sampler = node.sampler(batch_size=cfg["batch"], seed=cfg["seed"], stall_budget=0.0)
    loader = sc.CachedLoader(ds, batch_size=cfg["batch"], sampler=sampler, num_workers=2,
                             batch_transform=lambda x: x[:, :FEATURES].float() / 255.0)
    torch.manual_seed(cfg["seed"])
    model, opt = _model(cfg["lr"])
    ticks, view = Ticker(report), None
    report({"started": time.time(), "pid": os.getpid(), "job": cfg["job"]})
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        before, t0, ids = ds.stats(), time.perf_counter(), []
        for x, y, idx in loader:
            train_step(model, opt, sampler, x, y, idx)
            ids.append(idx.numpy().copy())
            ticks.add(len(idx))
            if view is None:      # a zero-copy reader's pin, held for the run (a kill leaves it)
                view = cache.view(int(idx[0]))
        sampler.end_epoch()
        after, ids = ds.stats(), np.concatenate(ids)
        counts = np.bincount(ids, minlength=len(ds))
        report({"epoch": epoch, "seconds": time.perf_counter() - t0, "end": time.time(), "samples": int(ids.size),
                "hits": after["hits"] - before["hits"], "store_reads": after["store_reads"] - before["store_reads"],
                "permutation": bool((counts == 1).all()), "followed": (sampler.follow_history + [0] * (epoch + 1))[epoch]})
    if view is not None:
        view.release()
    report({"done": time.time(), "stats": {k: v for k, v in ds.stats().items() if isinstance(v, (int, float))}})
    node.close()
    cache.close()
    return 0


# ---- the parent: jobs side by side -------------------------------------------------------------
class Child:
    """A job's process and the lines it reported (read by a thread as they come)."""

    def __init__(self, cfg: dict, disk, python=sys.executable, mode="_job"):
        self.cfg, self.rows = cfg, []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), mode, json.dumps(cfg)],
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, env=env,
                                     preexec_fn=disk.enter_in_child if disk is not None else None,
                                     start_new_session=True)   # a group: a hung job's workers go with it
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.rows.append(json.loads(line))

    def wait(self, timeout):
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)   # its DataLoader workers too
            self.proc.wait()
            rc = "hung: killed after the time limit"
        self.thread.join(5)
        if rc not in (0, -signal.SIGKILL):
            self.err.seek(0)
            self.rows.append({"failed": f"{rc}: {self.err.read()[-1500:]}"})
        return rc

    def epochs(self):
        return [r for r in self.rows if "epoch" in r]

    def ticks(self):
        return [r["tick"] for r in self.rows if "tick" in r]


def segment_bytes(name: str) -> int:
    return os.stat(f"/dev/shm/shadecache.{name}").st_size


def run_together(disk, path, configs, rule="uses", policy="importance", kill=None, kill_at=1.5,
                 timeout=1800):
    """The jobs of `configs` side by side on one new cache: device bytes, each job's epochs, the
    segment's size before and after, and with kill=k the SIGKILL of job k when it has trained
    `kill_at` epochs, and what became of its files."""
    import shadecache as sc
    with sc.PackedStore(path) as store:
        capacity = sc.Cache.capacity_for(int(CACHE_SHARE * len(store)), store.lengths)
        name = f"jobs-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        cache = sc.Cache.for_store(name, store, capacity_bytes=capacity, attach=False, policy=policy)
    seg0, b0 = segment_bytes(name), disk.counters()
    kids = [Child({**c, "path": path, "cache": name, "job": f"job{c.get('index', k)}", "rule": rule,
                   "epochs": EPOCHS, "samples": len(store)}, disk) for k, c in enumerate(configs)]
    killed = None
    try:
        if kill is not None:
            victim = kids[kill] if kill != "prefetcher" else _prefetchers_parent(kids, name)
            killed = _kill_mid_epoch(victim, name, kill_at)
        rcs = [k.wait(timeout) for k in kids]
        b1 = disk.counters()
        out = {"rule": rule, "policy": policy, "cache": name, "capacity_bytes": capacity,
               "segment_bytes": [seg0, segment_bytes(name)], "store_bytes": b1.bytes - b0.bytes,
               "store_requests": b1.requests - b0.requests, "returncodes": rcs,
               "pinned_after": cache.stats()["pinned"], "killed": killed,
               "jobs": [{"cfg": k.cfg, "epochs": k.epochs(), "ticks": k.ticks(),
                         "failed": next((r["failed"] for r in k.rows if "failed" in r), None)}
                        for k in kids]}
        out["left_in_shm"] = sorted(e for e in os.listdir("/dev/shm") if name in e and e != f"shadecache.{name}")
        return out
    finally:
        for k in kids:
            if k.proc.poll() is None:
                k.proc.kill()
        cache.close()
        cache.unlink()


def _prefetchers_parent(kids, cache_name):
    """The job whose process started the node's prefetcher (the worst one to lose: the
    prefetcher goes with it, and another job must start one again)."""
    from shadecache.lookahead.board import OrderBoard
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with OrderBoard.attach(cache_name) as b:
                pid = b.control.prefetcher_pid
        except (FileNotFoundError, ValueError):
            pid = 0
        if pid:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            for k in kids:
                if k.proc.pid == ppid:
                    return k
        time.sleep(0.1)
    return kids[0]


def _kill_mid_epoch(child, cache_name, at_epochs):
    """SIGKILLs `child` once it has trained `at_epochs` epochs (1.5: halfway through epoch 1);
    returns when, and when its job's board left /dev/shm (removed by the other jobs) and how many
    pins the cache held meanwhile."""
    import shadecache as sc
    half = at_epochs * child.cfg["samples"]
    while not child.ticks() or child.ticks()[-1][1] < half:
        if child.proc.poll() is not None:
            return {"error": "the job ended before it could be killed"}
        time.sleep(0.05)
    mine = [f for f in os.listdir("/dev/shm") if f.startswith(f"shadecache-job.{cache_name}.")]
    t_kill = time.time()
    os.kill(child.proc.pid, signal.SIGKILL)
    gone_after = None
    slot_file = None
    with sc.Cache.attach(cache_name) as c:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            now = [f for f in os.listdir("/dev/shm") if f.startswith(f"shadecache-job.{cache_name}.")]
            if len(now) < len(mine):
                slot_file = sorted(set(mine) - set(now))
                gone_after = time.time() - t_kill
                break
            time.sleep(0.01)
        pinned = c.stats()["pinned"]
    return {"at": t_kill, "at_epochs": at_epochs, "job": child.cfg["job"], "files_removed_after_s": gone_after,
            "removed": slot_file, "pinned_right_after": pinned}


def run_alone(disk, path, k, timeout=1800):
    return run_together(disk, path, [{**JOBS[k], "index": k}], timeout=timeout)


def summary(res):
    """Per job: hit ratio, samples/s per epoch, permutations; and the run's store bytes."""
    rows = []
    for j in res["jobs"]:
        ep = j["epochs"]
        samples = sum(e["samples"] for e in ep)
        rows.append({"job": j["cfg"]["job"], "seed": j["cfg"]["seed"], "batch": j["cfg"]["batch"],
                     "lr": j["cfg"]["lr"], "hit_ratio": sum(e["hits"] for e in ep) / samples if samples else 0.0,
                     "samples_per_s": [e["samples"] / e["seconds"] for e in ep],
                     "permutations": [e["permutation"] for e in ep], "followed": [e["followed"] for e in ep],
                     "failed": j["failed"]})
    return {"store_bytes": res["store_bytes"], "store_requests": res["store_requests"], "jobs": rows, "hits": sum(
        sum(e["hits"] for e in j["epochs"]) for j in res["jobs"]), "segment_bytes": res["segment_bytes"]}


def kill_rates(res):
    """Each surviving job's samples/s over whole epochs: [its last warm epoch (1 on) that ended
    before the kill, the first that began a second or more after it, their numbers]. Whole
    epochs, not windows of seconds: an epoch begins with a burst (the cached samples first, at
    2-3x the job's pace for a second), and a window of a few seconds holds zero, one or two of
    them, which moved its rate by up to 25% either way."""
    t = res["killed"]["at"]
    out = {}
    for j in res["jobs"]:
        if j["cfg"]["job"] == res["killed"]["job"]:
            continue
        spans = [(e["end"] - e["seconds"], e["end"], e["samples"] / e["seconds"], e["epoch"]) for e in j["epochs"]]
        before = [s for s in spans if s[3] >= 1 and s[1] <= t]
        after = [s for s in spans if s[0] >= t + 1.0]
        out[j["cfg"]["job"]] = [before[-1][2] if before else None, after[0][2] if after else None,
                                before[-1][3] if before else None, after[0][3] if after else None]
    return out


# ---- the peers: the same jobs on Mosaic Streaming and LitData ------------------------------------
def _peer_loader(cfg):
    """The job's loader over its system, configured as its docs allow (module docstring of
    bench/peers.py for each choice; here each job has its seed and batch size)."""
    import peers
    import torch
    budget = int(CACHE_SHARE * cfg["data_bytes"])
    if cfg["system"] == "streaming":
        streaming = peers._import_streaming()
        budget = max(budget, 4 * peers.SHARD_BYTES + (1 << 20))   # its docs: a few shards at least
        ds = streaming.StreamingDataset(remote=cfg["remote"], local=cfg["local_dir"], shuffle=True,
                                        shuffle_seed=cfg["seed"], shuffle_algo="py1e",
                                        shuffle_block_size=4 * cfg["samples_per_shard"],
                                        cache_limit=budget, batch_size=cfg["batch"], num_canonical_nodes=1)
        peers._drop_streaming_client(ds)
        return torch.utils.data.DataLoader(ds, batch_size=cfg["batch"], num_workers=2,
                                           collate_fn=peers._collate, persistent_workers=True)
    import litdata
    from litdata.streaming.resolver import Dir
    budget = max(budget, 5 * peers.SHARD_BYTES)     # what 2 workers pre-download, and one more
    ds = litdata.StreamingDataset(input_dir=Dir(path=cfg["local_dir"], url="local:" + cfg["remote"]),
                                  shuffle=True, seed=cfg["seed"], max_cache_size=budget)
    return litdata.StreamingDataLoader(ds, batch_size=cfg["batch"], num_workers=2,
                                       collate_fn=peers._collate)


def peer_child(cfg: dict) -> int:
    """One job on a peer system: its loader, the same model and loop as job_child's."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    out = os.fdopen(os.dup(1), "w", buffering=1)

    def report(obj):
        out.write(json.dumps(obj) + "\n")
    report({"started": time.time(), "pid": os.getpid()})
    try:
        loader = _peer_loader(cfg)
    except Exception as e:   # noqa: BLE001 (what the system said is the result)
        report({"refused": f"{type(e).__name__}: {e}"[:500]})
        return 0
    torch.manual_seed(cfg["seed"])
    model, opt = _model(cfg["lr"])
    for epoch in range(cfg["epochs"]):
        t0, count = time.perf_counter(), 0
        for batch in loader:
            x = torch.tensor(np.frombuffer(b"".join(b[0][:FEATURES] for b in batch), np.uint8)
                             .reshape(len(batch), FEATURES), dtype=torch.float32) / 255.0
            y = torch.tensor([b[1] for b in batch])
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            count += len(batch)
        report({"epoch": epoch, "seconds": time.perf_counter() - t0, "samples": count})
    report({"done": time.time()})
    os._exit(0)   # LitData's and Streaming's worker pools: no wait on their teardown


def _write_peer_data(system, root, n):
    import peers
    gen = peers.samples
    peers.samples = samples          # the same samples as shadecache's store
    try:
        return peers.WRITERS[system](root, n, SAMPLE_BYTES)
    finally:
        peers.samples = gen


class PageCacheDropper:
    """Drops the page cache every `every_s` seconds while the block runs (every_s 0: never).
    Streaming and LitData read the store with buffered reads: without drops, the node's page cache
    is a second, unbounded cache that every job shares, outside the budget each system is given,
    and the device counters show one read where the jobs made four. shadecache reads with
    O_DIRECT, which the page cache never serves."""

    def __init__(self, every_s: float):
        self.every_s, self.stop = every_s, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(self.every_s):
            throttled_disk.drop_caches()

    def __enter__(self):
        if self.every_s > 0:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


def run_peer(disk, system, data, n, epochs, shared_local, timeout):
    """The four jobs on `system` side by side: one local directory for all (shared_local) or one
    per job; device bytes, each job's outcome (read, refused, hung) and samples/s."""
    local = tempfile.mkdtemp(prefix=f"jobs-{system}-", dir="/var/tmp")
    b0 = disk.counters()
    kids = []
    for k, c in enumerate(JOBS):
        cfg = {**c, **data, "system": system, "epochs": epochs, "data_bytes": n * SAMPLE_BYTES,
               "local_dir": os.path.join(local, "shared" if shared_local else f"job{k}")}
        kids.append(Child(cfg, disk, mode="_peer"))
    deadline = time.monotonic() + timeout      # one limit for the four, not one each
    with PageCacheDropper(DROP_EVERY_S):
        rcs = [k.wait(max(1.0, deadline - time.monotonic())) for k in kids]
    b1 = disk.counters()
    jobs = []
    for k, rc in zip(kids, rcs):
        ep = k.epochs()
        refused = next((r["refused"] for r in k.rows if "refused" in r), None)
        what = ("refused" if refused else "hung" if isinstance(rc, str) else
                "read" if len(ep) == epochs else f"failed ({rc})")
        samples = sum(e["samples"] for e in ep)
        jobs.append({"outcome": what, "detail": refused or (rc if isinstance(rc, str) else None),
                     "epochs_done": len(ep), "samples_per_s": samples / sum(e["seconds"] for e in ep) if ep else 0.0,
                     "failed": next((r["failed"] for r in k.rows if "failed" in r), None)})
    subprocess.run(["rm", "-rf", local])
    return {"system": system, "local": "one for all jobs" if shared_local else "one per job",
            "store_bytes": b1.bytes - b0.bytes, "jobs": jobs}


def main_peers(args) -> int:
    global EPOCHS, DROP_EVERY_S
    EPOCHS, DROP_EVERY_S = args.epochs, args.drop_every
    import peers
    n = args.samples
    image = int(max(512 << 20, 4 * n * SAMPLE_BYTES + (256 << 20)))
    results = {"samples": n, "sample_bytes": SAMPLE_BYTES, "epochs": args.epochs, "jobs": JOBS, "drop_every_s": DROP_EVERY_S, "runs": []}
    with throttled_disk.ThrottledDisk(image, READ_IOPS, READ_BPS, image_dir=args.workdir) as disk:
        print(f"{disk.describe()}; {n:,} samples x {SAMPLE_BYTES:,} B; {args.epochs} epochs; jobs {JOBS}",
              flush=True)
        for system in args.systems.split(","):
            why = peers.available(system)
            if why:
                print(f"{system}: left out ({why})", flush=True)
                continue
            root = os.path.join(disk.mount, system)
            os.makedirs(root)
            if system == "shadecache":
                path = write_store(root, n, SAMPLE_BYTES)
                os.sync()
                throttled_disk.drop_caches()
                res = summary(run_together(disk, path, JOBS, timeout=args.timeout))
                results["runs"].append({"system": system, "local": "one cache (RAM) for all jobs",
                                        "store_bytes": res["store_bytes"],
                                        "jobs": [{"outcome": "read" if not j["failed"] else "failed",
                                                  "samples_per_s": _overall(j),
                                                  "epochs_done": len(j["samples_per_s"])}
                                                 for j in res["jobs"]]})
                print(f"  {json.dumps(results['runs'][-1])}", flush=True)
                continue
            data = _write_peer_data(system, root, n)
            os.sync()
            for shared in (True, False):
                throttled_disk.drop_caches()
                results["runs"].append(run_peer(disk, system, data, n, args.epochs, shared, args.timeout))
                print(f"  {json.dumps(results['runs'][-1])}", flush=True)
    print_peers(results)
    _save(args.out, results)
    return 0


def _overall(job_row):
    return float(np.mean(job_row["samples_per_s"]))


def print_peers(results):
    one = results["samples"] * SAMPLE_BYTES
    print("\n| system | local storage | store bytes | / data | what each job did | samples/s per job |")
    print("|---|---|---|---|---|---|")
    for r in results["runs"]:
        did = ", ".join(j["outcome"] for j in r["jobs"])
        rates = ", ".join(f"{j['samples_per_s']:,.0f}" for j in r["jobs"])
        print(f"| {r['system']} | {r['local']} | {r['store_bytes']:,} | {r['store_bytes'] / one:.2f}x | {did} | {rates} |")


# ---- accuracy: each job alone and with three others (fidelity data sets) ------------------------
def accuracy_child(cfg: dict) -> int:
    """One job on a fidelity data set (bench/fidelity.py's store, model and decode): its final
    test accuracy, trained through a node of its own job on the cache the parent made."""
    import torch
    import shadecache as sc
    import fidelity
    torch.set_num_threads(1)
    spec = fidelity.fdata.DATASETS[cfg["dataset"]]()
    store = sc.PackedStore(cfg["path"])
    cache = sc.Cache.attach(cfg["cache"])
    node = sc.Node(store, cache, job=cfg["job"], read_plan="samples")
    ds = node.dataset()
    sampler = node.sampler(batch_size=cfg["batch"], seed=cfg["seed"], stall_budget=0.0)
    nbytes = np.asarray(spec["train"][0][0], dtype=spec["dtype"]).nbytes
    loader = sc.CachedLoader(ds, batch_size=cfg["batch"], sampler=sampler, num_workers=0,
                             batch_transform=fidelity.BatchDecode(spec, nbytes))
    torch.manual_seed(cfg["seed"])
    model = fidelity.make_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9, weight_decay=5e-4)
    perms = []
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        seen = []
        for x, y, idx in loader:
            train_step(model, opt, sampler, x, y, idx)
            seen.append(idx.numpy().copy())
        sampler.end_epoch()
        perms.append(bool((np.bincount(np.concatenate(seen), minlength=len(ds)) == 1).all()))
    st = ds.stats()
    node.close()
    cache.close()
    model.eval()
    tx = fidelity.to_tensor(np.asarray(spec["test"][0]), spec)
    ty = torch.from_numpy(np.asarray(spec["test"][1], dtype=np.int64))
    with torch.no_grad():
        acc = float((model(tx).argmax(1) == ty).float().mean()) * 100
    print(json.dumps({"acc": acc, "hit_ratio": st["hit_ratio"], "permutations": perms,
                      "followed": sampler.follow_history}), flush=True)
    return 0


def _accuracy_group(path, n, lengths, dataset, seed, configs, epochs):
    """The jobs of `configs` (index, job config) with `seed`, side by side on one new cache."""
    import shadecache as sc
    name = f"jobs-acc-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    capacity = sc.Cache.capacity_for(int(CACHE_SHARE * n), lengths)
    out = {}
    with sc.Cache.create(name, num_samples=n, capacity_bytes=capacity, sizes=lengths) as cache:
        kids = {k: Child({**c, "seed": 100 * seed + c["seed"], "dataset": dataset, "path": path, "cache": name,
                          "job": f"job{k}", "epochs": epochs}, None, mode="_accuracy")
                for k, c in configs}
        for k, kid in kids.items():
            kid.wait(1800)
            row = next((r for r in kid.rows if "acc" in r), None)
            out[k] = row if row is not None else {"failed": kid.rows[-1:]}
    return out


def main_accuracy(args) -> int:
    import fidelity
    results = {"epochs": args.epochs, "jobs": JOBS, "cache_share": CACHE_SHARE, "runs": []}
    with tempfile.TemporaryDirectory(prefix="jobs-acc-", dir=fidelity.FAST_DIR) as tmp:
        for dataset in args.datasets.split(","):
            data = fidelity.Prepared(dataset, tmp)
            lengths = data.store.lengths
            for seed in range(args.seeds):
                together = _accuracy_group(data.path, data.n, lengths, dataset, seed,
                                           list(enumerate(JOBS)), args.epochs)
                for k, c in enumerate(JOBS):
                    alone = _accuracy_group(data.path, data.n, lengths, dataset, seed, [(k, c)],
                                            args.epochs)[k]
                    results["runs"].append({"dataset": dataset, "seed": seed, "job": k,
                                            "alone": alone, "together": together[k]})
                    print(f"  {json.dumps(results['runs'][-1])}", flush=True)
            data.close()
    print_accuracy(results)
    _save(args.out, results)
    return 0


def print_accuracy(results):
    print("\n| data set | job (seed offset, lr, batch) | accuracy alone (mean ± sd over seeds) | "
          "Δ with three others (mean ± se) | paired t | within seed noise | hit ratio alone -> together |")
    print("|---|---|---|---|---|---|---|")
    for dataset in sorted({r["dataset"] for r in results["runs"]}):
        for k, c in enumerate(JOBS):
            rows = [r for r in results["runs"] if r["dataset"] == dataset and r["job"] == k
                    and "acc" in r["alone"] and "acc" in r["together"]]
            if len(rows) < 2:
                continue
            a = np.array([r["alone"]["acc"] for r in rows])
            d = np.array([r["together"]["acc"] - r["alone"]["acc"] for r in rows])
            se = d.std(ddof=1) / np.sqrt(d.size)
            t = d.mean() / se if se > 0 else 0.0
            ha = np.mean([r["alone"]["hit_ratio"] for r in rows])
            ht = np.mean([r["together"]["hit_ratio"] for r in rows])
            print(f"| {dataset} | job{k} ({c['seed']}, {c['lr']}, {c['batch']}) | {a.mean():.2f} ± {a.std(ddof=1):.2f} | "
                  f"{d.mean():+.2f} ± {se:.2f} | {t:+.2f} | {abs(d.mean()) <= a.std(ddof=1) and abs(t) < 2.0} | "
                  f"{ha:.3f} -> {ht:.3f} |")


def print_run(results):
    alone = {s["jobs"][0]["job"]: s for s in results["alone"]}
    one = float(np.mean([s["store_bytes"] for s in alone.values()]))
    one_req = float(np.mean([s["store_requests"] for s in alone.values()]))
    print("\n| run | rule | store bytes | / one job alone (mean of the four) | store requests | / one alone | "
          "hits (all jobs) | hit ratio per job | segment bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in results["alone"]:
        print(f"| {s['jobs'][0]['job']} alone | - | {s['store_bytes']:,} | {s['store_bytes'] / one:.2f}x | "
              f"{s['store_requests']:,} | {s['store_requests'] / one_req:.2f}x | {s['hits']:,} | "
              f"{s['jobs'][0]['hit_ratio']:.3f} | {s['segment_bytes'][1]:,} |")
    for key, s in results["together"].items():
        ratios = ", ".join(f"{j['hit_ratio']:.3f}" for j in s["jobs"])
        print(f"| 4 jobs | {key} | {s['store_bytes']:,} | {s['store_bytes'] / one:.2f}x | "
              f"{s['store_requests']:,} | {s['store_requests'] / one_req:.2f}x | {s['hits']:,} | {ratios} | "
              f"{s['segment_bytes'][0]:,} -> {s['segment_bytes'][1]:,} |")
    print("\n| job | seed | batch | lr | hit ratio alone | hit ratio with 4 (uses) | samples/s alone | "
          "samples/s with 4 | every epoch a permutation | samples followed per epoch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for j in results["together"]["uses"]["jobs"]:
        a = alone[j["job"]]["jobs"][0]
        print(f"| {j['job']} | {j['seed']} | {j['batch']} | {j['lr']} | {a['hit_ratio']:.3f} | {j['hit_ratio']:.3f} | "
              f"{', '.join(f'{r:,.0f}' for r in a['samples_per_s'])} | "
              f"{', '.join(f'{r:,.0f}' for r in j['samples_per_s'])} | "
              f"{all(j['permutations']) and all(a['permutations'])} | {j['followed']} |")
    print_kill(results)


def print_kill(results):
    k = results.get("kill")
    if k:
        print(f"\nSIGKILL of {k['killed']['job']} after {k['killed'].get('at_epochs', 1.5):g} of its epochs: its files removed after "
              f"{k['killed']['files_removed_after_s']} s ({k['killed']['removed']}); pins right after the "
              f"kill {k['killed']['pinned_right_after']}, after the run {k['pinned_after']}; left in /dev/shm "
              f"after the run: {k['left_in_shm']}; return codes {k['returncodes']}")
        for job, (before, after, e0, e1) in k["rates"].items():
            change = f"{(after / before - 1) * 100:+.1f}%" if before and after else "-"
            print(f"  {job}: {before or 0:,.0f} samples/s in its epoch {e0} (before the kill), "
                  f"{after or 0:,.0f} in its epoch {e1} (begun after it) ({change})")


def plot_kill(kill, png):
    """Each job's samples/s over time (from its ticks, per second), the kill marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = kill["killed"]["at"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for job, ticks in sorted(kill["ticks"].items()):
        a = np.asarray(ticks, dtype=np.float64)
        if len(a) < 3:
            continue
        edges = np.arange(a[0, 0], a[-1, 0], 1.0)
        counts = np.interp(edges, a[:, 0], a[:, 1])
        ax.plot(edges[1:] - t0, np.diff(counts), label=job + (" (killed)" if job == kill["killed"]["job"] else ""))
    ax.axvline(0.0, color="k", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds from the SIGKILL")
    ax.set_ylabel("samples/s (1 s bins)")
    ax.set_title("Four jobs on one cache, the prefetcher's job killed mid-epoch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main_run(args) -> int:
    global EPOCHS
    EPOCHS = args.epochs
    why = throttled_disk.unavailable()
    if why:
        raise SystemExit(f"cannot run: {why}")
    n = args.samples
    image = int(max(512 << 20, 3 * n * SAMPLE_BYTES + (256 << 20)))
    results = {"samples": n, "sample_bytes": SAMPLE_BYTES, "epochs": EPOCHS, "cache_share": CACHE_SHARE,
               "jobs": JOBS, "alone": [], "together": {}}
    with throttled_disk.ThrottledDisk(image, READ_IOPS, READ_BPS, image_dir=args.workdir) as disk:
        print(f"{disk.describe()}; {n:,} samples x {SAMPLE_BYTES:,} B, the cache {CACHE_SHARE:.0%} of "
              f"the data; {EPOCHS} epochs; jobs {JOBS}", flush=True)
        path = write_store(disk.mount, n, SAMPLE_BYTES)
        os.sync()
        for k in range(len(JOBS)) if "alone" in args.parts else ():
            throttled_disk.drop_caches()
            results["alone"].append(summary(run_alone(disk, path, k)))
            print(f"  alone job{k}: {json.dumps(results['alone'][-1])}", flush=True)
        for rule in args.rules.split(",") if "together" in args.parts else ():
            throttled_disk.drop_caches()
            policy = "lru" if rule == "lru" else "importance"
            res = run_together(disk, path, JOBS, rule="uses" if rule == "lru" else rule, policy=policy)
            results["together"][rule] = summary(res)
            print(f"  together {rule}: {json.dumps(results['together'][rule])}", flush=True)
        if "kill" in args.parts:
            throttled_disk.drop_caches()
            res = run_together(disk, path, JOBS, kill=args.kill if args.kill == "prefetcher" else int(args.kill),
                               kill_at=args.kill_at)
            res["rates"] = kill_rates(res)
            results["kill"] = {k: res[k] for k in ("killed", "pinned_after", "left_in_shm", "returncodes",
                                                   "rates", "store_bytes")}
            results["kill"]["jobs"] = summary(res)["jobs"]
            results["kill"]["ticks"] = {j["cfg"]["job"]: j["ticks"] for j in res["jobs"]}
            if args.plot:
                plot_kill(results["kill"], args.plot)
            print(f"  kill: {json.dumps(results['kill'])}", flush=True)
    if results["alone"] and "uses" in results["together"]:
        print_run(results)
    else:
        print_kill(results)
    _save(args.out, results)
    return 0


def _save(path, results):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {path}")


def main(argv=None) -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "_job":
        return job_child(json.loads(sys.argv[2]))
    if len(sys.argv) > 2 and sys.argv[1] == "_peer":
        return peer_child(json.loads(sys.argv[2]))
    if len(sys.argv) > 2 and sys.argv[1] == "_accuracy":
        return accuracy_child(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="acceptance 1-3: alone, together under each rule, a kill")
    r.add_argument("--samples", type=int, default=SAMPLES)
    r.add_argument("--epochs", type=int, default=EPOCHS)
    r.add_argument("--rules", default="uses,max,sum,last,lru")
    r.add_argument("--parts", default="alone,together,kill")
    r.add_argument("--kill-at", type=float, default=2.5,
                   help="the epochs the killed job has trained when it is killed (2.5: halfway through "
                        "epoch 2; the survivors' warm epochs before and after it are compared: "
                        "--epochs 5 leaves one after it)")
    r.add_argument("--kill", default="prefetcher",
                   help="the job killed: an index in JOBS, or 'prefetcher': the one that started it")
    r.add_argument("--workdir", default="/var/tmp")
    r.add_argument("--out", default=os.path.join(HERE, "out", "jobs-run.json"))
    r.add_argument("--plot", default=os.path.join(REPO, "docs", "jobs-kill.png"),
                   help="the kill's timeline (PNG; '' for none)")
    a = sub.add_parser("accuracy", help="acceptance 4: accuracy alone and with three others")
    a.add_argument("--datasets", default="tabular,gratings-s")
    a.add_argument("--seeds", type=int, default=4)
    a.add_argument("--epochs", type=int, default=12)
    a.add_argument("--out", default=os.path.join(HERE, "out", "jobs-accuracy.json"))
    p = sub.add_parser("peers", help="acceptance 5: Streaming and LitData with the same jobs")
    p.add_argument("--samples", type=int, default=SAMPLES)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--systems", default="shadecache,streaming,litdata")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--workdir", default="/var/tmp")
    p.add_argument("--drop-every", type=float, default=DROP_EVERY_S,
                   help="seconds between page cache drops while Streaming and LitData run (0: none)")
    p.add_argument("--out", default=os.path.join(HERE, "out", "jobs-peers.json"))
    args = ap.parse_args(argv)
    return {"run": main_run, "accuracy": main_accuracy, "peers": main_peers}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
