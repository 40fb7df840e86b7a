"""An S3Store through every reader of the tier chain, unchanged: CachedLoader with an SSD tier,
DataLoader workers (forked: each builds its own client), the prefetcher's process (the store's
stream) and a peer server's process (read-through). Each returns the object's bytes."""
import os

import numpy as np
import pytest

import shadecache as sc
from prefetch_waits import wait_for_reads
from s3_data import local_store, upload
from shadecache.lookahead.board import OrderBoard
from shadecache.peer import PeerClient, new_secret

N = 600
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def pair(s3, tmp_path, monkeypatch):
    # processes started from here (the prefetcher, a peer server) find the tests' helpers
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HERE, os.path.dirname(HERE),
                                                      os.environ.get("PYTHONPATH", "")]))
    local = local_store(tmp_path / "a.shc", n=N, low=200, high=1200)
    # a small gap: extents of 64 KiB (the default, 8 MiB, would hold this whole data set)
    return local, sc.PackedStore(upload(s3, tmp_path / "a.shc"), gap_bytes=4096)


def test_cached_loader_with_an_ssd_tier(pair, cache_factory, tmp_path):
    local, store = pair
    cache = cache_factory(N, capacity=96 << 10, sizes=store.lengths, policy="importance")
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=128 << 10, cache=cache)
    ds = sc.Node(store, cache, ssd=ssd, read_ahead=False).dataset()
    sampler = sc.ShadeSampler(ds, cache=cache, batch_size=32, rep_factor=0, seed=0)
    loader = sc.CachedLoader(ds, batch_size=32, sampler=sampler, num_workers=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = 0
        for x, y, idx in loader:
            ids = idx.tolist()
            assert [bytes(v.numpy()) for v in x.tolist()] == local.read_many(ids)
            seen += len(ids)
        sampler.end_epoch()
        assert seen == N
    st = ds.stats()
    assert st["hits"] > 0 and st["tiers"]["store"]["hits"] > 0 and st["tiers"]["ssd"]["hits"] > 0
    ssd.close()
    cache.check()


def test_dataloader_workers_read_the_object(pair, cache_factory):
    from torch.utils.data import DataLoader
    local, store = pair
    store.read_many([0])                      # the parent's client exists before the fork
    cache = cache_factory(N, capacity=64 << 10, sizes=store.lengths)
    ds = sc.CachedDataset(store, cache, decode=bytes)
    loader = DataLoader(ds, batch_size=50, shuffle=True, num_workers=2, collate_fn=lambda items: items)
    got = {i: x for items in loader for x, y, i in items}
    assert sorted(got) == list(range(N))
    assert all(got[i] == local.read(i) for i in range(N))


def test_prefetcher_reads_the_object_ahead(pair, cache_factory):
    local, store = pair
    cache = cache_factory(N, capacity=1 << 20, sizes=store.lengths)
    order = np.random.default_rng(3).permutation(N)[:300]
    with OrderBoard.create(cache.name, N) as board:
        board.orders.publish(0, 0, order)
        with sc.Node(store, cache, read_plan="samples").prefetcher(lookahead_samples=300, batch=32):
            wait_for_reads(board, order.size)
        assert cache.cached_mask()[order].all()
        assert cache.get_many(order) == local.read_many(order)
    cache.check()


def test_peer_server_reads_the_object_through(pair, cache_factory):
    local, store = pair
    cache = cache_factory(N, capacity=1 << 20, sizes=store.lengths)
    ids = list(range(0, N, 7))
    secret = new_secret()
    with sc.Node(store, cache, read_ahead=False).serve(secret=secret) as server:
        client = PeerClient(server.address, secret=secret, dataset=store)
        assert client.get_many(ids, timeout=20) == local.read_many(ids)
        st = client.server_stats(5)
        client.close()
    assert st["store_reads"] == len(ids)


def test_the_stream_keeps_batches_in_flight(pair):
    local, store = pair
    batches = [list(range(k, N, 5)) for k in range(5)]
    with store.stream() as s:
        for b in batches:
            s.submit(b)
        assert s.pending == 5
        for b in batches:
            assert s.take() == local.read_many(b)
