"""The node's prefetcher: reads the upcoming misses of every rank into the cache ahead of the loader.

    node = sc.Node(store, cache, ssd=ssd)     # read_ahead=True: starts it when a sampler publishes
    with node.prefetcher(lookahead_samples=4096, lookahead_bytes=256 << 20):   # or by hand
        ...train: ShadeSampler publishes each epoch's order on the board as the loader iterates...

One per node (start() refuses while another one registered on the board lives), a background
process of its own (this module, started by start() in an isolated interpreter as `python -m`
would run it, minus the working directory on its import path: shadecache/process.py): the
training processes keep their GIL and their cores, and a prefetcher killed at any point (SIGKILL
included) can leave nothing half-done that matters. Its only writes to the cache are put_many and
remove, the engine's crash-safe writers (robust mutex, repair by the next locker), so check()
passes after any kill; its writes to the board are counters and flags, which no reader trusts for
correctness.

The process reads through the node it was started for (its tier chain, admission rule and read
plan: sc.Node.for_process), so it reads what the node's loaders would read, from the same tiers.
What it reads next is the plan's (plan.py, a pure function); the loop around the plan is
read_ahead.py; how far ahead it reads, pace.py. When it starts it publishes its read rule and
reach on the board (board.READS_*: the samplers' stall budget bends the order around what it reads)
and what it reads through in its status file (status.py). It exits when the board's stop word is
set (stop()), on SIGTERM, or once no job lives on the board (read_ahead.ReadAhead.serving).

It is the node's, not its starter's: every job on the node reads ahead through it. When the
process that started it leaves (its node closed: release(); or killed) while another job, or
another rank of its own, still trains on the node, it goes on serving them and exits when the
last of them leaves. A stop, or its starter's death, midway would leave the others without reads
ahead until one of them published its next epoch's order (and started another).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import numpy as np

from .. import status
from ..process import isolated_python
from .read_ahead import ReadAhead

DEFAULTS = dict(lookahead_samples=None, lookahead_bytes=256 << 20, batch=256, queue_depth=32,
                lanes=2, max_batches=4, poll_s=0.002)


def check_options(options: dict) -> dict:
    """DEFAULTS with `options` over them; TypeError naming an unknown option, ValueError one out
    of its range."""
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"Prefetcher got unknown options {sorted(unknown)}; it takes "
                        f"{sorted(DEFAULTS)}")
    opts = dict(DEFAULTS, **options)
    for k, v in opts.items():
        if k == "poll_s":
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"poll_s must be in (0, 1] seconds, got {v!r}")
        elif k == "lookahead_samples" and v is None:
            pass   # automatic: pace.py
        elif isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{k} must be an int >= 1, got {v!r}")
    return opts


class Prefetcher:
    """Starts and stops the prefetcher process of a node (sc.Node: node.prefetcher(**options)),
    which reads through the node's tier chain, as the node's loaders do, into its cache. The node
    must have a cache and an order board (Node(read_ahead=True) makes one). Options: see DEFAULTS
    and the module docstring."""

    def __init__(self, node, **options):
        opts = check_options(options)
        if getattr(node, "cache", None) is None:
            raise ValueError("the prefetcher reads into the node's cache: the node has none")
        if node.board is None:
            raise FileNotFoundError(f"cache {node.cache.name!r} has no order board: compose the node "
                                    "with read_ahead=True (it makes one)")
        self.node = node
        self.cache_name = node.cache.name
        self.board = node.board
        self.options = opts
        self.proc = None
        self._starter = None   # the pid that started it: only that process stops it

    def start(self) -> "Prefetcher":
        other = self.board.control.prefetcher_pid
        if self.board.control.prefetcher_alive():   # pid and start time: a reused pid is not a prefetcher
            raise RuntimeError(f"cache {self.cache_name!r} already has a prefetcher (pid {other}); "
                               "one per node")
        self.board.control.request_stop(False)
        payload = pickle.dumps((self.node.pickled_for_process(), self.options, os.getpid()))
        self.proc = subprocess.Popen(isolated_python("shadecache.lookahead.prefetcher"), stdin=subprocess.PIPE)
        self._starter = os.getpid()
        self.proc.stdin.write(payload)
        self.proc.stdin.close()
        # the child registers itself once running; wait for it so that stop() can find it
        deadline = time.monotonic() + 60
        while self.board.control.prefetcher_pid != self.proc.pid:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the prefetcher exited at start (status {self.proc.returncode})")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("the prefetcher did not start within 60 s")
            time.sleep(0.01)
        return self

    @property
    def pid(self):
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        """Asks the loop to finish its batches and exit; kills it after `timeout`. Returns its
        exit status (0 after a clean stop). In a forked child of the process that started it
        (a DataLoader worker, a subprocess of the training script) it only forgets it: the
        prefetcher serves the parent, whose exit stops it."""
        if self.proc is None:
            return 0
        if os.getpid() != self._starter:
            self.proc = None
            return 0
        self.board.control.request_stop(True)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.proc = None
        return rc

    def release(self, timeout: float = 10.0) -> int:
        """What closing the node that started it does (Node.close, and this process's exit),
        called after this process left its job: stops the prefetcher when no job lives on the
        board any more, else leaves it to the jobs that do (it exits when the last of them
        leaves: module docstring). Returns stop()'s status, 0 when left running."""
        if self.proc is None or os.getpid() != self._starter:
            return self.stop(timeout)
        if not self.board.closed and self.board.jobs.live() and self.alive():
            self.proc = None     # theirs now; its exit is reaped by whoever adopts it
            return 0
        return self.stop(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ---- the prefetcher process ------------------------------------------------------------------
def run(node, options: dict) -> None:
    """The process's body: registers on the board, publishes its rule, runs the loop
    (read_ahead.py), and leaves nothing behind that a reader would wait for."""
    cache, board = node.cache, node.board
    loop = ReadAhead(node, options)
    board.control.set_read_rule(loop.rule, loop.reach)   # before registering: a sampler sees both at once
    board.control.set_prefetcher(os.getpid())
    board.flags.clear_on_way()          # a killed predecessor's
    _publish_status(cache.name, node.chain, loop.rule, loop.reach)
    try:
        loop.run()
    finally:
        if board.control.prefetcher_pid == os.getpid():
            board.flags.clear_on_way()      # batches dropped unread: nobody waits for them
            board.control.set_prefetcher(0)
        status.remove(cache.name, os.getpid(), status.PREFETCHER)
        for _, t in node.chain.tiers:   # this process's copies: the SSD tier writes what it queued
            t.close()
        cache.close()
        board.close()


def _publish_status(cache_name: str, chain, rule: int, reach: int) -> None:
    """What this prefetcher reads through, and by which rule (status.py: `shadecache stats`)."""
    try:
        status.write(cache_name, {"pid": os.getpid(), "tiers": [list(t) for t in chain.describe()],
                                  "read_rule": rule, "reach": reach}, status.PREFETCHER)
    except OSError:
        pass   # the status file is for people; it never stops the prefetcher


def _main():
    pickled, options, parent_pid = pickle.loads(sys.stdin.buffer.read())
    node = pickle.loads(pickled)   # attaches the cache and the board, reopens the tiers
    if os.getppid() != parent_pid:
        return 0       # the starter died before it could register this one: nobody waits for it
    run(node, options)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
