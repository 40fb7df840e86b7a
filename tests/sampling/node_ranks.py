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
