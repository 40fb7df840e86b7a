"""The clairvoyant policy: evict the value read farthest in the future (Belady), values with no
known next read by importance below all known ones, a user-set blend, admission with bypass; its
input set_next_use (batched, checked before anything changes) and the order board feeding it."""
import numpy as np
import pytest

import shadecache as sc
from shadecache import _core
from sizing import capacity_holding
from values import make_value

KB4 = 4000


@pytest.fixture(scope="module")
def cap16():
    """A capacity that holds exactly 16 values of KB4 bytes in a cache of 1000 ids."""
    return capacity_holding(16, KB4, 1000, "clairvoyant")


def _full(name, cap16, n=1000, **kw):
    c = sc.Cache.create(name, num_samples=n, capacity_bytes=cap16, max_item_bytes=KB4,
                        policy="clairvoyant", **kw)
    for i in range(16):   # distinct scores: a full cache admits only a key above the lowest
        assert c.put(i, make_value(i, 0, KB4), score=float(i + 1))
    assert c.stats()["items"] == 16 and c.stats()["evictions"] == 0
    return c


def _cached(c, ids):
    return [i for i in ids if c.contains(i)]


def test_farthest_next_use_goes_first_and_later_newcomers_are_refused(cache_name, cap16):
    with _full(cache_name, cap16) as c:
        c.set_next_use(np.arange(16), 100 + np.arange(16) * 10)     # 15 is read last (250)
        assert c.put(100, make_value(100, 0, KB4), score=0.0) is False, \
            "no known next use: a score of 0 does not beat any known next use"
        c.set_next_use([100], [255])
        assert c.put(100, make_value(100, 0, KB4)) is False, "read after everything cached: bypass"
        c.set_next_use([100], [105])
        assert c.put(100, make_value(100, 0, KB4))
        assert not c.contains(15) and c.contains(100), "the value read farthest away (15) went"
        assert c.put(101, make_value(101, 0, KB4)) is False   # 101's next use unknown
        c.set_next_use([101], [0])
        assert c.put(101, make_value(101, 0, KB4))
        assert not c.contains(14)
        s = c.stats()
        assert s["evictions"] == 2 and s["rejected"] == 3 and s["policy"] == "clairvoyant"
        c.check()


def test_unknown_next_use_ordered_by_importance_below_every_known(cache_name, cap16):
    with _full(cache_name, cap16) as c:
        c.update_scores(np.arange(16), np.arange(16, dtype=np.float32) + 1e6)  # huge scores
        c.set_next_use([3], [10 ** 11])     # one known use, very far away
        c.set_next_use([0, 1, 2], [-1, -1, -1])
        c.set_next_use(np.arange(4, 16), np.full(12, -1))
        c.set_next_use([200, 201], [5, 6])
        # every unknown one (scores 1e6 + i) goes before 3, lowest score first
        assert c.put(200, make_value(200, 0, KB4)) and not c.contains(0)
        assert c.put(201, make_value(201, 0, KB4)) and not c.contains(1)
        c.update_scores([2], [-5.0])         # now the lowest
        c.set_next_use([202], [7])
        assert c.put(202, make_value(202, 0, KB4)) and not c.contains(2) and c.contains(3)
        c.check()


def test_blend_weight_trades_positions_for_score(cache_name, cap16):
    with _full(cache_name, cap16, blend=0.0) as c:
        assert c.policy_weight == 0.0
        c.set_next_use(np.arange(16), np.arange(16) * 10)
        c.update_scores([15], [100.0])       # 15 is read last but matters
        c.policy_weight = 1.0                # one point of score = one position: 150 - 100 = 50
        c.check()                            # every key rekeyed
        c.set_next_use([300], [1])
        assert c.put(300, make_value(300, 0, KB4))
        assert c.contains(15) and not c.contains(14), "14 (140) is now farther than 15 (150 - 100)"
        c.policy_weight = 0
        c.set_next_use([301], [1])
        assert c.put(301, make_value(301, 0, KB4)) and not c.contains(15)
        c.check()


def test_no_published_order_behaves_as_importance(cache_name):
    rng = np.random.default_rng(3)
    ops = [(int(rng.integers(500)), float(rng.random())) for _ in range(300)]
    kept = {}
    for policy in ("importance", "clairvoyant"):
        # each policy's own capacity for 16 values (clairvoyant keeps a tick per id on top)
        with sc.Cache.create(f"{cache_name}-{policy}", num_samples=500, max_item_bytes=KB4, policy=policy,
                             capacity_bytes=capacity_holding(16, KB4, 500, policy)) as c:
            for i, score in ops:
                c.put(i, make_value(i, 0, KB4), score=score)
            c.update_scores(np.arange(0, 500, 7), np.full(72, 0.5, np.float32))
            for i, score in ops[:50]:
                c.put(i + 1, make_value(i + 1, 0, KB4), score=score)
            kept[policy] = c.cached_mask().copy()
            c.check()
    assert (kept["importance"] == kept["clairvoyant"]).all()


def test_set_next_use_checks_the_whole_batch_first(cache_name, cap16):
    with _full(cache_name, cap16) as c:
        c.set_next_use(np.arange(16), np.arange(16))
        with pytest.raises(IndexError):
            c.set_next_use([0, 1000], [5, 5])
        with pytest.raises(IndexError):
            c.set_next_use([0, -1], [5, 5])
        with pytest.raises(ValueError, match="position"):
            c.set_next_use([0, 1], [5, -2])
        with pytest.raises(ValueError, match="position"):
            c.set_next_use([0, 1], [5, 1 << 39])
        with pytest.raises(ValueError, match="2 ids but 1 positions"):
            c.set_next_use([0, 1], [5])
        with pytest.raises(TypeError, match="positions must be a sequence or array of integers"):
            c.set_next_use([0], [1.5])
        with pytest.raises(TypeError, match="ids must be a sequence or array of integers"):
            c.set_next_use([0.0], [1])
        # nothing changed: 15 is still the farthest
        c.set_next_use([400], [3])
        assert c.put(400, make_value(400, 0, KB4)) and not c.contains(15)
        with pytest.raises(ValueError, match="finite"):
            c.policy_weight = -1.0
        with pytest.raises(ValueError, match="finite"):
            c.policy_weight = float("nan")
        with pytest.raises(TypeError):
            c.policy_weight = "1"
        c.set_next_use([], [])
        c.check()


def test_other_policies_ignore_next_use_and_have_no_blend(cache_name):
    with sc.Cache.create(cache_name, num_samples=100, capacity_bytes=64 * 1024, max_item_bytes=KB4,
                         policy="lru") as c:
        assert not c.keys_on_next_use
        c.set_next_use([1, 2], [5, 6])           # checked, then nothing keys on it
        with pytest.raises(IndexError):
            c.set_next_use([100], [5])
        with pytest.raises(ValueError, match="only clairvoyant"):
            c.policy_weight = 1.0
        c.check()
    with pytest.raises(ValueError, match="blend"):
        sc.Cache.create(cache_name, num_samples=100, capacity_bytes=1 << 20, blend=1.0)
    assert cache_name not in sc.cache.list_caches()


def test_check_knows_the_keys(cache_name, cap16):
    # A writer killed between a next-use store and its rekey leaves exactly the state that
    # check() must call wrong and repair must put right: the crash point sits between batch halves.
    import multiprocessing as mp
    import signal

    from crashing import attach_armed

    def writer(name):
        c = attach_armed(name, _core.CRASH_POINTS["next_use_mid"], 1)
        c.set_next_use(np.arange(16), np.arange(16)[::-1].copy() * 3)

    with _full(cache_name, cap16) as c:
        c.set_next_use(np.arange(16), np.arange(16))
        p = mp.get_context("fork").Process(target=writer, args=(cache_name,))
        p.start()
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
        c.check()   # the next locker repaired: every key recomputed from ticks and scores
        assert c.stats()["recoveries"] == 1
        # the first half of the batch got its new positions: 0..7 are now read at 45..24, 8..15
        # kept 8..15, so 0 (45) is the farthest
        c.set_next_use([500], [1])
        assert c.put(500, make_value(500, 0, KB4)) and not c.contains(0)
        c.check()


def test_sampler_publishes_and_the_policy_keeps_what_is_read_soonest(cache_name):
    torch = pytest.importorskip("torch")  # noqa: F841  (ShadeSampler needs torch)
    n = 64
    with sc.Cache.create(cache_name, num_samples=n, capacity_bytes=capacity_holding(16, KB4, n, "clairvoyant"),
                         max_item_bytes=KB4,
                         policy="clairvoyant") as c, sc.OrderBoard.create(cache_name, n) as board:
        for i in range(16):
            assert c.put(i, make_value(i, 0, KB4), score=float(i + 1))

        class _Data:
            def __len__(self):
                return n
        s = sc.ShadeSampler(_Data(), cache=c, board=board, batch_size=8, importance=False, pads=False,
                            rep_factor=0.0, seed=1)
        s.set_epoch(0)
        it = iter(s)
        first = [next(it) for _ in range(9)]     # batch 0 taken, batch boundary passed
        order = board.orders.snapshot(0)
        assert order is not None
        nu = board.orders.next_use(np.arange(16))
        assert (nu[[i for i in range(16) if i in first[:8]]] == -1).all(), "taken: no next read"
        # the victim of a newcomer needed next: a cached id not read again (lowest score first),
        # else the one read farthest away
        newcomer = next(i for i in range(16, n) if i not in first)
        c.set_next_use([newcomer], [0])
        key = np.where(nu < 0, np.arange(16) + 1.0, 2.0 ** 40 - nu)
        assert c.put(newcomer, make_value(newcomer, 0, KB4))
        gone = [i for i in range(16) if not c.contains(i)]
        assert gone == [int(np.argmin(key))], (gone, nu)
        c.check()
