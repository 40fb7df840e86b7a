"""The extent order (shadecache/sampling/extents.py): the epoch's draw, arranged so that its
misses come a few disk extents at a time; the draw itself, the cache's first place and the ranks'
shares are unchanged; "auto" picks it where the store is IOPS-bound."""
import numpy as np
import pytest

import shadecache as sc
from shadecache.sampling.extents import ExtentLayout, arrange

from conftest import CLOUD_DEVICE as CLOUD  # noqa: E402


@pytest.fixture
def store(cloud_store):
    return cloud_store


def _runs(ids, layout):
    """How many times the extent changes along `ids`."""
    e = layout.extent_of[ids]
    return int((e[1:] != e[:-1]).sum()) + 1


def test_arrange_keeps_the_ids_and_groups_them_by_window(store):
    layout = ExtentLayout.of_store(store, extent_bytes=64 << 10)
    assert abs(layout.extents - store.data_bytes / (64 << 10)) <= 1
    ids = np.random.default_rng(1).integers(0, len(store), 5000)      # repeats allowed
    rng = np.random.default_rng(2)
    out = arrange(ids, layout, window=1, rng=rng)
    assert np.array_equal(np.sort(out), np.sort(ids))
    # window 1: every extent's samples are consecutive
    assert _runs(out, layout) == np.unique(layout.extent_of[ids]).size
    # window 4: each run of 4 extents is a block; blocks differ between draws
    out4 = arrange(ids, layout, window=4, rng=np.random.default_rng(3))
    ext = layout.extent_of[out4]
    seen, blocks = set(), []
    for e in ext.tolist():
        if not blocks or e not in blocks[-1]:
            if blocks and len(blocks[-1]) < 4:
                blocks[-1].add(e)
            else:
                assert e not in seen, "an extent came back after its window"
                blocks.append({e})
            seen.add(e)
    assert not np.array_equal(out4, arrange(ids, layout, window=4, rng=np.random.default_rng(4)))


def test_the_sampler_draws_the_same_ids_in_extent_order(store):
    u = sc.ShadeSampler(store, order="uniform", seed=3)
    x = sc.ShadeSampler(store, order="extents", seed=3, extent_window=2, extent_bytes=64 << 10)
    assert u.order_kind == "uniform" and x.order_kind == "extents"
    a, b = np.fromiter(iter(u), np.int64), np.fromiter(iter(x), np.int64)
    assert np.array_equal(np.sort(a), np.sort(b)) and np.array_equal(np.sort(b), np.arange(len(store)))
    # a batch of 256 touches a handful of extents, not (nearly) one per sample
    layout = x.extents
    per_batch = [np.unique(layout.extent_of[b[k:k + 256]]).size for k in range(0, b.size, 256)]
    uniform = [np.unique(layout.extent_of[a[k:k + 256]]).size for k in range(0, a.size, 256)]
    assert 4 * max(per_batch) < min(uniform), (per_batch, uniform)
    # epochs differ, and the next epoch's order is what the sampler draws then
    nxt = x.next_epoch_order()
    x.end_epoch()
    c = np.fromiter(iter(x), np.int64)
    assert not np.array_equal(b, c) and np.array_equal(nxt, c)


def test_cached_samples_first_misses_in_extent_order(store, cache_factory):
    cache = cache_factory(len(store), capacity=4 << 20)
    for i in range(0, len(store), 3):
        cache.put(i, store.read(i))
    s = sc.ShadeSampler(store, cache=cache, order="extents", extent_window=1, rep_factor=0,
                        seed=1, pads=True)
    # cached first once there are scores (until then an epoch is the plain draw)
    s.update(np.arange(8), np.linspace(0.1, 1.0, 8))
    order = np.fromiter(iter(s), np.int64)
    cached = np.asarray(cache.cached_mask(), bool)
    k = int(cached[order].sum())
    assert cached[order[:k]].all() and not cached[order[k:]].any()
    misses = order[k:]
    assert _runs(misses, s.extents) == np.unique(s.extents.extent_of[misses]).size


def test_ranks_share_one_arrangement(store):
    ranks = [sc.ShadeSampler(store, order="extents", num_replicas=2, rank=r, seed=5) for r in (0, 1)]
    a, b = (np.fromiter(iter(r), np.int64) for r in ranks)
    both = np.empty(a.size + b.size, np.int64)
    both[0::2], both[1::2] = a, b
    assert np.array_equal(np.sort(both), np.arange(len(store)))
    one = sc.ShadeSampler(store, order="extents", seed=5)
    assert np.array_equal(both, np.fromiter(iter(one), np.int64))


def test_auto_picks_extents_where_the_store_is_iops_bound(store, tmp_path):
    assert store.iops_bound
    assert sc.ShadeSampler(store).order_kind == "extents"
    assert sc.ShadeSampler(len(store)).order_kind == "uniform"              # no store known
    assert sc.ShadeSampler(store, order="uniform").order_kind == "uniform"
    ds = sc.CachedDataset(store, None)
    assert sc.ShadeSampler(ds).order_kind == "extents"                      # the dataset's store
    with sc.PackedStore(store.path, device={"iops": 3000, "bandwidth": 3 << 20}) as fast_requests:
        assert not fast_requests.iops_bound
        assert sc.ShadeSampler(fast_requests).order_kind == "uniform"
    with pytest.raises(ValueError, match="needs the packed store"):
        sc.ShadeSampler(len(store), order="extents")
    with pytest.raises(ValueError, match="order must be"):
        sc.ShadeSampler(store, order="chunks")
    with pytest.raises(ValueError, match="extent_window"):
        sc.ShadeSampler(store, order="extents", extent_window=0)


def test_a_sampler_that_refuses_its_options_leaves_the_store_reading_as_before(store):
    """A constructor that raises changes nothing: the store does not start reading whole extents
    for an extent order that never came to be (every later reader of it would pay for them)."""
    for bad in ({"extent_window": 0}, {"smoothing": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            sc.ShadeSampler(store, order="extents", extent_bytes=64 << 10, **bad)
        assert store.extent_layout is None and store.extent_mates([0]).size == 0


def test_a_store_that_is_not_packed_gives_the_uniform_order_or_says_so(tmp_path):
    """store= a FolderStore (no disk order): "auto" is the uniform order, "extents" a clear
    ValueError, as for a data source without a packed store behind it."""
    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    for j in range(5):
        (root / "a" / f"{j}.bin").write_bytes(bytes([j]) * 100)
    folder = sc.FolderStore(root)
    assert sc.ShadeSampler(len(folder), store=folder).order_kind == "uniform"
    with pytest.raises(ValueError, match="needs the packed store"):
        sc.ShadeSampler(len(folder), store=folder, order="extents")


def test_ranks_arrange_alike_whatever_device_each_measured(store, tmp_path):
    """Two real ranks (gloo): each opens the store and measures the device itself, and the default
    extent size and "auto"'s choice come from that measurement. The ranks' shares are positions
    of one arranged sequence, so they must agree on both, or the epoch trains some samples twice
    and others never."""
    import torch.multiprocessing as tmp_mp
    from node_ranks import arrange_on_rank

    tmp_mp.spawn(arrange_on_rank, args=(2, str(tmp_path / "rdzv"), store.path, str(tmp_path)),
                 nprocs=2, join=True)
    for case in ("extent size", "auto"):
        both = np.concatenate([np.load(tmp_path / f"{case}-{r}.npy") for r in (0, 1)])
        assert np.array_equal(np.sort(both), np.arange(len(store))), case


def test_the_cache_is_given_one_score_per_extent_and_extents_it_holds_whole_score_higher(store):
    """Under the extent order a cached sample saves a read only while its whole extent is held,
    so every sample of an extent gets the mean of the extent's scores; the extents the cache
    holds whole score one standard deviation of the means higher, so a newcomer takes the
    place of one only where it scores clearly higher (the means of random handfuls of samples
    differ mostly by noise)."""
    layout = ExtentLayout.of_store(store, 64 << 10)
    rng = np.random.default_rng(4)
    scores = rng.random(len(store))
    members, shared = layout.shared_scores(np.arange(len(store)), scores)
    assert np.array_equal(np.sort(members), np.arange(len(store)))
    mean = np.bincount(layout.extent_of, weights=scores) / np.bincount(layout.extent_of)
    assert np.allclose(shared, mean[layout.extent_of[members]])
    cached = np.zeros(len(store), dtype=bool)
    whole, part = layout.by_extent[layout.first[0]:layout.first[1]], \
        layout.by_extent[layout.first[1]:layout.first[2]]
    cached[whole] = True
    cached[part[:-1]] = True                      # all but one sample of extent 1
    ids, bonus = layout.shared_scores(whole[:1].tolist() + part[:1].tolist(), scores, cached)
    by_id = dict(zip(ids.tolist(), bonus.tolist()))
    assert by_id[int(whole[0])] == pytest.approx(mean[0] + np.std(mean))
    assert by_id[int(part[0])] == pytest.approx(mean[1])
    assert len(ids) == whole.size + part.size     # every member of the two extents


def test_the_stall_planner_defers_nothing_under_the_extent_order(store, cache_factory):
    """A live prefetcher leaves a full cache's misses to the loader under the extent order (its
    reads are whole extents already), so the planner does not count on it: a miss deferred out
    of its extent's window is read apart from its extent."""
    import os

    from shadecache.lookahead.board import OrderBoard
    from shadecache.sampling.stalls import StallView

    cache = cache_factory(len(store), capacity=1 << 20, policy="importance")
    with OrderBoard.create(cache.name, len(store)) as board:
        try:
            board.set_prefetcher(os.getpid())        # a live process registered as prefetcher
            ds = sc.CachedDataset(store, cache)
            uniform = sc.ShadeSampler(ds, cache=cache, order="uniform")
            assert StallView(uniform, ds).prefetching()
            extents = sc.ShadeSampler(ds, cache=cache, order="extents", extent_bytes=64 << 10)
            assert not StallView(extents, ds).prefetching()
        finally:
            board.set_prefetcher(0)
            board.unlink()


def test_a_resume_mid_epoch_gives_the_cache_the_extent_scores_of_the_last_end_epoch(
        store, cache_factory):
    """Under the extent order the cache keeps the extent scores of the last end_epoch for the
    whole epoch (what update() gives mid-epoch is this rank's alone and moves as an extent is
    trained): a sampler resumed mid-epoch (load_state_dict) gives it those same scores, not
    ones with this rank's unmerged losses of the epoch folded in, which differ between ranks."""
    cache = cache_factory(len(store), capacity=1 << 20, policy="importance")
    kw = dict(cache=cache, order="extents", extent_bytes=64 << 10, batch_size=64, seed=5)
    sampler = sc.ShadeSampler(store, **kw)
    rng = np.random.default_rng(6)
    ids = np.arange(len(store))
    for k in range(0, ids.size, 64):
        sampler.update(ids[k:k + 64], rng.random(ids[k:k + 64].size))
    sampler.end_epoch()
    folded = np.asarray(cache.scores(), dtype=np.float64).copy()
    assert np.ptp(folded) > 0
    part = rng.permutation(len(store))[:640]
    for k in range(0, part.size, 64):
        sampler.update(part[k:k + 64], 10 * rng.random(64))
    assert np.array_equal(np.asarray(cache.scores(), dtype=np.float64), folded)
    state = sampler.state_dict()
    resumed = sc.ShadeSampler(store, **kw)
    resumed.load_state_dict(state)
    assert np.array_equal(np.asarray(cache.scores(), dtype=np.float64), folded)


def test_an_id_outside_the_data_set_is_named_by_the_extent_layout():
    layout = ExtentLayout(np.arange(10), np.full(10, 100), 250)
    assert layout.widen([0, 9]).tolist() == [0, 1, 2, 8, 9]
    for bad in (10, -1):
        with pytest.raises(IndexError, match=f"sample id {bad} is out of range 0..9"):
            layout.widen([3, bad])
