"""sc.Node: the node's parts composed once. Every process of the node (a DataLoader worker, the
prefetcher, the peer server) reads through the same tiers in the same order whatever order the
parts were made in, and every path that offers values to the cache follows the node's one
admission rule."""
import os
import time

import numpy as np
import pytest
import torch

import shadecache as sc
from shadecache import status
from shadecache.peer import PeerClient, new_secret
from rules import EvenIdsOnly

N = 400
SECRET = new_secret()


@pytest.fixture(autouse=True)
def _secret_in_env(monkeypatch):
    monkeypatch.setenv("SHADECACHE_SECRET", SECRET)
    monkeypatch.delenv("SHADECACHE_SECRET_FILE", raising=False)


@pytest.fixture
def store(tmp_path):
    rng = np.random.default_rng(3)
    with sc.PackWriter(tmp_path / "s.shc") as w:
        for i in range(N):
            w.add(rng.integers(0, 256, 500 + (i * 13) % 700, dtype=np.uint8).tobytes(), i % 5)
    s = sc.PackedStore(tmp_path / "s.shc")
    yield s
    s.close()


class TiersOfTheWorker(torch.utils.data.Dataset):
    """A data set whose items are what the process reading it (a DataLoader worker) reads through."""

    def __init__(self, node):
        self.node = node

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return {"pid": os.getpid(), "tiers": self.node.tiers()}


def _published(cache_name, role, pid, timeout=30.0):
    """The status file `role` publishes for the cache, once the process `pid` wrote it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = status.read(cache_name, role)
        if got is not None and got.get("pid") == pid:
            return got
        time.sleep(0.05)
    raise AssertionError(f"no {role} status of pid {pid}")


@pytest.mark.parametrize("made_first", ["cluster", "ssd"])
def test_every_process_reads_through_the_nodes_tiers_whatever_order_they_were_made_in(
        store, tmp_path, cache_factory, made_first):
    """The README's order (the cluster first, then the SSD tier) and the reverse give one node:
    a DataLoader worker and the prefetcher read through the home peer, the SSD tier and the
    store; the peer server through the SSD tier and the store (it answers for its own ids)."""
    remote_cache = cache_factory(N, 4 << 20, "lru", fingerprint=store.fingerprint)
    remote = sc.Node(store, remote_cache, read_ahead=False).serve(secret=SECRET)
    cache = cache_factory(N, 4 << 20, "lru", fingerprint=store.fingerprint)
    parts = {}
    for what in (made_first, {"cluster": "ssd", "ssd": "cluster"}[made_first]):
        if what == "cluster":
            parts["cluster"] = sc.Cluster([None, remote.address], node=0, secret=SECRET)
        else:
            parts["ssd"] = sc.SSDTier(tmp_path / "ssd", capacity_bytes=4 << 20, cache=cache)
    node = sc.Node(store, cache, ssd=parts["ssd"], cluster=parts["cluster"])
    server = node.serve(secret=SECRET)
    prefetcher = node.prefetcher().start()
    try:
        ssd, packed = f"SSDTier({tmp_path / 'ssd'})", f"PackedStore({store.path})"
        loader = torch.utils.data.DataLoader(TiersOfTheWorker(node), num_workers=1,
                                             collate_fn=lambda items: items[0])
        worker = next(iter(loader))
        assert worker["pid"] != os.getpid()
        names = [name for name, _ in worker["tiers"]]
        assert names == ["peer", "ssd", "store"]
        assert [list(t) for t in worker["tiers"][1:]] == [["ssd", ssd], ["store", packed]]
        pf = _published(cache.name, status.PREFETCHER, prefetcher.pid)
        assert pf["tiers"] == [list(t) for t in worker["tiers"]]
        sv = _published(cache.name, status.SERVER, server.pid)
        assert sv["tiers"] == [["ssd", ssd], ["store", packed]]
        assert node.tiers() == worker["tiers"]
    finally:
        prefetcher.stop()
        server.close()
        remote.close()
        parts["ssd"].close()


def test_a_cluster_that_started_its_own_server_is_refused(store, cache_factory):
    """A server started apart from the node may read through other tiers: the node refuses a
    Cluster that carries one, and says how to let the node start it."""
    cache = cache_factory(N, 4 << 20, "lru", fingerprint=store.fingerprint)
    cluster = sc.Cluster([None, "127.0.0.1:9"], node=0, secret=SECRET)
    cluster.server = sc.Node(store, cache, read_ahead=False).serve(secret=SECRET)
    try:
        with pytest.raises(ValueError, match="cluster='torch'"):
            sc.Node(store, cache, cluster=cluster)
    finally:
        cluster.server.close()


def test_the_node_checks_its_parts(store, cache_factory, tmp_path):
    with pytest.raises(ValueError, match="holds 10 sample ids"):
        sc.Node(store, cache_factory(10))
    with pytest.raises(TypeError, match="sc.Admission"):
        sc.Node(store, None, admission=lambda ids: ids)
    with pytest.raises(TypeError, match="'torch' or an sc.Cluster"):
        sc.Node(store, None, cluster=["127.0.0.1:1"])
    with pytest.raises(ValueError, match="a node needs a store"):
        sc.Node(None, None)
    with pytest.raises(ValueError, match="read_plan must be"):
        sc.Node(store, None, read_plan="blocks")


def _odd_cached(cache) -> int:
    return int(np.asarray(cache.cached_mask(), dtype=bool)[1::2].sum())


def _even_cached(cache) -> int:
    return int(np.asarray(cache.cached_mask(), dtype=bool)[0::2].sum())


@pytest.mark.parametrize("path", ["dataset", "loader", "prefetcher", "peer server"])
def test_one_admission_rule_is_followed_by_every_path(store, cache_factory, path):
    """The rule is given once, to the node; the data set in a DataLoader worker, CachedLoader's
    threads, the prefetcher's process and the peer server's process all follow it: no odd id is
    cached, and the even ones are (the cache has room for every sample)."""
    cache = cache_factory(N, 4 << 20, "lru", fingerprint=store.fingerprint, sizes=store.lengths)
    node = sc.Node(store, cache, admission=EvenIdsOnly(), read_plan="samples",
                   read_ahead=path == "prefetcher")
    ids = np.arange(N)
    if path == "dataset":
        loader = torch.utils.data.DataLoader(node.dataset(decode=bytes), batch_size=50, num_workers=2,
                                             collate_fn=list)
        got = [x for batch in loader for x, _, _ in batch]
        assert got == store.read_many(ids.tolist())
    elif path == "loader":
        loader = node.loader(50, num_workers=2)
        assert sum(len(idx) for _, _, idx in loader) == N
    elif path == "prefetcher":
        sampler = node.sampler(batch_size=50, seed=1, importance=False, stalls=False)
        sampler.set_epoch(0)                      # publishes: the node starts its prefetcher
        deadline = time.monotonic() + 30
        while _even_cached(cache) < N // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.prefetching
        assert node.stats()["samples"] == 0       # nothing was read by a loader: all by it
        node.close()
    else:
        server = node.serve(secret=SECRET)
        try:
            client = PeerClient(server.address, SECRET, store)
            assert client.get_many(ids, timeout=10.0) == store.read_many(ids.tolist())
            client.close()
        finally:
            server.close()
    assert _odd_cached(cache) == 0
    assert _even_cached(cache) == N // 2


def test_a_seed_reproduces_the_order_in_separate_processes(tmp_path):
    """Same seed, pack file and code, three separate processes (a DataLoader with 0 and with 2
    workers; stalls off and the defaults; a store the device keeps up with): the same ids in the
    same order every epoch, and with 0 workers the same losses. The store is large enough that
    each process measures its device: the read plan it chooses is remembered on the node, so all
    three draw under the same plan."""
    import json
    import subprocess
    import sys

    rng = np.random.default_rng(11)
    path = tmp_path / "repro.shc"
    with sc.PackWriter(path) as w:   # 18 MiB: over the size below which a store is not probed
        for i in range(4000):
            w.add(rng.integers(0, 256, 4700, dtype=np.uint8).tobytes(), int(i % 10))
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"),
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(here)),
                                           os.environ.get("PYTHONPATH", "")]))
    runs = []
    for workers, stalls in ((0, "off"), (2, "on"), (0, "on")):
        done = subprocess.run([sys.executable, os.path.join(here, "train_once.py"), str(path), "7",
                               str(workers), stalls], env=env, capture_output=True, text=True,
                              timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first = runs[0]
    for run in runs[1:]:
        assert run["read_plan"] == first["read_plan"]
        assert run["epochs"] == first["epochs"]
    assert sorted(first["epochs"][0]) == list(range(4000))
    assert first["epochs"][0] != first["epochs"][1]
    assert runs[2]["losses"] == first["losses"]
