"""The prefetcher's window over every job's published order (lookahead/read_ahead.py: Window):
the lookahead is the node's whole window, a depth shared equally by the streams with ids left,
merged by distance from each stream's cursor."""
import contextlib

import numpy as np

import shadecache as sc
from shadecache.lookahead.board import OrderBoard
from shadecache.lookahead.read_ahead import Window

N = 4000


@contextlib.contextmanager
def _two_jobs(cache_name):
    with sc.Cache.create(cache_name, num_samples=N, capacity_bytes=1 << 20):
        a = OrderBoard.join(cache_name, N, job="a")
        b = OrderBoard.join(cache_name, N, job="b")
        try:
            yield a, b
        finally:
            for board in (a, b):
                board.leave()
                board.close()


def test_the_streams_that_published_share_the_lookahead_equally(cache_name):
    with _two_jobs(cache_name) as (a, b):
        a.orders.publish(0, 0, np.arange(N), epoch_length=N)
        alone = Window(a.all_jobs, 400)
        assert alone.ids.tolist() == list(range(400))           # one stream: all of it
        b.orders.publish(0, 0, np.arange(N)[::-1].copy(), epoch_length=N)
        both = Window(a.all_jobs, 400)
        assert both.ids.size == 400
        # by distance: a's i-th and b's i-th next, alternately, each 200 deep
        assert set(both.ids.tolist()) == set(range(200)) | set(range(N - 200, N))
        assert both.ids[:4].tolist() == [0, N - 1, 1, N - 2]


def test_a_stream_with_nothing_left_takes_no_share(cache_name):
    """A job at the end of its epoch (idle, in evaluation, finished) reads nothing ahead: the
    others read as deep as the lookahead allows."""
    with _two_jobs(cache_name) as (a, b):
        a.orders.publish(0, 0, np.arange(N), epoch_length=N)
        b.orders.publish(0, 0, np.roll(np.arange(N), -N // 2), epoch_length=N)   # ids N/2.., 0..
        b.orders.set_cursor(0, N - 50)                          # b's last 50: N/2-50..N/2-1
        assert sorted(Window(a.all_jobs, 400).ids.tolist()) == list(range(200)) + list(range(N // 2 - 50, N // 2))
        b.orders.set_cursor(0, N)
        assert Window(a.all_jobs, 400).ids.tolist() == list(range(400))


def test_a_sample_two_streams_share_is_read_once_at_the_same_depth(cache_name):
    with _two_jobs(cache_name) as (a, b):
        a.orders.publish(0, 0, np.arange(N), epoch_length=N)
        b.orders.publish(0, 0, np.arange(N), epoch_length=N)    # the same order: jobs that follow the node
        assert Window(a.all_jobs, 400).ids.tolist() == list(range(200))
