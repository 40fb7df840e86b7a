"""The extent order (shadecache/sampling/extents.py): the epoch's draw, arranged so that its
misses come a few disk extents at a time, under the node's extent plan (shadecache/read_plan.py);
the draw itself, the cache's first place and the ranks' shares are unchanged; "auto" picks the
extent plan where the store is IOPS-bound."""
import numpy as np
import pytest

import shadecache as sc
from shadecache.read_plan import ExtentLayout, ReadPlan
from shadecache.sampling.extents import arrange

from conftest import CLOUD_DEVICE as CLOUD  # noqa: E402


@pytest.fixture
def store(cloud_store):
    return cloud_store


def sampler(store, plan, cache=None, **options):
    """A ShadeSampler over a node of `store` (and `cache`) read by `plan`."""
    node = sc.Node(store, cache, read_plan=plan, read_ahead=False)
    return sc.ShadeSampler(node.dataset(), **options)


def _runs(ids, layout):
    """How many times the extent changes along `ids`."""
    e = layout.extent_of[ids]
    return int((e[1:] != e[:-1]).sum()) + 1


def test_arrange_keeps_the_ids_and_groups_them_by_window(store):
    layout = ReadPlan.of_extents(store, extent_bytes=64 << 10).layout
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
    u = sampler(store, "samples", seed=3)
    x = sampler(store, ReadPlan.of_extents(store, 64 << 10, window=2), seed=3)
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
    s = sampler(store, ReadPlan.of_extents(store, window=1), cache, rep_factor=0, seed=1, pads=True)
    # cached first once there are scores (until then an epoch is the plain draw)
    s.update(np.arange(8), np.linspace(0.1, 1.0, 8))
    order = np.fromiter(iter(s), np.int64)
    cached = np.asarray(cache.cached_mask(), bool)
    k = int(cached[order].sum())
    assert cached[order[:k]].all() and not cached[order[k:]].any()
    misses = order[k:]
    assert _runs(misses, s.extents) == np.unique(s.extents.extent_of[misses]).size


def test_ranks_share_one_arrangement(store):
    ranks = [sampler(store, "extents", num_replicas=2, rank=r, seed=5) for r in (0, 1)]
    a, b = (np.fromiter(iter(r), np.int64) for r in ranks)
    both = np.empty(a.size + b.size, np.int64)
    both[0::2], both[1::2] = a, b
    assert np.array_equal(np.sort(both), np.arange(len(store)))
    one = sampler(store, "extents", seed=5)
    assert np.array_equal(both, np.fromiter(iter(one), np.int64))


def test_auto_picks_extents_where_the_store_is_iops_bound(store, tmp_path):
    assert store.iops_bound
    assert sc.Node(store, None, read_ahead=False).read_plan.kind == "extents"
    assert sc.ShadeSampler(len(store)).order_kind == "uniform"              # no node: no plan
    assert sampler(store, "samples").order_kind == "uniform"
    assert sampler(store, "auto").order_kind == "extents"
    with sc.PackedStore(store.path, device={"iops": 3000, "bandwidth": 3 << 20}) as fast_requests:
        assert not fast_requests.iops_bound
        assert sc.Node(fast_requests, None, read_ahead=False).read_plan.kind == "samples"
    with pytest.raises(ValueError, match="read_plan must be"):
        sc.Node(store, None, read_plan="chunks")
    with pytest.raises(ValueError, match="window"):
        ReadPlan.of_extents(store, window=0)


def test_the_read_plan_is_immutable_and_leaves_the_store_as_it_was(store):
    """The plan is given to the node, never set on the store by a sampler: a store read by one
    node under the extent plan reads sample by sample for another (no side effect travels)."""
    plan = ReadPlan.of_extents(store, 64 << 10)
    extents = sc.Node(store, None, read_plan=plan, read_ahead=False)
    samples = sc.Node(store, None, read_plan="samples", read_ahead=False)
    sampler(store, plan)
    assert extents.chain.reads_extents and not samples.chain.reads_extents
    assert not hasattr(store, "extent_layout")
    with pytest.raises(ValueError):
        plan.layout.extent_of[0] = 1
    assert plan.state() == {"kind": "extents", "extent_bytes": 64 << 10, "window": 16}


def test_a_sampler_state_saved_under_another_read_plan_is_refused(store):
    """The order is a function of the read plan: a checkpoint drawn under one plan does not
    resume under another as if it were the same order."""
    state = sampler(store, "extents", seed=3).state_dict()
    assert state["read_plan"]["kind"] == "extents"
    with pytest.raises(ValueError, match="read plan"):
        sampler(store, "samples", seed=3).load_state_dict(state)
    sampler(store, "extents", seed=3).load_state_dict(state)


def test_a_measured_choice_is_remembered_on_the_node(store, tmp_path, monkeypatch):
    """"auto" from a measurement is kept (this user's file, 0600) and taken by the next process
    over the same data on the same device, whatever that process measures; a given device
    profile is never overruled by it."""
    import os

    from shadecache import read_plan

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    class Measured:
        """The store as a process that measured it sees it (its own figures)."""
        def __init__(self, store, bandwidth):
            self._s, self.path = store, store.path
            self.device = {"iops": 3000.0, "bandwidth": float(bandwidth), "source": "measured (O_DIRECT)"}
            self.gap_bytes = int(self.device["bandwidth"] / self.device["iops"])
            self.iops_bound = 4 * store.data_bytes / len(store) < self.gap_bytes
            self.fingerprint, self.lengths = store.fingerprint, store.lengths

        def disk_order(self):
            return self._s.disk_order()

    first = read_plan.choose(Measured(store, 200 << 20))
    assert first.kind == "extents"
    files = os.listdir(tmp_path / "xdg" / "shadecache" / "read_plans")
    assert len(files) == 1
    st = os.stat(tmp_path / "xdg" / "shadecache" / "read_plans" / files[0])
    assert st.st_mode & 0o777 == 0o600
    again = read_plan.choose(Measured(store, 3 << 20))        # this process measured otherwise
    assert again.kind == "extents" and again.extent_bytes == first.extent_bytes
    assert "chosen on this node" in again.reason


def test_a_store_that_is_not_packed_gives_the_samples_plan_or_says_so(tmp_path):
    """A FolderStore (no disk order): "auto" is the samples plan, "extents" a clear ValueError."""
    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    for j in range(5):
        (root / "a" / f"{j}.bin").write_bytes(bytes([j]) * 100)
    folder = sc.FolderStore(root)
    assert sc.Node(folder, None, read_ahead=False).read_plan.kind == "samples"
    with pytest.raises(ValueError, match="needs a packed store"):
        sc.Node(folder, None, read_plan="extents")


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
    layout = ReadPlan.of_extents(store, 64 << 10).layout
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
    """A live prefetcher leaves a full cache's misses to the loader under the extent plan (its
    reads are whole extents already) and says so on the board, so the planner does not count on
    it: a miss deferred out of its extent's window is read apart from its extent."""
    import os

    from shadecache.lookahead.board import READS_EVERY_MISS, READS_UNTIL_FULL, OrderBoard
    from shadecache.sampling.stalls import StallView

    cache = cache_factory(len(store), capacity=1 << 20, policy="importance")
    with OrderBoard.create(cache.name, len(store)) as board:
        try:
            board.control.set_prefetcher(os.getpid())        # a live process registered as prefetcher
            board.control.set_read_rule(READS_EVERY_MISS, 100)   # what a prefetcher without an SSD tier says
            uniform = sampler(store, "samples", cache)
            assert StallView(uniform, uniform._source).prefetching()
            board.control.set_read_rule(READS_UNTIL_FULL, 100)   # ... and one under the extent plan
            extents = sampler(store, ReadPlan.of_extents(store, 64 << 10), cache)
            assert not StallView(extents, extents._source).prefetching()
        finally:
            board.control.set_prefetcher(0)
            board.unlink()


def test_a_resume_mid_epoch_gives_the_cache_the_extent_scores_of_the_last_end_epoch(
        store, cache_factory):
    """Under the extent order the cache keeps the extent scores of the last end_epoch for the
    whole epoch (what update() gives mid-epoch is this rank's alone and moves as an extent is
    trained): a sampler resumed mid-epoch (load_state_dict) gives it those same scores, not
    ones with this rank's unmerged losses of the epoch folded in, which differ between ranks."""
    cache = cache_factory(len(store), capacity=1 << 20, policy="importance")
    plan = ReadPlan.of_extents(store, 64 << 10)
    kw = dict(batch_size=64, seed=5)
    first = sampler(store, plan, cache, **kw)
    rng = np.random.default_rng(6)
    ids = np.arange(len(store))
    for k in range(0, ids.size, 64):
        first.update(ids[k:k + 64], rng.random(ids[k:k + 64].size))
    first.end_epoch()
    folded = np.asarray(cache.scores(), dtype=np.float64).copy()
    assert np.ptp(folded) > 0
    part = rng.permutation(len(store))[:640]
    for k in range(0, part.size, 64):
        first.update(part[k:k + 64], 10 * rng.random(64))
    assert np.array_equal(np.asarray(cache.scores(), dtype=np.float64), folded)
    state = first.state_dict()
    resumed = sampler(store, plan, cache, **kw)
    resumed.load_state_dict(state)
    assert np.array_equal(np.asarray(cache.scores(), dtype=np.float64), folded)


def test_an_id_outside_the_data_set_is_named_by_the_extent_layout():
    layout = ExtentLayout(np.arange(10), np.full(10, 100), 250)
    assert layout.widen([0, 9]).tolist() == [0, 1, 2, 8, 9]
    for bad in (10, -1):
        with pytest.raises(IndexError, match=f"sample id {bad} is out of range 0..9"):
            layout.widen([3, bad])
