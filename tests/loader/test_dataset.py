"""CachedDataset over a real PackedStore and a real shared-memory Cache, through real DataLoader
workers (none, fork, spawn, persistent)."""
import functools
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shadecache as sc
from shadecache.demo import synthetic

N, SIZE = 240, 8          # 240 images of 8x8 = 64 bytes


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ds") / "train.shc")
    sc.pack(synthetic.SyntheticImages(N, seed=3, size=SIZE), path, progress=False)
    return sc.PackedStore(path)


@pytest.fixture(scope="module")
def truth():
    return synthetic.SyntheticImages(N, seed=3, size=SIZE)


@pytest.fixture
def make_cache(cache_factory):
    def make(capacity=1 << 16, policy="lru", n=N):
        return cache_factory(n, capacity, policy, max_item_bytes=SIZE * SIZE)
    return make


decode = functools.partial(synthetic.decode, size=SIZE)


def test_items_are_sample_target_index_and_counted(store, truth, make_cache):
    cache = make_cache()
    ds = sc.CachedDataset(store, cache, decode=decode)
    assert len(ds) == N
    ids = [5, 17, 5, 239, 0]                        # 5 twice: read once from the store
    items = ds.__getitems__(ids)
    for i, (x, y, idx) in zip(ids, items):
        raw, label = truth[i]
        assert idx == i and y == label
        assert np.array_equal(x, synthetic.decode(raw, SIZE))
    st = ds.stats()
    assert st["hits"] == 0 and st["misses"] == 5 and st["store_reads"] == 4
    assert st["bytes_read"] == 4 * SIZE * SIZE
    assert cache.cached_mask()[[0, 5, 17, 239]].all()
    ds.__getitems__([5, 17, 1])
    st = ds.stats()
    assert (st["hits"], st["misses"], st["samples"], st["bytes_read"]) == (2, 6, 8, 5 * 64)
    assert st["hit_ratio"] == pytest.approx(2 / 8)
    # single-item path goes through the same batch code
    x, y, idx = ds[17]
    assert idx == 17 and y == truth[17][1] and ds.stats()["hits"] == 3
    ds.reset_stats()
    assert ds.stats()["samples"] == 0


def test_zero_byte_samples_decode_to_empty_tensors(tmp_path, cache_factory):
    """The format allows 0-byte samples; the default decode returns an empty uint8 tensor for
    them (torch.frombuffer refuses an empty buffer), from the store and from the cache."""
    p = tmp_path / "z.shc"
    with sc.PackWriter(p) as w:
        w.add(b"", 3)
        w.add(b"ab", 4)
    ds = sc.CachedDataset(sc.PackedStore(p), cache_factory(2))
    for _ in range(2):  # a miss, then a hit
        (x0, y0, _), (x1, y1, _) = ds.__getitems__([0, 1])
        assert x0.dtype == torch.uint8 and x0.numel() == 0 and y0 == 3
        assert bytes(x1.numpy()) == b"ab" and y1 == 4
    assert ds.stats()["hits"] == 2


def test_without_cache_every_read_goes_to_the_store(store, truth):
    ds = sc.CachedDataset(store, None)
    x, y, idx = ds[9]
    assert bytes(x.numpy()) == truth[9][0] and y == truth[9][1] and idx == 9
    ds.__getitems__([9, 10])
    assert ds.stats()["misses"] == 3 and ds.stats()["hits"] == 0


def test_bad_ids_and_mismatched_cache(store, make_cache):
    ds = sc.CachedDataset(store, make_cache(), decode=decode)
    with pytest.raises(IndexError, match="sample id 240 is out of range 0..239"):
        ds.__getitems__([1, 240])
    with pytest.raises(IndexError, match="sample id -1"):
        ds[-1]
    with pytest.raises(TypeError, match="integer"):
        ds.__getitems__(["a"])
    with pytest.raises(ValueError, match="holds 10 sample ids but the store has 240"):
        sc.CachedDataset(store, make_cache(n=10))


class ListStore:
    """A store written here over a list of samples, indexed as Python indexes a list: it checks
    nothing, as a store of one's own may not (-1 would be the last sample)."""

    def __init__(self, samples):
        self.samples = [data for data, _ in samples]
        self.labels = np.array([label for _, label in samples], dtype=np.int64)
        self.lengths, self.fingerprint = None, None

    def __len__(self):
        return len(self.samples)

    def read_many(self, ids):
        return [self.samples[i] for i in np.asarray(ids).tolist()]

    def close(self):
        pass


def test_fetch_bytes_applies_the_id_rule_to_an_int64_array_too(truth, make_cache):
    ds = sc.CachedDataset(ListStore([truth[i] for i in range(N)]), None)
    with pytest.raises(IndexError, match="sample id -1 is out of range 0..239"):
        ds.fetch_bytes(np.array([3, -1], dtype=np.int64))
    with pytest.raises(IndexError, match="sample id 240 is out of range"):
        ds.fetch_bytes(np.array([240], dtype=np.int64))
    assert ds.fetch_bytes(np.array([[3], [4]], dtype=np.int64)) == [truth[3][0], truth[4][0]]
    assert ds.stats()["samples"] == 2


def test_a_sample_larger_than_the_cache_takes_is_read_through(tmp_path, cache_factory):
    """A cache made with max_item_bytes below some samples' size refuses those (the SSD tier keeps
    them); every reader still gets them, and the others are admitted."""
    path = tmp_path / "mixed.shc"
    samples = [(bytes([i]) * (50 if i % 2 else 500), i % 5) for i in range(20)]
    with sc.PackWriter(path) as w:
        for data, label in samples:
            w.add(data, label)
    store = sc.PackedStore(path)
    cache = cache_factory(20, 1 << 20, "lru", max_item_bytes=100)
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, fingerprint=store.fingerprint)
    ds = sc.Node(store, cache, ssd=ssd, read_ahead=False).dataset()
    ids = [0, 1, 2, 3]
    assert [bytes(x.numpy()) for x, _, _ in ds.__getitems__(ids)] == [samples[i][0] for i in ids]
    assert cache.cached_mask()[[1, 3]].all() and not cache.cached_mask()[[0, 2]].any()
    ssd.flush()
    assert ssd.ids().tolist() == [0, 2]          # what the cache refused
    loader = sc.CachedLoader(ds, batch_size=5, num_workers=1)
    got = [bytes(x.numpy()) for batch in loader for x in batch[0].tolist()]
    assert got == [data for data, _ in samples]
    assert cache.cached_mask()[1::2].all() and not cache.cached_mask()[0::2].any()
    ssd.close()


class KillingStore(ListStore):
    """Kills the process that reads sample `victim` while the file `armed` exists, unless it is
    the test's own: a DataLoader worker SIGKILLed in the middle of the miss path."""

    def __init__(self, samples, victim, armed):
        super().__init__(samples)
        self.victim, self.armed, self.parent = victim, str(armed), os.getpid()

    def read_many(self, ids):
        if (self.victim in np.asarray(ids).tolist() and os.path.exists(self.armed)
                and os.getpid() != self.parent):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().read_many(ids)


def _files_of(cache_name):
    """What /dev/shm holds under a cache's name (its segment, a board, a status file, ...)."""
    return {e for e in os.listdir("/dev/shm") if cache_name in e}


def test_a_dataloader_worker_killed_in_the_miss_path_leaves_nothing_behind(tmp_path, truth, make_cache):
    armed = tmp_path / "armed"
    armed.touch()
    store = KillingStore([truth[i] for i in range(N)], victim=3, armed=armed)
    cache = make_cache()
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20)
    ds = sc.Node(store, cache, ssd=ssd, read_ahead=False).dataset()
    # One worker, killed in its first batch: torch's SIGCHLD handler raises for a killed pid at
    # any later SIGCHLD until its iterator lets go of its workers (another worker's exit)
    it = iter(DataLoader(ds, batch_size=16, num_workers=1, multiprocessing_context="fork"))
    with pytest.raises(RuntimeError, match="DataLoader worker .* (exited unexpectedly|is killed by signal)"):
        for _ in it:
            pass
    it._shutdown_workers()
    del it
    armed.unlink()
    cache.check()
    ids, xs = [], []
    for x, _, idx in DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context="fork"):
        ids += idx.tolist()
        xs += [bytes(v.numpy()) for v in x]
    assert ids == list(range(N)) and xs == [truth[i][0] for i in ids]
    cache.check()
    st = ds.stats()
    assert st["samples"] >= N and st["hits"] + st["misses"] == st["samples"]
    assert _files_of(cache.name) == {f"shadecache.{cache.name}"}
    ssd.close()


class SlowStore(ListStore):
    """Takes `delay` seconds over every read of sample 0."""

    def __init__(self, samples, delay):
        super().__init__(samples)
        self.delay = delay

    def read_many(self, ids):
        if 0 in np.asarray(ids).tolist():
            time.sleep(self.delay)
        return super().read_many(ids)


def test_a_worker_forked_while_a_thread_reads_misses_reads_its_own(truth, make_cache):
    """A thread of this process (sc.CachedLoader's, or the user's) is inside the miss path when
    DataLoader workers fork: each worker reads its misses itself, not behind a lock it inherited
    taken, whose holder does not exist in it."""
    ds = sc.CachedDataset(SlowStore([truth[i] for i in range(N)], delay=3.0), make_cache())
    reading = threading.Thread(target=ds.__getitems__, args=([0],))
    reading.start()
    time.sleep(0.5)   # the thread is in the store's read, under the data set's miss lock
    loader = DataLoader(ds, batch_size=4, sampler=[5, 6, 7, 8], num_workers=1,
                        multiprocessing_context="fork", timeout=20)
    t0 = time.monotonic()
    (x, _, idx), = list(loader)
    assert idx.tolist() == [5, 6, 7, 8] and bytes(x[0].numpy()) == truth[5][0]
    assert time.monotonic() - t0 < 15
    reading.join()


def test_misses_are_admitted_with_their_current_importance(tmp_path, make_cache):
    n = 1500                                     # one 64 KiB slab page holds fewer than that
    path = str(tmp_path / "big.shc")
    sc.pack(synthetic.SyntheticImages(n, seed=4, size=SIZE), path, progress=False)
    store = sc.PackedStore(path)
    cache = make_cache(capacity=1 << 16, policy="importance", n=n)
    ds = sc.CachedDataset(store, cache, decode=decode)
    ds.__getitems__(list(range(n)))                       # fill (the cache holds only part)
    held = np.flatnonzero(cache.cached_mask())
    assert 0 < held.size < n
    outside = np.setdiff1d(np.arange(n), held)
    low, high = int(outside[0]), int(outside[1])
    cache.update_scores(np.array([high, low]), np.array([9.0, -1.0], dtype=np.float32))
    ds.__getitems__([low, high])
    mask = cache.cached_mask()
    assert mask[high], "a miss scoring above every cached sample must be admitted"
    assert not mask[low], "a miss scoring below every cached sample must be refused"


def run_epochs(ds, sampler, truth, workers, context, persistent, epochs=2):
    loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=workers,
                        multiprocessing_context=context if workers else None,
                        persistent_workers=persistent)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        got = []
        for x, y, idx in loader:
            assert x.shape[1] == SIZE * SIZE
            for row, label, i in zip(x, y.tolist(), idx.tolist()):
                raw, want = truth[i]
                assert label == want
                assert torch.equal(row, torch.from_numpy(synthetic.decode(raw, SIZE)))
            losses = (x.mean(1) + 1.0)                 # any per-sample value drives the scores
            sampler.update(idx, losses)
            got.extend(idx.tolist())
        assert np.array_equal(np.asarray(got), sampler.order())
        sampler.end_epoch()
    del loader


@pytest.mark.parametrize("workers,context,persistent", [
    (0, None, False), (2, "fork", False), (2, "fork", True), (2, "spawn", True)])
def test_dataloader_workers(store, truth, make_cache, workers, context, persistent):
    cache = make_cache(capacity=1 << 16, policy="importance")
    ds = sc.CachedDataset(store, cache, decode=decode)
    sampler = sc.ShadeSampler(ds, cache=cache, batch_size=32, seed=1, rep_factor=1.0)
    run_epochs(ds, sampler, truth, workers, context, persistent)
    st = ds.stats()
    # the counts of every worker reach the main process
    assert st["samples"] == 2 * len(sampler)
    assert st["hits"] + st["misses"] == st["samples"]
    assert st["hits"] > 0, "the second epoch must hit what the workers inserted in the first"
    assert cache.cached_mask().sum() > 0
    assert st["bytes_read"] == st["store_reads"] * SIZE * SIZE
    cache.check()
