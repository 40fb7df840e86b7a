"""DDP training across "nodes" under torchrun (gloo, CPU): CachedDataset + ShadeSampler +
Cluster.from_torch, one cache per node shared by that node's processes.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank K --master-addr 127.0.0.1 --master-port P \
        tests/peer/peer_ddp_train.py STORE OUTDIR JOB EPOCHS

Every batch's inputs are checked against the store's bytes; each rank writes OUTDIR/rank<R>.json.
"""
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import shadecache as sc
from shadecache.demo import synthetic

SIZE = 8


def main(store_path, outdir, job, epochs):
    dist.init_process_group("gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    node = int(os.environ["GROUP_RANK"])
    store = sc.PackedStore(store_path)
    n = len(store)
    name = f"ddp-{job}-node{node}"
    if local_rank == 0:
        cache = sc.Cache.create(name, n, 1 << 16, policy="importance",   # one slab page: ~1/3 of the data
                                max_item_bytes=SIZE * SIZE)
    dist.barrier()
    if local_rank != 0:
        cache = sc.Cache.attach(name)
    # the secret: $SHADECACHE_SECRET; local rank 0 starts the node's peer server from the node
    shadecache_node = sc.Node(store, cache, cluster="torch", read_ahead=False,
                              peer_options=dict(timeout=1.0))
    cluster = shadecache_node.cluster
    decode = functools.partial(synthetic.decode, size=SIZE)
    ds = shadecache_node.dataset(decode=decode)
    sampler = sc.ShadeSampler(ds, cache=cache, batch_size=16, seed=1)
    # persistent_workers: the worker is forked once, before any DataLoader thread exists. Forking
    # a new worker every epoch while the last epoch's queue feeder thread is still exiting can
    # leave the child blocked in CPython 3.11's after-fork thread-state cleanup (a lock the
    # exiting thread held; seen once in a CI run: the worker never started, the job hung)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=1, persistent_workers=True)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(SIZE * SIZE, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    truth = sc.PackedStore(store_path)
    wrong = 0
    losses_by_epoch = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for x, y, idx in loader:
            want = torch.stack([torch.from_numpy(decode(b)) for b in truth.read_many(idx.tolist())])
            wrong += int((want != x).any(dim=1).sum())
            losses = F.cross_entropy(model(x), y, reduction="none")
            sampler.update(idx, losses.detach())
            opt.zero_grad()
            losses.mean().backward()
            opt.step()
            total += float(losses.sum())
        sampler.end_epoch()
        losses_by_epoch.append(total)
    stats = ds.stats()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "node": node, "wrong": wrong, "stats": stats,
                   "cluster": cluster.stats(), "losses": losses_by_epoch}, f, default=str)
    dist.barrier()          # every node is done asking the others before any server stops
    cluster.close()
    cache.close()
    if local_rank == 0:
        cache.unlink()
    dist.destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(a[0], a[1], a[2], int(a[3])))
