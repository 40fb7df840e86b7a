"""Benchmark of the peer layer and the SSD tier: store reads per epoch with 1, 2 and 4 nodes,
epoch time on slow shared storage, the SSD tier, and peer throughput.

    PYTHONPATH=. python bench/cluster.py [--samples 4000] [--epochs 3] [--seconds 2] [--png PATH]
                                         [--only reads,slow,ssd,throughput]

Nodes are server processes on 127.0.0.1, each with its own cache and its own read-through of the
shared store; the trainers of all nodes run in this process, each with its own Cluster and
CachedDataset, and read disjoint shards of every epoch. Store reads are counted at the trainers
(ds.stats) and at the home nodes (the servers' STATS).

Throughput (same run): GET of 64 x 100 KB and of 256 x 3 KB samples (sealed frames, as always)
against one loopback TCP stream moving the same bytes in clear text (recv_into a preallocated
buffer), Redis MGET of the 3 KB values (redis-py with hiredis) on a redis-server started here, for
information, and the AES-256-GCM speed of one core (openssl speed), the cost every peer byte pays
on each end; the parts a sealed GET adds to the stream (seal, open, crc32c, each timed alone with
the frames' own code), and, taking turns with the GET and the stream, the GET's sealed frames
alone (_core.peer_frame_stream: C++ on both ends of a loopback connection, no cache, no Python,
no allocation per value), the least a sealed GET can take here: its ratio to the stream bounds
the GET's.
Epoch time on slow shared storage ("slow", needs root and `ip netns`): the store is served from
a network namespace of its own (bench/remote_store.py) whose link is shaped with `tc tbf` to
--rate; 4 node processes (bench/cluster_node.py), each in its own namespace with a cache of 20%,
read disjoint shards of every epoch, once sharing (peer servers, read-through) and once each
node alone (its cache, then the store). Epoch time = last node's end - first node's start.
SSD tier ("ssd"): one node, RAM cache of 10% of the samples + SSD tier of 50% of the bytes; store
reads per epoch, then the tier's get_many against the packed store's read_many on the same ids
and disk, warm (paired per batch) and cold (page cache dropped, root only).
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
from shadecache import _core
from shadecache.peer import PeerClient, new_secret

HERE = os.path.dirname(os.path.abspath(__file__))
SECRET = new_secret()   # this run's; node processes get it in their environment


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
        servers.append(sc.Node(store, c, read_ahead=False).serve(secret=SECRET))
    addrs = [s.address for s in servers]
    dss = []
    for k in range(nodes):
        cl = sc.Cluster(addrs, k, timeout=5.0, secret=SECRET)
        dss.append((sc.Node(store, caches[k], cluster=cl, read_ahead=False).dataset(), cl))
    clients = [PeerClient(a, SECRET, store) for a in addrs]
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


def slow_storage(path, n, size, nodes, epochs, rate, frac=0.2):
    """{mode: [(epoch seconds, store reads), ...]} for mode "alone" and "shared", with the store
    behind a link shaped to `rate` (tc tbf) in a network namespace of its own."""
    import json

    import netns

    why = netns.available()
    if why:
        raise RuntimeError(f"slow-storage benchmark needs network namespaces: {why}")
    env = dict(os.environ, SHADECACHE_SECRET=SECRET, BENCH_MAX_ITEM=str(size + 64),
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
    capacity = int(frac * n * (size + 64))
    hosts = ["store"] + [f"n{k}" for k in range(nodes)]
    out = {}
    with netns.Net(hosts, shape={"store": rate}) as net:
        st = subprocess.Popen(net.argv("store") + [sys.executable, os.path.join(HERE, "remote_store.py"), path,
                                                  net.addr("store"), "7000"],
                              env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert st.stdout.readline().strip() == "ready"
            for mode in ("alone", "shared"):
                work = tempfile.mkdtemp(prefix="bench-slow-")
                procs = [subprocess.Popen(net.argv(f"n{k}") + [
                    sys.executable, os.path.join(HERE, "cluster_node.py"), str(k), str(nodes), net.addr(f"n{k}"),
                    f"{net.addr('store')}:7000", work, str(epochs), str(capacity), mode], env=env)
                    for k in range(nodes)]
                rows, before = [], 0
                try:
                    for k in range(nodes):
                        _wait_file(os.path.join(work, f"ready.{k}"), procs)
                    for e in range(epochs):
                        open(os.path.join(work, f"go.{e}"), "w").close()
                        done = []
                        for k in range(nodes):
                            f = os.path.join(work, f"done.{e}.{k}")
                            _wait_file(f, procs)
                            done.append(json.load(open(f)))
                        open(os.path.join(work, f"count.{e}"), "w").close()
                        reads = 0
                        for k in range(nodes):
                            f = os.path.join(work, f"reads.{e}.{k}")
                            _wait_file(f, procs)
                            reads += json.load(open(f))["store_reads"]
                        rows.append((max(d["end"] for d in done) - min(d["start"] for d in done), reads - before))
                        before = reads
                        print(f"  {mode:>6} epoch {e}: {rows[-1][0]:6.2f} s, store reads {rows[-1][1]}", flush=True)
                finally:
                    open(os.path.join(work, "stop"), "w").close()
                    for p in procs:
                        try:
                            p.wait(60)
                        except subprocess.TimeoutExpired:
                            p.kill()
                            p.wait()
                    shutil.rmtree(work, ignore_errors=True)
                out[mode] = rows
        finally:
            st.kill()
            st.wait()
    return out


def _wait_file(path, procs, timeout=600):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"node process {p.args[-8]} exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.005)


def _capacity_for(n, items, size, policy="importance"):
    """The smallest capacity (in whole slab pages) at which a cache like the benchmark's (n ids,
    `policy`, values of `size` bytes) holds `items` values: the RAM tier is "10% of the samples",
    not 10% of their bytes minus slab rounding."""
    cap = items * (size + 64)
    while True:
        with sc.Cache.create(f"bench-probe-{os.getpid()}", n, cap, policy=policy,
                             max_item_bytes=size + 64) as c:
            c.put_many(np.arange(items), [bytes(size)] * items)
            if c.stats()["items"] >= items:
                return cap
            cap += c.stats()["page_size"]


def ssd_tier(path, n, size, epochs, batch=64):
    """Store reads per epoch with a RAM cache of 10% and an SSD tier of 50% of the data (one node,
    CachedDataset), then the SSD tier's batch reads against the packed store's read_many of the
    same ids on the same disk, warm (page cache) and cold (caches dropped before each pass, when
    root)."""
    store = sc.PackedStore(path)
    ssd_dir = os.path.join(os.path.dirname(path), "ssd")
    ram = _capacity_for(n, int(0.10 * n), size)
    with sc.Cache.create(f"bench-ssd-{os.getpid()}", n, ram, policy="importance", max_item_bytes=size + 64) as cache:
        ssd = sc.SSDTier(ssd_dir, capacity_bytes=int(0.50 * n * sc.SSDTier.slot_bytes(size)), cache=cache)
        ds = sc.Node(store, cache, ssd=ssd, read_ahead=False).dataset()
        rng = np.random.default_rng(3)
        reads = []
        for _ in range(epochs):
            before = ds.stats()["store_reads"]
            order = rng.permutation(n)
            for b in range(0, n, batch):
                ds.fetch_bytes(order[b:b + batch])
            ssd.flush()
            reads.append(ds.stats()["store_reads"] - before)
        in_ram, on_ssd = cache.stats()["items"], ssd.stats()["items"]
        cache.unlink()
    # read speed: the ids the tier holds, read in batches by both
    held = ssd.ids()
    order = np.random.default_rng(4).permutation(held)
    speed = {}
    readers = (("packed store read_many", lambda ids: store.read_many(ids)),
               ("SSD tier get_many", lambda ids: ssd.get_many(ids)))
    for b in range(0, order.size, batch):   # both return the same bytes (checked untimed, once)
        assert ssd.get_many(order[b:b + batch]) == store.read_many(order[b:b + batch])
    # warm: the two readers timed on the same batch back to back (alternating which goes first),
    # 5 rounds over all held ids; both in wall time and in this process's CPU time (page-cache
    # reads are CPU work done by this process and its io_uring workers; CPU time is what the
    # load of other sessions disturbs least)
    for _ in range(5):
        spent = [0.0, 0.0]
        cpu = [0.0, 0.0]
        for j, b in enumerate(range(0, order.size, batch)):
            ids = order[b:b + batch]
            for r in ((0, 1) if j % 2 == 0 else (1, 0)):
                t0, c0 = time.perf_counter(), time.process_time()
                readers[r][1](ids)
                spent[r] += time.perf_counter() - t0
                cpu[r] += time.process_time() - c0
        for r in (0, 1):
            speed.setdefault((readers[r][0], "warm"), []).append(order.size / spent[r])
            speed.setdefault((readers[r][0], "warm CPU"), []).append(order.size / cpu[r])
    # cold: the page cache dropped before each pass (root only), 3 alternating passes each
    for _ in range(3 if os.geteuid() == 0 else 0):
        for name, fn in readers:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            t0 = time.perf_counter()
            for b in range(0, order.size, batch):
                got = fn(order[b:b + batch])
            dt = time.perf_counter() - t0
            assert got == store.read_many(order[b:b + batch])
            speed.setdefault((name, "cold"), []).append(order.size / dt)
    speed = {k: float(np.median(v)) for k, v in speed.items()}
    store.close()
    return reads, in_ram, on_ssd, speed


def _stream_server(port_box, ready, cpu_box):
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
        cpu_box[0] = time.thread_time()   # this thread's CPU seconds so far


def process_cpu_s(pid):
    """CPU seconds (user + system) process `pid` has used, from /proc (10 ms ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(seconds, rounds=8):
    """Rows (batch, path, seconds per batch, bytes/s). The peer GET and the TCP stream of the same
    bytes take turns, `rounds` turns of seconds/rounds each per batch size, so that both see the
    same load of the (shared) machine; each row is the median over its turns, and "ratio" rows
    give the median of the per-turn ratios. "CPU" rows: CPU seconds per batch over all turns, both
    ends (peer: this thread + the server process; stream: this thread + the stream's thread)."""
    rows = []
    name = f"bench-peer-{os.getpid()}"
    n_big, n_small = 256, 256
    with sc.Cache.create(name, n_big + n_small, 64 << 20, policy="static") as cache:
        rng = np.random.default_rng(2)
        big = [rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes() for _ in range(n_big)]
        small = [rng.integers(0, 256, 3000, dtype=np.uint8).tobytes() for _ in range(n_small)]
        cache.put_many(np.arange(n_big), big)
        cache.put_many(np.arange(n_big, n_big + n_small), small)
        # one loopback TCP stream of the same bytes (a thread here serves it; the reader is Python too)
        box, ready, stream_cpu = [], threading.Event(), [0.0]
        threading.Thread(target=_stream_server, args=(box, ready, stream_cpu), daemon=True).start()
        ready.wait()
        s = socket.create_connection(("127.0.0.1", box[0]))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def stream(nbytes, buf):
            s.sendall(nbytes.to_bytes(8, "little"))
            view, got = memoryview(buf), 0
            while got < nbytes:
                got += s.recv_into(view[got:], nbytes - got)

        def timed(fn, budget, cpu, other_cpu):
            """Seconds per call of fn; adds (calls, CPU seconds of this thread + other_cpu()) to cpu."""
            c0, t0, k = other_cpu(), (time.perf_counter(), time.thread_time()), 0
            while time.perf_counter() - t0[0] < budget:
                fn()
                k += 1
            wall = time.perf_counter() - t0[0]
            cpu[0] += k
            cpu[1] += time.thread_time() - t0[1] + other_cpu() - c0
            return wall / k

        with sc.Node(None, cache, read_ahead=False).serve(secret=SECRET) as server:
            client = PeerClient(server.address, SECRET, cache)
            for label, ids, nbytes in (("64 x 100 KB", list(range(64)), 64 * 100_000),
                                       ("256 x 3 KB", list(range(n_big, n_big + n_small)), n_small * 3000)):
                assert client.get_many(ids, timeout=10) == [cache.get(i) for i in ids]
                buf = bytearray(nbytes)
                turns, peer_cpu, stream_cpu_of = [], [0, 0.0], [0, 0.0]
                for _ in range(rounds):
                    t_peer = timed(lambda: client.get_many(ids, timeout=10), seconds / rounds, peer_cpu,
                                   lambda: process_cpu_s(server.pid))
                    t_tcp = timed(lambda: stream(nbytes, buf), seconds / rounds, stream_cpu_of, lambda: stream_cpu[0])
                    t_frames = _core.peer_frame_stream(nbytes, nbytes // len(ids), seconds / rounds)["seconds"]
                    turns.append((t_peer, t_tcp, t_frames))
                peer, tcp, frames = (float(np.median([t[j] for t in turns])) for j in (0, 1, 2))
                rows.append((label, "shadecache peer GET", peer, nbytes / peer))
                rows.append((label, "one TCP stream, recv_into", tcp, nbytes / tcp))
                rows.append((label, "sealed frames alone (C++, no cache)", frames, nbytes / frames))
                for what, j in (("peer", 0), ("frames alone", 2)):
                    r = [t[1] / t[j] for t in turns]
                    rows.append((label, f"ratio {what}/stream (turns {min(r):.2f}-{max(r):.2f})",
                                 float(np.median(r)), float(np.median(r))))
                cpu_peer, cpu_stream = peer_cpu[1] / peer_cpu[0], stream_cpu_of[1] / stream_cpu_of[0]
                rows.append((label, "CPU, peer GET (client + server)", cpu_peer, nbytes / cpu_peer))
                rows.append((label, "CPU, TCP stream (both ends)", cpu_stream, nbytes / cpu_stream))
                rows.append((label, "ratio of CPU stream/peer", cpu_stream / cpu_peer, cpu_stream / cpu_peer))
                rows.extend(_frame_parts(label, nbytes, nbytes // len(ids), cpu_stream))
            client.close()
        s.close()
        rows.append(_redis_mget(small, seconds))
    return rows


def _frame_parts(label, nbytes, value, stream_cpu):
    """Rows of the per-byte parts a sealed GET adds to a clear-text stream, each measured alone on
    this CPU in this run (_core.peer_frame_costs: the frames' own cipher and crc32c), and what
    they imply: the least CPU a sealed GET can take is the stream's (both copies, the TCP stack)
    plus one seal, one open and one crc32c pass."""
    c = _core.peer_frame_costs(nbytes, value)
    floor = stream_cpu + c["seal"] + c["open"] + c["crc32c"]
    rows = [(label, f"part: {name}", c[key], nbytes / c[key])
            for name, key in (("AES-256-GCM seal", "seal"), ("AES-256-GCM open", "open"),
                              ("crc32c", "crc32c"), ("memcpy", "memcpy"))]
    rows.append((label, "CPU floor: stream CPU + seal + open + crc", floor, nbytes / floor))
    return rows


def _aead_speed():
    """Bytes/s of AES-256-GCM on one core as `openssl speed` measures it (None without openssl):
    the cost every peer byte pays twice, beside the two copies of a plain TCP stream."""
    exe = shutil.which("openssl")
    if exe is None:
        return None
    out = subprocess.run([exe, "speed", "-elapsed", "-seconds", "1", "-bytes", "131072", "-evp", "aes-256-gcm"],
                         capture_output=True, text=True).stdout.strip().splitlines()
    try:
        return float(out[-1].split()[-1].rstrip("k")) * 1000
    except (IndexError, ValueError):
        return None


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


PARTS = ("reads", "slow", "ssd", "throughput")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--size", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--png", default=None)
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    ap.add_argument("--slow-samples", type=int, default=2000)
    ap.add_argument("--slow-size", type=int, default=16000)
    ap.add_argument("--rate", default="100mbit", help="the shaped store link (tc tbf rate)")
    args = ap.parse_args(argv)
    parts = args.only.split(",")
    tmp = tempfile.mkdtemp(prefix="bench-cluster-")
    try:
        if "reads" in parts:
            path = os.path.join(tmp, "s.shc")
            _store(path, args.samples, args.size)
            print(f"store reads per epoch, whole cluster, N = {args.samples}, each node caches 20%")
            print(f"{'nodes':>5} {'cached':>7} {'bound (N-cached)*1.01':>22} " + " ".join(f"{'epoch ' + str(e):>8}" for e in range(args.epochs)) + f" {'no sharing (N/node)':>20}")
            results = {}
            for nodes in (1, 2, 4):
                per, cached = store_reads(path, args.samples, args.size, nodes, args.epochs)
                results[nodes] = per
                print(f"{nodes:>5} {cached:>7} {int((args.samples - cached) * 1.01):>22} " + " ".join(f"{x:>8}" for x in per) + f" {args.samples * nodes:>20}")
            if args.png:
                _plot_reads(results, args.samples, args.epochs, args.png)
            print()
        if "slow" in parts:
            path = os.path.join(tmp, "slow.shc")
            _store(path, args.slow_samples, args.slow_size)
            n = args.slow_samples
            print(f"epoch time, store behind a link shaped to {args.rate} (tc tbf, own network namespace), "
                  f"4 nodes in namespaces, each caching 20%, N = {n} x {args.slow_size} B")
            slow = slow_storage(path, n, args.slow_size, 4, args.epochs, args.rate)
            print(f"{'epoch':>5} {'alone s':>8} {'alone reads':>12} {'shared s':>9} {'shared reads':>13} {'speedup':>8}")
            for e, (a, b) in enumerate(zip(slow["alone"], slow["shared"])):
                print(f"{e:>5} {a[0]:>8.2f} {a[1]:>12} {b[0]:>9.2f} {b[1]:>13} {a[0] / b[0]:>7.2f}x")
            warm_a = sum(r[0] for r in slow["alone"][1:])
            warm_s = sum(r[0] for r in slow["shared"][1:])
            if warm_s:
                print(f"after epoch 0: sharing {warm_a / warm_s:.2f}x faster than each node alone (target >= 2)")
            print()
        if "ssd" in parts:
            path = os.path.join(tmp, "ssd.shc")
            _store(path, args.samples, args.size)
            n = args.samples
            reads, in_ram, on_ssd, speed = ssd_tier(path, n, args.size, args.epochs)
            bound = int((n - 0.6 * n) * 1.01)
            print(f"SSD tier: RAM cache 10% + SSD tier 50% (bytes), N = {n} x {args.size} B; "
                  f"in RAM {in_ram}, on SSD {on_ssd}")
            print("store reads per epoch: " + " ".join(str(r) for r in reads) + f"   (bound after epoch 0: {bound})")
            print(f"{'reader':<26} {'cache':<9} {'samples/s':>10}")
            for (name, state), v in speed.items():
                print(f"{name:<26} {state:<9} {v:>10.0f}")
            for state in ("warm", "warm CPU", "cold"):
                if ("SSD tier get_many", state) in speed:
                    r = speed[("SSD tier get_many", state)] / speed[("packed store read_many", state)]
                    print(f"SSD tier / packed store, {state}: {r:.2f}x (target >= 0.9)")
            print()
        if "throughput" in parts:
            print(f"{'batch':<12} {'path':<40} {'ms/batch':>9} {'MB/s':>8}")
            rows = throughput(args.seconds)
            for label, what, dt, bps in rows:
                if what.startswith("ratio"):
                    print(f"{label:<12} {what:<40} {dt:>9.2f}x")
                else:
                    print(f"{label:<12} {what:<40} {dt * 1e3:>9.3f} {bps / 1e6:>8.0f}")
            by = {(r[0], r[1].split(" (")[0]): r[3] for r in rows}
            big = by[("64 x 100 KB", "ratio peer/stream")]
            small = by[("256 x 3 KB", "ratio peer/stream")]
            print(f"\npeer / TCP stream (100 KB): {big:.2f}x (target >= 0.6)")
            print(f"peer / TCP stream (3 KB):   {small:.2f}x (target >= 0.5)")
            for label in ("64 x 100 KB", "256 x 3 KB"):
                print(f"sealed frames alone / TCP stream ({label}): {by[(label, 'ratio frames alone/stream')]:.2f}x "
                      "(the bound of the GET's ratio)")
            print(f"frames sealed and opened with: {_core.peer_aead()}")
            mget = by.get(("256 x 3 KB", "Redis MGET"), float("nan"))
            print(f"peer / Redis MGET (3 KB):   {by[('256 x 3 KB', 'shadecache peer GET')] / mget:.2f}x (information)")
            aead = _aead_speed()
            if aead:
                print(f"AES-256-GCM, one core, 128 KiB records (openssl speed, same run): {aead / 1e9:.2f} GB/s; "
                      "every byte is sealed by the server and opened by the client")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _plot_reads(results, n, epochs, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = np.arange(epochs)
    for j, nodes in enumerate((1, 2, 4)):
        ax.bar(xs + (j - 1) * 0.27, results[nodes], 0.27, label=f"{nodes} node(s), shared")
    ax.axhline(n, color="k", ls="--", lw=1, label="N (one node alone)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("store reads, whole cluster")
    ax.set_title("Store reads per epoch, each node caching 20%")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
