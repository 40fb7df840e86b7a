"""Waiting on a running prefetcher from a test: the board's counters say what it has read."""
import time


def wait_for_reads(board, count: int, timeout: float = 60.0) -> None:
    """Returns once the prefetcher has issued reads for `count` samples (board totals); fails the
    test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while board.counters.totals()["reads_issued"] < count:
        assert time.monotonic() < deadline, "the prefetcher did not read the window"
        time.sleep(0.05)
