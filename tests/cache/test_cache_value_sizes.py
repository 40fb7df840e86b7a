"""Values at the edges of a cache's geometry: 0 bytes, exactly a chunk, a chunk and one byte, the
lengths whose head slot (16 bytes, 4 per chunk, the tail) is largest, and max_item_bytes itself.
Every length a cache accepts must fit its head in one page, round-trip, and find memory in a cache
full of other values; every longer one is refused with ValueTooLargeError. The puts run in a
forked writer, so that a writer that crashes fails the test instead of ending the run."""
import multiprocessing as mp

import pytest

import shadecache as sc
from values import make_value, verify_value

KiB = 1 << 10
MiB = 1 << 20


def _edge_lengths(chunk, top):
    """0, a chunk and its neighbours, the longest tail behind the most chunks below `top` (the
    largest head of any accepted length), and `top` with its neighbours below."""
    widest_head = (top // chunk) * chunk - 1   # chunk - 1 tail bytes behind top // chunk - 1 chunks
    out = {0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk - 1, widest_head, top - 1, top}
    # Every length just below a whole number of chunks near the top: the heads there are widest.
    for k in range(max(1, top // chunk - 3), top // chunk + 1):
        out.add(k * chunk - 1)
    return sorted(n for n in out if 0 <= n <= top)


def _in_writer(fn):
    """Runs fn() in a forked process; its exit code (a signal is negative)."""
    p = mp.get_context("fork").Process(target=fn)
    p.start()
    p.join(120)
    return p.exitcode


# Page sizes 4 KiB, 8 KiB and 64 KiB: where a head of max_item_bytes' order could outgrow a page.
@pytest.mark.parametrize("capacity", [300 * KiB, 1000 * KiB, 100 * MiB], ids=["4KiB-pages", "8KiB-pages", "64KiB-pages"])
def test_every_accepted_length_fits_its_head_in_a_page_and_round_trips(cache_name, capacity):
    with sc.Cache.create(cache_name, num_samples=4, capacity_bytes=capacity, policy="lru") as c:
        s = c.stats()
        chunk, page, top = s["chunk_size"], s["page_size"], c.max_item_bytes
        lengths = _edge_lengths(chunk, top)

        def writer():
            for k, n in enumerate(lengths):
                v = make_value(k % 4, n, n) if n >= 20 else bytes([k % 251]) * n
                assert c.put(k % 4, v), f"a value of {n} bytes (max_item_bytes {top}) was refused"
                assert c.get(k % 4) == v, f"a value of {n} bytes came back changed"

        code = _in_writer(writer)
        assert code == 0, (f"the writer of lengths up to max_item_bytes={top} (page {page}, chunk {chunk}) "
                           f"exited with {code}")
        c.check()
        assert c.stats()["recoveries"] == 0
        with pytest.raises(sc.ValueTooLargeError):
            c.put(0, b"x" * (top + 1))
        c.check()


@pytest.mark.parametrize("policy", ["lru", "importance"])
def test_the_largest_value_displaces_a_cache_full_of_small_values(cache_name, policy):
    """max_item_bytes is what the cache holds: a value that large is admitted into a cache whose
    memory went to thousands of small values (and to the heap pages that key them), and the put
    that evicts them all is not refused at the end."""
    n = 5000
    with sc.Cache.create(cache_name, num_samples=n, capacity_bytes=MiB, policy=policy) as c:
        for i in range(n - 1):
            assert c.put(i, make_value(i, 0, 24), score=0.5)
        assert c.stats()["heap_pages"] >= 2, c.stats()
        big = make_value(n - 1, 1, c.max_item_bytes)
        assert c.put(n - 1, big, score=1.0), c.stats()
        assert c.get(n - 1) == big
        c.check()
        for i, v in enumerate(c.get_many(range(n - 1))):
            assert v is None or verify_value(i, v) == ""
        # And back: the small values take the memory again.
        for i in range(2000):
            assert c.put(i, make_value(i, 2, 24), score=2.0)
        c.check()
