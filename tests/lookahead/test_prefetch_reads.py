"""What a prefetcher reads from the shared storage: with an SSD tier in the chain, never more per
warm epoch than the same job reads without a prefetcher (bench/prefetch_tiers.py measures it on
throttled storage; this is its short, unthrottled form, counted by the store itself).

The job is made (nearly) deterministic so that the runs can be compared: one loader thread
(num_workers=0), an order drawn from the scores alone (pads=False, rep_factor=0: it does not look
at the cache), losses a fixed function of the id, the SSD tier flushed after every batch. Without a
prefetcher the job's store reads then vary by a few per epoch; with one, the cache and the SSD tier
must see every sample when the loader asks for it, as they do without one, or the counts drift
apart."""
import os
import time
import uuid

import numpy as np
import pytest

import shadecache as sc
from shadecache.lookahead.board import OrderBoard
from values import make_value

N = 1500
BATCH = 32
HERE = os.path.dirname(os.path.abspath(__file__))


class CountingStore:
    """A PackedStore whose read_many appends what it read to a log file, from any process (the
    loader's, the prefetcher's): one line per call, "pid id id ...", one O_APPEND write each."""

    def __init__(self, path, log):
        self.path, self.log = os.fspath(path), os.fspath(log)
        self._store = sc.PackedStore(self.path)
        self.lengths = self._store.lengths
        self.labels = self._store.labels
        self.fingerprint = self._store.fingerprint
        self._fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def __len__(self):
        return len(self._store)

    def read_many(self, ids):
        out = self._store.read_many(ids)
        line = " ".join(str(int(i)) for i in np.asarray(ids).reshape(-1))
        os.write(self._fd, f"{os.getpid()} {line}\n".encode())
        return out

    def close(self):
        self._store.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __reduce__(self):
        return (CountingStore, (self.path, self.log))


def reads_logged(log, start: int = 0):
    """{pid: [ids read]} of the log from byte `start` on, and the log's size."""
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read()
    out = {}
    for line in text.decode().splitlines():
        pid, *ids = (int(x) for x in line.split())
        out.setdefault(pid, []).extend(ids)
    return out, start + len(text)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("reads") / "s.shc"
    with sc.PackWriter(path) as w:
        for i in range(N):
            w.add(make_value(i, 0, 1500 + (i * 37) % 400), i % 10)
    return path


def losses_of(ids: np.ndarray) -> np.ndarray:
    x = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return (x % np.uint64(1000)).astype(np.float64) / 1000.0


def store_reads_per_epoch(store_path, tmp_path, prefetch: bool, epochs: int = 4):
    """Per epoch: (the store reads of the loader, those of the prefetcher (ids), the epoch's
    order), for a node with a cache of 20% of the samples and an SSD tier of 30%. An epoch's
    reads are those from its end_epoch on to the next: the prefetcher reads an epoch's first
    misses once end_epoch has published its order."""
    name = f"t-reads-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log = tmp_path / f"{name}.log"
    store = CountingStore(store_path, log)
    ssd_bytes = int(0.30 * sum(sc.SSDTier.slot_bytes(int(v)) for v in store.lengths))
    cap = sc.Cache.capacity_for(round(0.20 * N), store.lengths)
    epochs_read = []
    with sc.Cache.for_store(name, store, capacity_bytes=cap, policy="importance", attach=False) as cache, \
            OrderBoard.create(name, N):
        ssd = sc.SSDTier(tmp_path / f"{name}-ssd", capacity_bytes=ssd_bytes, cache=cache)
        ds = sc.Node(store, cache, ssd=ssd, read_ahead=False).dataset()
        sampler = sc.ShadeSampler(ds, cache=cache, batch_size=BATCH, seed=0, pads=False,
                                  rep_factor=0.0)
        loader = sc.CachedLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0)
        pf = (sc.Node(store, cache, ssd=ssd).prefetcher(lookahead_samples=512, batch=64).start()
              if prefetch else None)
        start = 0
        try:
            for epoch in range(epochs):
                sampler.set_epoch(epoch)
                for _, _, idx in loader:
                    sampler.update(idx, losses_of(idx.numpy()))
                    ssd.flush()          # what the loader's misses gave the SSD tier is there
                    time.sleep(0.004)    # a training step: time for a prefetcher to read ahead
                order = np.asarray(sampler.order())
                reads, start = reads_logged(log, start)
                epochs_read.append((reads.get(os.getpid(), []),
                                    reads.get(pf.pid, []) if pf is not None else [], order))
                sampler.end_epoch()
        finally:
            if pf is not None:
                assert pf.stop() == 0
            ssd.close()
        cache.check()
    store.close()
    return epochs_read


@pytest.fixture
def importable(monkeypatch):
    """The prefetcher's process imports this module to unpickle CountingStore."""
    path = [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]   # + tests/ (values.py)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))


def test_with_an_ssd_tier_the_prefetcher_adds_no_store_read(store_path, tmp_path, importable):
    without = [[len(r[0]) for r in store_reads_per_epoch(store_path, tmp_path, prefetch=False)]
               for _ in range(2)]
    with_pf = store_reads_per_epoch(store_path, tmp_path, prefetch=True)
    assert without[0][0] == without[1][0] == N      # cold: every sample once
    assert sum(len(r[1]) for r in with_pf[1:]) > 0   # it read ahead in the warm epochs
    # A sample it read ahead is read from the store again for the same turn (the loader read it
    # too in an epoch that reads it once) only when its admission prediction was wrong: the
    # cache refused it when it was offered at its turn, and the SSD tier did not keep it either
    # (docs/prefetch.md; seen: 0 to 2 per run of 20-30 reads ahead, 3 of 7 under a load of 15 on
    # 2 vCPUs, and 5 to 7 of 26-28 in some full-suite runs of 2026-12-03, always the same ids:
    # a prediction that the timing decides, not yet diagnosed). A prefetcher that lost what it
    # read ahead, or raced the loader for it, does that for most.
    again, ahead = [], 0
    for e, (loader_ids, prefetcher_ids, order) in enumerate(with_pf[1:], 1):
        twice = np.intersect1d(np.asarray(loader_ids, np.int64), np.asarray(prefetcher_ids, np.int64))
        times = np.bincount(order, minlength=N)
        again += [(e, int(i)) for i in twice[times[twice] < 2]]
        ahead += len(prefetcher_ids)
    assert len(again) <= 3 + 0.2 * ahead, (again, ahead)
    # The job without a prefetcher is nearly deterministic: its SSD tier's writer takes the
    # values it is given in batches of its own timing, which moves a few reads per epoch (up to
    # about 1% between two runs here). With the prefetcher the warm epochs read no more than
    # that: 2% of the reads is the bound.
    warm = max(sum(w[1:]) for w in without)
    reads = [len(a) + len(b) for a, b, _ in with_pf]
    assert sum(reads[1:]) <= 1.02 * warm, (reads, without)


def prefetched_epochs(path, tmp_path, policy, cache_items, epochs=3):
    """A job without an SSD tier whose prefetcher reads ahead into a cache with room for
    `cache_items` samples: per epoch (the loader's store reads, the prefetcher's (ids), the
    epoch's order), then the next epoch's order and the cache's stats() at the end."""
    name = f"t-nossd-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log = tmp_path / f"{name}.log"
    store = CountingStore(path, log)
    cap = sc.Cache.capacity_for(cache_items, store.lengths)
    out = []
    with sc.Cache.for_store(name, store, capacity_bytes=cap, policy=policy,
                            attach=False) as cache, OrderBoard.create(name, N):
        ds = sc.CachedDataset(store, cache)
        sampler = sc.ShadeSampler(ds, cache=cache, batch_size=BATCH, seed=0, pads=False,
                                  rep_factor=0.0, stalls=False)
        loader = sc.CachedLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0)
        with sc.Node(store, cache).prefetcher(batch=64) as pf:
            start = 0
            for epoch in range(epochs):
                sampler.set_epoch(epoch)
                for _, _, idx in loader:
                    sampler.update(idx, losses_of(idx.numpy()))
                    time.sleep(0.004)    # a training step: time for the prefetcher to read ahead
                order = np.asarray(sampler.order())
                reads, start = reads_logged(log, start)
                out.append((reads.get(os.getpid(), []),
                            np.asarray(reads.get(pf.pid, []), dtype=np.int64), order))
                sampler.end_epoch()
            sampler.set_epoch(epochs)
            following = np.asarray(sampler.order())
        stats = cache.stats()
        cache.check()
    store.close()
    return out, following, stats


@pytest.mark.parametrize("policy", ["lru", "importance"])
def test_without_an_ssd_tier_a_full_cache_keeps_what_the_prefetcher_read_until_its_turn(
        store_path, tmp_path, importable, policy):
    """A policy that evicts to admit refuses nothing: LRU always, the importance policy whenever
    what arrives outscores the lowest cached sample. A prefetcher that waited for a refusal to
    call the cache full left the room to the engine, which evicted samples read for the next
    batches (LRU: the oldest arrivals, due first) and they were read again before their turn (LRU
    here: 1,140-1,255 extra reads an epoch; the importance policy on a throttled disk: up to six
    reads of one sample, 3,189 of an epoch's 6,805 reads). Once full, the prefetcher makes room
    among the samples needed later than those it reads, so each is read once for its turn."""
    epochs, following, _ = prefetched_epochs(store_path, tmp_path, policy, round(0.20 * N))
    segments = [mine for _, mine, _ in epochs]
    orders = [order for _, _, order in epochs] + [following]
    # An epoch's reads may also be the next epoch's head (the order of the next epoch is
    # published before this one ends: seen up to 220 positions into it): at most the cache's
    # samples.
    reach = round(0.20 * N)
    extra = []
    for e, mine in enumerate(segments):
        turns = np.bincount(orders[e], minlength=N) + np.bincount(orders[e + 1][:reach], minlength=N)
        over = np.bincount(mine, minlength=N) - turns
        extra.append(int(over[over > 0].sum()))
    ahead = sum(m.size for m in segments)
    assert ahead > 0.5 * N, ahead                     # it read most misses ahead
    # a sample is read again for the same turn only in a race of the loader's own miss with the
    # prefetcher's room-making (a few); the engine's eviction of the window made it hundreds
    assert sum(extra) <= 0.02 * ahead, (extra, ahead)


@pytest.fixture(scope="module")
def large_store_path(tmp_path_factory):
    """Samples of about 16 KB: a cache with room for all of them is over 95% used when it holds
    them (small samples leave more of it to slot rounding)."""
    path = tmp_path_factory.mktemp("reads-large") / "s.shc"
    with sc.PackWriter(path) as w:
        for i in range(N):
            w.add(make_value(i, 0, 16384 - (i * 37) % 256), i % 10)
    return path


@pytest.mark.parametrize("policy", ["lru", "importance"])
def test_without_an_ssd_tier_a_cache_that_holds_the_data_set_is_read_once(
        large_store_path, tmp_path, importable, policy):
    """A cache with room for every sample never evicts: once the first epoch read them all, the
    warm epochs read nothing, with or without a prefetcher. A prefetcher that calls it full when
    it is 90% used, and then removes a cached sample for each it reads ahead, removes samples the
    next epoch reads again, every epoch."""
    epochs, _, stats = prefetched_epochs(large_store_path, tmp_path, policy, N)
    per_epoch = [(len(loader), mine.size) for loader, mine, _ in epochs]
    assert sum(per_epoch[0]) >= N and per_epoch[0][1] > 0.5 * N, per_epoch   # cold, read ahead
    assert stats["evictions"] == 0, stats
    # What the first epoch's reads still had in flight at its end (or a refused insert left for
    # a later epoch) may be read in the next one: a few (0-20 seen). Removing one sample for each
    # of the last misses read 90-97 again every warm epoch here.
    assert sum(map(sum, per_epoch[1:])) <= 0.02 * N, (per_epoch, stats["items"], stats["bytes_used"],
                                                      stats["capacity_bytes"])
