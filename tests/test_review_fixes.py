"""Defects found by the review of the issue-11 sampler and of the store writer, one test each
(each failed before its fix)."""
import shutil

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


def test_weights_are_unbiased_at_the_defaults(cache_factory):
    """Over many epochs each sample's count x weight averages one (a uniform epoch's count),
    cached and missed samples alike, with the default substitution budget."""
    n = 400
    cache = cache_factory(n, policy="static")
    cache.put_many(np.arange(0, n, 3), [b"x" * 8] * len(range(0, n, 3)))
    s = sc.ShadeSampler(n, cache=cache, batch_size=20, seed=1)
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


def _pack(path, samples):
    with sc.PackWriter(path) as w:
        for d, lab in samples:
            w.add(d, lab)


def test_fingerprint_refuses_a_store_overwritten_in_place(tmp_path):
    """`cp b.shc a.shc` rewrites a.shc's inode: the open store still serves a's directory, so
    the fingerprint of what is now in the file is not its fingerprint."""
    a, b = tmp_path / "a.shc", tmp_path / "b.shc"
    _pack(a, [(b"one" * 10, 0), (b"two" * 10, 1)])
    _pack(b, [(b"ONE" * 10, 0), (b"TWO" * 10, 1), (b"3", 2)])
    store = sc.PackedStore(a)
    shutil.copyfile(b, a)
    with pytest.raises(sc.StoreFormatError, match="rewritten"):
        store.fingerprint


def test_a_structured_array_whose_field_name_holds_O_is_plain_numbers(tmp_path, cache_factory):
    a = np.zeros(3, dtype=[("Offset", "<i4"), ("x", "<f4")])
    a["Offset"] = [1, 2, 3]
    assert not a.dtype.hasobject
    _pack(tmp_path / "s.shc", [(a, 0)])
    assert sc.PackedStore(tmp_path / "s.shc").read(0) == a.tobytes()
    c = cache_factory(4)
    assert c.put(0, a) and c.get(0) == a.tobytes()


def test_a_fortran_order_array_is_refused_like_a_strided_one(tmp_path):
    f = np.arange(6, dtype=np.int32).reshape(2, 3).T
    with pytest.raises(TypeError, match="item 1"):
        sc.pack([(b"ok", 0), (f, 1)], tmp_path / "p.shc", progress=False)


@pytest.mark.parametrize("label,error", [(1.5, TypeError), ("3", TypeError), (1 << 63, ValueError)])
def test_labels_must_be_int64_integers(tmp_path, label, error):
    with pytest.raises(error, match="label"):
        _pack(tmp_path / "s.shc", [(b"x", label)])
    assert not (tmp_path / "s.shc").exists()
