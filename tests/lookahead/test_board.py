"""The order board (shadecache/lookahead/board.py): publishing, windows, next uses across streams, the
seqlock under a writer killed mid-publish, bad input, the sampler's hook, and the Belady bound."""
import itertools
import multiprocessing as mp
import os
import signal
import time
import uuid

import numpy as np
import pytest

import shadecache as sc
from shadecache.lookahead import board as order_mod
from shadecache.lookahead.belady import belady_hits
from shadecache.lookahead.board import NONE, OrderBoard


@pytest.fixture
def board_name():
    name = f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        os.unlink(f"/dev/shm/shadecache-order.{name}")
    except FileNotFoundError:
        pass


def test_publish_window_cursor_and_next_use(board_name):
    with OrderBoard.create(board_name, 10, streams=2, capacity=8) as b:
        assert b.orders.snapshot(0) is None                         # nothing published yet
        assert b.orders.next_use([1, 2]).tolist() == [-1, -1]
        assert b.orders.publish(0, 3, [4, 1, 4, 7, 2, 9, 1, 0, 5, 5]) == 8     # bounded to capacity
        epoch, ids, cursor = b.orders.snapshot(0, window=3)
        assert (epoch, ids.tolist(), cursor) == (3, [4, 1, 4], 0)
        # global position = epoch * capacity + k
        assert b.orders.next_use([4, 1, 9, 5, 3]).tolist() == [24, 25, 29, -1, -1]
        b.orders.publish(1, 3, [9, 3])
        assert b.orders.next_use([9, 3]).tolist() == [24, 25]      # stream 1 reads 9 sooner
        taken = b.orders.consumed(0, 0, 3)                          # 4, 1, 4 were taken
        b.orders.set_cursor(0, 3)
        assert taken.tolist() == [4, 1, 4]
        assert b.orders.next_use([4, 1]).tolist() == [-1, 30]      # 4: no later read; 1: at k=6
        epoch, ids, cursor = b.orders.snapshot(0, window=2)
        assert (ids.tolist(), cursor) == ([7, 2], 3)
        b.orders.publish(0, 4, [2])                                 # a new epoch resets the stream
        assert b.orders.stream_state(0) == {"seq": 4, "epoch": 4, "length": 1, "cursor": 0}
        assert b.orders.next_use([2, 1]).tolist() == [32, -1]
        attached = OrderBoard.attach(board_name)
        assert attached.orders.snapshot(0)[1].tolist() == [2] and attached.streams == 2
        attached.close()


def test_bad_input(board_name):
    with pytest.raises(ValueError):
        OrderBoard.create(board_name, 0)
    with pytest.raises(ValueError):
        OrderBoard.create(board_name, 4, streams=0)
    with pytest.raises(TypeError):
        OrderBoard.create(board_name, 4.0)
    with pytest.raises(ValueError):
        OrderBoard.create("a/b", 4)
    with pytest.raises(FileNotFoundError):
        OrderBoard.attach(board_name)
    with OrderBoard.create(board_name, 4) as b:
        with pytest.raises(FileExistsError):
            OrderBoard.create(board_name, 4)
        with pytest.raises(IndexError):
            b.orders.publish(1, 0, [0])
        with pytest.raises(IndexError, match="sample id 4"):
            b.orders.publish(0, 0, [0, 4])
        with pytest.raises(TypeError):
            b.orders.publish(0, 0, [0.5])
        with pytest.raises(TypeError):
            b.orders.snapshot("0")
        assert b.orders.snapshot(0) is None                         # nothing half-published
    assert not os.path.exists(f"/dev/shm/shadecache-order.{board_name}")
    with open(os.open(f"/dev/shm/shadecache-order.{board_name}", os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(b"\0" * 8192)
    with pytest.raises(ValueError, match="not an order board"):
        OrderBoard.attach(board_name)
    os.chmod(f"/dev/shm/shadecache-order.{board_name}", 0o644)   # open to others: never read
    with pytest.raises(PermissionError, match="open to group or others"):
        OrderBoard.attach(board_name)


def _publish_forever(name, n):
    b = OrderBoard.attach(name)
    rng = np.random.default_rng(os.getpid())
    e = 0
    while True:
        e += 1
        v = int(rng.integers(0, 1000))
        b.orders.publish(0, e, np.full(n, v, dtype=np.int64) + np.arange(n) * 0)   # every id equal


def test_a_writer_killed_mid_publish_never_shows_a_torn_order(board_name):
    """Each published order holds one id repeated; a reader must never see two different ids in
    one snapshot, whatever moment the writer is SIGKILLed at."""
    n = 50_000
    with OrderBoard.create(board_name, 1000, capacity=n) as b:
        ctx = mp.get_context("fork")
        seen = 0
        for _ in range(6):
            p = ctx.Process(target=_publish_forever, args=(board_name, n))
            p.start()
            t_end = time.monotonic() + 0.3
            while time.monotonic() < t_end:
                snap = b.orders.snapshot(0, window=n)
                if snap is not None:
                    ids = snap[1]
                    assert ids.size == 0 or (ids == ids[0]).all(), "a torn order was read"
                    seen += 1
            os.kill(p.pid, signal.SIGKILL)
            p.join()
            snap = b.orders.snapshot(0, window=n)     # odd seq left behind: None; else consistent
            assert snap is None or (snap[1] == snap[1][0]).all()
        assert seen > 0


def test_the_sampler_publishes_its_order_and_moves_the_cursor(board_name, tmp_path):
    n = 300
    with sc.Cache.create(board_name, num_samples=n, capacity_bytes=1 << 20) as cache, \
            OrderBoard.create(board_name, n) as b:
        s = sc.ShadeSampler(n, cache=cache, batch_size=32, seed=1, pads=True)
        s.set_epoch(2)
        it = iter(s)
        first = [next(it) for _ in range(70)]
        st = b.orders.stream_state(0)
        assert st["epoch"] == 2 and st["length"] == len(s.order())
        assert st["cursor"] == 64                       # two batches of 32 fully taken
        assert b.orders.snapshot(0, window=6)[1].tolist() == s.order()[64:70].tolist()
        rest = list(it)
        assert first + rest == s.order().tolist()        # the hook changes nothing it yields
        assert b.orders.stream_state(0)["cursor"] == len(s.order())
        assert (b.orders.next_use(np.arange(n)) == -1).all()    # everything of the epoch was read


def test_with_a_prefetcher_next_uses_move_one_batch_late(board_name):
    # The loader is still reading the batch it just took: with a prefetcher running, its ids keep
    # their current position until the next batch is taken (nothing evicts them under the read).
    # (A board of one epoch's capacity: no room for the next epoch's head, so a consumed id has no
    # next use at all; test_the_next_epoch_head_* cover the boundary.)
    n = 300
    with sc.Cache.create(board_name, num_samples=n, capacity_bytes=1 << 20,
                         policy="clairvoyant") as cache, OrderBoard.create(board_name, n, capacity=n) as b:
        s = sc.ShadeSampler(n, cache=cache, batch_size=32, importance=False, pads=False,
                            rep_factor=0.0, seed=1)
        for prefetcher, consumed_upto in ((0, 64), (os.getpid(), 32)):
            b.control.set_prefetcher(prefetcher)
            s.set_epoch(3 if prefetcher else 2)
            it = iter(s)
            taken = [next(it) for _ in range(70)]
            assert b.orders.stream_state(0)["cursor"] == 64
            nu = b.orders.next_use(np.asarray(taken[:64]))
            assert (nu[:consumed_upto] == -1).all() and (nu[consumed_upto:] >= 0).all()
            list(it)
            assert (b.orders.next_use(np.arange(n)) == -1).all()
        b.control.set_prefetcher(0)


def _opt_hits(trace, cap):
    """Optimal hits by exhaustive search over every keep/evict choice (tiny traces only)."""
    best = {frozenset(): 0}
    for x in trace:
        nxt = {}
        for cached, h in best.items():
            if x in cached:
                opts = [(cached, h + 1)]
            else:
                opts = [(cached, h)]                             # bypass
                if len(cached) < cap:
                    opts.append((cached | {x}, h))
                else:
                    opts += [((cached - {y}) | {x}, h) for y in cached]
            for c, v in opts:
                if nxt.get(c, -1) < v:
                    nxt[c] = v
        best = nxt
    return max(best.values())


def test_belady_matches_the_exhaustive_optimum():
    rng = np.random.default_rng(0)
    for _ in range(60):
        trace = rng.integers(0, 6, int(rng.integers(1, 14))).tolist()
        cap = int(rng.integers(1, 4))
        assert belady_hits(trace, cap) == _opt_hits(trace, cap), (trace, cap)
    assert belady_hits([], 3) == 0 and belady_hits([1, 1], 0) == 0
    with pytest.raises(ValueError):
        belady_hits([1], -1)


def test_a_publish_after_a_writer_died_mid_publish_is_readable(board_name):
    """A writer killed mid-publish leaves its stream's sequence word odd. The next publish must
    still write under an odd word and end on an even one: flipping the parity would let readers
    take orders while they are written, and leave the finished one unreadable."""
    from shadecache.lookahead.board_layout import HEADER_BYTES, S_SEQ
    with OrderBoard.create(board_name, 100, capacity=10) as b:
        b.orders.publish(0, 0, np.arange(10))
        # the stream's sequence word, as the job's file holds it
        import mmap
        with open(b.path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
        seq = np.ndarray((1,), dtype=np.int64, buffer=mm, offset=HEADER_BYTES + 8 * S_SEQ)
        seq[0] += 1                              # what a writer killed after its first store leaves
        assert b.orders.snapshot(0) is None
        b.orders.publish(0, 1, np.arange(10, 20))
        snap = b.orders.snapshot(0)
        assert snap is not None and snap[0] == 1 and np.array_equal(snap[1], np.arange(10, 20))
        assert int(seq[0]) % 2 == 0
        del seq
        mm.close()


def test_with_a_prefetcher_next_uses_move_one_batch_late_into_the_next_epochs_head(board_name):
    # The same with the default capacity: a taken id's next use moves to its read in the next
    # epoch's head (not to none), one batch late with a prefetcher.
    n = 300
    with sc.Cache.create(board_name, num_samples=n, capacity_bytes=1 << 20,
                         policy="clairvoyant") as cache, OrderBoard.create(board_name, n) as b:
        s = sc.ShadeSampler(n, cache=cache, batch_size=32, importance=False, pads=False,
                            rep_factor=0.0, seed=1)
        for prefetcher, consumed_upto, epoch in ((0, 64, 2), (os.getpid(), 32, 3)):
            b.control.set_prefetcher(prefetcher)
            s.set_epoch(epoch)
            head = s.next_epoch_order()
            it = iter(s)
            taken = [next(it) for _ in range(70)]
            assert b.orders.stream_state(0)["cursor"] == 64
            nu = b.orders.next_use(np.asarray(taken[:64]))
            base = epoch * b.capacity
            in_head = base + n + np.argsort(head)[np.asarray(taken[:64])]   # head is a permutation
            assert (nu[:consumed_upto] == in_head[:consumed_upto]).all()
            assert (nu[consumed_upto:] < base + n).all()
            list(it)


def test_set_epoch_and_end_epoch_publish_ahead_of_iter(board_name):
    n = 300
    with sc.Cache.create(board_name + "x", num_samples=n, capacity_bytes=1 << 20) as other:
        s = sc.ShadeSampler(n, cache=other, batch_size=32, seed=1)
        s.set_epoch(1)
        assert s._order is None                  # no board: drawn at __iter__, as before
    with sc.Cache.create(board_name, num_samples=n, capacity_bytes=1 << 20) as cache, \
            OrderBoard.create(board_name, n) as b:
        s = sc.ShadeSampler(n, cache=cache, batch_size=32, seed=1, pads=True)
        s.set_epoch(4)
        st = b.orders.stream_state(0)
        assert (st["epoch"], st["length"], st["cursor"]) == (4, len(s.order()), 0)
        assert b.orders.snapshot(0)[1].tolist() == s.order().tolist()
        seq = st["seq"]
        s.set_epoch(4)                           # the same order: not published again
        assert list(iter(s)) == s.order().tolist() and b.orders.stream_state(0)["seq"] == seq
        it = iter(s)                             # a second pass re-publishes (cursor went on)
        next(it)
        assert b.orders.stream_state(0)["seq"] == seq + 2 and b.orders.stream_state(0)["cursor"] == 0
        list(it)
        s.end_epoch(0.0)                         # epoch 5 is drawn and up before any __iter__
        assert b.orders.stream_state(0)["epoch"] == 5
        assert b.orders.snapshot(0)[1].tolist() == s.order().tolist()


def test_a_board_made_again_under_the_same_name_gets_the_order(board_name):
    # A board closed and made again under the same cache name in one process (a rerun, a sweep
    # that reuses the job's name, a restarted prefetcher): the sampler publishes into the new
    # board, not into the unlinked file it attached first, and not "already up" because this
    # process put the same order onto the board that is gone.
    n = 300
    with sc.Cache.create(board_name, num_samples=n, capacity_bytes=1 << 20) as cache:
        s = sc.ShadeSampler(n, cache=cache, batch_size=32, seed=1)
        with OrderBoard.create(board_name, n):
            s.set_epoch(0)
        with OrderBoard.create(board_name, n) as b:
            it = iter(s)
            taken = [next(it) for _ in range(40)]
            st = b.orders.stream_state(0)
            assert st["seq"] == 2 and st["epoch"] == 0 and st["cursor"] == 32
            assert b.orders.snapshot(0, window=5)[1].tolist() == s.order()[32:37].tolist()
            assert taken == s.order()[:40].tolist()


def test_the_published_order_is_not_kept_alive_by_the_hook(board_name):
    import gc
    import weakref
    n = 300
    with sc.Cache.create(board_name, num_samples=n, capacity_bytes=1 << 20) as cache, \
            OrderBoard.create(board_name, n):
        s = sc.ShadeSampler(n, cache=cache, batch_size=32, seed=1)
        s.set_epoch(0)
        ref = weakref.ref(s.order())
        del s
        gc.collect()
        assert ref() is None      # the sampler is gone: so is its order (no per-process copy)


def _served_ids(cache, board_name, n, skip_epoch):
    """Ids a loop of set_epoch/iter/break/resume/end_epoch takes, and the coverage it records."""
    def loss(ids):
        return np.where(np.asarray(ids) % 10 == 0, 10.0, 0.01)

    def make():
        return sc.ShadeSampler(n, cache=cache, batch_size=32, pads=False, rep_factor=0.0,
                               seed=7, coverage_epochs=2, temper=1.0)

    def take(s, k=None):
        out = []
        for i in iter(s):
            out.append(i)
            if len(out) % 32 == 0:
                s.update(out[-32:], loss(out[-32:]))
            if len(out) == k:
                break
        return out

    s, log = make(), []
    s.set_epoch(0)
    s.set_epoch(0)                       # twice: nothing changes
    log.append(take(s))
    s.end_epoch()
    s.set_epoch(1)
    log.append(take(s, 96))              # a break mid-epoch, then a second pass
    log.append(take(s))
    s.end_epoch()
    s.set_epoch(2)
    if not skip_epoch:
        log.append(take(s))
    s.end_epoch()                        # skip_epoch: an epoch ended without iterating
    s.set_epoch(3)
    log.append(take(s, 128))
    state = s.state_dict()               # resumed mid-epoch in a new sampler
    s = make()
    s.load_state_dict(state)
    s.set_epoch(3)
    log.append(take(s))
    s.end_epoch()
    s.set_epoch(1)                       # an earlier epoch
    log.append(take(s))
    return log, s.coverage()["per_epoch"], s.last_drawn.tolist()


@pytest.mark.parametrize("skip_epoch", [False, True])
def test_a_board_changes_no_id_the_sampler_draws(board_name, skip_epoch):
    # The order drawn ahead for the board (set_epoch/end_epoch) is the order __iter__ would have
    # drawn; an order nobody iterated is not counted as trained (the coverage floor then forces
    # the same ids with and without a board).
    n = 400
    with sc.Cache.create(board_name + "-x", num_samples=n, capacity_bytes=1 << 20) as plain:
        want = _served_ids(plain, board_name + "-x", n, skip_epoch)
    with sc.Cache.create(board_name, num_samples=n, capacity_bytes=1 << 20) as cache, \
            OrderBoard.create(board_name, n) as b:
        got = _served_ids(cache, board_name, n, skip_epoch)
        assert b.orders.stream_state(0)["seq"] > 0
    assert got == want


def test_an_order_drawn_ahead_is_reported_and_saved_as_without_a_board(board_name):
    # end_epoch draws the next epoch's order for the board; until it is used, the sampler reports
    # and saves what it would without a board: the finished epoch's draw stats, no order
    n = 300
    with sc.Cache.create(board_name, num_samples=n, capacity_bytes=1 << 20) as cache, \
            OrderBoard.create(board_name, n) as b:
        s = sc.ShadeSampler(n, cache=cache, batch_size=32, seed=2, pads=True)
        s.update([0, 1], [0.5, 1.0])     # scores exist: the order is drawn against the cache
        cache.put_many(np.arange(0, n, 3), [b"x" * 16] * len(range(0, n, 3)))
        s.set_epoch(0)
        list(iter(s))
        stats0 = dict(s.last_epoch_stats)
        cache.put_many(np.arange(1, n, 3), [b"y" * 16] * len(range(1, n, 3)))   # more cached
        s.end_epoch(0.0)
        assert b.orders.stream_state(0)["epoch"] == 1              # epoch 1 is up ahead...
        assert s.last_epoch_stats == stats0                 # ...but not reported as drawn
        assert s.state_dict()["order"] is None
        ahead = b.orders.snapshot(0)[1].tolist()
        assert list(iter(s)) == ahead                       # used: now it is the epoch's draw
        assert s.last_epoch_stats["cached_draws"] > stats0["cached_draws"]
        assert s.state_dict()["order"].tolist() == ahead


def _publish_reversed(name, n):
    b = OrderBoard.attach(name)
    b.orders.publish(0, 0, np.arange(n)[::-1].copy())
    b.close()


def test_iter_publishes_again_after_another_process_published_on_its_stream(board_name):
    # two ranks on one stream (more ranks than streams): the one that iterates publishes its
    # order again instead of moving the cursor over the other's (what __iter__ did before
    # publish_ahead), because the stream's seq is no longer the one its publish left
    n = 300
    with sc.Cache.create(board_name, num_samples=n, capacity_bytes=1 << 20) as cache, \
            OrderBoard.create(board_name, n) as b:
        s = sc.ShadeSampler(n, cache=cache, batch_size=32, seed=1, pads=True)
        s.set_epoch(0)
        p = mp.get_context("fork").Process(target=_publish_reversed, args=(board_name, n))
        p.start()
        p.join()
        assert p.exitcode == 0 and b.orders.snapshot(0)[1][0] == n - 1
        it = iter(s)
        assert [next(it) for _ in range(40)] == s.order()[:40].tolist()
        assert b.orders.snapshot(0)[1].tolist() == s.order()[32:].tolist()


def test_the_next_epoch_head_follows_a_known_order_on_the_board(board_name):
    """A uniform order the cache does not rearrange: the stream holds this epoch's order and then
    the next epoch's (default capacity: an epoch plus NEXT_EPOCH_ROOM), the cursor stops at the
    epoch's end, and an id taken in this epoch keeps a known next use: its read in the next one."""
    n = 300
    with sc.Cache.create(board_name, num_samples=n, capacity_bytes=1 << 20,
                         policy="clairvoyant") as cache, OrderBoard.create(board_name, n) as b:
        assert b.capacity == n + min(n, order_mod.NEXT_EPOCH_ROOM)
        s = sc.ShadeSampler(n, cache=cache, batch_size=32, importance=False, pads=False,
                            rep_factor=0.0, seed=1)
        s.set_epoch(0)
        now, ahead = s.order().copy(), s.next_epoch_order()
        st = b.orders.stream_state(0)
        assert (st["epoch"], st["length"], st["cursor"]) == (0, 2 * n, 0)
        assert b.orders.snapshot(0)[1].tolist() == now.tolist() + ahead.tolist()
        assert list(iter(s)) == now.tolist()                 # the loader gets this epoch only
        assert b.orders.stream_state(0)["cursor"] == n
        assert b.orders.snapshot(0, window=5)[1].tolist() == ahead[:5].tolist()
        pos = b.orders.next_use(ahead[:10])
        assert pos.tolist() == [n + k for k in range(10)]   # epoch 0: position = k (0 * capacity)
        s.end_epoch(0.0)
        assert s.order().tolist() == ahead.tolist()
        st = b.orders.stream_state(0)
        assert (st["epoch"], st["length"]) == (1, 2 * n)
        assert b.orders.next_use(ahead[:3]).tolist() == [b.capacity + k for k in range(3)]
    # a board of one epoch's capacity has no room: the epoch alone, as before
    with sc.Cache.create(board_name + "y", num_samples=n, capacity_bytes=1 << 20) as cache, \
            OrderBoard.create(board_name + "y", n, capacity=n) as b:
        s = sc.ShadeSampler(n, cache=cache, batch_size=32, importance=False, pads=False,
                            rep_factor=0.0, seed=1)
        s.set_epoch(0)
        assert b.orders.stream_state(0)["length"] == n and b.orders.snapshot(0)[1].tolist() == s.order().tolist()


@pytest.mark.parametrize("jump", ["set_epoch", "load_state_dict"])
def test_ids_that_drop_out_of_the_board_lose_their_next_use_in_the_cache(board_name, jump):
    """An epoch that is not the one the board showed behind the last (set_epoch jumps, a
    checkpoint is loaded; epoch_size < N, so ids leave the published orders): their next use in
    the clairvoyant cache goes back to what the board says (none), so they are not kept as if
    needed soonest and the next real read is admitted (a head that did not come)."""
    n = 300
    with sc.Cache.create(board_name, num_samples=n, capacity_bytes=sc.Cache.capacity_for(20, [1000] * n),
                         policy="clairvoyant", sizes=[1000] * n) as cache, OrderBoard.create(board_name, n) as b:
        pushed = {}
        real = cache.set_next_use

        def spy(ids, pos):
            pushed.update(zip(np.asarray(ids).tolist(), np.asarray(pos).tolist()))
            return real(ids, pos)

        cache.set_next_use = spy
        s = sc.ShadeSampler(n, cache=cache, batch_size=16, importance=False, pads=False,
                            rep_factor=0.0, seed=2, epoch_size=150)
        s.set_epoch(0)
        state = s.state_dict()
        head = s.next_epoch_order()
        list(iter(s))                        # epoch 0 read to the end: next uses in the head
        if jump == "set_epoch":
            s.set_epoch(3)
        else:
            s.end_epoch(0.0)
            list(iter(s))
            s.end_epoch(0.0)
            s.load_state_dict(state)         # back to epoch 0's checkpoint
            s.set_epoch(int(state.get("epoch", 0)))
            list(iter(s))                    # read again; then an epoch other than the head's
            s.set_epoch(7)
        nu = b.orders.next_use(np.arange(n))
        stale = [i for i in head.tolist() if nu[i] == -1]
        assert stale, "the case needs ids that left every published order"
        assert all(pushed.get(i, -1) == -1 for i in stale), [(i, pushed[i]) for i in stale[:5]]
        assert all(pushed.get(i, -1) == nu[i] for i in range(n) if i in pushed)
        val = b"v" * 1000
        refused = 0
        for i in stale:                      # fill the cache with them
            refused += not np.asarray(cache.put_many([i], [val]), bool)[0]
        assert refused, "the cache must be full of stale ids for the next put to evict one"
        y = int(s.order()[0])                # the next real read is admitted over them
        assert np.asarray(cache.put_many([y], [val]), bool)[0]
        cache.check()


def _process_with_pid(pid):
    """A live process (a sleep) under `pid`, which a process now gone had: the kernel gives the
    next fork the pid after ns_last_pid. Skips where this cannot be arranged (not root, another
    process takes the pid first every time)."""
    import subprocess
    import sys
    for _ in range(50):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError as exc:
            pytest.skip(f"cannot choose the next pid here: {exc}")
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.skip(f"pid {pid} was taken by others every time")


def test_a_reader_does_not_wait_for_a_killed_prefetcher_whose_pid_names_another_process(board_name):
    """A prefetcher killed while reading leaves ON_WAY flags; once its pid names another process
    (pids are reused), a reader must not take that process for the prefetcher and wait out its
    timeout on every batch that holds a flagged id."""
    import subprocess
    import sys
    with OrderBoard.create(board_name, 100) as b:
        prefetcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        b.control.set_prefetcher(prefetcher.pid)
        b.flags.mark_on_way([5, 6])
        assert b.control.prefetcher_alive()
        time.sleep(0.05)   # a start time is in clock ticks (10 ms): the next process starts later
        prefetcher.send_signal(signal.SIGKILL)
        prefetcher.wait()
        assert not b.control.prefetcher_alive()
        other = _process_with_pid(prefetcher.pid)
        try:
            assert not b.control.prefetcher_alive()
            t0 = time.monotonic()
            assert b.flags.wait_for(np.array([5, 7]), 3.0).tolist() == [True, False]
            assert time.monotonic() - t0 < 1.0
        finally:
            other.kill()
            other.wait()


def test_a_dropped_board_unmaps_without_the_cyclic_collector(board_name):
    """The board's parts refer to each other only weakly: a board dropped without close() gives
    its mapping back at once (an unlinked board's /dev/shm pages with it), not at the next
    cyclic collection."""
    import gc
    board = OrderBoard.create(board_name, 10_000, streams=2)
    path = board.path
    board.orders.publish(0, 0, np.arange(100))
    board.counters.count_reads(0, samples=7, hits=3, prefetch_hits=0, wait_ns=0)   # counters -> orders
    assert sum(row.get("samples", 0) for row in board.counters.epoch_counters()) == 7
    board.unlink()
    gc.disable()
    try:
        del board
        with open("/proc/self/maps") as maps:
            assert not any(path in line for line in maps)
    finally:
        gc.enable()
