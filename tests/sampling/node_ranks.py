"""Two (or more) real training processes of one node for the DDP tests: a gloo process group over
a file rendezvous and one cache they share (rank 0 makes it, the others attach), then the orderly
end (every rank lets go of the cache before rank 0 removes it)."""
import datetime

import torch.distributed as dist

import shadecache as sc


def join_node(rank, world, init_file, cache_name, **create):
    """The process group and the node's cache (Cache.create's options on rank 0)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    if rank == 0:
        cache = sc.Cache.create(cache_name, **create)
    dist.barrier()
    return cache if rank == 0 else sc.Cache.attach(cache_name)


def leave_node(rank, cache):
    dist.barrier()
    cache.close()
    dist.barrier()
    if rank == 0:
        cache.unlink()
    dist.destroy_process_group()


def arrange_on_rank(rank, world, init_file, path, out_dir):
    """One rank of test_extent_order's agreement test: opens the store with its own device
    figures and saves the order its ShadeSampler gives (a module of its own: a spawned rank
    imports this, not the test module and its conftest)."""
    import os

    import numpy as np

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        # the device figures each process measures at open differ between processes: here the
        # second rank's disk moves more per request (a larger gap: larger default extents), and
        # for "auto" it is not IOPS-bound at all
        for case, bandwidth in (("extent size", 200 + 150 * rank), ("auto", 200 if rank == 0 else 3)):
            with sc.PackedStore(path, device={"iops": 3000, "bandwidth": bandwidth << 20}) as store:
                node = sc.Node(store, None, read_plan="extents" if case == "extent size" else "auto",
                               read_ahead=False)
                s = sc.ShadeSampler(node.dataset(), seed=5)
                np.save(os.path.join(out_dir, f"{case}-{rank}.npy"), np.fromiter(iter(s), np.int64))
    finally:
        dist.destroy_process_group()
