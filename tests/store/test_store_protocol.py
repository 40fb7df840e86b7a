"""A store written here, in pure Python, against shadecache/store/protocol.py, read through every
reader of the tier chain (shadecache/tiers.py): CachedLoader, DataLoader(CachedDataset), the
prefetcher's process and a peer server's process (read-through). Each returns the same bytes (and
labels) as a PackedStore of the same samples."""
import hashlib
import json
import os
import uuid
import zlib

import numpy as np
import pytest

import shadecache as sc
from shadecache.lookahead.board import OrderBoard
from shadecache.peer import PeerClient, new_secret
from prefetch_waits import wait_for_reads
from values import make_value

N = 300
HERE = os.path.dirname(os.path.abspath(__file__))


class FileStore:
    """Samples back to back in `<dir>/data`, an index (offset, length, crc32, label) in
    `<dir>/index.json`: the protocol and nothing else, no native code."""

    def __init__(self, root):
        self.root = os.fspath(root)
        with open(os.path.join(self.root, "index.json")) as f:
            index = json.load(f)
        self.offsets = np.asarray(index["offsets"], dtype=np.int64)
        self.lengths = np.asarray(index["lengths"], dtype=np.int64)
        self.crcs = index["crcs"]
        self.labels = np.asarray(index["labels"], dtype=np.int64)
        self.fingerprint = hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()
        self._fd = os.open(os.path.join(self.root, "data"), os.O_RDONLY)

    @staticmethod
    def write(root, samples):
        os.makedirs(root, exist_ok=True)
        index = {"offsets": [], "lengths": [], "crcs": [], "labels": []}
        with open(os.path.join(root, "data"), "wb") as f:
            for data, label in samples:
                index["offsets"].append(f.tell())
                index["lengths"].append(len(data))
                index["crcs"].append(zlib.crc32(data))
                index["labels"].append(label)
                f.write(data)
        with open(os.path.join(root, "index.json"), "w") as f:
            json.dump(index, f)
        return FileStore(root)

    def __len__(self):
        return int(self.labels.size)

    def read_many(self, ids):
        out = []
        for i in np.asarray(ids, dtype=np.int64).tolist():
            data = os.pread(self._fd, int(self.lengths[i]), int(self.offsets[i]))
            if zlib.crc32(data) != self.crcs[i]:
                raise sc.CorruptSampleError(f"sample {i} fails its crc32", sample_id=i)
            out.append(data)
        return out

    def close(self):
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __reduce__(self):   # another process (a spawned worker, the prefetcher, a peer server)
        return (FileStore, (self.root,))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(the pure-Python store, a PackedStore of the same samples): sizes 200-999 B, 7 labels."""
    root = tmp_path_factory.mktemp("stores")
    samples = [(make_value(i, 0, 200 + (i * 53) % 800), i % 7) for i in range(N)]
    with sc.PackWriter(root / "p.shc") as w:
        for data, label in samples:
            w.add(data, label)
    return FileStore.write(root / "py", samples), sc.PackedStore(root / "p.shc")


@pytest.fixture
def importable(monkeypatch):
    """Processes started from here (the prefetcher, a peer server) import this module to unpickle
    the store, as they would import the user's own store module."""
    path = [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]   # + tests/ (values.py)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))


def test_the_store_answers_the_protocol(stores):
    py, packed = stores
    from shadecache.store.protocol import check_store
    check_store(py)
    ids = [5, 0, 299, 5]
    assert py.read_many(ids) == packed.read_many(ids)
    assert py.lengths.tolist() == packed.lengths.tolist() and py.labels.tolist() == packed.labels.tolist()
    with pytest.raises(TypeError, match="read_many"):
        sc.CachedDataset(object())


def test_cached_loader(stores, cache_factory):
    py, packed = stores
    cache = cache_factory(N, capacity=64 << 10, sizes=py.lengths)   # a fraction: hits and misses
    loader = sc.CachedLoader(sc.CachedDataset(py, cache), batch_size=32, shuffle=True, num_workers=2)
    for epoch in range(2):
        seen = 0
        for x, y, idx in loader:
            ids = idx.tolist()
            assert [bytes(v.numpy()) for v in x.tolist()] == packed.read_many(ids)
            assert y.tolist() == packed.labels[ids].tolist()
            seen += len(ids)
        assert seen == N
    st = loader.dataset.stats()
    assert st["hits"] > 0 and st["tiers"]["store"]["hits"] > 0
    cache.check()


def test_dataloader_workers(stores, cache_factory):
    from torch.utils.data import DataLoader
    py, packed = stores
    cache = cache_factory(N, capacity=64 << 10, sizes=py.lengths)
    ds = sc.CachedDataset(py, cache, decode=bytes)
    loader = DataLoader(ds, batch_size=25, shuffle=True, num_workers=2, collate_fn=lambda items: items)
    got = {i: (x, y) for items in loader for x, y, i in items}
    assert sorted(got) == list(range(N))
    assert all(got[i] == (packed.read_many([i])[0], int(packed.labels[i])) for i in range(N))
    assert ds.stats()["samples"] == N


def test_prefetcher_reads_it_ahead(stores, cache_factory, tmp_path, importable):
    py, packed = stores
    cache = cache_factory(N, capacity=1 << 20, sizes=py.lengths)       # room for all of them
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, fingerprint=py.fingerprint)
    ssd.put_many(range(0, 40), packed.read_many(range(0, 40)))       # some of the window on the SSD
    ssd.flush()
    order = np.random.default_rng(3).permutation(N)[:200]
    with OrderBoard.create(cache.name, N) as board:
        board.orders.publish(0, 0, order)
        with sc.Node(py, cache, ssd=ssd).prefetcher(lookahead_samples=200, batch=32):
            # with an SSD tier it holds what it read until a reader asks, and offers it all to
            # the cache when it stops
            wait_for_reads(board, order.size)
        assert cache.cached_mask()[order].all()
        assert cache.get_many(order) == packed.read_many(order)
        assert board.flags.prefetched(order).all()
        t = board.counters.totals()
        assert t["prefetched"] == order.size
    cache.check()


def test_peer_server_reads_it_through(stores, cache_factory, importable):
    py, packed = stores
    cache = cache_factory(N, capacity=1 << 20, sizes=py.lengths)
    ids = list(range(0, N, 7))
    secret = new_secret()
    with sc.Node(py, cache, read_ahead=False).serve(secret=secret) as server:
        client = PeerClient(server.address, secret=secret, dataset=py)
        assert client.get_many(ids, timeout=10) == packed.read_many(ids)   # read through the store
        assert client.get_many(ids, timeout=10) == packed.read_many(ids)   # now from the cache
        st = client.server_stats(5)
        client.close()
    assert st["store_reads"] == len(ids) and st["cache_hits"] == len(ids)
    assert cache.get_many(ids) == packed.read_many(ids)


def test_a_corrupt_sample_of_it_is_an_error_naming_the_id(tmp_path, cache_factory):
    samples = [(bytes([i]) * 100, 0) for i in range(10)]
    py = FileStore.write(tmp_path / f"bad-{uuid.uuid4().hex[:6]}", samples)
    with open(os.path.join(py.root, "data"), "r+b") as f:
        f.seek(3 * 100)
        f.write(b"\xff")
    py = FileStore(py.root)
    ds = sc.CachedDataset(py, cache_factory(10))
    with pytest.raises(sc.CorruptSampleError, match="sample 3"):
        ds[3]
    assert ds[4][0].tolist() == [4] * 100
