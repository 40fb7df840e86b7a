"""Processes of one node for tests/node: ranks that compose their nodes at the same moment, and
ranks of a process group whose device measurements differ (a module of its own: spawned
processes import this, not the test module)."""
import datetime
import os

import numpy as np

import shadecache as sc


def compose_at_once(store_path, cache_name, barrier, results):
    """One rank: attaches the cache, waits for the others, composes its node (the first makes
    the board while the others attach it), reports ok or the error."""
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    store = sc.PackedStore(store_path)
    cache = sc.Cache.attach(cache_name)
    barrier.wait()
    try:
        node = sc.Node(store, cache, read_plan="samples")
        results.put(("ok", node.board is not None and node.board.streams == 4))
        node.close()
    except Exception as e:   # noqa: BLE001 (the test reports it)
        results.put(("error", f"{type(e).__name__}: {e}"))
    cache.close()


class MeasuredStore:
    """A packed store's shape as one rank measured its device at open: IOPS-bound on rank 0,
    not on the others."""

    def __init__(self, rank):
        self.lengths = np.full(1000, 3000, np.int64)
        self.path, self.fingerprint = "/nonexistent", "ranks-measure-differently"
        self.iops_bound, self.gap_bytes = rank == 0, 70_000
        self.device = {"source": "measured (O_DIRECT)", "iops": 3000.0, "bandwidth": 2e8}

    def disk_order(self):
        return np.arange(1000)

    def __len__(self):
        return 1000


def choose_on_rank(rank, world, init_file, xdg, out):
    """One rank of the read plan test: chooses "auto" for its own measurement, records it."""
    import torch.distributed as dist

    from shadecache import read_plan
    os.environ["XDG_CACHE_HOME"] = xdg
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        out[rank] = read_plan.choose(MeasuredStore(rank), "auto").kind
        dist.barrier()
    finally:
        dist.destroy_process_group()
