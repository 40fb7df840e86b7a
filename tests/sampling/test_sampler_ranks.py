"""ShadeSampler across ranks and over many epochs: ranks without a process group, the epoch size,
unbiased weights with the accuracy budget."""
import numpy as np
import pytest

import shadecache as sc


def _drain(s):
    return np.fromiter(iter(s), dtype=np.int64)


def _epoch(ranks, rng, b):
    shares = []
    for s in ranks:
        o = _drain(s)
        shares.append(o)
        for i in range(0, o.size, b):
            s.update(o[i:i + b], rng.random(o[i:i + b].size))
    return shares


@pytest.mark.parametrize("temper", [0.5, 1.0])
def test_explicit_ranks_without_a_process_group_cannot_fold_different_scores(temper):
    """Without torch.distributed each rank would fold only its own losses at end_epoch and the
    ranks would then draw different orders (10-15% of the samples dropped per epoch): refused."""
    n, b = 400, 20
    ranks = [sc.ShadeSampler(n, batch_size=b, seed=3, num_replicas=2, rank=r, temper=temper)
             for r in (0, 1)]
    _epoch(ranks, np.random.default_rng(0), b)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ranks[0].end_epoch()
    assert ranks[0].epoch == 0, "a refused end_epoch changes nothing"


def test_explicit_ranks_at_temper_0_share_every_epoch():
    """temper=0 (the default) draws a permutation that does not depend on the scores: ranks
    without a process group still split every epoch exactly."""
    n, b = 400, 20
    ranks = [sc.ShadeSampler(n, batch_size=b, seed=3, num_replicas=2, rank=r) for r in (0, 1)]
    rng = np.random.default_rng(0)
    for epoch in range(3):
        for s in ranks:
            s.set_epoch(epoch)
        shares = _epoch(ranks, rng, b)
        assert np.unique(np.concatenate(shares)).size == n, f"epoch {epoch}: samples dropped"
        for s in ranks:
            s.end_epoch()


@pytest.mark.parametrize("size", [0, -5])
def test_an_epoch_size_below_one_is_a_clear_error(size):
    with pytest.raises(ValueError, match="epoch_size"):
        sc.ShadeSampler(10, epoch_size=size)


def test_weights_are_unbiased_with_the_accuracy_budget(cache_factory):
    """Over many epochs each sample's count x weight averages one (a uniform epoch's count),
    cached and missed samples alike, with an accuracy budget of 10%."""
    n = 400
    cache = cache_factory(n, policy="static")
    cache.put_many(np.arange(0, n, 3), [b"x" * 8] * len(range(0, n, 3)))
    s = sc.ShadeSampler(n, cache=cache, batch_size=20, seed=1, substitute=0.1)
    s.update([0, 1], [0.5, 1.0])     # scores exist: the accuracy budget substitutes
    acc = np.zeros(n)
    epochs = 60
    for e in range(epochs):
        s.set_epoch(e)
        o = s.order()
        acc += np.bincount(o, minlength=n) * s.weights(np.arange(n))
        s.end_epoch()
    m = acc / epochs
    cached = cache.cached_mask()
    assert m[cached].mean() == pytest.approx(1.0, abs=0.03)
    assert m[~cached].mean() == pytest.approx(1.0, abs=0.03)
