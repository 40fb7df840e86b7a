"""A peer connection is used only by the process that opened it. A DataLoader worker (or any
forked child) that inherits a PeerClient or a Cluster with open connections must open its own:
two processes writing records under one session would send two records under one key and
sequence number, and the XOR of their ciphertexts is the XOR of their plaintexts (the ids asked
for); two processes reading one stream would take each other's replies.

Each case forks a real child at one public call, with a middleman recording every byte the
clients send, and checks: the child's call does what it says on a connection of its own; the
parent's connection still works after it; no two records of any connection share a key stream;
the server saw no forged record."""
import os
import time

import numpy as np
import pytest

import shadecache as sc
from peer_helpers import full_cache, pack_store, secret_in_env
from recorder import Recorder
from shadecache.peer import PeerClient, new_secret

SECRET = new_secret()
N = 64


_secret_in_env = secret_in_env(SECRET)


def _key_streams_repeat(records, plaintexts) -> bool:
    """True when two GET records of one connection were sealed under the same key stream: their
    ciphertext XOR one of the requests the test made gives the same bytes."""
    for bodies in records:
        seen = {}
        for k, c in enumerate(bodies):
            for p in plaintexts:
                if len(p) == len(c):
                    stream = bytes(a ^ b for a, b in zip(c, p))
                    if seen.setdefault(stream, k) != k:
                        return True
    return False


def _ids(k):
    """The ids of request k: distinct per request, so every request has its own plaintext."""
    return np.arange(k, k + 8) % N


# What the child does, on the client and the cluster its parent connected (the parent's last
# request was a GET of `_ids(0)`; with "pending" the parent has sent `_ids(1)` and not read the
# reply yet). Each returns what the child reports.
CALLS = {
    "PeerClient.get_many": lambda t: t.client.get_many(_ids(2), timeout=5) == t.want(2),
    "PeerClient.send_get and recv_get": lambda t: t.client.recv_get(
        _ids(2), t.client.send_get(_ids(2), time.monotonic() + 5), time.monotonic() + 5) == t.want(2),
    "PeerClient.recv_get of the parent's request": lambda t: t.client.recv_get(
        _ids(1), t.opaque, time.monotonic() + 5) == t.want(1),
    "PeerClient.ping": lambda t: t.client.ping(5) >= 0,
    "PeerClient.server_stats": lambda t: "requests" in t.client.server_stats(5),
    "PeerClient.connect": lambda t: t.client.connect(time.monotonic() + 5) is None,
    "PeerClient.close": lambda t: t.client.close() is None,
    "Cluster.fetch": lambda t: t.cluster.fetch(_ids(2), home=np.ones(8, dtype=np.int64)) == t.want(2),
    "Cluster.ping": lambda t: all(isinstance(v, float) for v in t.cluster.ping().values()),
    "Cluster.stats": lambda t: t.cluster.stats()["failures"] == 0,
    "Cluster.alive": lambda t: bool(t.cluster.alive().all()),
    "Cluster.home_of": lambda t: t.cluster.home_of(_ids(2)).size == 8,
    "Cluster.bind": lambda t: t.cluster.bind(t.store) is None,
    "Cluster.close": lambda t: t.cluster.close() is None,
}


class _Both:
    def __init__(self, client, cluster, store):
        self.client, self.cluster, self.store = client, cluster, store
        self.opaque = None

    def want(self, k):
        return self.store.read_many(_ids(k).tolist())


def _in_child(fn) -> str:
    """fn() in a forked child; what it returned (or raised), as text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            try:
                out = repr(fn())
            except BaseException as e:   # reported to the parent
                out = f"{type(e).__name__}: {e}"
            os.write(w, out.encode()[:4000])
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


@pytest.mark.parametrize("call", list(CALLS))
def test_a_forked_child_never_uses_its_parents_connection(cache_factory, tmp_path, call):
    store = pack_store(tmp_path / "s.shc", N, (1, 2000), seed=4)
    c = full_cache(cache_factory, store)
    with sc.Node(None, c, read_ahead=False).serve() as srv:
        rec = Recorder(tuple((lambda h, p: (h, int(p)))(*srv.address.rsplit(":", 1))))
        client = PeerClient(rec.address, dataset=store)
        cluster = sc.Cluster([None, rec.address], node=0, timeout=5.0, dataset=store)
        t = _Both(client, cluster, store)
        assert client.get_many(_ids(0), timeout=5) == t.want(0)
        assert cluster.fetch(_ids(0), home=np.ones(8, dtype=np.int64)) == t.want(0)
        if call == "PeerClient.recv_get of the parent's request":
            t.opaque = client.send_get(_ids(1), time.monotonic() + 5)
        before = PeerClient(srv.address, dataset=store).server_stats(5)
        child = _in_child(lambda: CALLS[call](t))
        if call == "PeerClient.recv_get of the parent's request":
            # the reply is the parent's: the child has no connection to read it from
            assert child.startswith("ConnectionError") and "opened by process" in child, child
            assert client.recv_get(_ids(1), t.opaque, time.monotonic() + 5) == t.want(1)
        else:
            assert child == "True", child
        # the parent's connections go on as they were
        assert client.get_many(_ids(3), timeout=5) == t.want(3)
        assert cluster.fetch(_ids(3), home=np.ones(8, dtype=np.int64)) == t.want(3)
        assert cluster.stats()["failures"] == 0
        after = PeerClient(srv.address, dataset=store).server_stats(5)
        assert after["forged"] == 0 and after["errors"] == 0
        # the parent's two connections are still the ones it opened first
        assert after["connections"] - before["connections"] <= 2   # the child's own, and the stats
        assert not _key_streams_repeat(rec.get_records(), [_ids(k).astype("<u8").tobytes() for k in range(4)])
        client.close()
        cluster.close()
        rec.close()
    store.close()
