"""SHADE's rank weights and the score table, on hand-made minibatches with hand-computed answers."""
import math

import numpy as np
import pytest

from shadecache.sampling.importance import ImportanceTable, prior_score, rank_weights


def test_rank_weights_hand_made_batch():
    # losses:          0.5  2.0  0.1  9.0   -> ranks 1, 2, 0, 3 (highest loss, highest rank)
    w = rank_weights([0.5, 2.0, 0.1, 9.0])
    expected = [math.log(11), math.log(12), math.log(10), math.log(13)]
    assert w.tolist() == pytest.approx(expected, abs=1e-12)
    assert np.argmax(w) == 3 and np.argmin(w) == 2


def test_rank_weights_ties_share_the_mean_rank():
    # 1.0 twice spans ranks 1 and 2 -> both get rank 1.5, whatever their position
    w = rank_weights([1.0, 0.0, 1.0, 5.0])
    assert w.tolist() == pytest.approx([math.log(11.5), math.log(10), math.log(11.5),
                                        math.log(13)], abs=1e-12)
    assert rank_weights([3.0, 3.0, 3.0]).tolist() == pytest.approx([math.log(11)] * 3)


def test_rank_weights_depend_on_order_not_scale():
    x = np.array([0.3, 7.0, 0.01, 2.5, 1.0])
    assert np.allclose(rank_weights(x), rank_weights(x * 1000 + 5))
    perm = np.array([4, 2, 0, 1, 3])
    assert np.allclose(rank_weights(x[perm]), rank_weights(x)[perm])


def test_rank_weights_bad_input():
    with pytest.raises(ValueError, match="position 1"):
        rank_weights([0.1, float("nan"), 0.3])
    with pytest.raises(ValueError, match="one-dimensional"):
        rank_weights([[0.1, 0.2]])
    assert rank_weights([]).size == 0


def test_prior_is_mean_batch_weight():
    assert prior_score(4) == pytest.approx(np.mean(np.log([10, 11, 12, 13])))
    with pytest.raises(ValueError, match="batch_size"):
        prior_score(0)


def test_table_gives_each_weight_to_the_id_that_produced_the_loss():
    t = ImportanceTable(10, batch_size=4)
    prior = t.prior
    touched, scores = t.update([7, 2, 9, 0], [0.5, 2.0, 0.1, 9.0])
    # epoch 0 blends with a = 1: the score is exactly the rank weight of that id's loss
    expected = {7: math.log(11), 2: math.log(12), 9: math.log(10), 0: math.log(13)}
    for i, w in expected.items():
        assert t.scores[i] == pytest.approx(w)
    assert touched.tolist() == [0, 2, 7, 9]
    assert scores.tolist() == pytest.approx([expected[i] for i in [0, 2, 7, 9]])
    untouched = [1, 3, 4, 5, 6, 8]
    assert t.scores[untouched].tolist() == pytest.approx([prior] * 6)


def test_table_averages_an_id_seen_twice_in_an_epoch():
    t = ImportanceTable(5, batch_size=2)
    t.update([3, 1], [1.0, 0.0])      # 3 -> log 11
    t.update([3, 4], [0.0, 1.0])      # 3 -> log 10
    assert t.scores[3] == pytest.approx((math.log(11) + math.log(10)) / 2)
    # the same id twice in ONE batch (sampling with replacement): both weights are averaged
    t2 = ImportanceTable(5, batch_size=3)
    t2.update([2, 2, 0], [5.0, 1.0, 0.0])
    assert t2.scores[2] == pytest.approx((math.log(12) + math.log(11)) / 2)


def test_loss_trend_blend_across_epochs():
    t = ImportanceTable(4, batch_size=2, smoothing=0.5)
    t.update([0, 1], [1.0, 2.0])                 # epoch 0, a = 1
    t.end_epoch(mean_loss=2.0)
    assert t.alpha == pytest.approx(0.5)         # one loss seen: no trend yet
    t.update([0, 1], [3.0, 2.0])                 # 0 now ranks high
    assert t.scores[0] == pytest.approx(0.5 * math.log(10) + 0.5 * math.log(11))
    assert t.scores[1] == pytest.approx(0.5 * math.log(11) + 0.5 * math.log(10))
    t.end_epoch(mean_loss=1.0)                   # the loss halved: trend 0.5 -> a = 1.0
    assert t.alpha == pytest.approx(1.0)
    t.update([0], [1.0])
    assert t.scores[0] == pytest.approx(math.log(10))
    t.end_epoch(mean_loss=0.9)                   # 10% drop -> a = 0.6
    assert t.alpha == pytest.approx(0.6)
    before = t.scores.copy()
    t.update([2, 3], [0.0, 1.0])
    assert t.scores[3] == pytest.approx(0.4 * before[3] + 0.6 * math.log(11))
    assert t.scores[0] == before[0] and t.scores[1] == before[1]


def test_table_bad_ids_and_state_roundtrip():
    t = ImportanceTable(6, batch_size=3)
    with pytest.raises(IndexError, match="sample id 6"):
        t.update([0, 6], [1.0, 2.0])
    with pytest.raises(IndexError, match="sample id -1"):
        t.update([-1], [1.0])
    with pytest.raises(ValueError, match="2 sample ids but 3 losses"):
        t.update([0, 1], [1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match="integers"):
        t.update(np.array([0.5]), [1.0])
    t.update([0, 1, 2], [3.0, 1.0, 2.0])
    t.end_epoch(1.5)
    t.update([4], [1.0])
    u = ImportanceTable(6, batch_size=3)
    u.load_state_dict(t.state_dict())
    assert np.array_equal(u.scores, t.scores) and u.alpha == t.alpha and u.epoch == t.epoch
    u.update([5], [2.0])
    t.update([5], [2.0])
    assert np.array_equal(u.scores, t.scores)
    with pytest.raises(ValueError, match="state is for 6 samples, this table has 7"):
        ImportanceTable(7).load_state_dict(t.state_dict())
