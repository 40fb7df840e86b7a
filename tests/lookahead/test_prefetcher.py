"""The prefetcher (shadecache/lookahead/prefetcher.py), a real background process reading real files into a
real shared-memory cache: the loader reads the same bytes in the same order with it as without
it; many processes and a crashing writer run next to it; a prefetcher SIGKILLed mid-batch leaves
check() passing and the job running; it stops cleanly, alone per node, and with the last job on the node."""
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

import shadecache as sc
from shadecache.lookahead.board import OrderBoard
from planted_modules import run_among_planted_modules
from prefetch_waits import wait_for_reads
from values import make_value, verify_value

N = 1200


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "s.shc"
    with sc.PackWriter(path) as w:
        for i in range(N):
            w.add(make_value(i, 0, 1500 + (i * 37) % 400), i % 10)
    return path


@pytest.fixture
def name():
    n = f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    for p in (f"/dev/shm/shadecache-order.{n}",):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _train(store, cache, epochs, workers=0, step_s=0.0):
    """What the loop sees: [(ids, bytes)] per batch, over `epochs` epochs of a real DataLoader."""
    from torch.utils.data import DataLoader
    ds = sc.CachedDataset(store, cache, decode=bytes)
    sampler = sc.ShadeSampler(ds, cache=cache, batch_size=32, importance=False, pads=False,
                              rep_factor=0.0, seed=5)
    seen = []
    for e in range(epochs):
        sampler.set_epoch(e)
        loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=workers,
                            collate_fn=lambda items: items)
        for items in loader:
            seen.append([(i, x) for x, _, i in items])
            if step_s:
                time.sleep(step_s)
        sampler.end_epoch(0.0)
    return seen, ds.stats()


@pytest.mark.parametrize("workers", [0, 2])
def test_same_bytes_in_the_same_order_with_and_without_prefetch(store_path, name, workers):
    store = sc.PackedStore(store_path)
    cap = 1 << 20           # about 600 of the 1200 samples (1.5-1.9 KB): a third to a half
    with sc.Cache.create(name + "off", num_samples=N, capacity_bytes=cap, sizes=store.lengths) as c:
        off, off_stats = _train(store, c, 2, workers)
    with sc.Cache.create(name, num_samples=N, capacity_bytes=cap, sizes=store.lengths) as c, \
            OrderBoard.create(name, N):
        with sc.Node(store, c).prefetcher(lookahead_samples=128, batch=32) as pf:
            on, on_stats = _train(store, c, 2, workers, step_s=0.01)
            assert pf.alive()
        c.check()
    assert on == off
    for batch in on:
        for i, x in batch:
            assert verify_value(i, x) == ""
    assert off_stats["prefetch_hits"] == 0 and "prefetched" not in off_stats
    # the prefetcher did its work: most reads were served by samples it brought
    assert on_stats["prefetched"] > N // 3
    assert on_stats["prefetch_hits"] > N // 3
    # by how much depends on how far ahead the prefetcher keeps on a loaded machine (0.3 to 0.75
    # more seen here); that figure is bench/bench_prefetch.py's, this only says it helped
    assert on_stats["hit_ratio"] > off_stats["hit_ratio"] + 0.1
    assert on_stats["per_epoch"] == on_stats["prefetch_per_epoch"]
    # the last end_epoch published epoch 2 ahead (publish_ahead): the prefetcher may have begun
    # reading it before it stopped, but no loader read any of it
    rows = [r for r in on_stats["per_epoch"] if r["epoch"] < 2]
    assert all(r["epoch"] == 2 and r["samples"] == 0 for r in on_stats["per_epoch"][2:])
    assert [r["epoch"] for r in rows] == [0, 1]
    # per epoch, what the loop read (counted by every worker, atomic adds on the board)
    assert [r["samples"] for r in rows] == [N, N]
    assert sum(r["hits"] for r in rows) == on_stats["hits"]
    assert sum(r["prefetch_hits"] for r in rows) == on_stats["prefetch_hits"]
    assert abs(sum(r["wait_s"] for r in rows) - on_stats["wait_s"]) < 1e-6
    assert rows[1]["prefetch_hits"] > 0 and rows[1]["prefetched"] > 0


def test_a_prefetcher_sigkilled_mid_batch_leaves_the_cache_consistent(store_path, name):
    """Kill it at random moments while it reads and inserts; the loader goes on reading right
    bytes, check() passes after each kill, and a new prefetcher takes over."""
    store = sc.PackedStore(store_path)
    with sc.Cache.create(name, num_samples=N, capacity_bytes=1 << 20) as c, \
            OrderBoard.create(name, N) as board:
        from torch.utils.data import DataLoader
        ds = sc.CachedDataset(store, c, decode=bytes)
        sampler = sc.ShadeSampler(ds, cache=c, batch_size=32, importance=False, pads=False,
                                  rep_factor=0.0)
        rng = random.Random(0)
        kills = 0
        for e in range(3):
            sampler.set_epoch(e)
            pf = sc.Node(store, c).prefetcher(lookahead_samples=200, batch=16).start()
            kill_at = rng.uniform(0.02, 0.12)
            t0 = time.monotonic()
            for items in DataLoader(ds, batch_size=32, sampler=sampler, collate_fn=lambda x: x):
                for x, _, i in items:
                    assert verify_value(i, x) == ""
                if pf.proc is not None and time.monotonic() - t0 > kill_at:
                    os.kill(pf.pid, signal.SIGKILL)
                    pf.proc.wait()
                    pf.proc = None
                    kills += 1
                    c.check()
                    assert board.control.prefetcher_pid != 0          # the dead one is still registered
                    pf = sc.Node(store, c).prefetcher(lookahead_samples=200, batch=16).start()
                    t0, kill_at = time.monotonic(), rng.uniform(0.02, 0.12)
                time.sleep(0.01)
            assert pf.stop() == 0
            sampler.end_epoch(0.0)
        assert kills >= 3
        c.check()
        assert board.control.prefetcher_pid == 0


def _rank(name, path, stream, epochs, out):
    """One training process of a 4-rank node: its own stream on the board."""
    os.environ["LOCAL_RANK"] = str(stream)
    store = sc.PackedStore(path)
    cache = sc.Cache.attach(name)
    ds = sc.CachedDataset(store, cache, decode=bytes)
    sampler = sc.ShadeSampler(ds, cache=cache, batch_size=16, importance=False, pads=False,
                              rep_factor=0.0, num_replicas=4, rank=stream)
    faults, n = [], 0
    for e in range(epochs):
        sampler.set_epoch(e)
        it = iter(sampler)          # taken a batch at a time, as a DataLoader does
        while True:
            batch = [i for _, i in zip(range(16), it)]
            if not batch:
                break
            for i, x in zip(batch, ds.fetch_bytes(batch)):
                n += 1
                if verify_value(i, x):
                    faults.append(verify_value(i, x))
            time.sleep(0.002)
        sampler.end_epoch(0.0)
    out.put((n, faults[:5], ds.stats()["prefetch_hits"]))


def test_four_processes_with_a_prefetcher(store_path, name):
    store = sc.PackedStore(store_path)
    ctx = mp.get_context("spawn")
    with sc.Cache.create(name, num_samples=N, capacity_bytes=1 << 20) as c, \
            OrderBoard.create(name, N, streams=4) as board:
        with sc.Node(store, c).prefetcher(lookahead_samples=60, batch=16) as pf:
            out = ctx.Queue()
            procs = [ctx.Process(target=_rank, args=(name, str(store_path), r, 2, out))
                     for r in range(4)]
            for p in procs:
                p.start()
            results = [out.get(timeout=120) for _ in procs]
            for p in procs:
                p.join(30)
                assert p.exitcode == 0
            assert pf.alive()
        assert sum(r[0] for r in results) == 2 * N
        assert all(not r[1] for r in results), [r[1] for r in results]
        # four processes added their reads to the same per-epoch rows: none lost
        rows = board.counters.epoch_counters()
        assert [(r["epoch"], r["samples"]) for r in rows if r["samples"]] == [(0, N), (1, N)]
        assert sum(r["prefetch_hits"] for r in rows) == sum(r[2] for r in results)
        # end_epoch(1) published epoch 2's order ahead (publish_ahead): read by no loader yet
        assert all(board.orders.stream_state(s)["epoch"] == 2 for s in range(4))
        assert all(r["samples"] == 0 for r in rows if r["epoch"] == 2)
        assert board.counters.totals()["prefetched"] > 0
        c.check()


def _crashing_writer(name, seed):
    from crashing import attach_armed
    cache = attach_armed(name, 0, 0)
    rng = random.Random(seed)
    step = 0
    while True:
        step += 1
        ids = [rng.randrange(N) for _ in range(8)]
        cache.put_many(ids, [make_value(i, 0, 1500 + (i * 37) % 400) for i in ids])
        if rng.random() < 0.3:
            cache.remove(rng.randrange(N))


def test_writers_killed_next_to_a_running_prefetcher(store_path, name):
    store = sc.PackedStore(store_path)
    ctx = mp.get_context("fork")
    with sc.Cache.create(name, num_samples=N, capacity_bytes=1 << 20) as c, \
            OrderBoard.create(name, N) as board:
        sampler = sc.ShadeSampler(N, cache=c, batch_size=32, importance=False, pads=False,
                                  rep_factor=0.0)
        with sc.Node(store, c).prefetcher(lookahead_samples=200, batch=16) as pf:
            sampler.set_epoch(0)
            it = iter(sampler)
            for k in range(12):
                w = ctx.Process(target=_crashing_writer, args=(name, k))
                w.start()
                for _ in range(40):             # the loader advances: the prefetcher reads
                    next(it, None)
                time.sleep(random.uniform(0.01, 0.06))
                os.kill(w.pid, signal.SIGKILL)
                w.join()
                for i in range(0, N, 97):
                    v = c.get(i)
                    assert v is None or verify_value(i, v) == ""
            assert pf.alive()
            c.check()
        c.check()


def test_one_prefetcher_per_node_and_a_clean_stop(store_path, name):
    store = sc.PackedStore(store_path)
    with sc.Cache.create(name, num_samples=N, capacity_bytes=1 << 20) as c, \
            OrderBoard.create(name, N) as board:
        pf = sc.Node(store, c).prefetcher().start()
        with pytest.raises(RuntimeError, match="already has a prefetcher"):
            sc.Node(store, c).prefetcher().start()
        assert pf.stop() == 0 and board.control.prefetcher_pid == 0
        with pytest.raises(TypeError, match="unknown options"):
            sc.Node(store, c).prefetcher(lookahead=3)
        with pytest.raises(ValueError):
            sc.Node(store, c).prefetcher(batch=0)
    with sc.Cache.create(name, num_samples=N, capacity_bytes=1 << 20) as c:
        with pytest.raises(FileNotFoundError):
            sc.Node(store, c, read_ahead=False).prefetcher()   # no order board for this cache


@pytest.mark.parametrize("with_ssd", [False, True])
def test_a_readers_late_wanted_flag_is_cleared_with_or_without_an_ssd_tier(store_path, name,
                                                                          tmp_path, with_ssd):
    """A reader that waits for a sample on its way flags it WANTED, and that store may land just
    after the prefetcher offered the sample (board.py's contract): the prefetcher clears WANTED
    on what it does not hold on each pass, or every later reader of that sample waits the full
    ON_WAY_WAIT_S for it. Without an SSD tier the flag stayed (and a prefetcher that reads
    nothing more, a full cache under the extent order, never clears it)."""
    store = sc.PackedStore(store_path)
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=4 << 20) if with_ssd else None
    with sc.Cache.create(name, num_samples=N, capacity_bytes=1 << 20) as c, \
            OrderBoard.create(name, N) as board:
        pf = sc.Node(store, c, ssd=ssd).prefetcher().start()
        try:
            ids = np.array([5, 7])
            board.flags.mark_on_way(ids)           # on its way, then offered: the reader's store lands late
            board.flags.wait_for(ids, 0.0)
            deadline = time.monotonic() + 10
            while board.flags.on_way(ids).any() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not board.flags.on_way(ids).any()
        finally:
            assert pf.stop() == 0
            if ssd is not None:
                ssd.close()


def test_the_prefetcher_reads_the_ssd_tier_before_the_store(store_path, name, tmp_path):
    """The prefetcher reads through the node's tier chain: what the SSD tier holds comes from the
    SSD tier, not the store. The SSD tier here holds other bytes than the store for some ids (the
    tier checks its own crc32c, not the store's), so the bytes in the cache say which tier served."""
    store = sc.PackedStore(store_path)
    ssd = sc.SSDTier(tmp_path / "ssd", capacity_bytes=8 << 20, fingerprint=store.fingerprint)
    marked = list(range(0, 200, 4))
    ssd.put_many(marked, [b"ssd:" + bytes(str(i), "ascii") for i in marked])
    ssd.flush()
    order = np.arange(200)
    with sc.Cache.create(name, num_samples=N, capacity_bytes=4 << 20, sizes=store.lengths) as c, \
            OrderBoard.create(name, N) as board:
        board.orders.publish(0, 0, order)
        with sc.Node(store, c, ssd=ssd).prefetcher(lookahead_samples=200, batch=32):
            # with an SSD tier it holds what it read until a reader asks, and offers it all to
            # the cache when it stops
            wait_for_reads(board, order.size)
        assert c.cached_mask()[order].all()
        got = c.get_many(order)
        assert [got[i] for i in marked] == [b"ssd:" + bytes(str(i), "ascii") for i in marked]
        rest = [i for i in order.tolist() if i not in set(marked)]
        assert [got[i] for i in rest] == store.read_many(rest)
        c.check()
    ssd.close()


def test_a_prefetcher_alone_on_its_node_dies_with_the_job_that_started_it(store_path, name, tmp_path):
    """A job SIGKILLed, alone on its node, leaves no prefetcher behind: it exits once no job lives
    on the board."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time, shadecache as sc
        store = sc.PackedStore({str(store_path)!r})
        c = sc.Cache.create({name!r}, num_samples={N}, capacity_bytes=1 << 20)
        b = sc.OrderBoard.create({name!r}, {N})
        pf = sc.Node(store, c).prefetcher().start()
        print(pf.pid, flush=True)
        time.sleep(60)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    job = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    pid = int(job.stdout.readline())
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the prefetcher outlived its job")
    sc.cache.remove(name)


def test_shadecache_stats_shows_the_prefetch_counters(store_path, name):
    store = sc.PackedStore(store_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with sc.Cache.create(name, num_samples=N, capacity_bytes=1 << 20) as c, \
            OrderBoard.create(name, N) as board:
        sampler = sc.ShadeSampler(N, cache=c, batch_size=32, importance=False, pads=False,
                                  rep_factor=0.0)
        sampler.set_epoch(0)
        it = iter(sampler)
        next(it)                                      # published; the cursor stays at 0
        with sc.Node(store, c).prefetcher(lookahead_samples=100, batch=25):
            deadline = time.monotonic() + 30
            while board.counters.totals()["reads_issued"] < 100 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)
        res = subprocess.run([sys.executable, "-m", "shadecache.cli", "stats", name],
                             capture_output=True, text=True, cwd=root, timeout=120)
        assert res.returncode == 0, res.stderr
        import json
        pf = json.loads(res.stdout)["prefetch"]
        assert pf["prefetched"] == board.counters.totals()["prefetched"]
        assert pf["reads_issued"] >= 100                 # the window (a swap may re-read a few)
        assert 0 < c.stats()["items"] <= pf["prefetched"]   # swaps remove some it brought
        assert pf["per_epoch"][0]["epoch"] == 0 and pf["prefetcher_pid"] == 0
        assert {"samples", "hits", "prefetch_hits", "wait_s"} <= set(pf["per_epoch"][0])


def test_the_prefetcher_reads_an_epoch_before_its_first_batch_is_asked_for(store_path, name):
    # set_epoch publishes the order (publish_ahead); the automatic lookahead (no
    # lookahead_samples) reads the epoch's first misses while nothing iterates the sampler
    store = sc.PackedStore(store_path)
    with sc.Cache.create(name, num_samples=N, capacity_bytes=1 << 20,
                         sizes=store.lengths) as c, OrderBoard.create(name, N) as board:
        sampler = sc.ShadeSampler(N, cache=c, batch_size=32, importance=False, pads=False,
                                  rep_factor=0.0, seed=3)
        with sc.Node(store, c).prefetcher(batch=16):
            sampler.set_epoch(0)
            first = sampler.order()[:32]
            deadline = time.monotonic() + 30
            while not c.cached_mask()[first].all() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert c.cached_mask()[first].all()
            assert board.orders.stream_state(0)["cursor"] == 0      # no id was taken yet
            seq = board.orders.stream_state(0)["seq"]
            assert list(iter(sampler)) == sampler.order().tolist()
            assert board.orders.stream_state(0)["seq"] == seq       # __iter__ took the published order
            for i, x in zip(first.tolist(), c.get_many(first.tolist())):
                assert verify_value(i, x) == ""
        c.check()


def test_the_prefetcher_reads_the_next_epochs_first_misses_before_the_epoch_ends(store_path, name):
    # A uniform order the cache does not rearrange is known an epoch ahead: the board shows the
    # next epoch's head behind this one's, so once the loader has taken the last batch of this
    # epoch the prefetcher reads the next epoch's first misses before end_epoch draws them.
    store = sc.PackedStore(store_path)
    with sc.Cache.create(name, num_samples=N, capacity_bytes=1 << 20, policy="clairvoyant",
                         sizes=store.lengths) as c, OrderBoard.create(name, N) as board:
        sampler = sc.ShadeSampler(N, cache=c, batch_size=32, importance=False, pads=False,
                                  rep_factor=0.0, seed=3)
        sampler.set_epoch(0)
        head = sampler.next_epoch_order()[:32]
        with sc.Node(store, c).prefetcher(batch=16):
            assert list(iter(sampler)) == sampler.order().tolist()   # the whole epoch taken
            deadline = time.monotonic() + 30
            while not c.cached_mask()[head].all() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert c.cached_mask()[head].all()
            assert board.orders.stream_state(0)["epoch"] == 0     # epoch 1 is not published yet
            assert board.flags.prefetched(head).all()                 # brought by the prefetcher
            sampler.end_epoch(0.0)
            assert sampler.order()[:32].tolist() == head.tolist()
            for i, x in zip(head.tolist(), c.get_many(head.tolist())):
                assert verify_value(i, x) == ""
        c.check()


def test_the_automatic_lookahead_follows_the_pace():
    from shadecache.lookahead.pace import Pace as _Pace
    p = _Pace(batch=16, max_batches=4, cache_items=2000)
    assert p.window(10_000) == 64                  # nothing measured: max_batches batches
    p.saw_window(100, 25)                          # a quarter of the window is to read
    assert p.window(10_000) == 256
    p.saw_cursors(0.0, {0: (0, 0)})
    p.saw_cursors(0.1, {0: (0, 1000)})             # 10,000 samples/s
    p.saw_cursors(0.2, {0: (1, 5)})                # a new epoch: no rate sample from it
    assert p.rate == pytest.approx(10_000)
    p.saw_batch(0.02)                              # 20 ms a batch: 3 x 200 samples ahead
    assert p.window(10_000) == 600 and p.window(300) == 300
    p.saw_batch(0.2)                               # slower reads: capped at half the cache
    assert p.window(10_000) == 1000


def test_the_automatic_lookahead_never_exceeds_half_a_small_cache():
    # a cache of fewer items than two prefetch batches: the window (and so each batch read into
    # it) stays within half the cache, never a batch larger than the cache itself
    from shadecache.lookahead.pace import Pace as _Pace
    for items in (1, 2, 7, 100, 511):
        p = _Pace(batch=256, max_batches=4, cache_items=items)
        assert 1 <= p.window(10_000) <= max(1, items // 2)
        p.saw_window(100, 100)
        p.saw_cursors(0.0, {0: (0, 0)})
        p.saw_cursors(1.0, {0: (0, 50_000)})
        p.saw_batch(1.0)
        assert 1 <= p.window(10_000) <= max(1, items // 2)
    p = _Pace(batch=256, max_batches=4, cache_items=0)   # nothing fits: one id at a time
    assert p.window(10_000) == 1


@pytest.mark.parametrize("step_mode", ["spin", "sleep"])
def test_bench_prefetch_short_run_produces_the_table_and_the_png(tmp_path, step_mode):
    """A seconds-long bench/bench_prefetch.py (the stall figures are its full run's), so the
    benchmark cannot rot: one latency, both loaders, with and without the prefetcher."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    png = tmp_path / "stall.png"
    res = subprocess.run([sys.executable, os.path.join(root, "bench", "bench_prefetch.py"),
                          "--samples", "384", "--sample-kb", "4", "--epochs", "2", "--latencies-ms", "1",
                          "--policies", "clairvoyant", "--step-ms", "1", "--step-mode", step_mode,
                          "--dir", str(tmp_path / "data"), "--png", str(png)],
                         capture_output=True, text=True, timeout=300)
    # exit status 1 says a target missed, which a seconds-long run proves nothing about
    assert res.returncode in (0, 1) and "Traceback" not in res.stderr, res.stderr[-3000:]
    rows = [line.split("|") for line in res.stdout.splitlines() if line.startswith("| dataloader |")
            or line.startswith("| cached |")]
    assert [(r[1].strip(), r[2].strip(), r[3].strip()) for r in rows] == [
        ("dataloader", "clairvoyant", "1 ms"), ("cached", "clairvoyant", "1 ms")]
    for r in rows:
        assert float(r[4].split()[0]) > 0 and float(r[5].split()[0]) > 0   # stall without / with
    assert f"step 1 ms ({step_mode})" in res.stdout
    assert png.stat().st_size > 0
    assert not os.listdir(tmp_path / "data"), "the packed store is removed after the run"


def test_the_prefetcher_imports_nothing_from_the_working_directory(store_path, name, tmp_path):
    """A job runs in a world-writable working directory that holds planted modules named like
    those the prefetcher process imports: the prefetcher (started from a script elsewhere, in
    that directory) runs none of them, registers on the board and stops cleanly."""
    out, ran = run_among_planted_modules(
        tmp_path, ("numpy", "pickle", "ctypes", "signal", "subprocess", "runpy", "shadecache"), f"""
        import shadecache as sc
        store = sc.PackedStore({str(store_path)!r})
        with sc.Cache.create({name!r}, num_samples={N}, capacity_bytes=1 << 20) as c, \\
                sc.OrderBoard.create({name!r}, {N}):
            pf = sc.Node(store, c).prefetcher().start()
            print("stopped", pf.stop(), flush=True)
    """)
    assert not ran, ran
    assert out.stdout.strip() == "stopped 0", out.stdout + out.stderr


def test_a_reader_that_asks_during_a_hand_over_is_not_left_waiting(name):
    """The hand-over thread hands over only when something moved (a stream, a reader's WANTED):
    a reader that asks for a held sample while a hand-over runs (the SSD tier's flush of the one
    before it, say) is seen at the next poll, not left to wait ON_WAY_WAIT_S and read the sample
    itself."""
    import collections
    import threading

    from shadecache.lookahead.read_ahead import Held, ReadAhead
    from shadecache.tiers import Read

    board = OrderBoard.create(name, 100, streams=1)
    try:
        board.orders.publish(0, 0, np.arange(100))
        board.control.set_prefetcher(os.getpid())       # this process stands for the live prefetcher
        loop = ReadAhead.__new__(ReadAhead)      # the hand-over thread's state, no process
        loop.board, loop.held, loop.mu, loop.done = board, Held(), threading.Lock(), threading.Event()
        loop.jobs = board.all_jobs               # every job's orders: here the one job's
        loop.options, loop.inflight = {"poll_s": 0.002}, collections.deque()
        landed, readers, helper = {}, [], None

        def held_read(i):
            r = Read(np.array([i], np.int64), np.ones(1, bool))
            r.values = [b"x"]
            return r

        def ask(i):          # a reader's wait for a sample on its way (it sets WANTED)
            board.flags.wait_for(np.array([i]), 3.0)

        def land(read, epoch):   # stands for the admission (put_many, the SSD tier's flush)
            i = int(read.ids[0])
            landed[i] = time.monotonic()
            board.flags.unmark(read.ids)
            if i == 50:          # a second reader asks for 60 while 50 is being offered
                reader = threading.Thread(target=ask, args=(60,))
                reader.start()
                readers.append(reader)     # started first: the test joins what it finds here
                time.sleep(0.05)
        loop._land = land
        for i in (50, 60):     # ahead of the cursor: due only when asked for
            loop.held.add(held_read(i), 0, np.array([i]), np.array([1]))
        board.flags.mark_on_way(np.array([50, 60]))
        helper = threading.Thread(target=loop._hand_over_loop, daemon=True)
        helper.start()
        time.sleep(0.05)
        t0 = time.monotonic()
        ask(50)           # returns once 50 is offered: its reader for 60 may not have started yet
        while 60 not in landed and time.monotonic() - t0 < 5.0:
            time.sleep(0.005)
        for t in readers:
            t.join(5)
        assert 60 in landed and landed[60] - t0 < 1.0, landed
    finally:
        if helper is not None:        # stopped before the board goes: the thread reads the board
            loop.done.set()
            helper.join(30)
        board.control.set_prefetcher(0)
        board.close()
        board.unlink()
