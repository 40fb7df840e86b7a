"""Benchmark of the peer layer: store reads per epoch with 1, 2 and 4 nodes, and peer throughput.

    PYTHONPATH=. python bench/cluster.py [--samples 4000] [--epochs 3] [--seconds 2] [--png PATH]

Nodes are server processes on 127.0.0.1, each with its own cache and its own read-through of the
shared store; the trainers of all nodes run in this process, each with its own Cluster and
CachedDataset, and read disjoint shards of every epoch. Store reads are counted at the trainers
(ds.stats) and at the home nodes (the servers' STATS).

Throughput (same run): GET of batches of 100 KB samples against one loopback TCP stream moving
the same bytes (recv_into a preallocated buffer), and GET of 256 x 3 KB against Redis MGET of the
same values (redis-py with hiredis) on a redis-server started here.
Not measured here: epoch time on shaped slow storage, and the SSD tier's figures (see
BENCHMARKS.md).
"""
import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import shadecache as sc
from shadecache.peer import PeerClient


def _store(path, n, size, seed=0):
    rng = np.random.default_rng(seed)
    with sc.PackWriter(path) as w:
        for _ in range(n):
            w.add(rng.integers(0, 256, size, dtype=np.uint8).tobytes(), 0)
    return sc.PackedStore(path)


def store_reads(path, n, size, nodes, epochs, frac=0.2, batch=64):
    store = sc.PackedStore(path)
    caches, servers = [], []
    cap = max(1 << 20, int(frac * n * (size + 32)))
    for k in range(nodes):
        c = sc.Cache.create(f"bench-cluster-{os.getpid()}-{nodes}-{k}", n, cap, policy="importance",
                            max_item_bytes=4096)
        caches.append(c)
        servers.append(sc.serve(c, store=store))
    addrs = [s.address for s in servers]
    dss = []
    for k in range(nodes):
        cl = sc.Cluster(addrs, k, timeout=5.0)
        dss.append((sc.CachedDataset(store, caches[k], cluster=cl), cl))
    clients = [PeerClient(a) for a in addrs]
    rng = np.random.default_rng(1)
    per_epoch = []
    try:
        for epoch in range(epochs):
            before = sum(d.stats()["store_reads"] for d, _ in dss) + sum(c.server_stats(5)["store_reads"] for c in clients)
            order = rng.permutation(n)
            shards = np.array_split(order, nodes)
            for b in range(0, max(len(s) for s in shards), batch):
                for k, (ds, _) in enumerate(dss):
                    ids = shards[k][b:b + batch]
                    if ids.size:
                        ds.fetch_bytes(ids)
            after = sum(d.stats()["store_reads"] for d, _ in dss) + sum(c.server_stats(5)["store_reads"] for c in clients)
            per_epoch.append(after - before)
        cached = sum(c.stats()["items"] for c in caches)
    finally:
        for c in clients:
            c.close()
        for _, cl in dss:
            cl.close()
        for s in servers:
            s.close()
        for c in caches:
            c.close()
            c.unlink()
    return per_epoch, cached


def _stream_server(port_box, ready):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_box.append(srv.getsockname()[1])
    ready.set()
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = bytearray(64 << 20)
    while True:
        head = conn.recv(8)
        if len(head) < 8:
            return
        n = int.from_bytes(head, "little")
        conn.sendall(memoryview(payload)[:n])


def throughput(seconds):
    rows = []
    name = f"bench-peer-{os.getpid()}"
    n_big, n_small = 256, 256
    with sc.Cache.create(name, n_big + n_small, 64 << 20, policy="static") as cache:
        rng = np.random.default_rng(2)
        big = [rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes() for _ in range(n_big)]
        small = [rng.integers(0, 256, 3000, dtype=np.uint8).tobytes() for _ in range(n_small)]
        cache.put_many(np.arange(n_big), big)
        cache.put_many(np.arange(n_big, n_big + n_small), small)
        with sc.serve(cache) as server:
            client = PeerClient(server.address)
            for label, ids, nbytes in (("64 x 100 KB", list(range(64)), 64 * 100_000),
                                       ("256 x 3 KB", list(range(n_big, n_big + n_small)), n_small * 3000)):
                assert client.get_many(ids, timeout=10) == [cache.get(i) for i in ids]
                t0, k = time.perf_counter(), 0
                while time.perf_counter() - t0 < seconds:
                    client.get_many(ids, timeout=10)
                    k += 1
                dt = (time.perf_counter() - t0) / k
                rows.append((label, "shadecache peer GET", dt, nbytes / dt))
            client.close()
        # one loopback TCP stream of the same bytes (a thread here serves it; the reader is Python too)
        box, ready = [], threading.Event()
        threading.Thread(target=_stream_server, args=(box, ready), daemon=True).start()
        ready.wait()
        s = socket.create_connection(("127.0.0.1", box[0]))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nbytes = 64 * 100_000
        buf = bytearray(nbytes)
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            s.sendall(nbytes.to_bytes(8, "little"))
            view, got = memoryview(buf), 0
            while got < nbytes:
                got += s.recv_into(view[got:], nbytes - got)
            k += 1
        dt = (time.perf_counter() - t0) / k
        rows.append(("64 x 100 KB", "one TCP stream, recv_into", dt, nbytes / dt))
        s.close()
        rows.append(_redis_mget(small, seconds))
    return rows


def _redis_mget(values, seconds):
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        return ("256 x 3 KB", "Redis MGET (redis-server not installed)", float("nan"), float("nan"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                         stdout=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        keys = [f"s{i}" for i in range(len(values))]
        r.mset(dict(zip(keys, values)))
        assert r.mget(keys) == values
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            r.mget(keys)
            k += 1
        dt = (time.perf_counter() - t0) / k
        parser = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "pure-Python parser"
        return ("256 x 3 KB", f"Redis MGET ({parser})", dt, len(values) * 3000 / dt)
    finally:
        p.terminate()
        p.wait()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--size", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="bench-cluster-")
    try:
        path = os.path.join(tmp, "s.shc")
        _store(path, args.samples, args.size)
        print(f"store reads per epoch, whole cluster, N = {args.samples}, each node caches 20%")
        print(f"{'nodes':>5} {'cached':>7} {'bound (N-cached)*1.01':>22} " + " ".join(f"{'epoch ' + str(e):>8}" for e in range(args.epochs)) + f" {'no sharing (N/node)':>20}")
        results = {}
        for nodes in (1, 2, 4):
            per, cached = store_reads(path, args.samples, args.size, nodes, args.epochs)
            results[nodes] = per
            print(f"{nodes:>5} {cached:>7} {int((args.samples - cached) * 1.01):>22} " + " ".join(f"{x:>8}" for x in per) + f" {args.samples * nodes:>20}")
        print()
        print(f"{'batch':<12} {'path':<40} {'ms/batch':>9} {'MB/s':>8}")
        rows = throughput(args.seconds)
        for label, what, dt, bps in rows:
            print(f"{label:<12} {what:<40} {dt * 1e3:>9.3f} {bps / 1e6:>8.0f}")
        by = {(r[0], r[1].split(" (")[0]): r[3] for r in rows}
        big = by[("64 x 100 KB", "shadecache peer GET")] / by[("64 x 100 KB", "one TCP stream, recv_into")]
        small = by[("256 x 3 KB", "shadecache peer GET")] / by.get(("256 x 3 KB", "Redis MGET"), float("nan"))
        print(f"\npeer / TCP stream (100 KB): {big:.2f}x (target >= 0.6)")
        print(f"peer / Redis MGET (3 KB):   {small:.2f}x (target >= 3)")
        if args.png:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(6, 3.5))
            xs = np.arange(args.epochs)
            for j, nodes in enumerate((1, 2, 4)):
                ax.bar(xs + (j - 1) * 0.27, results[nodes], 0.27, label=f"{nodes} node(s), shared")
            ax.axhline(args.samples, color="k", ls="--", lw=1, label="N (one node alone)")
            ax.set_xlabel("epoch")
            ax.set_ylabel("store reads, whole cluster")
            ax.set_title("Store reads per epoch, each node caching 20%")
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(args.png, dpi=120)
            print(f"wrote {args.png}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
