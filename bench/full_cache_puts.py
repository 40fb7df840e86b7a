"""Puts into a full cache, two builds of shadecache side by side: each in its own process with its
own full 1 GiB cache of 3 KB values (every put evicts one), taking turns one repetition at a time
(`puts` puts, CPU time by time.thread_time), so that both see the same load on a shared machine.
Prints each build's ns per put, the medians, and the median of the per-round ratios.

    python bench/full_cache_puts.py importance 15 20000 /path/to/old/checkout /path/to/new/checkout

Each checkout must be built in place (python setup.py build_ext --inplace). The values come from a
pool of 8192 random 3 KB strings; under importance each put's score is above every cached one.
"""
import os
import statistics
import subprocess
import sys

WORKER = r'''
import os, sys, time
import numpy as np
import shadecache as sc
from shadecache import _core
policy, puts = sys.argv[1], int(sys.argv[2])
cap = 1 << 30; size = 3 * 1024; fits = cap // size; n = 2 * fits
name = f"full-cache-puts-{os.getpid()}"
rng = np.random.default_rng(7)
pool = [rng.bytes(size) for _ in range(8192)]
c = sc.Cache.create(name, num_samples=n, capacity_bytes=cap, policy=policy)
try:
    over = fits + fits // 4
    for lo in range(0, over, 4096):
        ids = np.arange(lo, min(over, lo + 4096), dtype=np.int64)
        s = (np.arange(lo, lo + len(ids), dtype=np.float32) - over) if policy == "importance" else None
        c.put_many(ids, [pool[i % 8192] for i in ids], s)
    next_score = 1.0; put = c.put
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go": break
        unc = np.flatnonzero(~c.cached_mask())
        ids = rng.choice(unc, size=puts, replace=False).tolist()
        vals = [pool[i % 8192] for i in ids]
        ev0 = c.stats()["evictions"]
        if policy == "importance":
            sc_ = (next_score + np.arange(puts, dtype=np.float64)).tolist(); next_score += puts
            t0 = time.thread_time()
            for i, v, s in zip(ids, vals, sc_): put(i, v, s)
        else:
            t0 = time.thread_time()
            for i, v in zip(ids, vals): put(i, v)
        dt = time.thread_time() - t0
        assert c.stats()["evictions"] - ev0 >= puts
        print(dt / puts * 1e9, flush=True)
finally:
    c.close(); _core.CacheCore.unlink(name)
'''

if len(sys.argv) != 6:
    sys.exit(__doc__)
policy, rounds, puts, old, new = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
procs = {}
for tag, tree in (("old", old), ("new", new)):
    env = dict(os.environ, PYTHONPATH=tree)
    procs[tag] = subprocess.Popen([sys.executable, "-c", WORKER, policy, puts], env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
for p in procs.values():
    assert p.stdout.readline().strip() == "ready"
t = {"old": [], "new": []}
order = ["old", "new"]
for r in range(rounds):
    for tag in (order if r % 2 == 0 else order[::-1]):
        procs[tag].stdin.write("go\n"); procs[tag].stdin.flush()
        t[tag].append(float(procs[tag].stdout.readline()))
for p in procs.values():
    p.stdin.write("stop\n"); p.stdin.flush(); p.wait()
ratios = [b / a for a, b in zip(t["old"], t["new"])]
print("old ns/put:", " ".join(f"{x:.0f}" for x in t["old"]))
print("new ns/put:", " ".join(f"{x:.0f}" for x in t["new"]))
print(f"median old {statistics.median(t['old']):.0f} ns, new {statistics.median(t['new']):.0f} ns, "
      f"median per-round new/old {statistics.median(ratios):.3f} (speed {1/statistics.median(ratios):.3f}x)")
