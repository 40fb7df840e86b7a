"""The node's prefetcher: reads the upcoming misses of every rank into the cache ahead of the loader.

    board = sc.OrderBoard.create(cache.name, len(store), streams=ranks_on_this_node)
    with sc.Prefetcher(cache, store, ssd=ssd, lookahead_samples=4096, lookahead_bytes=256 << 20):
        ...train: ShadeSampler publishes each epoch's order on the board as the loader iterates...

One per node (start() refuses while another one registered on the board lives), a background
process of its own (this module, started by start() in an isolated interpreter as `python -m`
would run it, minus the working directory on its import path: shadecache/process.py): the
training processes keep their GIL and their cores, and a prefetcher killed at any point (SIGKILL
included) can leave nothing half-done that matters. Its only writes to the cache are put_many and remove, the engine's
crash-safe writers (robust mutex, repair by the next locker), so check() passes after any kill; its
writes to the board are counters and "prefetched" flags, which no reader trusts for correctness.

The loop, in one pass:
1. window: from each stream's cursor (the position up to which the DataLoader has taken ids), the
   next `lookahead_samples` ids, merged across streams by distance from each cursor, first
   occurrence kept; the ids neither cached nor already on their way are the candidates, cut where
   their bytes (plus the bytes in flight) pass `lookahead_bytes`.
2. room: never evict a sample needed sooner than the one it brings. Before a batch is read, cached
   samples whose next use (any stream) is later than the batch's latest next use, or unknown, are
   removed, farthest first, the unknown ones lowest score first, until the batch fits in the free
   bytes; if they do not suffice the batch is cut to what fits. (Under the clairvoyant policy the
   engine's own eviction order is the same one.)
3. read: batches go through the node's tier chain (shadecache/tiers.py), as the loader's misses
   do: the home peer (cluster=), the SSD tier (ssd=), then the store, whose reads stay in flight
   across batch boundaries (a PackedStore's stream: `queue_depth` reads per lane; any other
   store's read_many on a thread per batch). Up to `max_batches` batches are in flight. With a
   cluster, only the ids this node keeps are read ahead (those it is home to, unless keep_remote).
4. insert: each finished batch goes in with put_many (admission as the policy says; room made as
   in 2.); what the cache refused goes to the SSD tier, as the chain admits a loader's misses. The
   admitted ids get their "prefetched" flag; counters per epoch: prefetched, prefetched_bytes,
   reads_issued, and prefetch_wasted (a flagged sample found evicted before any read used it).
It exits when the board's stop word is set (stop()), when its parent dies (PR_SET_PDEATHSIG, and
a check of the parent pid), or on SIGTERM.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from collections import deque

import numpy as np

from ..cache.handle import DEFAULT_MAX_ITEM_BYTES
from ..peer.tier import HomePeerTier
from ..process import alive, isolated_python
from ..store.protocol import check_store, lengths_of
from ..tiers import TierChain
from .board import OrderBoard

DEFAULTS = dict(lookahead_samples=None, lookahead_bytes=256 << 20, batch=256, queue_depth=32,
                lanes=2, max_batches=4, poll_s=0.002)


class Prefetcher:
    """Starts and stops the node's prefetcher process for `cache` (which must have an order board,
    OrderBoard.create(cache.name, ...)), reading through the tiers its loaders read: `store` (a
    picklable store, shadecache/store/protocol.py; a PackedStore keeps reads in flight across
    batches), and, as CachedDataset takes them, `ssd` (an SSDTier, read before the store and given
    what the cache refuses), `cluster` (a Cluster: ids homed on other nodes are asked of them, and
    only those this node keeps are read ahead) and `keep_remote`. Options: see DEFAULTS and the
    module docstring."""

    def __init__(self, cache, store, ssd=None, cluster=None, keep_remote: bool = False, **options):
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
                pass   # automatic: see _Pace
            elif isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{k} must be an int >= 1, got {v!r}")
        check_store(store)
        if len(store) != cache.num_samples:
            raise ValueError(f"store has {len(store)} samples, cache {cache.name!r} holds "
                             f"{cache.num_samples} ids")
        if ssd is not None:   # the tier must hold this store's samples, as CachedDataset checks
            ssd.bind_store(store)
        self.cache_name = cache.name
        self.board = OrderBoard.attach(cache.name)   # FileNotFoundError: no board for this cache
        self.store = store
        self.chain = TierChain.for_node(store, cache, peer=None if cluster is None else HomePeerTier(cluster),
                                        ssd=ssd, keep_remote=keep_remote)
        self.options = opts
        self.proc = None

    def start(self) -> "Prefetcher":
        other = self.board.prefetcher_pid
        if other and alive(other):
            raise RuntimeError(f"cache {self.cache_name!r} already has a prefetcher (pid {other}); "
                               "one per node")
        self.board.request_stop(False)
        payload = pickle.dumps((self.cache_name, self.chain, self.options, os.getpid()))
        self.proc = subprocess.Popen(isolated_python("shadecache.lookahead.prefetcher"), stdin=subprocess.PIPE)
        self.proc.stdin.write(payload)
        self.proc.stdin.close()
        # the child registers itself once running; wait for it so that stop() can find it
        deadline = time.monotonic() + 60
        while self.board.prefetcher_pid != self.proc.pid:
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
        exit status (0 after a clean stop)."""
        if self.proc is None:
            return 0
        self.board.request_stop(True)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.proc = None
        return rc

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        self.board.close()


# ---- the prefetcher process ------------------------------------------------------------------
class _Pace:
    """The automatic lookahead (lookahead_samples=None): how far ahead of the cursors the
    prefetcher must read so that a miss is in the cache when the loader gets to it.

    It measures the rate at which the loaders take samples (the streams' cursors, samples/s over
    every stream) and how long one batch of reads takes from submit to insert (seconds), both as
    moving averages, and reads ahead what the loaders take while `margin` such batches complete,
    but at least enough to fill `max_batches` batches of misses at the observed miss fraction of
    the window. Capped at half the cache's items (a window larger than the cache would evict its
    own reads before they are used) and at `top` (the order's length). Before anything is
    measured: max_batches batches' worth."""

    def __init__(self, batch: int, max_batches: int, cache_items: int, margin: float = 3.0,
                 alpha: float = 0.3):
        self.batch, self.max_batches, self.margin, self.alpha = batch, max_batches, margin, alpha
        self.cap = max(1, cache_items // 2)   # a small cache: below one batch, not above
        self.rate = None          # samples/s taken by the loaders (all streams)
        self.read_s = None        # seconds from submit to insert of one batch
        self.miss = None          # fraction of the window neither cached nor on its way
        self._last = None         # (time, {stream: (epoch, cursor)}) of the last rate sample

    @staticmethod
    def _ewma(old, new, a):
        return new if old is None else (1 - a) * old + a * new

    def saw_cursors(self, now: float, cursors: dict) -> None:
        if self._last is None:
            self._last = (now, cursors)
            return
        t0, before = self._last
        if now - t0 < 0.02:       # short intervals measure the poll, not the loader
            return
        moved = sum(c - before[s][1] for s, (e, c) in cursors.items()
                    if s in before and before[s][0] == e and c >= before[s][1])
        self._last = (now, cursors)
        if moved:                 # idle gaps (evaluation, epoch ends) do not lower the rate
            self.rate = self._ewma(self.rate, moved / (now - t0), self.alpha)

    def saw_batch(self, seconds: float) -> None:
        self.read_s = self._ewma(self.read_s, seconds, self.alpha)

    def saw_window(self, size: int, misses: int) -> None:
        if size:
            self.miss = self._ewma(self.miss, max(misses, 1) / size, self.alpha)

    def window(self, top: int) -> int:
        fill = self.max_batches * self.batch / max(1.0 if self.miss is None else self.miss, 1e-3)
        need = (self.margin * self.rate * self.read_s
                if self.rate is not None and self.read_s is not None else 0.0)
        return int(max(1, min(top, self.cap, max(fill, need))))


def _window(board, lookahead):
    """(epoch of the most advanced stream, the merged window's ids by distance from the cursors,
    {stream: (epoch, cursor)})."""
    parts, dists, epoch, cursors = [], [], -1, {}
    for s in range(board.streams):
        snap = board.snapshot(s, window=lookahead)
        if snap is None:
            continue
        e, ids, cursor = snap
        cursors[s] = (e, cursor)
        epoch = max(epoch, e)
        parts.append(ids)
        dists.append(np.arange(ids.size))
    if not parts:
        return epoch, np.empty(0, np.int64), cursors
    ids = np.concatenate(parts)
    d = np.concatenate(dists)
    ids = ids[np.argsort(d, kind="stable")]
    _, first = np.unique(ids, return_index=True)
    return epoch, ids[np.sort(first)], cursors


def _make_room(cache, board, count: int, latest_use: int) -> int:
    """Removes up to `count` cached samples whose next use (any stream) is later than
    `latest_use` or unknown: the unknown ones first, lowest score first, then the known ones,
    farthest first. Returns how many were removed."""
    cached = np.flatnonzero(cache.cached_mask())
    if cached.size == 0 or count <= 0:
        return 0
    nu = board.next_use(cached)
    later = (nu < 0) | (nu > latest_use)
    cand, nu = cached[later], nu[later]
    if cand.size == 0:
        return 0
    unknown = nu < 0
    scores = np.asarray(cache.scores(), dtype=np.float64)[cand]
    order = np.lexsort((np.where(unknown, scores, 0.0), -nu.astype(np.float64), ~unknown))
    removed = 0
    for i in cand[order[:count]].tolist():
        removed += bool(cache.remove(i))
    return removed


def _insert(cache, board, ids, data, rounds: int = 4):
    """put_many, and for what a full cache refused: make more room among the samples needed
    later than those (a freed slot may be of another size class), then try them again (`rounds`
    times; 0: the policy's word is final)."""
    admitted = np.asarray(cache.put_many(ids, data), dtype=bool)
    for _ in range(rounds):
        rest = np.flatnonzero(~admitted)
        if rest.size == 0:
            break
        nu = board.next_use(ids[rest])
        if (nu < 0).any() or _make_room(cache, board, 2 * int(rest.size), int(nu.max())) == 0:
            break      # not needed any more, or nothing needed later is left to make room
        again = np.asarray(cache.put_many(ids[rest], [data[j] for j in rest.tolist()]), dtype=bool)
        admitted[rest] = again
        if not again.any():
            break      # room of another size class does not help these; stop removing
    return admitted


def run(cache_name, chain, options, parent_pid):
    cache = chain.cache      # attached by name when the chain was unpickled
    board = OrderBoard.attach(cache_name)
    board.set_prefetcher(os.getpid())
    board.clear_on_way()          # a killed predecessor's
    lengths = lengths_of(chain.store)
    tier = chain.reader(options["max_batches"], options["queue_depth"], options["lanes"])

    # With a tier that keeps copies (an SSD tier), the prefetcher keeps what it reads as the
    # loader's misses are kept: the cache's policy decides, the SSD tier takes what it refused, and
    # nothing is removed to make room (a sample only the cache holds, removed, would be read from
    # the shared storage again). Without one, room is made among the samples needed later.
    copies = chain.keeps_copies
    rounds = 0 if copies else 4

    def insert(ids, data):
        return _insert(cache, board, ids, data, rounds)
    L, B = options["lookahead_samples"], options["batch"]
    pace = None
    if L is None:   # automatic: from the loaders' pace and the reads' latency (_Pace)
        mean_len = float(lengths.mean()) if lengths is not None and lengths.size else 4096.0
        pace = _Pace(B, options["max_batches"],
                     int(cache.capacity_bytes // max(mean_len, 1.0)))
        L = pace.window(board.capacity)
    max_bytes, max_batches = options["lookahead_bytes"], options["max_batches"]
    inflight = deque()            # (ids, epoch) in submission order
    on_way = set()
    flagged = set()               # ids this process flagged "prefetched" and not yet seen used
    refused = set()               # ids the cache refused this epoch: not read again for it
    full = False                  # the last insert was refused: make room before reading more
    last_epoch = None
    stopping = False

    def on_term(*_):
        nonlocal stopping
        stopping = True
    signal.signal(signal.SIGTERM, on_term)
    try:
        while not stopping and not board.stop_requested and os.getppid() == parent_pid:
            epoch, window, cursors = _window(board, L)
            if pace is not None:
                pace.saw_cursors(time.monotonic(), cursors)
            if epoch != last_epoch:
                refused.clear()
                last_epoch = epoch
            cached = np.asarray(cache.cached_mask(), dtype=bool)
            # flags cleared by readers are used prefetches; flagged and gone are wasted ones
            if flagged:
                f = np.fromiter(flagged, dtype=np.int64, count=len(flagged))
                used = ~board.prefetched(f)
                wasted = f[~used & ~cached[f]]
                if wasted.size:
                    board.unmark(wasted)
                    board.count(max(epoch, 0), prefetch_wasted=int(wasted.size))
                flagged.difference_update(f[used].tolist())
                flagged.difference_update(wasted.tolist())
            cand = window[~cached[window]] if window.size else window
            if cand.size:
                cand = cand[chain.keeps(cand)]   # never what another node keeps for this one
            skip = on_way | refused
            if skip and cand.size:
                cand = cand[~np.isin(cand, np.fromiter(skip, np.int64, len(skip)))]
            if pace is not None:
                pace.saw_window(int(window.size), int(cand.size) + len(on_way))
                L = pace.window(board.capacity)
            if cand.size and full and copies and len(inflight) < max_batches:
                # Only what the cache would admit and keep until it is due, and not what the SSD
                # tier holds (the loader reads that without the shared storage): the rest the
                # loader reads when it is due and the SSD tier keeps, as without a prefetcher. A
                # sample read now and lost before it is due would be read again then. Each sample
                # not cached that is due before a candidate (read ahead, or read by the loader)
                # may displace the lowest cached one first, and scores move meanwhile (counted
                # twice): a candidate is read only if it outscores what would be left.
                due_before = 2 * (len(on_way) + np.arange(cand.size))
                cand = cand[~chain.held(cand) & cache.admits(cand, due_before)]
            submitted = False
            if cand.size and len(inflight) < max_batches:
                nbytes = (lengths[cand] if lengths is not None   # unknown sizes: a page's worth
                          else np.full(cand.size, min(cache.max_item_bytes, DEFAULT_MAX_ITEM_BYTES), np.int64))
                budget = max_bytes - sum(int(f[2]) for f in inflight)
                cut = int(np.searchsorted(np.cumsum(nbytes), budget, side="right"))
                batch = cand[:min(B, cut)]
                if batch.size and full and not copies:
                    # one out for one in (the engine's free bytes do not say how many slots of a
                    # size class are free, so "full" is learnt from a refused insert); whatever
                    # cannot be matched by a sample needed later stays unread
                    latest = int(board.next_use(batch).max())
                    batch = batch[:_make_room(cache, board, int(batch.size), latest)]
                if batch.size:
                    board.mark_on_way(batch)     # readers wait for these instead of reading them
                    tier.submit(batch)
                    inflight.append((batch, max(epoch, 0), int(nbytes[:batch.size].sum()),
                                     time.monotonic()))
                    on_way.update(batch.tolist())
                    board.count(max(epoch, 0), reads_issued=int(batch.size))
                    submitted = True
            if inflight and (not submitted or len(inflight) >= max_batches):
                ids, ep, nb, t_sub = inflight.popleft()
                read = tier.take()
                data = read.values
                if pace is not None:
                    pace.saw_batch(time.monotonic() - t_sub)
                # the batch's ids, then the extent mates read with them (tiers.Read)
                admitted = chain.admit(read, insert)
                on_way.difference_update(ids.tolist())
                asked = admitted[:read.asked]
                full = full or not asked.all()   # the cache only shrinks by removals
                refused.update(ids[~asked].tolist())
                got = read.ids[admitted]
                board.unmark(ids[~asked])
                board.mark_prefetched(got)
                flagged.update(got.tolist())
                board.count(ep, prefetched=int(got.size),
                            prefetched_bytes=int(sum(len(d) for d, a in zip(data, admitted) if a)))
            elif not submitted:
                time.sleep(options["poll_s"])
        # a clean stop: finish (and insert) what is in flight, so no read is left to die with us
        while inflight:
            ids, ep, *_ = inflight.popleft()
            read = tier.take()
            admitted = chain.admit(read, insert)
            board.unmark(ids[~admitted[:read.asked]])
            board.mark_prefetched(read.ids[admitted])
            board.count(ep, prefetched=int(admitted.sum()))
    finally:
        tier.close()
        if board.prefetcher_pid == os.getpid():
            board.clear_on_way()      # batches dropped unread: nobody waits for them
            board.set_prefetcher(0)
        for _, t in chain.tiers:   # this process's copies: the SSD tier writes what it queued
            t.close()
        cache.close()
        board.close()


def _main():
    try:   # die with the parent even if it is SIGKILLed (Linux)
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    cache_name, chain, options, parent_pid = pickle.loads(sys.stdin.buffer.read())
    if os.getppid() != parent_pid:
        return 0
    run(cache_name, chain, options, parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
