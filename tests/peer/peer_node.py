"""One "node" of a multi-node test, as its own process: its own cache, its own peer server
(read-through over the shared store), a Cluster of all nodes, and epochs of reads through
CachedDataset whose every byte is checked against the store.

    python tests/peer/peer_node.py NODE NUM_NODES STORE WORKDIR EPOCHS CAPACITY [HOST]

The job's secret comes from $SHADECACHE_SECRET (never the command line).

HOST is the address its server binds (default 127.0.0.1; the address of its network namespace
when the test runs the node inside one).

Publishes its server's address as WORKDIR/addr.NODE, waits for all the others, then reads its
shard (ids k with k % NUM_NODES == NODE, in a per-epoch shuffled order) in batches of 32, appending
"epoch batch" to WORKDIR/progress.NODE after each batch, and writes WORKDIR/result.NODE (JSON:
stats) at the end. Before its last epoch it waits for WORKDIR/go.last, so that a test can do
something to the cluster (kill a node) while every node still has an epoch to read: on a loaded
machine the nodes would otherwise finish before the test acts. Exit 0: every byte was right; 3: a
wrong byte.
"""
import json
import os
import sys
import time

import numpy as np

import shadecache as sc


def main(node, num_nodes, store_path, workdir, epochs, capacity, host="127.0.0.1"):
    store = sc.PackedStore(store_path)
    n = len(store)
    cache = sc.Cache.create(f"peer-node-{os.getpid()}-{node}", n, capacity, policy="lru", max_item_bytes=4096)
    server = sc.Node(store, cache, read_ahead=False).serve(host=host)
    with open(os.path.join(workdir, f"addr.{node}.tmp"), "w") as f:
        f.write(f"{server.address} {server.pid}")
    os.rename(os.path.join(workdir, f"addr.{node}.tmp"), os.path.join(workdir, f"addr.{node}"))
    addresses = []
    for k in range(num_nodes):
        p = os.path.join(workdir, f"addr.{k}")
        while not os.path.exists(p):
            time.sleep(0.02)
        addresses.append(open(p).read().split()[0])
    cluster = sc.Cluster(addresses, node, timeout=0.5, backoff=(0.2, 1.0))
    ds = sc.Node(store, cache, cluster=cluster, read_ahead=False).dataset()
    truth = sc.PackedStore(store_path)
    mine = np.arange(node, n, num_nodes)
    rng = np.random.default_rng(node)
    progress = open(os.path.join(workdir, f"progress.{node}"), "a", buffering=1)
    for epoch in range(epochs):
        if epoch == epochs - 1:
            while not os.path.exists(os.path.join(workdir, "go.last")):
                time.sleep(0.02)
        order = rng.permutation(mine)
        for b in range(0, order.size, 32):
            ids = order[b:b + 32]
            got = ds.fetch_bytes(ids)
            want = truth.read_many(ids.tolist())
            if got != want:
                bad = [int(i) for i, g, w in zip(ids, got, want) if g != w]
                print(f"node {node}: wrong bytes for ids {bad[:10]}", file=sys.stderr)
                return 3
            progress.write(f"{epoch} {b // 32}\n")
            time.sleep(0.01)
    result = {"dataset": ds.stats(), "cluster": cluster.stats()}
    # written whole, then renamed: the test reads the file as soon as it exists
    path = os.path.join(workdir, f"result.{node}")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, default=str)
    os.replace(path + ".tmp", path)
    # stay up (serving the others) until told to stop
    stop = os.path.join(workdir, "stop")
    while not os.path.exists(stop):
        time.sleep(0.05)
    server.close()
    cache.close()
    cache.unlink()
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(int(a[0]), int(a[1]), a[2], a[3], int(a[4]), int(a[5]), *a[6:]))
