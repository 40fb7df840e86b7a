"""The peer layer between real processes on 127.0.0.1: separate caches, real servers, real
SIGKILL and SIGSTOP. The three-node test also runs with every node in a network namespace of its
own, joined by veth pairs through a bridge and shaped with `tc tbf` (bench/netns.py; skipped
without root or `ip netns`). This kernel has no netem: delay and loss are not shaped; a hung peer
is a SIGSTOPped process instead."""
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import shadecache as sc
from shadecache.peer import AuthenticationError, PeerClient, SecretError, new_secret, wire

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "bench"))
import netns  # noqa: E402
N = 600
SECRET = new_secret()


@pytest.fixture(autouse=True)
def _secret_in_env(monkeypatch):
    """The job's secret, as a launcher gives it: in the environment (children inherit it)."""
    monkeypatch.setenv("SHADECACHE_SECRET", SECRET)
    monkeypatch.delenv("SHADECACHE_SECRET_FILE", raising=False)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("peer") / "train.shc")
    rng = np.random.default_rng(9)
    with sc.PackWriter(path) as w:
        for i in range(N):
            w.add(rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes(), i % 7)
    return path


@pytest.fixture
def store(store_path):
    s = sc.PackedStore(store_path)
    yield s
    s.close()


def _node_cache(cache_factory, store, ids):
    """A cache holding `ids` of the store."""
    c = cache_factory(N, 8 << 20, "lru", max_item_bytes=4096, fingerprint=store.fingerprint)
    ids = list(ids)
    c.put_many(np.asarray(ids, dtype=np.int64), store.read_many(ids))
    return c


def test_cross_node_hits_return_exact_bytes(cache_factory, store):
    remote = _node_cache(cache_factory, store, range(0, N, 2))
    with sc.Node(None, remote, read_ahead=False).serve(secret=SECRET) as server:
        client = PeerClient(server.address, SECRET, store)
        ids = list(range(0, N, 3))
        got = client.get_many(ids, timeout=5)
        want = store.read_many(ids)
        for i, g, w in zip(ids, got, want):
            assert g == (w if i % 2 == 0 else None), i
        # a request larger than one reply chunk, repeated ids included
        ids = list(range(N)) + list(range(0, N, 2))
        got = client.get_many(ids, timeout=5)
        assert [g for g in got if g is not None] == [w for i, w in zip(ids, store.read_many(ids)) if i % 2 == 0]
        client.close()


def test_read_through_server_reads_the_store_once_and_caches(cache_factory, store):
    home = cache_factory(N, 8 << 20, "lru", max_item_bytes=4096)
    with sc.Node(store, home, read_ahead=False).serve() as server:
        client = PeerClient(server.address, dataset=store)
        ids = list(range(100, 200))
        assert client.get_many(ids, timeout=5) == store.read_many(ids)
        assert all(home.contains(i) for i in ids)    # the home node keeps what it owns
        assert client.get_many(ids, timeout=5) == store.read_many(ids)
        st = client.server_stats()
        assert st["store_reads"] == 100 and st["cache_hits"] == 100 and st["ids"] == 200
        client.close()


def test_wrong_secret_is_refused_before_any_sample(cache_factory, store):
    remote = _node_cache(cache_factory, store, range(N))
    with sc.Node(None, remote, read_ahead=False).serve() as server:
        with pytest.raises(AuthenticationError):
            PeerClient(server.address, new_secret(), store).get_many([1, 2, 3], timeout=2)
        # skipping the handshake: a GET first gets no sample, only the HELLO and an ERROR in clear
        host, port = server.address.split(":")
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(wire.pack_header(wire.GET, 1, 8) + np.array([5], "<u8").tobytes())
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            assert store.read(5) not in data
            assert wire.MAGIC + bytes([wire.VERSION, wire.HELLO]) == data[:6]   # only the challenge...
            assert data[wire.HEADER_BYTES + wire.HELLO_BYTES:][4 + 1] == wire.ERROR  # ...then ERROR
        assert PeerClient(server.address, SECRET, store).get_many([5], timeout=2) == [store.read(5)]


def test_a_strong_secret_is_required_everywhere_loopback_included(cache_factory, store, monkeypatch, tmp_path):
    """No secret, or a weak one, is refused on loopback too, with a message that says how to make
    one; the secret comes from secret=, $SHADECACHE_SECRET or a 0600 file of this user."""
    c = _node_cache(cache_factory, store, range(10))
    monkeypatch.delenv("SHADECACHE_SECRET")
    for host in ("127.0.0.1", "0.0.0.0"):
        with pytest.raises(SecretError, match="shadecache secret"):
            sc.Node(None, c, read_ahead=False).serve(host=host)
    for weak in ("s3cret", "passwordpassword", "correct horse battery staple", "ab" * 32, b"\x00" * 16):
        with pytest.raises(SecretError, match="shadecache secret"):
            sc.Node(None, c, read_ahead=False).serve(secret=weak)
        with pytest.raises(SecretError):
            sc.Cluster(["127.0.0.1:1", "127.0.0.1:2"], node=0, secret=weak)
    with pytest.raises(TypeError):
        sc.Node(None, c, read_ahead=False).serve(secret=12)
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    monkeypatch.setenv("SHADECACHE_SECRET_FILE", str(path))
    with pytest.raises(SecretError, match="mode 0644"):
        sc.Node(None, c, read_ahead=False).serve()
    path.chmod(0o600)
    with sc.Node(None, c, read_ahead=False).serve() as server:   # the 0600 file's secret
        assert PeerClient(server.address, SECRET, store).get_many([1], timeout=5) == [store.read(1)]
    with pytest.raises(ValueError, match="host:port"):
        sc.Cluster(["127.0.0.1:1", "nohostport"], node=0)
    with pytest.raises(ValueError, match="node"):
        sc.Cluster(["127.0.0.1:1"], node=3)


def _three_servers(cache_factory, store, secret):
    """Servers for nodes 1 and 2 (this process is node 0), each caching its own share."""
    caches, servers = [], []
    fake = sc.Cluster(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], node=0, secret=secret)
    home = fake.home_of(np.arange(N))
    for k in (1, 2):
        c = _node_cache(cache_factory, store, np.flatnonzero(home == k).tolist())
        caches.append(c)
        servers.append(sc.Node(None, c, read_ahead=False).serve(secret=secret))
    return home, caches, servers


def test_sigstopped_peer_costs_at_most_the_timeout_per_batch_then_rejoins(cache_factory, store):
    home, caches, servers = _three_servers(cache_factory, store, SECRET)
    try:
        cluster = sc.Cluster([None] + [s.address for s in servers], node=0, secret=SECRET,
                             timeout=0.3, backoff=(0.4, 0.4))
        local = cache_factory(N, 8 << 20, "lru", max_item_bytes=4096)
        ds = sc.Node(store, local, cluster=cluster, admission=sc.ReadThrough(), read_ahead=False).dataset()
        batches = [np.arange(b, b + 40) for b in range(0, N, 40)]
        assert all(ds.fetch_bytes(b) == store.read_many(b.tolist()) for b in batches)
        assert ds.stats()["tiers"]["peer"]["hits"] == int((home != 0).sum())
        os.kill(servers[0].pid, signal.SIGSTOP)
        try:
            times = []
            for b in batches:
                t0 = time.monotonic()
                assert ds.fetch_bytes(b) == store.read_many(b.tolist())
                times.append(time.monotonic() - t0)
            # the first batch waits out the timeout; the next ones skip the peer during backoff
            assert max(times) < 0.3 + 0.25, times
            assert cluster.stats()["failures"] >= 1
        finally:
            os.kill(servers[0].pid, signal.SIGCONT)
        time.sleep(0.5)
        before = ds.stats()["tiers"]["peer"]["hits"]
        for b in batches:
            assert ds.fetch_bytes(b) == store.read_many(b.tolist())
        assert ds.stats()["tiers"]["peer"]["hits"] - before == int((home != 0).sum())   # rejoined
        cluster.close()
    finally:
        for s in servers:
            s.close()


@pytest.fixture(params=["loopback", "netns"])
def where(request):
    """(argv prefix, host) per node: all on 127.0.0.1, or each in its own network namespace with
    its link shaped to 200 Mbit/s (tbf)."""
    if request.param == "loopback":
        yield lambda k: ([], "127.0.0.1")
        return
    why = netns.available()
    if why:
        pytest.skip(why)
    hosts = ["n0", "n1", "n2"]
    with netns.Net(hosts, shape={h: "200mbit" for h in hosts}) as net:
        yield lambda k: (net.argv(hosts[k]), net.addr(hosts[k]))


def test_three_node_processes_one_sigkilled_mid_epoch(store_path, tmp_path, where):
    """Three node processes, each with its own cache and server; node 2 (process and server) is
    SIGKILLed during epoch 1; nodes 0 and 1 finish every epoch with the right bytes."""
    work = str(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen(where(k)[0] + [sys.executable, os.path.join(HERE, "peer_node.py"), str(k), "3",
                                             store_path, work, "3", str(N * 3000 // 3), where(k)[1]],
                              env=env)
             for k in range(3)]
    try:
        prog = os.path.join(work, "progress.2")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if os.path.exists(prog) and any(l.startswith("1 ") for l in open(prog)):
                break
            assert procs[2].poll() is None, "node 2 exited early"
            time.sleep(0.02)
        else:
            pytest.fail("node 2 never reached epoch 1")
        server_pid = int(open(os.path.join(work, "addr.2")).read().split()[1])
        os.kill(server_pid, signal.SIGKILL)
        procs[2].kill()
        procs[2].wait()
        open(os.path.join(work, "go.last"), "w").close()   # nodes 0 and 1 read their last epoch now
        for k in (0, 1):
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(work, f"result.{k}")):
                assert procs[k].poll() is None, f"node {k} failed with {procs[k].returncode}"
                assert time.monotonic() < deadline, f"node {k} did not finish"
                time.sleep(0.05)
        import json
        stats = [json.load(open(os.path.join(work, f"result.{k}"))) for k in (0, 1)]
        assert all(s["dataset"]["tiers"]["peer"]["hits"] > 0 for s in stats)
        assert any(s["cluster"]["failures"] >= 1 for s in stats)   # node 2's death was noticed
    finally:
        open(os.path.join(work, "stop"), "w").close()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert procs[0].returncode == 0 and procs[1].returncode == 0
    # the killed node's server could not remove its tier status file: gc's sweep does
    from shadecache import status as tier_status
    from shadecache import shm
    shm.sweep(sc.cache.list_caches())
    names = [p[len(shm.STATUS_PREFIX):-len(".json")] for p in os.listdir(shm.SHM_DIR)
             if p.startswith(shm.STATUS_PREFIX) and p.endswith(".json")]
    assert not [n for n in names if (tier_status.read(n) or {}).get("stale")]


def test_serve_command_serves_a_cache(cache_factory, store):
    c = _node_cache(cache_factory, store, range(50))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "shadecache.cli", "serve", c.name, "--port", str(port), "--cache-only"],
                         env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert "serving" in p.stdout.readline()
        assert PeerClient(f"127.0.0.1:{port}", SECRET, store).get_many([1, 60], timeout=5) == [store.read(1), None]
        for argv, extra, why in ((["--host", "0.0.0.0", "--cache-only"], {"SHADECACHE_SECRET": ""}, "needs a secret"),
                                 (["--cache-only"], {"SHADECACHE_SECRET": "cli"}, "at least 16"),
                                 ([], {}, "--store")):
            bad = subprocess.run([sys.executable, "-m", "shadecache.cli", "serve", c.name] + argv,
                                 env=dict(env, **extra), capture_output=True, text=True)
            assert bad.returncode == 2 and why in bad.stderr, bad.stderr
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(10)
    assert p.returncode == 0


def test_stats_and_ls_show_the_tiers(cache_factory, store, tmp_path):
    """The node's server publishes its tiers: cache.stats()["tiers"] and `shadecache stats` carry
    its counters (GETs from the cache, SSD tier and store, mean latency), `shadecache ls` shows
    the SSD tier and the peers it was told of; the file goes when the server stops."""
    import json

    from shadecache import status as tier_status

    c = _node_cache(cache_factory, store, range(10))
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, fingerprint=store.fingerprint)
    ssd.put_many([20, 21], store.read_many([20, 21]))
    ssd.flush()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    with sc.Node(store, c, ssd=ssd, read_ahead=False).serve() as server:
        server.set_peers([server.address, "127.0.0.1:9"])
        cl = PeerClient(server.address, dataset=store)
        assert cl.get_many([1, 20, 30], timeout=5) == store.read_many([1, 20, 30])
        cl.close()
        deadline = time.monotonic() + 10
        while True:
            t = c.stats().get("tiers")
            if t and t["server"]["get_ns"] > 0 and t["peers"]:   # get_ns: added when the GET is done
                break
            assert time.monotonic() < deadline, t
            time.sleep(0.1)
        s = t["server"]
        assert (s["cache_hits"], s["ssd_hits"], s["store_reads"]) == (1, 1, 1)
        assert s["mean_get_seconds"] > 0 and t["ssd"]["hits"] == 1 and not t["stale"]
        out = subprocess.run([sys.executable, "-m", "shadecache.cli", "ls"], env=env, capture_output=True,
                             text=True, check=True).stdout
        assert f"{c.name}: peer server {server.address}" in out
        assert f"ssd tier {tmp_path / 'ssd'}: 2 items" in out or f"ssd tier {tmp_path / 'ssd'}: 3 items" in out
        assert "127.0.0.1:9" in out
        st = json.loads(subprocess.run([sys.executable, "-m", "shadecache.cli", "stats", c.name], env=env,
                                       capture_output=True, text=True, check=True).stdout)
        assert st["tiers"]["server"]["ssd_hits"] == 1
    assert not os.path.exists(tier_status.path_of(c.name))
    assert "tiers" not in c.stats()


def _flip_in_shm(cache, value: bytes):
    """Flips one byte of `value` where it lies in the cache's shared-memory segment, behind the
    engine's back (as a stray write or bad memory would): the cache's recorded crc32c stays."""
    import mmap

    with open(f"/dev/shm/shadecache.{cache.name}", "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        at = m.find(value)
        assert at >= 0 and m.find(value, at + 1) < 0
        m[at + len(value) // 2] ^= 0x20


def test_value_damaged_in_the_servers_memory_is_refused(cache_factory, store):
    """The server sends the crc32c its cache recorded at put (the store's checksum of the
    sample), not one computed from the bytes now: a value flipped in the server's shared memory
    fails it at the client, which refuses that value; CachedDataset then reads it from the next
    tier (the store here) and returns the right bytes."""
    ids = list(range(0, 60))
    remote = _node_cache(cache_factory, store, ids)
    want = store.read_many(ids)
    victim = max(ids, key=lambda i: len(want[i]))      # a long value: unique in the segment
    _flip_in_shm(remote, want[victim])
    with sc.Node(None, remote, read_ahead=False).serve(secret=SECRET) as server:
        client = PeerClient(server.address, SECRET, store)
        with pytest.warns(RuntimeWarning, match="failed their crc32c"):
            got = client.get_many(ids, timeout=5)
        assert got == [None if i == victim else w for i, w in zip(ids, want)]
        assert client.refused == 1
        assert client.get_many([victim + 1], timeout=5) == [want[victim + 1]]  # the stream stays in step
        client.close()
        cluster = sc.Cluster([None, server.address], node=0, secret=SECRET, timeout=2.0)
        cluster.home_of = lambda a: np.ones(len(a), dtype=np.int64)   # every id lives on node 1
        ds = sc.Node(store, None, cluster=cluster, admission=sc.ReadThrough(), read_ahead=False).dataset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert ds.fetch_bytes(np.array(ids)) == want
        s = ds.stats()
        assert s["store_reads"] == 1 and s["tiers"]["peer"]["hits"] == len(ids) - 1
        assert cluster.stats()["refused"] == 1
        cluster.close()


def test_a_reply_cut_at_any_boundary_arrives_whole(cache_factory):
    """A reply is cut into messages (64 ids, 512 KiB) and calls (256 ids, 2 MiB of values): sizes
    that put a cut on every kind of boundary, one value larger than a whole call among them, all
    arrive, in order, exact."""
    rng = np.random.default_rng(3)
    sizes = [8000] * 192 + [600_000] * 8 + [0, 1, 3 << 20, 5] + [int(s) for s in rng.integers(0, 70_000, 100)]
    values = [rng.integers(0, 256, s, dtype=np.uint8).tobytes() for s in sizes]
    c = cache_factory(len(values), 96 << 20, "static", max_item_bytes=4 << 20)
    assert c.put_many(np.arange(len(values)), values).all()
    with sc.Node(None, c, read_ahead=False).serve() as server:
        client = PeerClient(server.address, dataset=c)
        assert client.get_many(list(range(len(values))), timeout=30) == values
        order = rng.permutation(len(values)).tolist()
        assert client.get_many(order, timeout=30) == [values[i] for i in order]
        client.close()


_REWRITER = """
import sys, time
import numpy as np
import shadecache as sc
name, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
c = sc.Cache.attach(name)
rng = np.random.default_rng(11)
end = time.monotonic() + seconds
while time.monotonic() < end:
    ids = rng.choice(n, 16, replace=False)
    flip = rng.integers(0, 2, 16)
    c.put_many(ids, [bytes([i % 251]) * (1000 + 7 * i if f else 2500 + 3 * i) for i, f in zip(ids.tolist(), flip)])
print("done", flush=True)
"""


def test_values_rewritten_while_served_arrive_whole_and_every_pin_ends(cache_factory):
    """The server pins a reply message's values in one batch after planning the message by the
    lengths the cache shows, then checks each slot as a single pin does. A real writer process
    rewrites values (to other lengths, so slots move) while a client reads them back through a
    real server: every value arrives as one of its two versions or as a miss, never torn, and
    when both stop no pin of the server is left in the cache."""
    n = 512

    def versions(i):
        return {bytes([i % 251]) * (1000 + 7 * i), bytes([i % 251]) * (2500 + 3 * i)}

    c = cache_factory(n, 16 << 20, "static", max_item_bytes=8192)
    assert c.put_many(np.arange(n), [min(versions(i)) for i in range(n)]).all()
    with sc.Node(None, c, read_ahead=False).serve() as server:
        writer = subprocess.Popen([sys.executable, "-c", _REWRITER, c.name, str(n), "2.0"],
                                  stdout=subprocess.PIPE, text=True)
        client = PeerClient(server.address, dataset=c)
        gets = found = 0
        try:
            while writer.poll() is None:
                ids = np.random.default_rng(gets).permutation(n)[:300]
                got = client.get_many(ids, timeout=10)
                for i, v in zip(ids.tolist(), got):
                    assert v is None or v in versions(i), i
                    found += v is not None
                gets += 1
        finally:
            writer.wait(10)
        assert writer.returncode == 0 and writer.stdout.read().strip() == "done"
        assert gets >= 3 and found >= gets * 250   # most values were there to be pinned
        assert client.get_many(list(range(n)), timeout=10) == [c.get(i) for i in range(n)]
        client.close()
        assert client.refused == 0
    assert c.stats()["pinned"] == 0


def test_a_reply_refused_for_want_of_pin_entries_holds_nothing_after(cache_factory):
    """The process already holds nearly all the views it may (kPinsPerOwner), so a reply message
    of a value in chunks (a private copy) and twenty small values cannot pin them all: sealing it
    raises CapacityError, and the copy made before the small values were claimed goes too, so
    that once the views end and the cache is closed its segment is unmapped from this process."""
    from shadecache import _core
    from shadecache.peer.server import seal_reply
    c = cache_factory(64, 8 << 20)
    chunk = c.stats()["chunk_size"]
    assert c.put_many(np.arange(21), [b"L" * (3 * chunk)] + [bytes([i]) * 100 for i in range(1, 21)]).all()
    views = [c.view(1) for _ in range(500)]
    a, b = os.urandom(32), os.urandom(32)
    server_side, client_side = socket.socketpair()
    with server_side, client_side:
        with pytest.raises(sc.CapacityError, match="views of cache"):
            seal_reply(c, _core.PeerSession(a, b), server_side.fileno(), np.arange(21, dtype=np.uint64),
                       {}, 1, False, 1 << 20, 1.0)
    del views
    assert c.stats()["pinned"] == 0
    segment = f"shadecache.{c.name}"
    with open("/proc/self/maps") as f:
        assert segment in f.read()
    c.close()
    with open("/proc/self/maps") as f:
        assert segment not in f.read()
