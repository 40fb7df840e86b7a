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


def test_ranks_that_compose_their_nodes_at_once_share_one_board(store, tmp_path):
    """Four processes compose a node of one cache at the same moment: one makes the board, the
    others wait until it is whole and attach it (none fails on a board half made)."""
    import multiprocessing as mp

    from rank_processes import compose_at_once

    ctx = mp.get_context("fork")
    for trial in range(3):
        name = f"t-{os.getpid()}-race{trial}"
        cache = sc.Cache.create(name, num_samples=N, capacity_bytes=1 << 20)
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=compose_at_once, args=(store.path, name, barrier, results))
                 for _ in range(4)]
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        cache.close()
        sc.Cache.remove(name)
        assert got == [("ok", True)] * 4, got


def test_a_later_node_reads_ahead_when_none_runs(store, cache_factory):
    """Whoever made the board, a node that reads ahead starts the prefetcher when none runs: a
    second node of the cache in this process (the first closed), and the next job's node over a
    board a job killed with SIGKILL left behind (made anew: its stream count was the old job's)."""
    import subprocess
    import sys

    cache = cache_factory(N, 4 << 20, "lru")

    def one_epoch(node):
        sampler = node.sampler(batch_size=50, seed=0)
        sampler.set_epoch(0)
        for _ in node.loader(50, sampler=sampler, num_workers=0):
            pass
        return node.started_prefetcher is not None and node.prefetching

    first = sc.Node(store, cache, read_plan="samples")
    assert one_epoch(first)
    first.close()
    second = sc.Node(store, cache, read_plan="samples")
    assert one_epoch(second)
    second.close()

    name = f"t-{os.getpid()}-killedjob"
    left = sc.Cache.create(name, num_samples=N, capacity_bytes=1 << 20, persist=True)
    code = (f"import os, signal, shadecache as sc\n"
            f"n = sc.Node(sc.PackedStore({store.path!r}), sc.Cache.attach({name!r}), "
            f"read_plan='samples', streams=2)\n"
            f"os.kill(os.getpid(), signal.SIGKILL)\n")
    subprocess.run([sys.executable, "-c", code], timeout=60)
    assert os.path.exists(f"/dev/shm/shadecache-order.{name}")
    try:
        node = sc.Node(store, left, read_plan="samples", streams=1)
        assert node.board.streams == 1 and not node.board.control.creator_gone()
        assert one_epoch(node)
        node.close()
    finally:
        left.close()
        sc.Cache.remove(name)


def test_a_prefetcher_that_cannot_start_leaves_training_going(store, tmp_path):
    """An admission rule defined in the training script (its __main__) cannot be unpickled by
    the prefetcher's interpreter: the node warns once, and every epoch delivers every sample
    without reading ahead."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(f"""
import numpy as np, shadecache as sc
class EvenOnly(sc.Admission):
    def allows(self, ids):
        return np.asarray(ids) % 2 == 0
store = sc.PackedStore({store.path!r})
cache = sc.Cache.for_store("t-{os.getpid()}-mainrule", store, capacity_bytes=1 << 20, attach=False)
node = sc.Node(store, cache, admission=EvenOnly(), read_plan="samples")
sampler = node.sampler(batch_size=50, seed=0)
for epoch in range(2):
    sampler.set_epoch(epoch)
    got = {{}}
    for x, y, idx in node.loader(50, sampler=sampler, num_workers=0):
        for k, i in enumerate(idx.tolist()):
            got[i] = x.row(k) if hasattr(x, "row") else bytes(x[k].numpy())
    assert sorted(got) == list(range(len(store)))
print("epochs done; reading ahead:", node.prefetching)
cache.close()
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epochs done; reading ahead: False" in done.stdout
    assert done.stderr.count("the node's prefetcher did not start") == 1


def test_only_rank_0s_choice_is_taken_and_remembered(tmp_path):
    """Ranks that measured their devices differently draw under rank 0's plan, and the plan the
    next run finds on the node is that one, not the choice of whichever rank wrote last."""
    import json

    import torch.multiprocessing as tmp_mp
    from rank_processes import choose_on_rank

    xdg = str(tmp_path / "xdg")
    for run in range(2):
        out = tmp_mp.Manager().dict()
        tmp_mp.spawn(choose_on_rank, args=(2, str(tmp_path / f"rdzv{run}"), xdg, out), nprocs=2)
        assert dict(out) == {0: "extents", 1: "extents"}
        plans = os.path.join(xdg, "shadecache", "read_plans")
        (name,) = os.listdir(plans)
        with open(os.path.join(plans, name)) as f:
            assert json.load(f)["kind"] == "extents"


def test_a_remembered_plan_out_of_range_is_measured_again(store, tmp_path, monkeypatch):
    """A remembered extent size this module never writes (0, negative, not a power of two, not a
    number) is no plan: the node measures again rather than fail for a week."""
    import json

    from rank_processes import MeasuredStore
    from shadecache import read_plan

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    fake = MeasuredStore(0)
    first = read_plan.choose(fake, "auto")
    plans = tmp_path / "xdg" / "shadecache" / "read_plans"
    (path,) = list(plans.iterdir())
    for bad in (0, -4096, 1, 3 << 10, True, "64k"):
        data = json.loads(path.read_text())
        data["extent_bytes"] = bad
        path.write_text(json.dumps(data))
        got = read_plan.choose(fake, "auto")
        assert got.extent_bytes == first.extent_bytes and "chosen on this node" not in got.reason


def test_a_read_plan_of_another_store_and_bad_prefetch_options_are_refused(store, tmp_path):
    rng = np.random.default_rng(5)
    with sc.PackWriter(tmp_path / "other.shc", seed=3) as w:
        for i in range(N):
            w.add(rng.integers(0, 256, 900, dtype=np.uint8).tobytes(), 0)
    other = sc.PackedStore(tmp_path / "other.shc")
    with pytest.raises(ValueError, match="made for another store"):
        sc.Node(store, None, read_plan=sc.ReadPlan.of_extents(other, 64 << 10))
    with pytest.raises(TypeError, match="unknown options"):
        sc.Node(store, None, prefetch={"bogus": 1})
    with pytest.raises(ValueError, match="poll_s"):
        sc.Node(store, None, prefetch={"poll_s": 0})


def test_the_nodes_own_processes_get_the_clusters_secret_and_no_other_pickle_does(
        store, cache_factory, monkeypatch):
    """A cluster given its secret as an argument: the node's prefetcher and peer server (their
    configuration pickled for a pipe) get it; a plain pickle of the node (a checkpoint) does not."""
    import pickle

    monkeypatch.delenv("SHADECACHE_SECRET", raising=False)
    cache = cache_factory(N, 4 << 20, "lru", fingerprint=store.fingerprint)
    cluster = sc.Cluster([None, "127.0.0.1:9"], node=0, secret=SECRET)
    node = sc.Node(store, cache, cluster=cluster, read_ahead=False)
    mine = pickle.loads(node.pickled_for_process())
    assert mine.cluster._secret() == cluster._secret()
    saved = pickle.loads(pickle.dumps(node.for_process()))   # the same node, another pickle
    with pytest.raises(sc.peer.SecretError):
        saved.cluster._secret()


def test_a_forked_child_that_closes_its_copy_of_the_node_leaves_the_parents_prefetcher_running(
        store, cache_factory):
    """A DataLoader worker or a subprocess forked from the training script has a copy of the node
    and of its prefetcher's handle; when it closes the node (or exits normally, and the exit
    handler closes it) the prefetcher, its parent's, keeps running: only the process that
    started it stops it."""
    from shadecache.node import node as node_module
    cache = cache_factory(N, 4 << 20, "lru")
    node = sc.Node(store, cache, read_plan="samples")
    sampler = node.sampler(batch_size=50, seed=0)
    sampler.set_epoch(0)                        # publishes the order: the node starts its prefetcher
    assert node.started_prefetcher is not None and node.board.control.prefetcher_alive()
    pid = os.fork()
    if pid == 0:
        try:
            node.close()
            node_module._stop_prefetchers()     # what the child's exit runs
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    time.sleep(0.5)
    assert not node.board.control.stop_requested and node.board.control.prefetcher_alive()
    prefetcher_pid = node.started_prefetcher.pid
    node.close()
    with pytest.raises(ProcessLookupError):     # the parent's close stops it (and reaps it)
        os.kill(prefetcher_pid, 0)


def test_a_plain_pickle_of_the_data_set_is_a_copy_that_reads_and_counts_on_its_own(
        store, cache_factory):
    """A checkpoint pickles the data set with plain pickle (no process being started): the copy
    reads the same bytes through the same tiers, starts from the counts as they were, and counts
    in a row of its own (only a process multiprocessing starts shares the node's counters)."""
    import pickle
    cache = cache_factory(N, 4 << 20, "lru", fingerprint=store.fingerprint)
    ds = sc.Node(store, cache, read_ahead=False).dataset()
    ids = np.arange(0, N, 7)
    want = store.read_many(list(ids))
    assert ds.fetch_bytes(ids) == want
    before = ds.stats()
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.stats() == before
    assert copy.fetch_bytes(ids) == want                    # hits now: the cache took them
    assert copy.stats()["hits"] == before["hits"] + len(ids)
    assert ds.stats() == before                             # the original's counts did not move
