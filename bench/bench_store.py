"""Packed sample store: random reads against what a user would use instead.

    python bench/bench_store.py            # ~3 minutes; prints a table, writes bench/out/bench_store.json

Rows (every ratio is measured in this run, alternatives interleaved round by round, and the
figure reported is the median over rounds of the per-round ratio, so a slow spell of this shared
machine hits both sides of a ratio alike; the fio rows run fio, ours, ours, fio in each of 11
rounds of 1 s runs):

1. 4 KB samples, O_DIRECT, queue depth 32: PackedStore.read_many(256 ids) IOPS vs
   `fio --ioengine=io_uring --iodepth=32 --direct=1 --rw=randread --bs=4k` on the same file.
2. 4 KB samples, page cache dropped before each side: read_many(256) (buffered, QD 32) vs a
   Python loop of os.pread over the same ids; the same in O_DIRECT (loop of os.preadv into an
   aligned buffer) and warm (both served by the page cache).
3. 128 KB samples, O_DIRECT, QD 32: read_many(256) bandwidth vs fio --bs=128k.
4. One file per sample (an ImageFolder tree of small files): FolderStore.read_many(256) vs a loop
   of open(path, 'rb').read(), with a cold page cache (dropped before each side) and warm.
5. The same 4 KB and 128 KB O_DIRECT ids through the prefetch path: a stream of
   256-id batches through the prefetcher's reads (the tier chain's pipeline, shadecache/tiers.py:
   the PackedStore's stream, 2 lanes, QD 32 in all, 4 batches queued) vs fio in the same rounds (fio, stream, stream, fio).
   `--stream-only` runs just these rows.

Checksums are verified by read_many in every row (the default); the alternatives check nothing.
Needs fio (installed with apt-get when missing and possible, else its rows are skipped) and root
for `echo 3 > /proc/sys/vm/drop_caches` (else the cold rows are skipped). The files (about
2 x --gib GiB) are deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import time

# numpy's OpenBLAS threads busy-wait next to the reads otherwise (seen in perf on this 1-core
# machine); nothing here uses BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shadecache as sc  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
BATCH = 256
QD = 32


# ---- setup -------------------------------------------------------------------------------------

def ensure_fio() -> str | None:
    fio = shutil.which("fio")
    if fio is None and shutil.which("apt-get") and os.geteuid() == 0:
        print("fio not found: installing it with apt-get ...", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "-q", "fio"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=300)
        fio = shutil.which("fio")
    if fio is None:
        print("fio is not available: the fio rows are skipped", file=sys.stderr)
    return fio


def can_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def make_pack(path: str, sample_bytes: int, total_bytes: int) -> int:
    """A store of equal-sized samples cut from a random buffer (distinct contents, cheap)."""
    n = total_bytes // sample_bytes
    pool = np.random.default_rng(0).bytes(64 << 20)
    view = memoryview(pool)
    span = len(pool) - sample_bytes
    # in id order: the samples are of one size, so the placement changes no offset's alignment,
    # and a shuffled pack would write the file twice (its staging copy)
    with sc.PackWriter(path, shuffle=False) as w:
        for i in tqdm(range(n), desc=f"pack {sample_bytes // 1024} KB samples", unit="sample",
                      mininterval=0.5, file=sys.stderr):
            o = (i * 4099 + 17) % span
            w.add(view[o:o + sample_bytes], i % 1000)
    return n


def make_tree(root: str, files: int, classes: int = 100) -> None:
    """An ImageFolder tree of small files (2-16 KB, the many-small-files case)."""
    rng = np.random.default_rng(1)
    pool = rng.bytes(16 << 20)
    per = files // classes
    for c in tqdm(range(classes), desc="write folder tree", unit="class", file=sys.stderr):
        d = os.path.join(root, f"class{c:03d}")
        os.makedirs(d, exist_ok=True)
        for j in range(per):
            n = int(rng.integers(2048, 16384))
            o = int(rng.integers(0, len(pool) - n))
            with open(os.path.join(d, f"{j:05d}.jpg"), "wb") as f:
                f.write(pool[o:o + n])
    os.sync()


# ---- measurements ------------------------------------------------------------------------------

def fio_run(fio: str, path: str, bs: str, secs: int) -> dict:
    cmd = [fio, "--name=bench", f"--filename={path}", "--rw=randread", f"--bs={bs}",
           "--ioengine=io_uring", f"--iodepth={QD}", "--direct=1", f"--runtime={secs}",
           "--time_based", "--norandommap", "--randrepeat=0", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=secs + 60)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr.strip()}")
    job = json.loads(out.stdout)["jobs"][0]["read"]
    return {"iops": job["iops"], "bw": job["bw_bytes"]}


def read_many_for(store, ids: np.ndarray, secs: float) -> dict:
    """Calls read_many on consecutive slices of `ids` for about `secs` seconds."""
    done = 0
    nbytes = 0
    t0 = time.perf_counter()
    while True:
        k = done % (len(ids) - BATCH)
        out = store.read_many(ids[k:k + BATCH])
        done += BATCH
        nbytes += sum(map(len, out))
        el = time.perf_counter() - t0
        if el >= secs:
            return {"iops": done / el, "bw": nbytes / el}


def stream_for(store, ids: np.ndarray, secs: float, ahead: int = 4) -> dict:
    """The prefetch path: BATCH-id batches submitted to the prefetcher's reader `ahead` at a time
    (the next one goes in as soon as the oldest is taken), for about `secs` seconds."""
    from shadecache.tiers import TierChain
    tier = TierChain((), store).reader(ahead, QD, 2)   # the prefetcher's reads: the chain's pipeline
    try:
        return keep_streaming(tier.submit, lambda: tier.take().values, ids, secs, ahead)
    finally:
        tier.close()


def keep_streaming(submit, take, ids: np.ndarray, secs: float, ahead: int = 4) -> dict:
    """Consecutive BATCH-id slices of `ids` through submit(ids) / take() -> values, `ahead`
    batches queued (the next goes in as soon as the oldest is taken), for about `secs` seconds:
    {"iops": samples/s, "bw": bytes/s}."""
    done = nbytes = k = 0
    t0 = time.perf_counter()
    for _ in range(ahead):
        submit(ids[k:k + BATCH])
        k = (k + BATCH) % (len(ids) - BATCH)
    while True:
        out = take()
        done += len(out)
        nbytes += sum(map(len, out))
        el = time.perf_counter() - t0
        if el >= secs:
            return {"iops": done / el, "bw": nbytes / el}
        submit(ids[k:k + BATCH])
        k = (k + BATCH) % (len(ids) - BATCH)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def pread_loop(fd: int, offsets, length: int) -> None:
    pread = os.pread
    for off in offsets:
        pread(fd, length, off)


def preadv_loop(fd: int, offsets, buf) -> None:
    preadv = os.preadv
    bufs = [buf]
    for off in offsets:
        preadv(fd, bufs, off)


def read_many_all(store, ids) -> None:
    for k in range(0, len(ids), BATCH):
        store.read_many(ids[k:k + BATCH])


def open_read_loop(paths) -> None:
    for p in paths:
        with open(p, "rb") as f:
            f.read()


def median(xs) -> float:
    return float(np.median(np.asarray(xs, dtype=float)))


# ---- rows --------------------------------------------------------------------------------------

def bench_vs_fio(fio, path, bs_label, n, rounds, secs, key, read_for=read_many_for) -> dict:
    """Rounds of fio, ours, ours, fio (ABBA, so a drift within a round weighs on both sides alike);
    the device's speed wanders by +-30 % from second to second here, so rounds are short."""
    store = sc.PackedStore(path, direct=True, queue_depth=QD)
    rng = np.random.default_rng(2)
    ours, theirs, ratios = [], [], []
    for _ in tqdm(range(rounds), desc=f"{bs_label} O_DIRECT vs fio", file=sys.stderr):
        ids = rng.integers(0, n, 400_000)
        f1 = fio_run(fio, path, bs_label, int(secs))[key]
        o1 = read_for(store, ids[:200_000], secs)[key]
        o2 = read_for(store, ids[200_000:], secs)[key]
        f2 = fio_run(fio, path, bs_label, int(secs))[key]
        ours.append((o1 + o2) / 2)
        theirs.append((f1 + f2) / 2)
        ratios.append((o1 + o2) / (f1 + f2))
    return {"ours": median(ours), "fio": median(theirs), "ratio": median(ratios),
            "ratios": ratios, "backend": store.backend}


def loop_vs_ours(rounds, desc, count, draw, run_loop, run_ours, cold=False, warm=None) -> dict:
    """Rounds of (a Python loop, then ours) over the same fresh draw of `count` ids. Cold rounds
    drop the page cache before each side; warm rounds first read the draw with `warm`, so both
    sides find it in the page cache. Returns the medians and every round's ratio."""
    ours, loop, ratios = [], [], []
    for _ in tqdm(range(rounds), desc=desc, file=sys.stderr):
        batch = draw()
        if warm is not None and not cold:
            warm(batch)
        if cold:
            drop_caches()
        t_loop = timed(lambda: run_loop(batch))
        if cold:
            drop_caches()
        t_ours = timed(lambda: run_ours(batch))
        ours.append(count / t_ours)
        loop.append(count / t_loop)
        ratios.append(t_loop / t_ours)
    return {"ours": median(ours), "loop": median(loop), "ratio": median(ratios), "ratios": ratios}


def bench_vs_pread(path, n, rounds, count, cold: bool) -> dict:
    store = sc.PackedStore(path, direct=False, queue_depth=QD)
    offsets_of = store._r.offsets()
    fd = os.open(path, os.O_RDONLY)
    rng = np.random.default_rng(3)

    def draw():
        ids = rng.integers(0, n, count)
        return ids, [int(x) for x in offsets_of[ids]]

    try:
        return loop_vs_ours(rounds, "4 KB buffered vs os.pread loop" + (" (cold)" if cold else " (warm)"),
                            count, draw, lambda b: pread_loop(fd, b[1], 4096),
                            lambda b: read_many_all(store, b[0]), cold=cold,
                            warm=lambda b: read_many_all(store, b[0]))
    finally:
        os.close(fd)


def bench_vs_preadv_direct(path, n, rounds, count) -> dict:
    store = sc.PackedStore(path, direct=True, queue_depth=QD)
    offsets_of = store._r.offsets()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT requires
    rng = np.random.default_rng(4)

    def draw():
        ids = rng.integers(0, n, count)
        return ids, [int(x) for x in offsets_of[ids]]

    try:
        return loop_vs_ours(rounds, "4 KB O_DIRECT vs os.preadv loop", count, draw,
                            lambda b: preadv_loop(fd, b[1], buf), lambda b: read_many_all(store, b[0]))
    finally:
        os.close(fd)


def bench_folder(root, rounds, count, cold: bool) -> dict:
    store = sc.FolderStore(root, queue_depth=64)
    paths = store.paths
    rng = np.random.default_rng(5)

    def draw():
        ids = rng.permutation(len(paths))[:count]
        return ids, [paths[i] for i in ids]

    row = loop_vs_ours(rounds, "FolderStore vs open().read()" + (" (cold)" if cold else " (warm)"),
                       count, draw, lambda b: open_read_loop(b[1]), lambda b: read_many_all(store, b[0]),
                       cold=cold, warm=lambda b: open_read_loop(b[1]))
    row["backend"] = store.backend
    return row


# ---- main --------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(OUT, "store_bench"),
                    help="where the test files go (a real disk, not tmpfs)")
    ap.add_argument("--gib", type=float, default=2.0, help="size of each packed file")
    ap.add_argument("--rounds", type=int, default=11, help="rounds of the fio rows")
    ap.add_argument("--secs", type=float, default=1.0, help="seconds per run in the fio rows")
    ap.add_argument("--files", type=int, default=20000, help="files in the folder tree")
    ap.add_argument("--keep", action="store_true", help="keep the files for another run")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a result")
    ap.add_argument("--no-fio", action="store_true", help="skip the fio rows")
    ap.add_argument("--stream-only", action="store_true",
                    help="only the prefetch-path rows against fio")
    ap.add_argument("--json", default=os.path.join(OUT, "bench_store.json"),
                    help="where the results go")
    args = ap.parse_args(argv)
    if args.quick:
        args.gib, args.rounds, args.secs, args.files = 0.02, 1, 1.0, 200
    os.makedirs(args.dir, exist_ok=True)
    fio = None if args.no_fio else ensure_fio()
    cold_ok = can_drop_caches()
    if not cold_ok:
        print("cannot write /proc/sys/vm/drop_caches (not root): cold rows are skipped",
              file=sys.stderr)

    p4 = os.path.join(args.dir, "s4k.shc")
    p128 = os.path.join(args.dir, "s128k.shc")
    tree = os.path.join(args.dir, "tree")
    total = int(args.gib * 2**30)
    n4 = (sc.PackedStore(p4).__len__() if os.path.exists(p4) and args.keep
          else make_pack(p4, 4096, total))
    n128 = (sc.PackedStore(p128).__len__() if os.path.exists(p128) and args.keep
            else make_pack(p128, 128 << 10, total))
    if not (os.path.isdir(tree) and args.keep) and not args.stream_only:
        shutil.rmtree(tree, ignore_errors=True)
        make_tree(tree, args.files)

    fio_version = (subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()
                   if fio else None)
    results: dict = {"kernel": os.uname().release, "fio": fio_version,
                     "backend": sc.PackedStore(p4).backend,
                     "gib_per_file": args.gib, "rounds": args.rounds, "queue_depth": QD,
                     "batch": BATCH}
    count = 1000 if args.quick else 20000
    t_start = time.time()
    try:
        if fio:
            results["4k_stream_vs_fio"] = bench_vs_fio(fio, p4, "4k", n4, args.rounds, args.secs,
                                                       "iops", read_for=stream_for)
            results["128k_stream_vs_fio"] = bench_vs_fio(fio, p128, "128k", n128, args.rounds,
                                                         args.secs, "bw", read_for=stream_for)
        if args.stream_only:
            return finish(results, args, t_start)
        if fio:
            results["4k_vs_fio"] = bench_vs_fio(fio, p4, "4k", n4, args.rounds, args.secs, "iops")
        if cold_ok:
            results["4k_vs_pread_cold"] = bench_vs_pread(p4, n4, 3, count, cold=True)
        results["4k_vs_pread_warm"] = bench_vs_pread(p4, n4, 3, count, cold=False)
        results["4k_direct_vs_preadv"] = bench_vs_preadv_direct(p4, n4, 3, count // 4)
        if fio:
            results["128k_vs_fio"] = bench_vs_fio(fio, p128, "128k", n128, args.rounds,
                                                  args.secs, "bw")
        fcount = min(args.files, 200 if args.quick else 3000)
        if cold_ok:
            results["folder_cold"] = bench_folder(tree, 3, fcount, cold=True)
        results["folder_warm"] = bench_folder(tree, 3, min(args.files, 4 * fcount), cold=False)
    finally:
        results["seconds"] = time.time() - t_start
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    return finish(results, args, t_start)


def finish(results, args, t_start) -> int:
    results["seconds"] = time.time() - t_start
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print_table(results)
    return 0


def print_table(r: dict) -> None:
    rows = []

    def row(name, ours, alt, altname, ratio, target, unit):
        ok = "" if target is None else ("yes" if ratio >= target else "NO")
        rows.append((name, f"{ours:,.0f} {unit}", f"{alt:,.0f} {unit} ({altname})",
                     f"{ratio:.2f}x", "" if target is None else f">= {target}x", ok))

    if "4k_vs_fio" in r:
        x = r["4k_vs_fio"]
        row("4 KB O_DIRECT QD32, read_many(256)", x["ours"], x["fio"], "fio io_uring",
            x["ratio"], 0.9, "IOPS")
    if "4k_vs_pread_cold" in r:
        x = r["4k_vs_pread_cold"]
        row("4 KB cold cache, read_many(256)", x["ours"], x["loop"], "os.pread loop", x["ratio"],
            2.5, "reads/s")
    if "4k_stream_vs_fio" in r:
        x = r["4k_stream_vs_fio"]
        row("4 KB O_DIRECT QD32, prefetch stream of 256-id batches", x["ours"], x["fio"],
            "fio io_uring", x["ratio"], 0.95, "IOPS")
    if "128k_stream_vs_fio" in r:
        x = r["128k_stream_vs_fio"]
        row("128 KB O_DIRECT QD32, prefetch stream of 256-id batches", x["ours"] / 2**20,
            x["fio"] / 2**20, "fio io_uring", x["ratio"], 0.95, "MiB/s")
    if "4k_vs_pread_warm" not in r:
        return print_rows(rows, r)
    x = r["4k_vs_pread_warm"]
    row("4 KB warm cache, read_many(256)", x["ours"], x["loop"], "os.pread loop", x["ratio"],
        None, "reads/s")
    x = r["4k_direct_vs_preadv"]
    row("4 KB O_DIRECT, read_many(256)", x["ours"], x["loop"], "os.preadv loop", x["ratio"],
        2.5, "reads/s")
    if "128k_vs_fio" in r:
        x = r["128k_vs_fio"]
        row("128 KB O_DIRECT QD32, read_many(256)", x["ours"] / 2**20, x["fio"] / 2**20,
            "fio io_uring", x["ratio"], 0.9, "MiB/s")
    if "folder_cold" in r:
        x = r["folder_cold"]
        row("FolderStore cold cache, read_many(256)", x["ours"], x["loop"], "open().read()",
            x["ratio"], 3.0, "files/s")
    x = r["folder_warm"]
    row("FolderStore warm cache, read_many(256)", x["ours"], x["loop"], "open().read()",
        x["ratio"], None, "files/s")
    print_rows(rows, r)


def print_rows(rows, r) -> None:
    head = ("case", "shadecache", "alternative", "ratio", "target", "met")
    widths = [max(len(str(c[i])) for c in rows + [head]) for i in range(len(head))]
    line = " | ".join(h.ljust(w) for h, w in zip(head, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for c in rows:
        print(" | ".join(str(v).ljust(w) for v, w in zip(c, widths)))
    for key in ("4k_vs_fio", "128k_vs_fio", "4k_stream_vs_fio", "128k_stream_vs_fio"):
        if key in r:
            print(f"per-round ratios {key}: " + " ".join(f"{x:.2f}" for x in r[key]["ratios"]))
    print(f"\nkernel {r['kernel']}, {r['fio'] or 'no fio'}, "
          f"backend {r['backend']}, queue depth {r['queue_depth']}, batch {r['batch']}, "
          f"{r['gib_per_file']} GiB per packed file, medians of per-round ratios, "
          f"{r['seconds']:.0f} s of measurement")


if __name__ == "__main__":
    sys.exit(main())
