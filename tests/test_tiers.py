"""The tier chain (shadecache/tiers.py) on real tiers: the order it reads them in, what it keeps,
what the SSD tier gets, and the prefetcher's pipeline through a PackedStore's stream or threads."""
import numpy as np
import pytest

import shadecache as sc
from shadecache.tiers import STORE, TierChain
from values import make_value

N = 64


@pytest.fixture
def store(tmp_path):
    with sc.PackWriter(tmp_path / "s.shc") as w:
        for i in range(N):
            w.add(make_value(i, 0, 300 + 10 * i), i % 3)
    return sc.PackedStore(tmp_path / "s.shc")


class EvenPeer:
    """A partitioning tier written here: it serves the even ids (their home is elsewhere) and
    holds those below 20; it records what it was asked."""
    lengths = fingerprint = None

    def __init__(self, store):
        self.store, self.asked = store, []

    def serves(self, ids):
        return np.asarray(ids) % 2 == 0

    def read_many(self, ids):
        self.asked.append(list(ids))
        return [self.store.read_many([i])[0] if i < 20 else None for i in ids]

    def close(self):
        pass


def test_tiers_are_read_in_order_and_counted(store, tmp_path):
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, fingerprint=store.fingerprint)
    ssd.put_many([1, 3, 4], store.read_many([1, 3, 4]))
    ssd.flush()
    peer = EvenPeer(store)
    chain = TierChain.for_node(store, peer=peer, ssd=ssd)
    ids = [0, 1, 2, 3, 4, 30, 31]
    r = chain.read(ids)
    assert r.values == store.read_many(ids)
    assert peer.asked == [[0, 2, 4, 30]]                      # only the ids it serves
    assert r.source.tolist() == [0, 1, 0, 1, 0, 2, 2]         # peer, ssd, peer, ssd, peer, store
    assert r.counts["peer"].hits == 3 and r.counts["ssd"].asked == 4 and r.counts["ssd"].hits == 2
    assert r.counts[STORE] == (2, 2, len(r.values[5]) + len(r.values[6]), r.counts[STORE].ns)
    assert r.keep.tolist() == [False, True, False, True, False, False, True]   # the odd ones: ours
    assert TierChain.for_node(store, peer=peer, keep_remote=True).keeps(ids).all()
    ssd.close()


def test_held_locally_is_what_a_read_takes_from_the_ssd_tier(store, tmp_path):
    """An id the SSD tier holds is read from it unless the home peer serves it (the peer is asked
    first): held_locally says which, as the read's sources show."""
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, fingerprint=store.fingerprint)
    ssd.put_many([1, 2, 3, 4], store.read_many([1, 2, 3, 4]))
    ssd.flush()
    ids = [1, 2, 3, 4, 5]
    chain = TierChain.for_node(store, peer=EvenPeer(store), ssd=ssd)
    assert chain.held(ids).tolist() == [True, True, True, True, False]
    assert chain.held_locally(ids).tolist() == [True, False, True, False, False]
    assert (chain.read(ids).source == 1).tolist() == chain.held_locally(ids).tolist()
    assert TierChain.for_node(store, ssd=ssd).held_locally(ids).tolist() == [True] * 4 + [False]
    ssd.close()


def test_admission_keeps_ours_and_the_ssd_tier_gets_what_the_cache_refused(store, tmp_path, cache_factory):
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, fingerprint=store.fingerprint)
    cache = cache_factory(N, capacity=1 << 20, policy="static", sizes=store.lengths)
    cache.put_many(list(range(40, 64)), store.read_many(range(40, 64)))
    chain = TierChain.for_node(store, cache, peer=EvenPeer(store), ssd=ssd)
    chain.fetch([5, 7, 30, 33])
    ssd.flush()
    # 5, 7 and 33 are ours (odd) and the static cache (never evicts) admitted them while it had
    # room; 30 is another node's: neither cached nor written
    assert cache.cached_mask()[[5, 7, 33]].all() and not cache.contains(30)
    assert ssd.ids().tolist() == []
    # read-through (sc.ReadThrough): nothing is offered to the cache, so the SSD tier keeps it all
    TierChain.for_node(store, cache, ssd=ssd, admission=sc.ReadThrough()).fetch([9, 11])
    ssd.flush()
    assert ssd.ids().tolist() == [9, 11] and not cache.contains(9) and not cache.contains(11)
    assert ssd.get_many([9, 11]) == store.read_many([9, 11])
    ssd.close()


def test_the_ssd_tier_fills_a_cache_with_room_and_displaces_nothing_in_a_full_one(
        store, tmp_path, cache_factory):
    """The tiers are exclusive: an SSD hit moves up into the cache only into free room (a
    restarted node's empty cache beside a warm SSD tier fills), never into a full cache, where it
    would evict a sample no tier keeps and leave the hit on both tiers. The store's misses are
    offered to the cache either way."""
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, fingerprint=store.fingerprint)
    ssd.put_many([1, 3], store.read_many([1, 3]))
    ssd.flush()
    roomy = cache_factory(N, capacity=1 << 20, policy="lru", sizes=store.lengths)
    assert TierChain.for_node(store, roomy, ssd=ssd).fetch([1, 3, 5]) == store.read_many([1, 3, 5])
    assert roomy.cached_mask()[[1, 3, 5]].all()
    full = cache_factory(N, capacity=48 << 10, policy="lru")
    full.put_many(list(range(10, 64)), [bytes(900)] * 54)     # more than it holds: it evicted
    assert full.stats()["evictions"] > 0 and full.stats()["free_pages"] == 0
    assert TierChain.for_node(store, full, ssd=ssd).fetch([1, 3, 5]) == store.read_many([1, 3, 5])
    ssd.flush()
    assert full.contains(5) and not full.contains(1) and not full.contains(3)
    assert ssd.ids().tolist() == [1, 3]
    ssd.close()


def test_without_a_store_what_no_tier_holds_stays_none(store, tmp_path):
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, fingerprint=store.fingerprint)
    ssd.put_many([2], store.read_many([2]))
    ssd.flush()
    r = TierChain([("ssd", ssd)]).read([2, 3])
    assert r.values == [store.read_many([2])[0], None] and r.source.tolist() == [0, -1]
    ssd.close()


class ThreadedStore:
    """The packed store without its stream: the pipeline reads it on threads."""

    def __init__(self, store):
        self.store = store
        self.labels = store.labels
        self.lengths = store.lengths

    def __len__(self):
        return len(self.store)

    def read_many(self, ids):
        return self.store.read_many(ids)


@pytest.mark.parametrize("streamed", [True, False])
def test_the_pipeline_gives_each_batch_in_order(store, tmp_path, streamed):
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=1 << 20, fingerprint=store.fingerprint)
    ssd.put_many(range(0, N, 5), store.read_many(range(0, N, 5)))
    ssd.flush()
    chain = TierChain([("ssd", ssd)], store if streamed else ThreadedStore(store))
    reader = chain.reader(batches=3, queue_depth=8, lanes=2)
    batches = [np.arange(k, k + 16) for k in range(0, N, 16)] + [np.array([0, 5, 10])]
    try:
        got = []
        for b in batches:
            reader.submit(b)
            if len(reader) == 3:
                got.append(reader.take())
        while len(reader):
            got.append(reader.take())
    finally:
        reader.close()
    assert [r.ids.tolist() for r in got] == [b.tolist() for b in batches]
    for r in got:
        assert r.values == store.read_many(r.ids)
    assert STORE not in got[-1].counts and got[-1].counts["ssd"].hits == 3   # all on the SSD tier
    ssd.close()


class AnswerStore:
    """A store written here whose read_many answers through `answer(ids, values)`: the packed
    store's values as another bytes-like type, or a broken answer."""

    def __init__(self, store, answer):
        self.store, self.answer = store, answer
        self.labels, self.lengths, self.fingerprint = store.labels, store.lengths, None

    def __len__(self):
        return len(self.store)

    def read_many(self, ids):
        return self.answer(ids, self.store.read_many(ids))

    def close(self):
        pass


def _numpy_rows(ids, values):   # uint8 arrays; sample 0 as a (2, n/2) array
    return [np.frombuffer(v, np.uint8).reshape(2, -1) if i == 0 else np.frombuffer(v, np.uint8)
            for i, v in zip(np.asarray(ids).tolist(), values)]


@pytest.mark.parametrize("answer", [
    lambda ids, values: [bytearray(v) for v in values],
    lambda ids, values: [memoryview(v) for v in values],
    _numpy_rows,
], ids=["bytearray", "memoryview", "numpy"])
def test_bytes_like_values_reach_every_reader_as_their_bytes(tmp_path, cache_factory, answer):
    with sc.PackWriter(tmp_path / "z.shc") as w:       # sample 5: one zero byte
        for i in range(N):
            w.add(b"\0" if i == 5 else make_value(i, 0, 300 + 10 * i), i % 3)
    packed = sc.PackedStore(tmp_path / "z.shc")
    store = AnswerStore(packed, answer)
    ids = [0, 5, 7, 5]
    want = packed.read_many(ids)
    r = TierChain([], store).read([0, 5, 7])
    assert r.values == want[:3] and all(type(v) is bytes for v in r.values)
    for cache in (None, cache_factory(N, capacity=1 << 20)):
        ds = sc.CachedDataset(store, cache)
        for _ in range(2):   # misses, then (with a cache) hits
            assert [bytes(x.numpy()) for x, _, _ in ds.__getitems__(ids)] == want
        batch = next(iter(sc.CachedLoader(ds, batch_size=4, sampler=ids, num_workers=0)))
        assert [bytes(x.numpy()) for x in batch[0].tolist()] == want    # a RaggedBatch


@pytest.mark.parametrize("answer, message", [
    (lambda ids, values: values[:-1], r"store AnswerStore answered 2 values for 3 ids"),
    (lambda ids, values: values + [b"x"], r"store AnswerStore answered 4 values for 3 ids"),
    (lambda ids, values: [None if i == 7 else v for i, v in zip(np.asarray(ids).tolist(), values)],
     r"store AnswerStore has no value for sample id 7"),
    (lambda ids, values: ["text"] * len(values), r"store AnswerStore answered a str for sample id 0"),
], ids=["fewer", "more", "none", "str"])
def test_a_store_answering_against_the_protocol_is_refused_naming_it(store, cache_factory, answer, message):
    bad = AnswerStore(store, answer)
    with pytest.raises((ValueError, TypeError), match=message):
        TierChain([], bad).read([0, 5, 7])
    # no reader hands out an empty or wrong sample in its place, and nothing is admitted
    cache = cache_factory(N, capacity=1 << 20)
    for ds in (sc.CachedDataset(bad, None), sc.CachedDataset(bad, cache)):
        with pytest.raises((ValueError, TypeError), match=message):
            ds.__getitems__([0, 5, 7])
    assert not cache.cached_mask().any()


def test_a_tier_answering_another_count_is_refused_naming_it(store):
    class Short(EvenPeer):
        def read_many(self, ids):
            return super().read_many(ids)[1:]
    with pytest.raises(ValueError, match=r"tier 'peer' \(Short\) answered 1 values for 2 ids"):
        TierChain.for_node(store, peer=Short(store)).read([0, 2, 3])
