"""The read stream's submission modes against fio, in the same rounds.

    python bench/stream_modes.py --store /var/tmp/sc-lanes/s4k.shc --bs 4k --rounds 7

Each round runs fio (io_uring, QD 32, O_DIRECT, random reads of --bs), then the stream in each
mode (auto, spread, single, then again in the reverse order: ABBA, so that the device's drift
within a round weighs on every mode alike), then fio again. Every run lasts --secs. The stream is
the prefetch path's: 256-id batches, four queued, 2 lanes, QD 32 (csrc/io/read_stream.h says what
the modes are). Prints each round and the medians of each mode's ratio to the round's fio.

The store is any packed store of samples of one size, e.g. the one bench_store.py writes:
`python bench/bench_store.py --gib 1 --stream-only --dir /var/tmp/sc-lanes --keep`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np

from bench_store import BATCH, QD, keep_streaming   # bench/ is this script's import path
from shadecache.store import PackedStore

MODES = ("auto", "spread", "single")
AHEAD, LANES = 4, 2


def fio_rate(path: str, bs: str, secs: float) -> float:
    """fio's reads/s (4k) or bytes/s (anything else) over `secs`."""
    out = subprocess.run(["fio", "--name=modes", f"--filename={path}", "--rw=randread", f"--bs={bs}",
                          "--ioengine=io_uring", f"--iodepth={QD}", "--direct=1",
                          f"--runtime={max(1, round(secs))}", "--time_based", "--norandommap",
                          "--randrepeat=0", "--output-format=json"],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)["jobs"][0]["read"]
    return r["iops"] if bs == "4k" else r["bw_bytes"]


def stream_rate(store, ids: np.ndarray, mode: str, bs: str, secs: float) -> float:
    """The stream's samples/s (4k) or bytes/s over about `secs`, batches kept queued."""
    s = store.stream(QD, LANES, mode)
    try:
        rates = keep_streaming(s.submit, s.take, ids, secs, AHEAD)
    finally:
        s.close()
    return rates["iops"] if bs == "4k" else rates["bw"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True, help="a packed store of samples of one size")
    ap.add_argument("--bs", default="4k", help="fio's block size: the store's sample size")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--secs", type=float, default=2.0, help="seconds per run")
    args = ap.parse_args()
    # device= given: no probe reads at open (they would land in the first round)
    store = PackedStore(args.store, direct=True, queue_depth=QD,
                        device={"iops": 50_000, "bandwidth": 1e9})
    ids = np.random.default_rng(0).integers(0, len(store), 400_000).astype(np.int64)
    ratios = {m: [] for m in MODES}
    unit = "reads/s" if args.bs == "4k" else "MB/s"
    scale = 1.0 if args.bs == "4k" else 1e-6
    for r in range(args.rounds):
        f1 = fio_rate(args.store, args.bs, args.secs)
        got = {m: [] for m in MODES}
        for m in MODES + MODES[::-1]:
            got[m].append(stream_rate(store, ids, m, args.bs, args.secs))
        f2 = fio_rate(args.store, args.bs, args.secs)
        fio = (f1 + f2) / 2
        line = [f"round {r + 1}: fio {f1 * scale:,.0f} / {f2 * scale:,.0f} {unit}"]
        for m in MODES:
            ratios[m].append(float(np.mean(got[m])) / fio)
            line.append(f"{m} {np.mean(got[m]) * scale:,.0f} ({ratios[m][-1]:.2f}x)")
        print("  ".join(line), flush=True)
    print(f"\n{args.bs} O_DIRECT QD {QD}, {BATCH}-id batches, {LANES} lanes, {args.rounds} rounds "
          f"of {args.secs:g} s: median ratio to fio")
    for m in MODES:
        print(f"  {m:<7} {np.median(ratios[m]):.3f}x   (rounds {' '.join(f'{x:.2f}' for x in ratios[m])})")


if __name__ == "__main__":
    sys.exit(main())
