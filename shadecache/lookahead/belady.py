"""Belady's offline bound: the hits of optimal replacement (MIN) on a known sequence of reads."""
import heapq

import numpy as np


def belady_hits(trace, capacity: int) -> int:
    """Hits of Belady's optimal replacement (MIN, with bypass: a miss is not kept when it is
    needed later than everything cached) on `trace` for a cache of `capacity` equal-size items.

    The offline bound for any policy on that exact sequence of reads; O(T log capacity)."""
    trace = np.asarray(trace, dtype=np.int64)
    t = trace.size
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if t == 0 or capacity == 0:
        return 0
    # nxt[j]: the next position of trace[j] after j (t = never)
    srt = np.lexsort((np.arange(t), trace))
    nxt = np.full(t, t, dtype=np.int64)
    same = trace[srt[1:]] == trace[srt[:-1]]
    nxt[srt[:-1][same]] = srt[1:][same]
    nxt_l = nxt.tolist()
    cached = {}          # id -> its next use (the key in the heap)
    heap = []            # (-next use, id), lazily deleted
    hits = 0
    for j, x in enumerate(trace.tolist()):
        nu = nxt_l[j]
        if x in cached:
            hits += 1
        elif len(cached) >= capacity:
            # the farthest next use among the cached items and the incoming one goes
            while True:
                neg, y = heap[0]
                if cached.get(y) == -neg:
                    break
                heapq.heappop(heap)
            if -heap[0][0] <= nu:
                continue          # bypass: the newcomer is needed last
            heapq.heappop(heap)
            del cached[y]
        cached[x] = nu
        heapq.heappush(heap, (-nu, x))
    return hits
