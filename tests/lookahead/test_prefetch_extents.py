"""The prefetcher under the extent order (docs/prefetch.md): its batches' reads bring whole
extents, whose other samples are on their way with them, and once the cache is full it leaves the
reads to the loader, whose own reads are whole extents. Counted by the store itself, in every
process that reads it."""
import os
import time
import uuid

import numpy as np
import pytest

import shadecache as sc
from shadecache.lookahead.board import OrderBoard
from shadecache.store.packed import PackedStore
from test_prefetch_reads import reads_logged as _reads   # the same log format

HERE = os.path.dirname(os.path.abspath(__file__))
N = 3000
BATCH = 64


class LoggedStore(PackedStore):
    """A PackedStore that appends the ids of every read (read_many, and the prefetcher's
    stream) to a log, one O_APPEND line per call: "pid id id ..."."""

    def __init__(self, path, log, **options):
        super().__init__(path, **options)
        self.log = os.fspath(log)

    def _write(self, ids):
        line = " ".join(str(int(i)) for i in np.asarray(ids).reshape(-1))
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.getpid()} {line}\n".encode())
        finally:
            os.close(fd)

    def read_many(self, ids, *args, **kwargs):
        self._write(ids)
        return super().read_many(ids, *args, **kwargs)

    def stream(self, *args, **kwargs):
        return _LoggedStream(self, super().stream(*args, **kwargs))

    def __reduce__(self):
        return (_reopen, (self.path, self.log, self._shape_options))


def _reopen(path, log, options):
    return LoggedStore(path, log, **options)


class _LoggedStream:
    def __init__(self, store, stream):
        self._store, self._stream = store, stream

    def submit(self, ids):
        self._store._write(ids)
        return self._stream.submit(ids)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _cloud_device() -> dict:
    # Imported here, in the test's process only: the prefetcher's process imports this module to
    # unpickle LoggedStore, with the test process's import path, on which another `conftest`
    # (bench/'s, put first by a test module that imports from bench/) may come first.
    from conftest import CLOUD_DEVICE
    return CLOUD_DEVICE


def _extent_node(store, cache, ssd=None):
    """A node of `store` under the extent plan: 64 KiB extents, two at a time (its prefetcher is
    started by the test)."""
    from shadecache.read_plan import ReadPlan
    return sc.Node(store, cache, ssd=ssd, read_plan=ReadPlan.of_extents(store, 64 << 10, window=2),
                   read_ahead=False)


def _extent_loader(ds):
    """(sampler, loader) of `ds`, a data set of an _extent_node."""
    sampler = sc.ShadeSampler(ds, batch_size=BATCH, seed=1)
    return sampler, sc.CachedLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2)


def _train(sampler, loader, log, prefetcher_pid, epochs):
    """Trains `epochs` epochs with scores (losses a fixed function of the id and the epoch);
    per epoch, the ids the store read (loader's process, prefetcher's process)."""
    start, out = os.path.getsize(log) if os.path.exists(log) else 0, []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for _, _, idx in loader:
            ids = idx.numpy()
            sampler.update(idx, ((ids * 2654435761 + epoch * 97) % 1000) / 1000.0)
            time.sleep(0.003)     # a training step: time for the prefetcher to read
        sampler.end_epoch()
        reads, start = _reads(log, start)
        out.append((reads.get(os.getpid(), []), reads.get(prefetcher_pid, [])))
    return out


@pytest.fixture
def importable(monkeypatch):
    """The prefetcher's process imports this module to unpickle LoggedStore."""
    path = [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))


def test_under_the_extent_order_the_prefetcher_reads_each_extent_once_and_stops_when_full(
        cloud_store, tmp_path, importable):
    name = f"t-pfext-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "reads.log"
    store = LoggedStore(cloud_store.path, log, device=_cloud_device())
    cap = sc.Cache.capacity_for(N // 4, store.lengths)
    ssd_bytes = int(0.25 * sum(sc.SSDTier.slot_bytes(int(v)) for v in store.lengths))
    with sc.Cache.for_store(name, store, capacity_bytes=cap, policy="importance",
                            attach=False) as cache, OrderBoard.create(name, N):
        ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=ssd_bytes, cache=cache)
        ds = _extent_node(store, cache, ssd).dataset()
        sampler, loader = _extent_loader(ds)
        pf = ds.node.prefetcher(lookahead_samples=1024, batch=64).start()
        try:
            data_ids = _train(sampler, loader, log, pf.pid, epochs=3)
        finally:
            assert pf.stop() == 0
            ssd.close()
        cache.check()
    store.close()
    loader_cold, prefetcher_cold = data_ids[0]
    assert len(prefetcher_cold) > 0                      # it read ahead while the cache filled
    for loader_ids, prefetcher_ids in data_ids:
        # the mates of a batch in flight are not asked for again by the next batches (each of
        # up to 4 batches in flight read the same extents before)
        assert np.unique(prefetcher_ids).size == len(prefetcher_ids)
    for loader_ids, prefetcher_ids in data_ids[1:]:
        assert prefetcher_ids == []                      # the cache is full: the loader reads
        assert len(loader_ids) <= N                      # no sample read twice over


def test_a_warm_ssd_tier_does_not_stop_the_prefetcher_filling_an_empty_cache(
        cloud_store, tmp_path, importable):
    """Under the extent order what the SSD tier serves stays there (it is not offered to the
    cache), so a read ahead of extents the SSD tier holds brings nothing the cache refused: the
    cache is not full, and the prefetcher goes on reading the store's extents ahead (a restarted
    job: the SSD tier's journal is warm, the cache empty). Taking those values for refusals
    stopped it after its first such read, and the loader read the epoch's misses itself."""
    from shadecache.read_plan import ReadPlan

    name = f"t-pfssd-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "reads.log"
    store = LoggedStore(cloud_store.path, log, device=_cloud_device())
    layout = ReadPlan.of_extents(store, 64 << 10).layout
    warm = np.concatenate([layout.by_extent[layout.first[e]:layout.first[e + 1]]
                           for e in range(0, layout.extents, 4)])       # every 4th extent whole
    cap = sc.Cache.capacity_for(2 * N, store.lengths)                     # never full
    with sc.Cache.for_store(name, store, capacity_bytes=cap, policy="importance",
                            attach=False) as cache, OrderBoard.create(name, N):
        ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=16 << 20, cache=cache)
        ssd.bind_store(store)
        ssd.put_many(warm, store.read_many(warm))
        ssd.flush()
        start = os.path.getsize(log)
        ds = _extent_node(store, cache, ssd).dataset()
        sampler, loader = _extent_loader(ds)
        pf = ds.node.prefetcher(lookahead_samples=1024, batch=64).start()
        try:
            sampler.set_epoch(0)
            for _ in loader:
                time.sleep(0.01)      # a training step: time for the prefetcher to read
            sampler.end_epoch()
            reads, _ = _reads(log, start)
            pid = pf.pid
        finally:
            assert pf.stop() == 0
            ssd.close()
        assert cache.stats()["rejected"] == 0 and cache.stats()["evictions"] == 0
        cache.check()
    store.close()
    misses = N - warm.size                     # what only the store holds
    # measured: the prefetcher read all 2236 of them (303 before, the loader the other 1933)
    assert len(reads.get(pid, [])) >= 0.5 * misses, (len(reads.get(pid, [])), misses)
    assert len(reads.get(os.getpid(), [])) <= 0.5 * misses


def test_without_an_ssd_tier_the_prefetcher_reads_nothing_ahead_once_the_cache_is_full(
        cloud_store, tmp_path, importable):
    """Under the extent order a full cache is read ahead no more with or without an SSD tier:
    an extent read lands whole long before most of its samples are due, and what room it makes
    is read again when due. Without an SSD tier it went on reading: each warm epoch the
    prefetcher read more than the data set (about 3200 of 3000 samples, where the loader alone
    reads about 2000)."""
    name = f"t-pfnossd-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "reads.log"
    store = LoggedStore(cloud_store.path, log, device=_cloud_device())
    cap = sc.Cache.capacity_for(N // 3, store.lengths)
    with sc.Cache.for_store(name, store, capacity_bytes=cap, policy="importance",
                            attach=False) as cache, OrderBoard.create(name, N):
        ds = _extent_node(store, cache).dataset()
        sampler, loader = _extent_loader(ds)
        pf = ds.node.prefetcher(lookahead_samples=1024, batch=64).start()
        try:
            rows = [(len(a), len(b)) for a, b in _train(sampler, loader, log, pf.pid, epochs=3)]
        finally:
            assert pf.stop() == 0
        cache.check()
    store.close()
    assert rows[0][1] > 0, rows                  # it read ahead while the cache filled
    for loader_read, prefetcher_read in rows[1:]:
        assert prefetcher_read == 0, rows
        assert loader_read <= N, rows
