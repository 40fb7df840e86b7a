"""Cluster: this node's view of the job's nodes, and the batched fetch from their servers.

    cluster = Cluster(["10.0.0.1:7070", "10.0.0.2:7070"], node=0, timeout=1.0)   # secret: secret.py
    node = sc.Node(store, cache, cluster="torch")        # under torchrun: membership from the job's store
    node = sc.Node(store, cache, cluster=cluster)        # binds the cluster to the store's data set
    values = cluster.fetch(ids)                          # bytes or None per id

Each id has a home node (homes.py, over the nodes this process currently considers alive). fetch()
sends one GET to every peer that is home to some of the ids, all before reading any reply, so the
peers work in parallel; every reply must arrive by one deadline (`timeout` seconds after the call).
A peer that fails (refused, reset, timed out, malformed or corrupt reply) is marked down: its ids
come back None (the caller reads them from the next tier), and it is retried after a backoff that
doubles from `backoff[0]` to `backoff[1]` seconds; the first call after that reconnects (the
address looked up again under torchrun, so a restarted server on a new port rejoins). While a peer
is down its ids' homes move to the live nodes (only its share moves). A peer that proves it holds
the job's secret and serves another data set is not a failure but a mistake in the job: fetch
raises FingerprintError naming both. A mismatch that no one proved (a HELLO or a clear ERROR from
whoever answers at the address: an address alone, from a store anyone can write, decides
nothing) is an ordinary failure.

Picklable: DataLoader workers get the addresses and open their own connections (a connection is
used only by the process that opened it: a forked child opens its own at its first call). The
secret travels with the pickle only to a process of this job that multiprocessing starts (spawn
or forkserver: a DataLoader worker, torch.multiprocessing.spawn), the way multiprocessing's own
locks do, and to the node's own processes (the prefetcher, the peer server: their configuration
is pickled under carrying_secret() and handed over a pipe); any other pickle (a data set saved in a checkpoint, torch.save) leaves it out, and the
cluster unpickled from it takes the secret of the process it is in (secret.py) or, without one,
raises SecretError when first used.
"""
import contextlib
import multiprocessing.context
import os
import socket
import threading
import time

import numpy as np

from . import homes, identity, wire
from . import secret as secrets_
from ..errors import FingerprintError
from .client import PeerClient, split_address

STORE_PREFIX = "shadecache/peer/node"


class _Peer:
    def __init__(self, address):
        self.address = address
        self.client = None
        self.failures = 0
        self.retry_at = 0.0


_CARRYING = threading.local()


@contextlib.contextmanager
def carrying_secret():
    """While it is held, in this thread, a pickled Cluster carries its secret: for the node's own
    processes (the prefetcher, the peer server), whose configuration goes over a pipe to a child
    this process starts, never to a file or the network."""
    before = getattr(_CARRYING, "on", False)
    _CARRYING.on = True
    try:
        yield
    finally:
        _CARRYING.on = before


class Cluster:
    def __init__(self, addresses, node: int, secret=None, timeout: float = 1.0,
                 backoff=(0.5, 8.0), lookup=None, dataset=None):
        """secret: see secret.py (default: $SHADECACHE_SECRET, or the file $SHADECACHE_SECRET_FILE
        names). dataset: the data set the nodes serve (a store, a Cache, or (fingerprint,
        num_samples)); CachedDataset binds its store when not given here."""
        self._setup(addresses, node, secrets_.resolve(secret), timeout, backoff, lookup, dataset)

    def _setup(self, addresses, node, key, timeout, backoff, lookup, dataset):
        """key: the resolved secret, or the SecretError to raise when the cluster is first used."""
        if isinstance(addresses, (str, bytes)) or not len(addresses):
            raise ValueError("addresses must be a non-empty list of 'host:port' (one per node)")
        addresses = [None if a is None else str(a) for a in addresses]
        for k, a in enumerate(addresses):
            if a is not None and k != node:
                split_address(a)
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < len(addresses):
            raise ValueError(f"node must be an index into the {len(addresses)} addresses, got {node!r}")
        if not (isinstance(timeout, (int, float)) and 0 < timeout <= 3600):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.addresses = addresses
        self.node = node
        self.num_nodes = len(addresses)
        self.timeout = float(timeout)
        self.backoff = (float(backoff[0]), float(backoff[1]))
        self._key = key
        self._identity = None if dataset is None else identity.identity_of(dataset)
        self._lookup = lookup      # node -> address, or None (under torchrun: the job's store)
        self.server = None         # the PeerServer this process started, if any
        self._reset()

    def _reset(self):
        self._pid = os.getpid()
        self._peers = [_Peer(a) for a in self.addresses]
        self.counters = {"requests": 0, "hits": 0, "misses": 0, "bytes": 0, "seconds": 0.0, "refused": 0,
                         "failures": 0, "skipped": 0}

    def __getstate__(self):
        # The secret only to a process multiprocessing is starting for this job, or to one of the
        # node's own processes (carrying_secret; module docstring).
        spawning = (multiprocessing.context.get_spawning_popen() is not None
                    or getattr(_CARRYING, "on", False))
        return {"addresses": [p.address for p in self._peers] if hasattr(self, "_peers") else self.addresses,
                "node": self.node, "timeout": self.timeout, "backoff": self.backoff,
                "key": self._key if spawning and isinstance(self._key, bytes) else None,
                "identity": self._identity}

    def __setstate__(self, s):
        key = s["key"]
        if key is None:
            try:
                key = secrets_.resolve()
            except secrets_.SecretError as e:   # raised at first use: a checkpoint may be read for other parts
                key = secrets_.SecretError(f"this Cluster was unpickled without its secret (a pickle carries it "
                                           f"only to a process multiprocessing spawns for the job): {e}")
        self._setup(s["addresses"], s["node"], key, s["timeout"], s["backoff"], None, s["identity"])

    def _secret(self) -> bytes:
        if not isinstance(self._key, bytes):
            raise self._key
        return self._key

    def bind(self, dataset) -> None:
        """Makes `dataset` (a store, a Cache, or (fingerprint, num_samples)) the data set this
        cluster fetches; FingerprintError when it is bound to another one already."""
        self._check_pid()
        mine = identity.identity_of(dataset)
        if self._identity is not None and self._identity != mine:
            raise FingerprintError(f"the cluster fetches {identity.describe(self._identity)}, not "
                                   f"{identity.describe(mine)}")
        self._identity = mine
        for p in self._peers:
            if p.client is not None and p.client.identity != mine:
                p.client.close()
                p.client = None

    # ---- membership --------------------------------------------------------------------------
    def alive(self) -> np.ndarray:
        """Which nodes this process currently sends requests to (itself always)."""
        self._check_pid()
        now = time.monotonic()
        return np.array([k == self.node or (p.address is not None and p.retry_at <= now)
                         for k, p in enumerate(self._peers)])

    def home_of(self, ids) -> np.ndarray:
        """The home node of every id among the nodes alive now."""
        self._check_pid()
        return homes.home_of(ids, range(self.num_nodes), self.alive())

    def _check_pid(self):
        """Every entry point first: in a forked child, the parent's connections (and its server)
        are not this process's to use. The copies of the sockets are closed (the parent's stay
        open) and the peers start afresh; each opens its own connection when first asked."""
        if self._pid != os.getpid():
            for p in self._peers:
                if p.client is not None:
                    p.client.close()
            self.server = None
            self._reset()

    def _failed(self, peer: _Peer) -> None:
        if peer.client is not None:
            peer.client.close()
        peer.failures += 1
        delay = min(self.backoff[0] * 2 ** (peer.failures - 1), self.backoff[1])
        peer.retry_at = time.monotonic() + delay
        self.counters["failures"] += 1

    def _client(self, k: int) -> PeerClient:
        peer = self._peers[k]
        if peer.client is None or peer.client.sock is None:
            if peer.failures and self._lookup is not None:
                address = self._lookup(k)       # a restarted server may have a new port
                if address and address != peer.address:
                    peer.address = address
                    peer.client = None
            if peer.client is None:
                peer.client = PeerClient(peer.address, self._secret(), self._identity)
        return peer.client

    # ---- the batched fetch -------------------------------------------------------------------
    def fetch(self, ids, home=None) -> list:
        """bytes or None for every id: the ids whose home is a live peer are asked of it; the
        others (this node's own, and those of peers that fail) are None. FingerprintError only
        when a peer proves it holds the job's secret and serves another data set; a mismatch no one
        proved (an impostor's HELLO, a clear ERROR) is a failure like any other."""
        self._check_pid()
        self._secret()
        ids = np.asarray(ids, dtype=np.int64)
        out = [None] * ids.size
        if self.num_nodes == 1 or ids.size == 0:
            return out
        if self._identity is None:
            raise ValueError("the cluster does not know its data set: give Cluster(..., dataset=store) or use "
                             "it through CachedDataset(store, cache, cluster=...)")
        if home is None:
            home = self.home_of(ids)
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        sent = []
        for k in np.unique(home).tolist():
            if k == self.node:
                continue
            where = np.flatnonzero(home == k)
            peer = self._peers[k]
            if peer.retry_at > t0:
                self.counters["skipped"] += where.size
                continue
            for part in np.array_split(where, -(-where.size // wire.MAX_BATCH)):
                try:
                    client = self._client(k)
                    asked = ids[part].astype("<u8")
                    sent.append((k, part, asked, client.send_get(asked, deadline)))
                except FingerprintError:
                    raise
                except (OSError, ValueError):
                    self._failed(peer)
                    break
        for k, part, asked, opaque in sent:
            peer = self._peers[k]
            if peer.client is None or peer.client.sock is None:
                continue    # failed on an earlier part of this call
            try:
                refused = peer.client.refused
                values = peer.client.recv_get(asked, opaque, deadline)
                self.counters["refused"] += peer.client.refused - refused   # failed crc32c: None
            except (OSError, ValueError):   # timeouts, resets, ProtocolError, RemoteError
                self._failed(peer)
                continue
            peer.failures = 0
            for j, v in zip(part.tolist(), values):
                out[j] = v
        c = self.counters
        c["requests"] += len(sent)
        hits = sum(v is not None for v in out)
        c["hits"] += hits
        c["misses"] += sum(p.size for _, p, _, _ in sent) - hits
        c["bytes"] += sum(len(v) for v in out if v is not None)
        c["seconds"] += time.monotonic() - t0
        return out

    def ping(self) -> dict:
        """Round-trip seconds (or the error) of every peer."""
        self._check_pid()
        self._secret()
        out = {}
        for k in range(self.num_nodes):
            if k == self.node:
                continue
            try:
                out[k] = self._client(k).ping(self.timeout)
            except (OSError, ValueError) as e:
                out[k] = e
        return out

    def stats(self) -> dict:
        """This process's counters (a forked child starts its own)."""
        self._check_pid()
        d = dict(self.counters)
        d["nodes"] = self.num_nodes
        d["node"] = self.node
        d["down"] = [k for k, a in enumerate(self.alive().tolist()) if not a]
        return d

    def close(self) -> None:
        """Closes this process's connections, and the server if this process started it."""
        self._check_pid()
        for p in self._peers:
            if p.client is not None:
                p.client.close()
        if self.server is not None:
            self.server.close()
            self.server = None

    # ---- membership from torch.distributed ---------------------------------------------------
    @classmethod
    def from_torch(cls, node, secret=None, host=None, port: int = 0, timeout: float = 1.0,
                   prefix: str = STORE_PREFIX) -> "Cluster":
        """Joins the job's nodes through torch.distributed's key-value store (torchrun); the
        node calls it (sc.Node(..., cluster="torch")).

        Local rank 0 of each node starts the node's server (node.serve(): its cache, read
        through the node's own tiers) and publishes its address under `prefix/<node rank>`;
        every process reads all addresses. Node rank: GROUP_RANK (torchrun), else
        rank // LOCAL_WORLD_SIZE. secret: see secret.py; host: the address to bind and publish
        (default 127.0.0.1 when MASTER_ADDR is loopback, else this host's name). The cluster is
        bound to the data set of the node's store."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Cluster.from_torch needs torch.distributed initialised "
                               "(init_process_group) first")
        secret = secrets_.resolve(secret)
        kv = dist.distributed_c10d._get_default_store()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        index = int(os.environ.get("GROUP_RANK", dist.get_rank() // local_world))
        num_nodes = dist.get_world_size() // local_world
        server = None
        if local_rank == 0:
            if host is None:
                from .server import is_loopback
                master = os.environ.get("MASTER_ADDR", "127.0.0.1")
                host = "127.0.0.1" if is_loopback(master) else socket.gethostname()
            server = node.serve(host=host, port=port, secret=secret)
        try:
            if server is not None:
                kv.set(f"{prefix}/{index}", server.address)
            addresses = [kv.get(f"{prefix}/{k}").decode() for k in range(num_nodes)]
            if server is not None:
                server.set_peers(addresses)
        except BaseException:
            if server is not None:   # a join that failed leaves no server behind
                server.close()
            raise

        def lookup(k, kv=kv):
            try:
                return kv.get(f"{prefix}/{k}").decode()
            except Exception:   # the store itself is gone: keep the old address
                return None

        cluster = cls(addresses, index, secret, timeout, lookup=lookup,
                      dataset=identity.of_server(node.cache, node.store))
        cluster.server = server
        return cluster

    def __repr__(self):
        return f"<Cluster node {self.node} of {self.num_nodes}, timeout={self.timeout}s>"
