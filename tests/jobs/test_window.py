"""The prefetcher's window over every job's published order (lookahead/read_ahead.py: Window):
the lookahead is the whole window, shared equally by the streams that published, merged by
distance from each stream's cursor."""
import numpy as np

import shadecache as sc
from shadecache.lookahead.board import OrderBoard
from shadecache.lookahead.read_ahead import Window

N = 4000


def test_the_streams_that_published_share_the_lookahead_equally(cache_name):
    with sc.Cache.create(cache_name, num_samples=N, capacity_bytes=1 << 20):
        a = OrderBoard.join(cache_name, N, job="a")
        b = OrderBoard.join(cache_name, N, job="b")
        try:
            a.orders.publish(0, 0, np.arange(N), epoch_length=N)
            alone = Window(a.all_jobs, 400)
            assert alone.ids.tolist() == list(range(400))           # one stream: all of it
            b.orders.publish(0, 0, np.arange(N)[::-1].copy(), epoch_length=N)
            both = Window(a.all_jobs, 400)
            assert both.ids.size == 400
            # by distance: a's i-th and b's i-th next, alternately, each 200 deep
            assert set(both.ids.tolist()) == set(range(200)) | set(range(N - 200, N))
            assert both.ids[:4].tolist() == [0, N - 1, 1, N - 2]
        finally:
            for board in (a, b):
                board.leave()
                board.close()
