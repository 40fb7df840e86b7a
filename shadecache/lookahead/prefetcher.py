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
   their bytes (plus the bytes in flight and held) pass `lookahead_bytes`. With an SSD tier (ssd=),
   once the cache is full, only those it would admit when due and the SSD tier does not hold.
2. room (no SSD tier): never evict a sample needed sooner than the one it brings. Before a batch is read, cached
   samples whose next use (any stream) is later than the batch's latest next use, or unknown, are
   removed, farthest first, the unknown ones lowest score first, until the batch fits in the free
   bytes; if they do not suffice the batch is cut to what fits. (Under the clairvoyant policy the
   engine's own eviction order is the same one.)
3. read: batches go through the node's tier chain (shadecache/tiers.py), as the loader's misses
   do: the home peer (cluster=), the SSD tier (ssd=), then the store, whose reads stay in flight
   across batch boundaries (a PackedStore's stream: `queue_depth` reads per lane; any other
   store's read_many on a thread per batch). Up to `max_batches` batches are in flight. With a
   cluster, only the ids this node keeps are read ahead (those it is home to, unless keep_remote).
4. insert: without an SSD tier each finished batch goes in with put_many (admission as the policy
   says; room made as in 2.). With one, the batch is held in this process (its ids stay ON_WAY on
   the board) and each sample is offered with put_many when a loader takes the batch that holds it
   (the cursor passes it) or asks for it (WANTED: a loader waits for it); the hand-over thread
   does that every poll_s. What the cache refuses goes to the SSD tier, written before the flag is
   cleared, as the chain admits a loader's misses: the cache and the SSD tier see each sample
   when the loader reads it, as without a prefetcher (docs/prefetch.md says why). The admitted
   ids get their "prefetched" flag; counters per epoch: prefetched, prefetched_bytes,
   reads_issued, and prefetch_wasted (a flagged sample found evicted before any read used it).
   Under the extent order (the store reads whole extents, docs/prefetch.md) a batch's read
   brings its extents' other samples: they are on their way with it (flagged, not read again by
   the next batches), the read is offered whole when it arrives (the tiers keep whole extents),
   and once the cache is full nothing more is read ahead: the loader's own reads are whole
   extents, and what the tiers refuse waits in its process until its turn.
It exits when the board's stop word is set (stop()), when its parent dies (PR_SET_PDEATHSIG, and
a check of the parent pid), or on SIGTERM.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import numpy as np

from .. import _io
from ..cache.handle import DEFAULT_MAX_ITEM_BYTES
from ..peer.tier import HomePeerTier
from ..process import isolated_python
from ..store.protocol import check_store, lengths_of
from ..tiers import TierChain
from .board import OrderBoard

IDLE_S = 0.05      # how often a prefetcher with nothing to read or hand over looks again
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
        if self.board.prefetcher_alive():   # pid and start time: a reused pid is not a prefetcher
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
    their global positions (board.py: epoch * capacity + entry), {stream: (epoch, cursor)})."""
    parts, dists, places, epoch, cursors = [], [], [], -1, {}
    for s in range(board.streams):
        snap = board.snapshot(s, window=lookahead)
        if snap is None:
            continue
        e, ids, cursor = snap
        cursors[s] = (e, cursor)
        epoch = max(epoch, e)
        parts.append(ids)
        dists.append(np.arange(ids.size))
        places.append(e * board.capacity + cursor + dists[-1])
    if not parts:
        return epoch, np.empty(0, np.int64), np.empty(0, np.int64), cursors
    ids = np.concatenate(parts)
    by_distance = np.argsort(np.concatenate(dists), kind="stable")
    ids, places = ids[by_distance], np.concatenate(places)[by_distance]
    _, first = np.unique(ids, return_index=True)
    first = np.sort(first)
    return epoch, ids[first], places[first], cursors


def _cursors(board) -> dict:
    """{stream: (epoch, cursor)} of the streams that published."""
    out = {}
    for s in range(board.streams):
        st = board.stream_state(s)
        if st["seq"]:
            out[s] = (st["epoch"], st["cursor"])
    return out


def _now(cursors: dict, capacity: int) -> int:
    """The global position of the most advanced cursor (-1: none)."""
    return max((e * capacity + c for e, c in cursors.values()), default=-1)


class _Held:
    """What the prefetcher read ahead and holds until a reader asks for it (a tier that keeps
    copies is in the chain): batches as read (tiers.Read), each sample's global position in the
    order, and which are still held. Guarded by the prefetcher's lock."""

    def __init__(self):
        self.batches = []       # [Read, epoch, positions, still held (bool mask), bytes held]

    def add(self, read, epoch: int, positions: np.ndarray, nbytes: np.ndarray) -> None:
        self.batches.append([read, epoch, positions, np.ones(read.ids.size, dtype=bool), nbytes])

    @property
    def nbytes(self) -> int:
        return sum(int(b[4][b[3]].sum()) for b in self.batches)

    def ids(self) -> np.ndarray:
        parts = [b[0].ids[b[3]] for b in self.batches]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def take(self, due) -> list:
        """[(Read of the due samples, epoch)]: due(ids, positions) -> bool mask of those to hand
        over now; they are held no more."""
        out, left = [], []
        for b in self.batches:
            read, epoch, positions, held, _ = b
            pos = np.flatnonzero(held)
            pos = pos[due(read.ids[pos], positions[pos])]
            if pos.size:
                out.append((read.part(pos), epoch))
                held[pos] = False
            if held.any():
                left.append(b)
        self.batches = left
        return out


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
    # loader's misses are kept, and when they are: it holds each sample it read ahead until a
    # reader asks for it (WANTED on the board) and then offers it to the cache, whose policy
    # decides as it would on the reader's own miss at that moment; the SSD tier takes what it
    # refused. Nothing is removed to make room. Without one, samples go in as they arrive and room
    # is made among the samples needed later.
    copies = chain.keeps_copies
    rounds = 0 if copies else 4
    extent_order = chain.reads_extents

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
    copying = [t for _, t in chain.tiers if callable(getattr(t, "put_many", None))]
    # The loop and the hand-over thread share what follows; `mu` guards it (and the board's
    # counter rows, whose adds are not atomic).
    mu = threading.Lock()
    inflight = deque()            # (ids, epoch, bytes, submit time, positions) in submission order
    on_way = set()                # read, or held, and not offered yet
    held = _Held()
    flagged = set()               # ids this process flagged "prefetched" and not yet seen used
    refused = set()               # ids the cache refused this epoch: not read again for it
    # the cache is full (it refused an insert, it evicted since this process started, or what is
    # cached, held and in flight fills 90% of it): what is read ahead makes room, or is what it
    # would admit (a cache that has evicted or refused before this process started is full
    # already)
    st = cache.stats()
    full = bool(st["evictions"] or st["rejected"])
    evicted_before = st["evictions"]
    # the engine itself said so (it refused, or evicted since this process started): what the
    # cache holds no longer tells its free room (slots are rounded up to their size class, so a
    # cache of small samples is out of memory with bytes_used well below its capacity)
    engine_full = full
    free = 0                      # the cache's bytes that nothing cached, held or in flight takes
    now = -1                      # the most advanced cursor's global position
    last_epoch = None
    stopping = False

    def pending_bytes() -> int:
        """Bytes read ahead and not offered yet: held, and in flight. mu held."""
        return held.nbytes + sum(int(f[2].sum()) for f in inflight)

    def landed(read, ep):
        """Offers one read to the cache (what it refuses to the copying tiers) and flags it.
        mu held."""
        nonlocal full, engine_full
        ids, data = read.ids, read.values
        admitted = chain.admit(read, insert)
        if not admitted.all():
            # the cache only shrinks by removals; full only when it refused something offered
            # to it (what the SSD tier served is offered only into free room: a read of a warm
            # SSD tier's extents into an empty cache stopped all reading ahead)
            full = full or bool((read.offered & ~admitted).any())
            engine_full = engine_full or full
            refused.update(ids[~admitted].tolist())
            if copies:
                # a reader asks for these now or soon: it reads them from the SSD tier, once
                # written (not from the store again)
                for t in copying:
                    flush = getattr(t, "flush", None)
                    if callable(flush):
                        flush(2.0)
        on_way.difference_update(ids.tolist())
        got = ids[admitted]
        board.unmark(ids[~admitted])
        board.mark_prefetched(got)
        flagged.update(got.tolist())
        board.count(ep, prefetched=int(got.size),
                    prefetched_bytes=int(sum(len(d) for d, a in zip(data, admitted) if a)))

    def arrived(read, ep, positions, nbytes) -> bool:
        """One read done: held until a reader asks for it when a copying tier is in the chain,
        else offered now. Returns whether it is held. A read that brought extent mates
        (positions from read.asked on, tiers.Read: the extent order) is offered whole, now, as
        the loader offers its own extent reads: the cache and the SSD tier keep whole extents
        (one score per extent), and with the mates offered at once and the asked samples held
        until their turn, extents landed in pieces (the held samples refused by tiers that had
        filled meanwhile), and the next epoch read their other samples around the holes. mu
        held."""
        if copies and read.asked == read.ids.size:
            held.add(read, ep, positions, nbytes)
            return True
        landed(read, ep)
        return False

    def hand_over(everything: bool = False):
        """Offers the held samples a reader waits for (WANTED), and those no reader will ask for
        any more (their turn is a window behind the cursors, or no published order reads them
        now); everything when stopping. Clears WANTED on ids this process does not hold (a
        reader's flag that landed after the hand-over). mu held."""
        def due(ids, positions):
            if everything:
                return np.ones(ids.size, dtype=bool)
            nu = board.next_use(ids)
            return board.wanted(ids) | (nu < 0) | (positions < _now(_cursors(board), board.capacity))
        for read, ep in held.take(due):
            landed(read, ep)

    def clear_stray_wanted():
        stray = board.wanted()
        if stray.size:
            mine = np.fromiter(on_way, np.int64, len(on_way))   # held or in flight, mates too
            stray = stray[~np.isin(stray, mine)]
            board.unmark(stray)

    done = threading.Event()

    def hand_over_loop():
        while not done.wait(options["poll_s"] if held.batches or inflight else IDLE_S):
            with mu:
                hand_over()
    helper = None
    if copies:
        helper = threading.Thread(target=hand_over_loop, name="sc-prefetch-hand-over", daemon=True)
        helper.start()

    def on_term(*_):
        nonlocal stopping
        stopping = True
    signal.signal(signal.SIGTERM, on_term)
    try:
        while not stopping and not board.stop_requested and os.getppid() == parent_pid:
            # what the board and the cache say now, before the lock (the hand-over waits on it)
            epoch, window, places, cursors = _window(board, L)
            cached = np.asarray(cache.cached_mask(), dtype=bool)
            mu.acquire()
            try:
                now = _now(cursors, board.capacity)
                if pace is not None:
                    pace.saw_cursors(time.monotonic(), cursors)
                if epoch != last_epoch:
                    refused.clear()
                    last_epoch = epoch
                # a reader's WANTED that landed after the offer: cleared whether or not a copying
                # tier is in the chain (left, every later reader of the sample waited
                # ON_WAY_WAIT_S for it, until a read of this process offered it again)
                clear_stray_wanted()
                if not engine_full:
                    # Full when what is cached, held and in flight would fill the cache, or when
                    # it has evicted since this process started: from then on, what is read ahead
                    # must make room (no copying tier) or be what the cache would admit (a copying
                    # tier; under the extent order nothing). The loaders' own misses fill it too,
                    # unseen by landed(); and a policy that evicts to admit refuses nothing, so a
                    # refused insert alone never told: the engine made the room, by its own order
                    # (the importance policy: lowest score first, a sample read for the next batch
                    # as soon as any other), and what it evicted from the window was read again
                    # (measured on a throttled disk, longtail: 3,189 of 6,805 reads in one epoch
                    # were second to sixth reads of a sample before its turn).
                    st = cache.stats()
                    free = st["capacity_bytes"] - st["bytes_used"] - pending_bytes()
                    # (Looked at until the engine refused or evicted: without a copying tier, what
                    # is read ahead makes room only for what the free bytes do not take until then.)
                    engine_full = st["evictions"] > evicted_before
                    full = full or engine_full or free <= 0.1 * st["capacity_bytes"]
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
                keep = ~cached[window] if window.size else np.zeros(0, dtype=bool)
                if keep.any():
                    keep[keep] = chain.keeps(window[keep])   # never what another node keeps for this one
                skip = on_way | refused
                if skip and keep.any():
                    keep[keep] = ~np.isin(window[keep], np.fromiter(skip, np.int64, len(skip)))
                cand, cand_at = window[keep], places[keep]
                if pace is not None:
                    pace.saw_window(int(window.size), int(cand.size) + len(on_way))
                    L = pace.window(board.capacity)
                if cand.size and full and extent_order:
                    # Under the extent order nothing, once the cache is full: an extent read lands
                    # whole when it arrives, long before most of its samples are due, and what it
                    # displaces (the lowest-scored extents) may be due sooner and is read again.
                    # The loader's own reads are whole extents already, read when its window
                    # reaches them, and keep what the tiers refuse until its turn
                    # (tiers.MateStage), which this process cannot hand over. With or without an
                    # SSD tier (without one, room made for a read was read again: warm epochs
                    # read 1.07x the data, 0.66x with nothing read ahead).
                    cand, cand_at = cand[:0], cand_at[:0]
                elif cand.size and full and copies and len(inflight) < max_batches:
                    # With an SSD tier, only what the cache would admit when it is due, and not what
                    # the SSD tier holds (the loader reads that without the shared storage): the
                    # rest the loader reads when it is due and the SSD tier keeps, as without a
                    # prefetcher. A sample read now that neither the cache nor the SSD tier keeps
                    # when it is offered would be read again by the loader. Each sample not cached
                    # that is due before a candidate (held, or read by the loader) may displace the
                    # lowest cached one first, and scores move meanwhile (counted twice): a
                    # candidate is read only if it outscores what would be left.
                    due_before = 2 * (len(on_way) + np.arange(cand.size))
                    ok = ~chain.held(cand) & cache.admits(cand, due_before)
                    cand, cand_at = cand[ok], cand_at[ok]
                submitted = False
                if cand.size and len(inflight) < max_batches:
                    nbytes = (lengths[cand] if lengths is not None   # unknown sizes: a page's worth
                              else np.full(cand.size, min(cache.max_item_bytes, DEFAULT_MAX_ITEM_BYTES), np.int64))
                    budget = max_bytes - pending_bytes()
                    cut = int(np.searchsorted(np.cumsum(nbytes), budget, side="right"))
                    batch = cand[:min(B, cut)]
                    if batch.size and full and not copies:
                        # one out for one in (the engine's free bytes do not say how many slots of a
                        # size class are free); whatever cannot be matched by a sample needed later
                        # stays unread. Until the engine refused or evicted, what fits in the free
                        # bytes is read without removing anything: called full at 90%, a cache with
                        # room for the whole data set (large samples: over 95% used when it holds
                        # them all) lost a sample for each of its last misses, and read it again
                        # the next epoch, every epoch.
                        need = int(batch.size)
                        if not engine_full:   # `free` is this pass's (the check above)
                            need -= int(np.searchsorted(np.cumsum(nbytes[:need]), free, side="right"))
                        if need:
                            latest = int(board.next_use(batch).max())
                            removed = _make_room(cache, board, need, latest)
                            batch = batch[:int(batch.size) - need + removed]
                    if batch.size:
                        board.mark_on_way(batch)     # readers wait for these instead of reading them
                        # A loader that took one of them since the window was read may have looked
                        # for the mark before it was made, and reads it itself: leave it to it.
                        # (The loader moves the cursor before it looks; the fence orders our mark
                        # before our look at the cursor.)
                        _io.memory_fence()
                        taken = cand_at[:batch.size] < _now(_cursors(board), board.capacity)
                        if taken.any():
                            board.unmark(batch[taken])
                            keep_ = ~taken
                            batch, cand_at = batch[keep_], cand_at[:taken.size][keep_]
                            nbytes = nbytes[:taken.size][keep_]
                    if batch.size:
                        mates = tier.submit(batch)
                        if mates.size:
                            # The extent mates read with the batch are on their way too: not
                            # candidates of the next batches (each read the same extents again,
                            # up to max_batches times), and a loader waits for them
                            board.mark_on_way(mates)
                            on_way.update(mates.tolist())
                        inflight.append((batch, max(epoch, 0), nbytes[:batch.size], time.monotonic(),
                                         cand_at[:batch.size]))
                        on_way.update(batch.tolist())
                        board.count(max(epoch, 0), reads_issued=int(batch.size))
                        submitted = True
            finally:
                mu.release()
            if inflight and (not submitted or len(inflight) >= max_batches):
                ids, ep, nb, t_sub, at = inflight[0]
                read = tier.take()            # waits for the device, without the lock
                if pace is not None:
                    pace.saw_batch(time.monotonic() - t_sub)
                with mu:
                    inflight.popleft()
                    if arrived(read, ep, at, nb):
                        hand_over()           # what a reader already waits for
            elif not submitted:
                # Under the extent order a full cache is read ahead no more (it only shrinks by
                # removals): look less often, and leave the loader this machine's cores
                resting = full and extent_order
                time.sleep(IDLE_S if resting and not held.batches else options["poll_s"])
        # a clean stop: finish what is in flight and offer everything held, so no read is left
        # to die with us
        done.set()
        if helper is not None:
            helper.join()
        with mu:
            while inflight:
                ids, ep, nb, _, at = inflight.popleft()
                arrived(tier.take(), ep, at, nb)
            hand_over(everything=True)
    finally:
        done.set()
        if helper is not None:
            helper.join(5.0)
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
