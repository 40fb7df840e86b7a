"""ShadeSampler: determinism, importance, coverage floor, PADS + substitution against a real Cache,
score mapping through a real DataLoader, resume, and DDP shares with 2 real gloo ranks."""
import math
import os
import uuid

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp_mp
from torch.utils.data import DataLoader, Dataset

import shadecache as sc
from shadecache.sampling.importance import rank_weights


# SHADE's draw by scores, cached samples first, without a substitution budget (ShadeSampler's
# defaults draw a permutation and keep its order): the tests of SHADE's algorithm use it by name
SHADE_DRAW = dict(temper=1.0, substitute=None, pads=True)


def shade(*args, **kw):
    return sc.ShadeSampler(*args, **{**SHADE_DRAW, **kw})


def scored(s):
    """The sampler with scores (one update), so that it orders and repeats against the cache:
    without scores an epoch is a plain permutation."""
    s.update([0, 1], [0.5, 1.0])
    return s


def drain(sampler):
    return np.fromiter(iter(sampler), dtype=np.int64)


def test_same_seed_same_order_other_seed_other_order():
    a = drain(sc.ShadeSampler(200, seed=7))
    b = drain(sc.ShadeSampler(200, seed=7))
    c = drain(sc.ShadeSampler(200, seed=8))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.size == 200 and a.min() >= 0 and a.max() < 200
    s = sc.ShadeSampler(200, seed=7)
    s.set_epoch(1)
    assert not np.array_equal(drain(s), a)     # epochs differ
    u = sc.ShadeSampler(200, seed=7, importance=False)
    assert sorted(drain(u).tolist()) == list(range(200))   # uniform baseline: a permutation
    d = sc.ShadeSampler(200, seed=7)
    d.table.base[:] = np.linspace(1.0, 5.0, 200)           # defaults: a permutation whatever the scores
    assert sorted(drain(d).tolist()) == list(range(200))


def test_draw_follows_the_scores_with_replacement():
    n = 4
    s = shade(n, batch_size=2, seed=1, coverage_epochs=0, epoch_size=40_000,
                        draw="multinomial")
    s.table.base[:] = [1.0, 1.0, 1.0, 5.0]
    counts = np.bincount(drain(s), minlength=n) / 40_000
    assert counts == pytest.approx([0.125, 0.125, 0.125, 0.625], abs=0.01)
    assert counts.tolist() != [0.125, 0.125, 0.125, 0.625]     # multinomial: random counts


def test_systematic_draw_gives_each_sample_floor_or_ceil_of_its_share():
    n, total = 50, 300
    rng = np.random.default_rng(0)
    scores = rng.uniform(0.5, 3.0, n)
    for epoch in range(5):
        s = shade(n, seed=9, coverage_epochs=0, epoch_size=total)
        s.set_epoch(epoch)
        s.table.base[:] = scores
        counts = np.bincount(drain(s), minlength=n)
        expect = total * scores / scores.sum()
        assert counts.sum() == total
        assert ((counts == np.floor(expect)) | (counts == np.ceil(expect))).all()
    # equal scores (the first epoch, before any loss): every sample exactly once
    s = sc.ShadeSampler(n, seed=9)
    assert sorted(drain(s).tolist()) == list(range(n))
    with pytest.raises(ValueError, match="draw must be"):
        sc.ShadeSampler(n, draw="poisson")


def test_coverage_floor_draws_every_sample_every_k_epochs():
    n = 300
    for k in (2, 3):
        s = shade(n, seed=0, coverage_epochs=k)
        seen_by_epoch = []
        for epoch in range(7):
            s.set_epoch(epoch)
            s.table.base[:] = 1e-6
            s.table.base[:10] = 1.0          # ten samples hold almost all the weight
            seen = np.zeros(n, dtype=bool)
            seen[drain(s)] = True
            seen_by_epoch.append(seen)
            s.end_epoch()
        for e in range(k - 1, 7):
            window = np.logical_or.reduce(seen_by_epoch[e - k + 1:e + 1])
            assert window.all(), f"K={k}: {int((~window).sum())} samples unseen in epochs " \
                                 f"{e - k + 1}..{e}"
        assert s.coverage()["not_seen_in_window"] == 0
    # without the floor the same scores starve most samples
    off = shade(n, seed=0, coverage_epochs=0)
    for epoch in range(3):
        off.set_epoch(epoch)
        off.table.base[:] = 1e-6
        off.table.base[:10] = 1.0
        drain(off)
        off.end_epoch()
    assert off.coverage()["last"] < 0.1


def test_pads_puts_cached_first_and_substitutes_misses(cache_factory):
    n = 400
    cache = cache_factory(n)
    cached = np.arange(0, n, 4)                    # a quarter of the ids
    cache.put_many(cached, [b"x" * 8] * cached.size)
    mask = cache.cached_mask()
    assert mask.sum() == cached.size
    plain = scored(shade(n, cache=cache, seed=3, rep_factor=0.0, coverage_epochs=0))
    o0 = drain(plain)
    hits0 = int(mask[o0].sum())
    assert mask[o0[:hits0]].all() and not mask[o0[hits0:]].any()   # hits first, then misses
    for rep in (1.0, 2.0, 0.5):
        s = scored(shade(n, cache=cache, seed=3, rep_factor=rep, coverage_epochs=0))
        o = drain(s)
        assert o.size == n
        hits = int(mask[o].sum())
        assert mask[o[:hits]].all() and not mask[o[hits:]].any()
        sub = s.last_epoch_stats["substituted"]
        assert hits == hits0 + sub
        assert sub == min(n - hits0, round(rep * hits0)) or (rep == 0.5 and abs(sub - rep * hits0) <= 1)
        # the misses left are a sub-multiset of the misses drawn; nothing new appears
        left = np.bincount(o[~mask[o]], minlength=n)
        drawn = np.bincount(o0[~mask[o0]], minlength=n)
        assert (left <= drawn).all()


def test_forced_samples_are_never_substituted(cache_factory):
    n = 200
    cache = cache_factory(n)
    cache.put_many(np.arange(100), [b"y"] * 100)   # half cached
    s = shade(n, cache=cache, seed=5, rep_factor=3.0, coverage_epochs=2)
    for arr in (s.table.base, s.table.scores):  # base: what the draw uses; scores: what end_epoch folds
        arr[:] = 1e-6
        arr[:100] = 1.0                          # the draw lands on cached ids only
    seen = np.zeros(n, dtype=bool)
    for epoch in range(2):
        s.set_epoch(epoch)
        o = drain(s)
        seen[o] = True
        if epoch == 1:
            forced = s._forced
            assert forced.size > 0
            assert np.isin(forced, o).all()
        s.end_epoch()
    assert seen.all()                               # floor of 2 epochs held despite rep 3


class IdEncodedData(Dataset):
    """Sample i is the tensor [i]; its "loss" is a function of the CONTENT, not of the index."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), 0, i


def content_loss(x):
    v = x[:, 0]
    return (v * 7919.0) % 101.0      # scrambles the order: loss rank != id rank


@pytest.mark.parametrize("workers", [0, 2])
def test_score_goes_to_the_sample_whose_loss_produced_it(cache_factory, workers):
    n, b = 96, 8
    cache = cache_factory(n)
    cache.put_many(np.arange(0, n, 3), [b"z"] * len(range(0, n, 3)))
    s = shade(n, cache=cache, batch_size=b, seed=11, rep_factor=1.0)
    s.table.base[0] += 1e-3      # scores exist (barely): the epoch is reordered against the cache
    loader = DataLoader(IdEncodedData(n), batch_size=b, sampler=s, num_workers=workers)
    expected_sum = np.zeros(n)
    expected_cnt = np.zeros(n)
    for x, _, idx in loader:
        losses = content_loss(x)
        s.update(idx, losses)
        ids = x[:, 0].long().numpy()          # who produced each loss, read from the content
        np.add.at(expected_sum, ids, rank_weights(losses.numpy()))
        np.add.at(expected_cnt, ids, 1)
    seen = expected_cnt > 0
    # epoch 0 blends with a = 1: each seen id's score is exactly the mean weight of its own losses
    assert np.allclose(s.scores[seen], expected_sum[seen] / expected_cnt[seen])
    assert np.allclose(s.scores[~seen], s.table.base[~seen])
    assert np.allclose(cache.scores()[seen], (expected_sum[seen] / expected_cnt[seen]), atol=1e-5)
    # SHADE's public sampler wrote batch k's weights to positions k*b..k*b+b-1 of the raw draw,
    # taken before PADS reordered it: that puts most scores on other samples
    raw, _ = s.global_draw()
    order = s.order()
    assert not np.array_equal(raw, order)
    shade_sum = np.zeros(n)
    shade_cnt = np.zeros(n)
    for k in range(0, n, b):
        w = rank_weights(content_loss(torch.tensor(order[k:k + b], dtype=torch.float32)[:, None]))
        np.add.at(shade_sum, raw[k:k + b], w)
        np.add.at(shade_cnt, raw[k:k + b], 1)
    both = seen & (shade_cnt > 0)
    wrong = ~np.isclose(shade_sum[both] / shade_cnt[both], expected_sum[both] / expected_cnt[both])
    assert wrong.mean() > 0.5


def run_epochs(s, n_epochs, b, stop_after=None):
    """Drive a sampler like a training loop; returns the ids in order. stop_after=(epoch, batches)
    returns early with the state at that point."""
    out = []
    for epoch in range(s.epoch, n_epochs):
        s.set_epoch(epoch)
        order = drain(s)
        for k in range(0, order.size, b):
            if stop_after == (epoch, k // b):
                return out
            ids = order[k:k + b]
            out.append(ids)
            s.update(ids, content_loss(torch.tensor(ids, dtype=torch.float32)[:, None]))
        s.end_epoch()
    return out


def test_resume_mid_epoch_reproduces_order_and_scores():
    n, b = 120, 10
    ref = shade(n, batch_size=b, seed=4)
    full = run_epochs(ref, 4, b)
    first = shade(n, batch_size=b, seed=4)
    part = run_epochs(first, 4, b, stop_after=(2, 5))
    state = first.state_dict()
    resumed = shade(n, batch_size=b, seed=4)
    resumed.load_state_dict(state)
    rest = run_epochs(resumed, 4, b)
    got = np.concatenate(part + rest)
    assert np.array_equal(got, np.concatenate(full))
    assert np.array_equal(resumed.scores, ref.scores)
    assert resumed.coverage() == ref.coverage()
    with pytest.raises(ValueError, match="state is for 120 samples"):
        sc.ShadeSampler(121).load_state_dict(state)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rep_factor"):
        sc.ShadeSampler(10, rep_factor=-1)
    with pytest.raises(ValueError, match="rank 2"):
        sc.ShadeSampler(10, num_replicas=2, rank=2)
    s = sc.ShadeSampler(10)
    with pytest.raises(IndexError, match="sample id 10"):
        s.update(torch.tensor([1, 10]), torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="2 sample ids but 1 losses"):
        s.update(torch.tensor([1, 2]), torch.tensor([0.1]))


# ---- DDP: two real processes, gloo over loopback (a file rendezvous) ----------------------------
def _ddp_worker(rank, world, init_file, out_dir, n, b, epochs, cache_name):
    import torch.distributed as dist
    from node_ranks import join_node, leave_node
    # both ranks on this node share one cache: rank 0 creates it, rank 1 attaches
    cache = join_node(rank, world, init_file, cache_name, num_samples=n,
                      capacity_bytes=1 << 20, policy="lru")
    s = shade(n, cache=cache, batch_size=b, seed=21, coverage_epochs=2, rep_factor=0.0)
    assert (s.num_replicas, s.rank) == (world, rank)
    for epoch in range(epochs):
        s.set_epoch(epoch)
        share = drain(s)
        raw, _ = s.global_draw()
        np.save(os.path.join(out_dir, f"share-{rank}-{epoch}.npy"), share)
        np.save(os.path.join(out_dir, f"raw-{rank}-{epoch}.npy"), raw)
        for k in range(0, share.size, b):
            ids = share[k:k + b]
            s.update(ids, content_loss(torch.tensor(ids, dtype=torch.float32)[:, None]))
        s.end_epoch()
        np.save(os.path.join(out_dir, f"scores-{rank}-{epoch}.npy"), s.scores)
    dist.barrier()
    np.save(os.path.join(out_dir, f"cache-scores-{rank}.npy"), cache.scores())
    leave_node(rank, cache)


def test_ddp_two_ranks_share_the_draw_and_merge_scores(tmp_path):
    n, b, world, epochs = 101, 5, 2, 3
    name = f"sc-test-ddp-{uuid.uuid4().hex[:10]}"
    tmp_mp.spawn(_ddp_worker, args=(world, str(tmp_path / "rdzv"), str(tmp_path), n, b, epochs,
                                    name), nprocs=world, join=True)
    ref = shade(n, batch_size=b, seed=21, coverage_epochs=2)   # one process, same draws
    seen = np.zeros(n, dtype=bool)
    for epoch in range(epochs):
        shares = [np.load(tmp_path / f"share-{r}-{epoch}.npy") for r in range(world)]
        raws = [np.load(tmp_path / f"raw-{r}-{epoch}.npy") for r in range(world)]
        assert np.array_equal(raws[0], raws[1])              # every rank draws the same
        assert all(sh.size == math.ceil(n / world) for sh in shares)
        # together the shares are exactly the global draw (each rank a shuffled stride of it)
        together = np.sort(np.concatenate(shares))
        assert np.array_equal(together, np.sort(raws[0]))
        for r in range(world):
            assert np.array_equal(np.sort(shares[r]), np.sort(raws[0][r::world]))
        for sh in shares:
            seen[sh] = True
        # the merged scores equal one table fed every rank's batches
        ref.set_epoch(epoch)
        for sh in shares:
            for k in range(0, sh.size, b):
                ids = sh[k:k + b]
                ref.update(ids, content_loss(torch.tensor(ids, dtype=torch.float32)[:, None]))
        ref._order = np.concatenate(shares)
        ref.end_epoch()
        s0 = np.load(tmp_path / f"scores-0-{epoch}.npy")
        s1 = np.load(tmp_path / f"scores-1-{epoch}.npy")
        assert np.array_equal(s0, s1)
        assert np.allclose(s0, ref.scores)
    assert seen.all()        # coverage floor of 2 epochs holds across ranks
    # the shared cache's score table holds the merged scores, as both ranks see it
    for r in range(world):
        assert np.allclose(np.load(tmp_path / f"cache-scores-{r}.npy"), ref.scores, atol=1e-5)


def test_ranks_draw_the_same_global_order_even_without_end_epoch():
    """Two ranks that saw different losses and only call set_epoch (the DistributedSampler
    habit, no end_epoch) still draw from the same weights (those of the last end_epoch), so
    their shares stay disjoint halves of one draw; the missing end_epoch is warned about."""
    n = 400
    ranks = [shade(n, seed=3, num_replicas=2, rank=r, coverage_epochs=0) for r in (0, 1)]
    rng = np.random.default_rng(0)
    for s in ranks:
        s.set_epoch(0)
        order = drain(s)
        for k in range(0, len(order), 50):  # each rank's own losses: its live scores diverge
            ids = order[k:k + 50]
            s.update(ids, rng.random(ids.size))
    assert not np.array_equal(ranks[0].scores, ranks[1].scores)
    for s in ranks:
        with pytest.warns(RuntimeWarning, match="without end_epoch"):
            s.set_epoch(1)
    a, b = drain(ranks[0]), drain(ranks[1])
    g, _ = ranks[0].global_draw()
    assert np.array_equal(np.sort(np.concatenate([a, b])), np.sort(g))


# ---- tempering, the substitution budget, unbiased weights ----------------------------
def test_temper_mixes_the_scores_toward_uniform():
    n, total = 40, 4000
    scores = np.linspace(1.0, 5.0, n)
    s0 = sc.ShadeSampler(n, seed=2, temper=0.0, coverage_epochs=0)
    s0.table.base[:] = scores
    assert s0.draw_probabilities() is None
    assert sorted(drain(s0).tolist()) == list(range(n))       # temper 0: a permutation
    for t in (0.5, 1.0):
        s = sc.ShadeSampler(n, seed=2, temper=t, coverage_epochs=0, epoch_size=total)
        s.table.base[:] = scores
        p = (1 - t) / n + t * scores / scores.sum()
        assert s.draw_probabilities() == pytest.approx(p)
        counts = np.bincount(drain(s), minlength=n)
        assert ((counts == np.floor(total * p)) | (counts == np.ceil(total * p))).all()
    with pytest.raises(ValueError, match="temper"):
        sc.ShadeSampler(n, temper=1.5)
    with pytest.raises(ValueError, match="substitute"):
        sc.ShadeSampler(n, substitute=-0.1)


def test_substitution_budget_caps_the_repeats(cache_factory):
    n = 400
    cache = cache_factory(n)
    cache.put_many(np.arange(0, n, 4), [b"x" * 8] * (n // 4))  # a quarter cached
    mask = cache.cached_mask()
    for budget in (0.0, 0.05, 0.1):
        s = scored(sc.ShadeSampler(n, cache=cache, seed=3, rep_factor=2.0, substitute=budget,
                                   importance=False, coverage_epochs=0, pads=True))
        o = drain(s)
        assert o.size == n
        assert s.last_epoch_stats["substituted"] == int(budget * n)
        assert np.unique(o).size == n - int(budget * n)       # distinct = all but the repeats
        hits = int(mask[o].sum())
        assert mask[o[:hits]].all() and hits == n // 4 + int(budget * n)
    # the per-cached-draw cap still applies below the budget
    s = scored(sc.ShadeSampler(n, cache=cache, seed=3, rep_factor=0.1, substitute=0.5,
                               importance=False, coverage_epochs=0))
    drain(s)
    assert abs(s.last_epoch_stats["substituted"] - 0.1 * n // 4) <= 1


def test_weights_are_one_over_n_p_f_and_average_one(cache_factory):
    n = 300
    scores = np.random.default_rng(1).uniform(2.3, 4.3, n)
    # uniform epoch, no cache: every weight is 1
    u = sc.ShadeSampler(n, seed=1, importance=False)
    assert np.array_equal(u.weights(np.arange(n)), np.ones(n, dtype=np.float32))
    # importance draw, no cache: 1 / (N p)
    s = shade(n, seed=1, coverage_epochs=0)
    s.table.base[:] = scores
    p = scores / scores.sum()
    o = drain(s)
    w = s.weights(o)
    assert w == pytest.approx(1.0 / (n * p[o]), rel=1e-5)
    assert w.mean() == pytest.approx(1.0, abs=0.02)           # E_p[1/(Np)] = 1
    t = s.weights(torch.from_numpy(o[:8]).view(2, 4))         # tensors in, tensor out, same shape
    assert isinstance(t, torch.Tensor) and t.shape == (2, 4) and t.dtype == torch.float32
    # with substitution: cached ids weigh 1/(1 + k/h), misses 1/(1 - k/m)
    cache = cache_factory(n)
    cached = np.arange(0, n, 5)
    cache.put_many(cached, [b"z" * 8] * cached.size)
    c = scored(sc.ShadeSampler(n, cache=cache, seed=1, importance=False, rep_factor=1.0,
                               substitute=0.1, coverage_epochs=0))
    o = drain(c)
    st = c.last_epoch_stats
    k, h, m = st["substituted"], st["cached_draws"], st["missed_draws"]
    assert k > 0
    assert c.weights(cached) == pytest.approx(np.full(cached.size, 1 / (1 + k / h)), rel=1e-5)
    miss = np.setdiff1d(np.arange(n), cached)
    assert c.weights(miss) == pytest.approx(np.full(miss.size, 1 / (1 - k / m)), rel=1e-5)
    assert c.weights(o).sum() == pytest.approx(n, rel=0.05)
    with pytest.raises(IndexError, match="sample id 300"):
        c.weights([0, 300])


def test_weights_deterministic_rank_consistent_and_resume_safe(cache_factory):
    n, b = 120, 10
    scores = np.random.default_rng(5).uniform(2.3, 4.3, n)

    def make(**kw):
        s = sc.ShadeSampler(n, batch_size=b, seed=4, temper=0.5, **kw)
        s.table.base[:] = scores
        return s
    a, b2 = make(), make()
    assert np.array_equal(a.weights(np.arange(n)), b2.weights(np.arange(n)))
    # ranks hold the same merged scores: the same id gets the same weight on every rank
    r0, r1 = make(num_replicas=2, rank=0), make(num_replicas=2, rank=1)
    assert np.array_equal(r0.weights(np.arange(n)), r1.weights(np.arange(n)))
    # resume: the weights of the interrupted epoch come back even if the cache changed since
    cache = cache_factory(n)
    cache.put_many(np.arange(30), [b"q"] * 30)
    s = make(cache=cache, rep_factor=1.0)
    drain(s)
    before = s.weights(np.arange(n))
    state = s.state_dict()
    cache.put_many(np.arange(30, 90), [b"q"] * 60)            # the cache moves on
    r = make(cache=cache, rep_factor=1.0)
    r.load_state_dict(state)
    assert np.array_equal(r.weights(np.arange(n)), before)
    assert np.array_equal(r.order(), s.order())


def test_next_epoch_order_is_the_next_epochs_draw_when_nothing_learned_can_change_it(cache_factory):
    """A uniform draw the cache does not rearrange is known an epoch ahead (the order board shows
    it to the prefetcher); any draw that depends on the scores or on what is cached is
    not, and asking changes nothing in the sampler."""
    n = 300
    cache = cache_factory(n)
    cache.put_many(np.arange(0, n, 3), [b"x" * 8] * 100)
    known = [dict(importance=False, pads=False, rep_factor=0.0),
             dict(),                                                             # the defaults
             dict(importance=True, temper=0.0, pads=False, rep_factor=0.0),   # scores unused
             dict(importance=False, pads=False, rep_factor=0.0, num_replicas=2, rank=1),
             dict(importance=False, pads=True, rep_factor=1.0, use_cache=False)]
    for kw in known:
        kw = dict(kw)
        with_cache = kw.pop("use_cache", True)
        s = sc.ShadeSampler(n, cache=cache if with_cache else None, batch_size=16, seed=4, **kw)
        s.set_epoch(2)
        now = s.order().copy()
        w = s.weights(np.arange(n)).copy()
        ahead = s.next_epoch_order()
        assert ahead is not None, kw
        assert np.array_equal(s.order(), now) and np.array_equal(s.weights(np.arange(n)), w)
        assert s.epoch == 2
        s.end_epoch(0.0)
        assert np.array_equal(s.order(), ahead), kw      # the very draw of epoch 3
        assert not np.array_equal(ahead, now)
    unknown = [dict(importance=True, temper=1.0),                       # draws by the scores
               dict(importance=False, pads=True, rep_factor=0.0),       # cached first
               dict(importance=False, rep_factor=1.0, substitute=0.1)]  # misses -> hits
    for kw in unknown:
        s = sc.ShadeSampler(n, cache=cache, batch_size=16, seed=4, **kw)
        s.set_epoch(1)
        assert s.next_epoch_order() is None, kw
