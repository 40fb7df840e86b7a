"""How often the defaults choose each read plan on a throttled disk: a node composed afresh, ten
times, over a store of 3 KB samples on bench/throttled_disk.py's cloud-like disk (3,000 reads/s,
200 MiB/s). Each run opens the store (it measures the device) and composes sc.Node(store, None)
with read_plan="auto" and a remembered-plan directory of its own, so nothing is carried over from
an earlier run: the choice is the measurement's.

    sudo python bench/read_plan_runs.py            # 10 runs, ~20 s
"""
import argparse
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import shadecache as sc  # noqa: E402
import throttled_disk  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--size", type=int, default=3072, help="sample bytes")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--iops", type=int, default=3000)
    ap.add_argument("--mibps", type=int, default=200)
    args = ap.parse_args(argv)
    why = throttled_disk.unavailable()
    if why:
        print(f"cannot run here: {why}")
        return 2
    rows = []
    with throttled_disk.ThrottledDisk(1 << 30, read_iops=args.iops, read_bps=args.mibps << 20) as disk:
        path = os.path.join(disk.mount, "s.shc")
        rng = np.random.default_rng(0)
        with sc.PackWriter(path) as w:
            for i in range(args.n):
                w.add(rng.bytes(args.size), i % 10)
        os.sync()
        disk.enter()
        try:
            for run in range(args.runs):
                with tempfile.TemporaryDirectory() as xdg, sc.PackedStore(path, direct=True) as store:
                    os.environ["XDG_CACHE_HOME"] = xdg
                    node = sc.Node(store, None, read_ahead=False)
                    d = store.device
                    rows.append((run, d["iops"], d["bandwidth"], d["gap_bytes"], node.read_plan.kind))
        finally:
            disk.leave()
    print(f"\n{args.n:,} samples of {args.size:,} B on a disk throttled to {args.iops:,} reads/s and "
          f"{args.mibps} MiB/s\n")
    print("| run | measured reads/s | measured MB/s | gap | read plan |\n|---|---|---|---|---|")
    for run, iops, bw, gap, kind in rows:
        print(f"| {run} | {iops:,.0f} | {bw / 1e6:,.0f} | {gap:,} B | {kind} |")
    kinds = [r[4] for r in rows]
    print(f"\nextents in {kinds.count('extents')} of {len(kinds)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
