"""One node of the slow-shared-storage benchmark (bench/cluster.py --slow), as its own process,
run inside its own network namespace: its own cache (a fraction of the data), and in "shared" mode
its own peer server (read-through over the remote store) and a Cluster of all nodes.

    python bench/cluster_node.py NODE NODES HOST STORE_ADDR WORKDIR EPOCHS CAPACITY MODE

Every epoch: waits for WORKDIR/go.E, reads its shard of the epoch (the same permutation on every
node, every NODES-th id from NODE) in batches of 64, and writes WORKDIR/done.E.NODE: JSON with the
start and end (time.monotonic, one clock for every namespace); then, after WORKDIR/count.E, the
store reads so far to WORKDIR/reads.E.NODE (this process's and its server's read-through). The secret comes from SHADECACHE_SECRET.
"""
import json
import os
import sys
import time

import numpy as np

import shadecache as sc
from remote_store import RemoteStore
from shadecache.peer import PeerClient

BATCH = 64


def _wait(path):
    while not os.path.exists(path):
        time.sleep(0.002)


def _publish(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def main(node, nodes, host, store_addr, workdir, epochs, capacity, mode):
    secret = os.environ.get("SHADECACHE_SECRET")
    store = RemoteStore(store_addr)
    n = len(store)
    item = int(os.environ.get("BENCH_MAX_ITEM", 1 << 20))
    cache = sc.Cache.create(f"bench-node-{os.getpid()}-{node}", n, capacity, policy="importance",
                            max_item_bytes=item)
    server = client = cluster = None
    if mode == "shared":
        server = sc.Node(store, cache, read_ahead=False).serve(host=host, secret=secret)
        _publish(os.path.join(workdir, f"addr.{node}"), server.address)
        addrs = []
        for k in range(nodes):
            _wait(os.path.join(workdir, f"addr.{k}"))
            addrs.append(open(os.path.join(workdir, f"addr.{k}")).read())
        cluster = sc.Cluster(addrs, node, secret=secret, timeout=30.0)
        client = PeerClient(server.address, secret, store)
    ds = sc.Node(store, cache, cluster=cluster, read_ahead=False).dataset()
    _publish(os.path.join(workdir, f"ready.{node}"), "")
    try:
        for epoch in range(epochs):
            _wait(os.path.join(workdir, f"go.{epoch}"))
            order = np.random.default_rng(100 + epoch).permutation(n)[node::nodes]
            t0 = time.monotonic()
            for b in range(0, order.size, BATCH):
                ds.fetch_bytes(order[b:b + BATCH])
            t1 = time.monotonic()
            _publish(os.path.join(workdir, f"done.{epoch}.{node}"), json.dumps({"start": t0, "end": t1}))
            # counted once every node has finished the epoch (the others' requests to our server
            # belong to it too)
            _wait(os.path.join(workdir, f"count.{epoch}"))
            reads = ds.stats()["store_reads"]
            if client is not None:
                reads += client.server_stats(30)["store_reads"]
            _publish(os.path.join(workdir, f"reads.{epoch}.{node}"), json.dumps({"store_reads": reads}))
        _wait(os.path.join(workdir, "stop"))
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
        if server is not None:
            server.close()
        cache.close()
        cache.unlink()
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(int(a[0]), int(a[1]), a[2], a[3], a[4], int(a[5]), int(a[6]), a[7]))
