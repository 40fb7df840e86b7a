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
import threading
import time

import numpy as np

from .. import status
from ..process import isolated_python
from .read_ahead import ReadAhead

ORPHANED_EXIT_S = 10.0   # _exit_when_orphaned: how long a stuck prefetcher outlives the last job
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
    and the module docstring; lookahead_samples is the node's whole window, over every rank and
    job (read_ahead.Window), None: automatic (pace.py)."""

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
        self._own_board = False   # a handle attached for it once left to other jobs (release)

    def start(self) -> "Prefetcher":
        release_handed()
        other = self.board.control.prefetcher_pid
        if self.board.control.prefetcher_alive():   # pid and start time: a reused pid is not a prefetcher
            raise RuntimeError(f"cache {self.cache_name!r} already has a prefetcher (pid {other}); "
                               "one per node")
        self.board.control.request_stop(False)
        payload = pickle.dumps((self.node.pickled_for_process(), self.options, os.getpid()))
        # a session of its own: it is the node's, so a Ctrl-C or a hang-up of the starter's
        # terminal (its process group) must not end it while other jobs train
        self.proc = subprocess.Popen(isolated_python("shadecache.lookahead.prefetcher"), stdin=subprocess.PIPE,
                                     start_new_session=True)
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
        exit status (0 after a clean stop). The board's stop word asks the node's registered
        prefetcher: one that is not (or no longer) registered, or whose board this process
        closed, is sent SIGTERM instead, so that another's prefetcher is never stopped by it. In
        a forked child of the process that started it (a DataLoader worker, a subprocess of the
        training script) it only forgets it: the prefetcher is not the child's to stop."""
        proc, self.proc = self.proc, None
        if proc is None or os.getpid() != self._starter:
            return 0
        if proc.poll() is None:
            if not self.board.closed and self.board.control.prefetcher_pid == proc.pid:
                self.board.control.request_stop(True)
            else:
                proc.terminate()          # its loop's SIGTERM handler: a clean stop
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._own_board and not self.board.closed:
            self.board.close()
        return proc.returncode

    def release(self, timeout: float = 10.0) -> int:
        """What closing the node that started it does (Node.close, and this process's exit),
        called after this process left its job: stops the prefetcher when no job lives on the
        board any more, else leaves it to the jobs that do (it exits when the last of them
        leaves: module docstring), holding a board handle of its own (the node's closes) and the
        process, to reap it and to stop it should it outlive them (release_handed). Returns
        stop()'s status, 0 when left running."""
        if self.alive() and os.getpid() == self._starter and self._jobs_live():
            try:
                from .board import OrderBoard
                board = OrderBoard.attach(self.cache_name)   # observes: keeps no job alive
            except (FileNotFoundError, ValueError, PermissionError):
                return self.stop(timeout)                  # the last job left meanwhile
            self.board, self._own_board = board, True
            with _HANDED_LOCK:
                _HANDED.append(self)
            return 0
        return self.stop(timeout)

    def _jobs_live(self) -> bool:
        return not self.board.closed and bool(self.board.jobs.live())

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


_HANDED = []   # prefetchers this process started and left to other jobs (Prefetcher.release)
_HANDED_LOCK = threading.Lock()   # guards _HANDED (a node's close and a sampler's start may race)


def release_handed(timeout: float = 10.0) -> None:
    """The prefetchers this process left to other jobs: those that exited are reaped, and those
    on a board where no job lives any more are stopped (Node.close, this process's exit, and
    every start call it). The stops run outside the lock."""
    with _HANDED_LOCK:
        done = [p for p in _HANDED if not p.alive() or not p._jobs_live()]
        for p in done:
            _HANDED.remove(p)
    for p in done:
        p.stop(timeout)


# ---- the prefetcher process ------------------------------------------------------------------
def run(node, options: dict, parent_pid: int) -> None:
    """The process's body: registers on the board, publishes its rule, runs the loop
    (read_ahead.py), and leaves nothing behind that a reader would wait for."""
    cache, board = node.cache, node.board
    if os.getppid() != parent_pid:
        return       # the starter died before it could register this one: nobody waits for it
    loop = ReadAhead(node, options)
    board.control.set_read_rule(loop.rule, loop.reach)   # before registering: a sampler sees both at once
    board.control.set_prefetcher(os.getpid())
    board.flags.clear_on_way()          # a killed predecessor's
    _publish_status(cache.name, node.chain, loop.rule, loop.reach)
    # The backstop watches until the loop has returned, its drain of the reads in flight and its
    # reader's close included: a hung read blocks those too
    returned = threading.Event()
    watchdog = threading.Thread(target=_exit_when_orphaned, args=(board, cache.name, returned),
                                name="sc-prefetch-orphaned", daemon=True)
    watchdog.start()
    try:
        loop.run()
    finally:
        returned.set()
        watchdog.join()
        if board.control.prefetcher_pid == os.getpid():
            board.flags.clear_on_way()      # batches dropped unread: nobody waits for them
            board.control.set_prefetcher(0)
        status.remove(cache.name, os.getpid(), status.PREFETCHER)
        for _, t in node.chain.tiers:   # this process's copies: the SSD tier writes what it queued
            t.close()
        cache.close()
        board.close()


def _exit_when_orphaned(board, cache_name: str, done) -> None:
    """A backstop for a loop stuck in a read that never returns (a hung store): once no job has
    lived on the board for ORPHANED_EXIT_S, the process exits where it stands (its cache writes
    are the engine's crash-safe ones). The normal exit is the loop's (ReadAhead.serving)."""
    gone = None
    while not done.wait(1.0):
        if board.jobs.live():
            gone = None
            continue
        gone = gone or time.monotonic()
        if time.monotonic() - gone >= ORPHANED_EXIT_S:
            if board.control.prefetcher_pid == os.getpid():
                board.flags.clear_on_way()   # nobody waits for what it had on its way
                board.control.set_prefetcher(0)
            status.remove(cache_name, os.getpid(), status.PREFETCHER)
            os._exit(0)


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
    run(node, options, parent_pid)
    # cleaned up: exit now, not after the interpreter joins a reader thread a hung read holds
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_main())
