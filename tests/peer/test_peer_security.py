"""The peer layer attacked from the network and from another user of the node: real server
processes, real sockets, a middleman relaying real traffic, a second real user (uid 65534).

Each test is one attack with its reproducer: it describes what an attacker tried and shows what
it gets now (refused, dropped, nothing read, nothing allocated, nothing altered)."""
import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

import shadecache as sc
from shadecache.peer import ForgedFrameError, PeerClient, SecretError, new_secret, server, wire
from peer_helpers import full_cache, pack_store, secret_in_env
from recorder import Recorder
from planted_modules import run_among_planted_modules

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SECRET = new_secret()
N = 64


_secret_in_env = secret_in_env(SECRET)


@pytest.fixture
def store(tmp_path):
    s = pack_store(tmp_path / "a.shc")
    yield s
    s.close()


def _memory_kib(pid, field="VmHWM"):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _address(server_):
    host, port = server_.address.rsplit(":", 1)
    return host, int(port)


def _drain(sock, seconds=3.0):
    """Everything the other side sends until it closes (or `seconds`)."""
    sock.settimeout(seconds)
    data = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 16)
        except (socket.timeout, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data


# ---- before authentication ----------------------------------------------------------------------

def test_headers_before_authentication_make_the_server_allocate_nothing(cache_factory, store):
    """An unauthenticated endpoint sends headers that claim 512 MiB bodies, in every opcode; the
    server process's peak RSS does not move, and it goes on serving."""
    c = full_cache(cache_factory, store)
    with sc.Node(None, c, read_ahead=False).serve() as srv:
        client = PeerClient(srv.address, dataset=store)
        assert client.get_many([1], timeout=5) == [store.read(1)]
        before = _memory_kib(srv.pid)
        socks = []
        for op in (wire.HELLO, wire.PROOF, wire.GET, wire.GET_REPLY, wire.ERROR, wire.STATS_REPLY):
            s = socket.create_connection(_address(srv), timeout=5)
            s.sendall(wire.pack_header(op, 1, 512 << 20, 1 << 40) + os.urandom(4096))
            socks.append(s)
        for s in socks:
            _drain(s)
            s.close()
        assert _memory_kib(srv.pid) - before < 16 << 10, "the server allocated for an unauthenticated header"
        assert client.get_many([2], timeout=5) == [store.read(2)]
        client.close()


def test_slow_handshakes_from_one_address_cannot_lock_out_the_others(cache_factory, store):
    """300 connections from 127.0.0.2 that dribble a byte every 0.4 s: the server holds each at
    most HANDSHAKE_TIMEOUT, on its event loop (no thread each), and a client from 127.0.0.1 is
    served within its 1-second deadline all along."""
    c = full_cache(cache_factory, store)
    with sc.Node(None, c, read_ahead=False).serve() as srv:
        stop = threading.Event()
        held, closed_after = [], []

        def attacker():
            while not stop.is_set():
                try:
                    s = socket.create_connection(_address(srv), timeout=2, source_address=("127.0.0.2", 0))
                except OSError:
                    continue
                held.append((s, time.monotonic()))
                if len(held) >= 300:
                    return

        def dribble():
            while not stop.wait(0.4):
                for s, t0 in list(held):
                    try:
                        s.send(b"\x00")
                    except OSError:
                        if (s, t0) in held:
                            held.remove((s, t0))
                            closed_after.append(time.monotonic() - t0)

        threads = [threading.Thread(target=attacker, daemon=True), threading.Thread(target=dribble, daemon=True)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            good = PeerClient(srv.address, dataset=store)
            t_end = time.monotonic() + 4
            n = 0
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                assert good.get_many([n % N], timeout=1.0) == [store.read(n % N)]
                good.close()   # a new connection (a new handshake) every time
                assert time.monotonic() - t0 < 1.0
                n += 1
            assert n >= 4
        finally:
            stop.set()
            for s, _ in held:
                s.close()
        stats = PeerClient(srv.address, dataset=store).server_stats(5)
        assert stats["refused_auth"] > 0   # dribblers dropped at the handshake deadline
        assert min(closed_after) > server.auth.HANDSHAKE_TIMEOUT - 0.5, min(closed_after)
        assert max(closed_after) < server.auth.HANDSHAKE_TIMEOUT + 1.5, max(closed_after)


def test_a_dribbling_handshake_is_dropped_at_its_deadline(cache_factory, store):
    """One byte every 0.5 s keeps any per-recv timeout happy; the handshake's one deadline
    (HANDSHAKE_TIMEOUT) ends it anyway."""
    c = full_cache(cache_factory, store)
    with sc.Node(None, c, read_ahead=False).serve() as srv:
        s = socket.create_connection(_address(srv), timeout=5)
        t0 = time.monotonic()
        hello = wire.pack_header(wire.HELLO, 0, wire.HELLO_BYTES, N) + bytes(wire.HELLO_BYTES)
        try:
            for b in hello:
                s.send(bytes([b]))
                time.sleep(0.5)
                if time.monotonic() - t0 > 10:
                    break
        except OSError:
            pass
        _drain(s, 2)
        elapsed = time.monotonic() - t0
        s.close()
        assert elapsed < server.auth.HANDSHAKE_TIMEOUT + 2.5, elapsed


def test_the_client_handshake_obeys_the_callers_deadline(store):
    """PeerClient.get_many(timeout=1) and Cluster.fetch(timeout=1) against an endpoint that
    dribbles its HELLO a byte every 0.5 s return by the deadline (the cluster counts the peer as
    failed and its ids as misses)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    hello = wire.pack_header(wire.HELLO, 0, wire.HELLO_BYTES, N) + bytes(wire.HELLO_BYTES)

    def dribble(conn):
        for b in hello:
            try:
                conn.send(bytes([b]))
            except OSError:
                return
            time.sleep(0.5)

    def dribbler():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=dribble, args=(conn,), daemon=True).start()

    threading.Thread(target=dribbler, daemon=True).start()
    address = "127.0.0.1:%d" % srv.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(socket.timeout):
        PeerClient(address, dataset=store).get_many([1], timeout=1.0)
    assert time.monotonic() - t0 < 1.5
    cluster = sc.Cluster([None, address], node=0, timeout=1.0, dataset=store)
    t0 = time.monotonic()
    got = cluster.fetch(np.arange(N), home=np.ones(N, dtype=np.int64))
    assert time.monotonic() - t0 < 1.5
    assert got == [None] * N and cluster.stats()["failures"] == 1
    cluster.close()
    srv.close()


def test_an_accept_error_backs_off_and_serving_goes_on(cache_factory, store):
    """The server process runs out of descriptors (RLIMIT_NOFILE lowered to what it holds):
    accept() fails with EMFILE; the server counts it, backs off, and serves the waiting client
    as soon as a descriptor is free again."""
    c = full_cache(cache_factory, store)
    with sc.Node(None, c, read_ahead=False).serve() as srv:
        soft, hard = resource.prlimit(srv.pid, resource.RLIMIT_NOFILE)
        fds = len(os.listdir(f"/proc/{srv.pid}/fd"))
        resource.prlimit(srv.pid, resource.RLIMIT_NOFILE, (fds, hard))
        try:
            result = {}

            def ask():
                try:
                    result["got"] = PeerClient(srv.address, dataset=store).get_many([3], timeout=20)
                except Exception as e:   # reported below
                    result["error"] = e

            t = threading.Thread(target=ask)
            t.start()
            time.sleep(1.0)                  # accept() fails over and over meanwhile
            assert srv.alive
        finally:
            resource.prlimit(srv.pid, resource.RLIMIT_NOFILE, (soft, hard))
        t.join(20)
        assert result.get("got") == [store.read(3)], result
        stats = PeerClient(srv.address, dataset=store).server_stats(5)
        assert stats["accept_errors"] >= 1


def test_a_connection_whose_thread_cannot_start_does_not_end_serving(cache_factory, store):
    """The server process runs out of address space for thread stacks (RLIMIT_AS lowered to what
    it maps now) while four clients prove themselves (a connection gets its thread only then):
    those it cannot start a thread for are closed and counted, and it serves again as soon as
    memory is there."""
    c = full_cache(cache_factory, store)
    with sc.Node(None, c, read_ahead=False).serve() as srv:
        first = PeerClient(srv.address, dataset=store)   # serving: its own threads are up
        assert first.get_many([0], timeout=10) == [store.read(0)]
        first.close()
        deadline = time.monotonic() + 10
        # main, accept and status threads, and no more: the first connection's is gone, and the
        # status thread (started after the accept thread, which may already have served the GET
        # above) is up before the limit leaves no room for its stack
        while len(os.listdir(f"/proc/{srv.pid}/task")) != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        soft, hard = resource.prlimit(srv.pid, resource.RLIMIT_AS)
        mapped = _memory_kib(srv.pid, "VmSize") << 10
        # no room for an 8 MiB stack, and room for the rest: with 2 MiB the server itself died
        # once in a full run (a small allocation of its own failed)
        resource.prlimit(srv.pid, resource.RLIMIT_AS, (mapped + (6 << 20), hard))
        try:
            from shadecache.peer import auth
            from shadecache.peer.identity import identity_of

            held = [socket.create_connection(_address(srv), timeout=5) for _ in range(4)]
            for s in held:
                try:
                    auth.client_handshake(s, SECRET.encode(), identity_of(store), time.monotonic() + 5)
                except OSError:
                    pass
            time.sleep(1.0)
            assert srv.alive
        finally:
            resource.prlimit(srv.pid, resource.RLIMIT_AS, (soft, hard))
        for s in held:
            s.close()
        assert PeerClient(srv.address, dataset=store).get_many([3], timeout=10) == [store.read(3)]
        assert PeerClient(srv.address, dataset=store).server_stats(5)["thread_errors"] >= 1

# ---- after authentication -----------------------------------------------------------------------

HANDSHAKE_FROM_SERVER = 2 * wire.HEADER_BYTES + wire.HELLO_BYTES + wire.DIGEST_BYTES


def test_a_middleman_that_relays_the_handshake_reads_no_sample(cache_factory, store):
    c = full_cache(cache_factory, store)
    with sc.Node(None, c, read_ahead=False).serve() as srv:
        relay = Recorder(_address(srv))
        client = PeerClient(relay.address, dataset=store)
        want = store.read_many(list(range(N)))
        assert client.get_many(list(range(N)), timeout=5) == want   # the handshake went through it
        client.close()
        relay.close()
        seen = b"".join(relay.received)
        assert len(seen) > sum(len(v) for v in want)   # every sample crossed the middleman...
        leaked = [i for i, v in enumerate(want) if len(v) >= 16 and v[:16] in seen]
        assert not leaked, f"samples {leaked[:5]} readable on the wire"   # ...and none in clear


@pytest.mark.parametrize("where", ["value", "table", "header"])
def test_a_middleman_cannot_make_the_client_accept_an_altered_sample(cache_factory, store, where):
    """The middleman flips a bit of the first reply (a value, the entry table with its lengths
    and crc32c, or the clear header): the client returns nothing of that reply
    (ForgedFrameError, or a ProtocolError for a header that no longer parses), and a
    CachedDataset over the same middleman still returns the store's exact bytes."""
    c = full_cache(cache_factory, store)
    offset = {"header": 14, "table": wire.HEADER_BYTES + 12,
              "value": wire.HEADER_BYTES + N * wire.ENTRY_BYTES + wire.TAG_BYTES + 100}[where]
    with sc.Node(None, c, read_ahead=False).serve() as srv:
        relay = Recorder(_address(srv), flip_at=HANDSHAKE_FROM_SERVER + offset)
        client = PeerClient(relay.address, dataset=store)
        with pytest.raises((ForgedFrameError, wire.ProtocolError)):
            client.get_many(list(range(N)), timeout=5)
        assert client.refused == 0 and client.sock is None
        relay.close()
        relay = Recorder(_address(srv), flip_at=HANDSHAKE_FROM_SERVER + offset)
        cluster = sc.Cluster([None, relay.address], node=0, timeout=5.0)
        ds = sc.Node(store, None, cluster=cluster, admission=sc.ReadThrough(), read_ahead=False).dataset()
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # not even a value refused for its crc32c: the tag caught it
            got = ds.fetch_bytes(np.arange(N))
        assert got == store.read_many(list(range(N)))
        assert cluster.stats()["failures"] == 1 and ds.stats()["tiers"]["peer"]["hits"] == 0
        cluster.close()
        relay.close()


def test_one_slow_reader_does_not_stall_the_others(cache_factory, store):
    """Three authenticated clients pipeline GETs and never read their replies; the server's pins
    are never held while it waits for them, so a good client's 1-second GETs all succeed."""
    c = full_cache(cache_factory, store)
    with sc.Node(None, c, read_ahead=False).serve() as srv:
        from shadecache.peer import auth
        from shadecache.peer.identity import identity_of

        slow = []
        for _ in range(3):
            s = socket.create_connection(_address(srv), timeout=5)
            session = auth.client_handshake(s, SECRET.encode(), identity_of(store), time.monotonic() + 5)
            ids = np.tile(np.arange(N, dtype="<u8"), 4)   # 256 ids a GET
            for k in range(200):   # ~120 MiB of replies asked for; the socket buffers hold a few
                code, _ = session.send_message(s.fileno(), wire.GET, ids.size, k, 0, ids, 5.0)
                if code:
                    break
            slow.append(s)
        time.sleep(0.5)
        good = PeerClient(srv.address, dataset=store)
        ids = list(np.tile(np.arange(N), 4))
        want = store.read_many(ids)
        for _ in range(10):
            t0 = time.monotonic()
            assert good.get_many(ids, timeout=1.0) == want
            assert time.monotonic() - t0 < 1.0
        good.close()
        for s in slow:
            s.close()


def test_every_reply_chunk_stays_within_its_bound_filled_values_included(cache_factory, tmp_path):
    """40 uncached samples of 2.2 MiB read through from the store in one GET (88 MiB): the server
    reads and sends them a chunk at a time; its peak RSS grows by a few chunks, not the reply."""
    big = pack_store(tmp_path / "big.shc", n=40, size=2_200_000)
    c = cache_factory(40, 1 << 20, "lru", max_item_bytes=4096, fingerprint=big.fingerprint)
    with sc.Node(big, c, read_ahead=False).serve() as srv:
        client = PeerClient(srv.address, dataset=big)
        assert client.get_many([0], timeout=10) == [big.read(0)]
        before = _memory_kib(srv.pid)
        got = client.get_many(list(range(40)), timeout=60)
        assert got == big.read_many(list(range(40)))
        grew = (_memory_kib(srv.pid) - before) >> 10
        assert grew < 24, f"server peak RSS grew {grew} MiB for an 88 MiB reply"
        client.close()
    big.close()


def test_a_node_of_another_data_set_is_refused(cache_factory, store, tmp_path):
    """A node reading data set A asks a server of data set B (same size, other bytes): the
    handshake refuses with FingerprintError naming both, and no sample of B is returned."""
    other = pack_store(tmp_path / "b.shc", seed=6)
    assert other.fingerprint != store.fingerprint and len(other) == len(store)
    c = full_cache(cache_factory, other)
    with sc.Node(other, c, read_ahead=False).serve() as srv:
        with pytest.raises(sc.FingerprintError) as e:
            PeerClient(srv.address, dataset=store).get_many([1], timeout=5)
        assert store.fingerprint in str(e.value) and other.fingerprint in str(e.value)
        cluster = sc.Cluster([None, srv.address], node=0, timeout=2.0)
        ds = sc.Node(store, None, cluster=cluster, admission=sc.ReadThrough(), read_ahead=False).dataset()
        with pytest.raises(sc.FingerprintError):
            ds.fetch_bytes(np.arange(N))
        cluster.close()
        stats = PeerClient(srv.address, dataset=other).server_stats(5)
        assert stats["refused_dataset"] >= 1 and stats["ids"] == 0
    other.close()


def test_another_user_of_the_node_cannot_read_samples_over_loopback(cache_factory, store, tmp_path):
    """The job's secret lives in a 0600 file; uid 65534 on the same node can neither read it nor
    get a sample from the server on 127.0.0.1 without it (and a server without a secret does not
    start)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as uid 65534")
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    os.chmod(tmp_path, 0o755)
    c = full_cache(cache_factory, store)
    with pytest.raises(SecretError):
        sc.Node(None, c, read_ahead=False).serve(secret="")
    with sc.Node(None, c, read_ahead=False).serve() as srv:
        # the other user: a child of this process that drops to uid 65534 (the interpreter
        # lives under /root, which that user may not enter: what the child runs is imported here)
        import encodings.idna  # noqa: F401  (socket.create_connection encodes the host name with it)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            report = []
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                try:
                    open(secret_file).read()
                    report.append("read-the-secret-file")
                except PermissionError:
                    report.append("no-secret-file")
                try:
                    # the data set's name is no secret (the server's HELLO says it): only the secret is
                    PeerClient(srv.address, new_secret(), (store.fingerprint, N)).get_many([1], timeout=3)
                    report.append("got-a-sample")
                except Exception as e:
                    report.append(f"{type(e).__name__}:{str(e).replace(' ', '_')}")
            finally:
                os.write(w, " ".join(report).encode())
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            report = f.read().split()
        os.waitpid(pid, 0)
        assert report[0] == "no-secret-file" and report[1].startswith("AuthenticationError:"), report


def test_weak_secrets_are_refused_at_every_entry_point(cache_factory, store, monkeypatch):
    """`s3cret` (which one sniffed handshake gave up after 10,059 guesses) and its kind are
    refused by serve, Cluster, PeerClient and `shadecache serve`, each with a message that says how
    to make a good one."""
    c = full_cache(cache_factory, store)
    for weak in ("s3cret", "hunter2hunter2hunter2", "0123456789abcdef0123456789abcdef"):
        for make in (lambda: sc.Node(None, c, read_ahead=False).serve(secret=weak),
                     lambda: sc.Cluster(["127.0.0.1:1", "127.0.0.1:2"], node=0, secret=weak),
                     lambda: PeerClient("127.0.0.1:1", weak, store)):
            with pytest.raises(SecretError, match="shadecache secret"):
                make()
    env = dict(os.environ, SHADECACHE_SECRET="s3cret", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "shadecache.cli", "serve", c.name, "--cache-only"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "shadecache secret" in out.stderr
    fresh = subprocess.run([sys.executable, "-m", "shadecache.cli", "secret"], env=env, capture_output=True,
                           text=True, timeout=60).stdout.strip()
    assert len(fresh) == 64 and sc.peer.secret.check(fresh)


# Passwords that one form of the secret check took for random bytes: text that decodes as base64
# (the refused `hunter2hunter2hunter2` with one more letter), text with letters beyond ASCII
# (whose UTF-8 bytes were taken as raw bytes), as str and as the bytes a secret file holds.
PASSWORDS = ["hunter2hunter2hunter2h", "CorrectHorseBatteryStaple1", "Passwort-für-Müller-2024",
             "Passwort-für-Müller-2024".encode(), "Ünïcödé-Pässwörd-2024"]


@pytest.mark.parametrize("weak", PASSWORDS, ids=repr)
def test_passwords_written_as_base64_or_beyond_ascii_are_refused(cache_factory, store, tmp_path, weak):
    c = full_cache(cache_factory, store)
    for make in (lambda: sc.Node(None, c, read_ahead=False).serve(secret=weak),
                 lambda: sc.Cluster(["127.0.0.1:1", "127.0.0.1:2"], node=0, secret=weak),
                 lambda: PeerClient("127.0.0.1:1", weak, store)):
        with pytest.raises(SecretError, match="shadecache secret"):
            make()
    path = tmp_path / "secret"
    path.write_bytes(weak if isinstance(weak, bytes) else weak.encode())
    path.chmod(0o600)
    with pytest.raises(SecretError, match="shadecache secret"):
        sc.peer.secret.check(sc.peer.secret.read_file(str(path)))


def test_random_secrets_pass_in_every_form_they_are_written_in():
    """What the check refuses must not include secrets that are random: 16 to 64 random bytes
    as raw bytes, hex (either case) and base64 (standard or URL-safe, padded or not), 500 of
    each size (a fixed seed). The odds of refusing a random one are under 1e-8 per secret,
    except raw bytes that happen to read as printable text (about 3e-6 at 16 bytes, 4e-9 at 24:
    secret.py), which these seeded draws do not hold."""
    import base64
    import random

    check = sc.peer.secret.check
    rng = random.Random(21)
    for n in (16, 17, 18, 24, 32, 48, 64):
        for _ in range(500):
            raw = rng.randbytes(n)
            b64, url = base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()
            for form in (raw, raw.hex(), raw.hex().upper(), b64, b64.rstrip("="), url, url.rstrip("=")):
                check(form)


# Encodings of passwords and patterned bytes that passed the check before it judged the decoded
# bytes: hex and base64 of ASCII passwords, counting patterns, a password behind one byte that is
# not UTF-8 (so that it read as raw bytes). One sniffed handshake allows offline guessing: the
# hex-encoded password was found that way.
ENCODED = {
    "hex of a password": b"CorrectHorseBatteryStaple1".hex(),
    "hex of a password beyond ASCII": "Passwort-für-Müller-2024".encode().hex(),
    "base64 of a password": __import__("base64").b64encode(b"Tr0ub4dor&3-horse-Staple!").decode(),
    "base64 of a password beyond ASCII": __import__("base64").b64encode("Passwort-für-Müller-2024".encode()).decode(),
    "counting bytes as hex": bytes(range(16)).hex(),
    "counting bytes as base64": __import__("base64").b64encode(bytes(range(24))).decode(),
    "every other byte as hex": bytes(range(0, 64, 2)).hex(),
    "a password behind one byte that is not UTF-8": b"\xff" + b"CorrectHorseBatteryStaple1",
    "a lowercase password behind one such byte": b"\xfe" + b"quickbrownfoxjumps",
}


@pytest.mark.parametrize("weak", list(ENCODED))
def test_encoded_and_patterned_secrets_are_refused_by_their_decoded_bytes(cache_factory, store, weak):
    """Each of them is refused at every entry point with a message that names `shadecache
    secret`, by what its decoded bytes are (text, steps), not only by how many there are."""
    secret = ENCODED[weak]
    c = full_cache(cache_factory, store)
    for make in (lambda: sc.Node(None, c, read_ahead=False).serve(secret=secret),
                 lambda: sc.Cluster(["127.0.0.1:1", "127.0.0.1:2"], node=0, secret=secret),
                 lambda: PeerClient("127.0.0.1:1", secret, store)):
        with pytest.raises(SecretError, match="shadecache secret") as e:
            make()
        assert "read as" in str(e.value), e.value


def test_a_pickled_cluster_carries_no_secret_but_a_spawned_worker_gets_it(tmp_path, monkeypatch):
    """A Cluster pickled as a checkpoint would be (pickle.dumps, torch.save) holds no secret: the
    secret's bytes are nowhere in it, and unpickled where no secret is configured it says so
    (SecretError naming `shadecache secret`) when first used. Unpickled where the job's secret is
    configured ($SHADECACHE_SECRET), it works. A process of the job started by multiprocessing's
    spawn (a DataLoader worker, torch.multiprocessing.spawn) gets it with the cluster."""
    import multiprocessing as mp
    import pickle

    import torch

    key = new_secret()
    cluster = sc.Cluster(["127.0.0.1:1", "127.0.0.1:2"], node=0, secret=key, dataset=(None, N))
    for blob in (pickle.dumps(cluster), _torch_saved(torch, cluster, tmp_path)):
        assert key.encode() not in blob and bytes.fromhex(key) not in blob
    monkeypatch.delenv("SHADECACHE_SECRET")
    restored = pickle.loads(pickle.dumps(cluster))
    with pytest.raises(SecretError, match="shadecache secret"):
        restored.fetch([1, 2, 3], home=np.ones(3, dtype=np.int64))
    monkeypatch.setenv("SHADECACHE_SECRET", key)
    assert pickle.loads(pickle.dumps(cluster)).fetch([1], home=np.ones(1, dtype=np.int64)) == [None]
    monkeypatch.delenv("SHADECACHE_SECRET")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_report_key, args=(cluster, q))
    p.start()
    got = q.get(timeout=120)
    p.join(60)
    assert got == key.encode(), got


def _torch_saved(torch, obj, tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"dataset_cluster": obj}, str(path))
    return path.read_bytes()


def _report_key(cluster, q):
    q.put(cluster._key)


def test_the_interpreters_import_path_leaves_out_directories_another_user_can_replace():
    """A directory of this user's on the import path (mode 0755) inside a parent that any user may
    write to (0777, no sticky bit): another user (uid 65534) renames it away and puts one of
    their own, with a planted module, in its place. The interpreters the package starts leave
    such a directory out of their import path (its parents are checked, not only itself), so the
    planted module never runs."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as uid 65534")
    import shutil
    import tempfile

    from shadecache import process

    base = tempfile.mkdtemp(prefix="shadecache-import-path-")   # in /tmp: the other user can reach it
    try:
        os.chmod(base, 0o755)
        shared = os.path.join(base, "shared")
        os.mkdir(shared)
        os.chmod(shared, 0o777)
        mine = os.path.join(shared, "lib")
        os.mkdir(mine, 0o755)
        marker = os.path.join(base, "planted-ran")
        saved = list(sys.path)
        sys.path.insert(0, mine)
        try:
            cmd = process.isolated_python("json.tool")
        finally:
            sys.path[:] = saved
        pid = os.fork()
        if pid == 0:   # the other user replaces the directory
            code = 1
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                os.rename(mine, os.path.join(shared, "lib.old"))
                os.mkdir(mine)
                with open(os.path.join(mine, "json.py"), "w") as f:
                    f.write(f"open({marker!r}, 'w').write('ran')\nraise ImportError('planted')\n")
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert status == 0, "the other user could not replace the directory: the test shows nothing"
        out = subprocess.run(cmd, input=b"{}", capture_output=True, timeout=60)
        assert not os.path.exists(marker), "a module planted by another user ran in the package's interpreter"
        assert out.returncode == 0 and out.stdout.strip() == b"{}", out
    finally:
        shutil.rmtree(base)


def test_the_server_imports_nothing_from_the_working_directory(cache_factory, store, tmp_path):
    """A world-writable working directory holds planted modules named like the ones the server
    imports; the server process (started from a script elsewhere, in that directory) runs none
    of them, and serves."""
    c = full_cache(cache_factory, store)
    out, ran = run_among_planted_modules(
        tmp_path, ("hmac", "json", "pickle", "struct", "secrets", "hashlib", "ipaddress", "runpy"), f"""
        import shadecache as sc
        from shadecache.peer import PeerClient
        store = sc.PackedStore({store.path!r})
        cache = sc.Cache.attach({c.name!r})
        with sc.Node(None, cache, read_ahead=False).serve() as srv:
            ok = PeerClient(srv.address, dataset=store).get_many([4], timeout=10) == [store.read(4)]
        print("served" if ok else "wrong bytes")
    """)
    assert out.stdout.strip() == "served", out.stdout + out.stderr
    assert not ran, ran

def test_serve_fetch_close_cycles_never_abort(cache_factory, store):
    """12 cycles of serve, fetch, close (with a connection still open at close): every server
    process exits 0 and nothing prints "terminate called" (a thread left in a native call)."""
    c = full_cache(cache_factory, store)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        import shadecache as sc
        from shadecache.peer import PeerClient
        store = sc.PackedStore({store.path!r})
        cache = sc.Cache.attach({c.name!r})
        codes = []
        for cycle in range(12):
            srv = sc.Node(store, cache, read_ahead=False).serve()
            clients = [PeerClient(srv.address, dataset=store) for _ in range(3)]
            for k, cl in enumerate(clients):
                assert cl.get_many(list(range(k, {N})), timeout=10) == store.read_many(list(range(k, {N})))
            srv.close()
            codes.append(srv._proc.returncode)
            for cl in clients:
                cl.close()
        print(codes)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == str([0] * 12), out.stdout + out.stderr
    assert "terminate called" not in out.stderr, out.stderr


# ---- the read-through default -------------------------------------------------------------------

def test_a_node_without_a_store_serves_its_cache_and_has_no_data_set(cache_factory, store):
    """A node given no store only serves what its cache holds (filled some other way): it has no
    data set to read, and a node of nothing at all is refused, saying what to give."""
    node = sc.Node(None, full_cache(cache_factory, store), read_ahead=False)
    with pytest.raises(ValueError, match="no data set"):
        node.dataset()
    with pytest.raises(ValueError, match="a node needs a store"):
        sc.Node(None, None)


def test_a_three_node_cluster_reads_each_uncached_sample_once_per_epoch(cache_factory, tmp_path):
    """Three nodes served the natural way (serve(cache, store=store)), trainers reading disjoint
    shards: after the first epoch the whole cluster reads at most (N - cached) x 1.01 samples
    from the store per epoch, not nearly all of them."""
    n = 600
    st = pack_store(tmp_path / "c.shc", n=n, size=2000, seed=7)
    caches = [cache_factory(n, 400 << 10, "importance", max_item_bytes=4096, fingerprint=st.fingerprint)
              for _ in range(3)]
    servers = [sc.Node(st, c, read_ahead=False).serve() for c in caches]
    try:
        addrs = [s.address for s in servers]
        dss = [sc.Node(st, caches[k], cluster=sc.Cluster(addrs, k, timeout=5.0), read_ahead=False).dataset() for k in range(3)]
        clients = [PeerClient(a, dataset=st) for a in addrs]

        def reads():
            return (sum(d.stats()["store_reads"] for d in dss)
                    + sum(cl.server_stats(5)["store_reads"] for cl in clients))

        rng = np.random.default_rng(1)
        per_epoch = []
        for _ in range(3):
            before = reads()
            shards = np.array_split(rng.permutation(n), 3)
            for b in range(0, 200, 50):
                for k in range(3):
                    dss[k].fetch_bytes(shards[k][b:b + 50])
            per_epoch.append(reads() - before)
        cached = sum(c.stats()["items"] for c in caches)
        assert 0 < cached < n
        assert all(r <= (n - cached) * 1.01 for r in per_epoch[1:]), (per_epoch, cached)
        for cl in clients:
            cl.close()
        for d in dss:
            d.node.cluster.close()
    finally:
        for s in servers:
            s.close()
        st.close()


def test_raw_bytes_that_read_as_text_are_refused_with_the_odds_and_their_hex_is_taken():
    """Sixteen bytes drawn by os.urandom that happen to be printable UTF-8 (about 3e-6 of draws)
    read as a password given as bytes: refused, the message says how rare that is for random
    bytes and to give them as hex, and their hex is taken."""
    from shadecache.peer.secret import SecretError
    raw = b"Xs\xdd\xbayeFua|*x3\xd2\xaf]"
    with pytest.raises(SecretError, match="odds of about 3e-6 at 16 bytes.*give them as hex"):
        sc.peer.secret.check(raw)
    assert sc.peer.secret.check(raw.hex()) == raw.hex().encode()
    with pytest.raises(SecretError, match="a password") as refused:
        sc.peer.secret.check("correct horse battery staple")
    assert "give them as hex" not in str(refused.value)       # text given as text: no odds to quote
