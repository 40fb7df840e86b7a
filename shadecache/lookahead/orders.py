"""The order board's orders: each rank's published order, its cursor and every sample's next use
(one writer per stream, a seqlock; readers take no lock: board.py's memory contract). One job's:
the streams are its ranks' (its board file, board_files.JobFile); the header given is the node's
(the WANTED count that marks() includes)."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from .board_layout import (NONE, H_WANTED_SEQ, S_CURSOR, S_EPOCH, S_EPOCH_LENGTH, S_LENGTH, S_SEQ,
                           fence)


class Orders:
    """The streams of one board (board.py: OrderBoard.orders). counters: the board's
    EpochCounters, whose rows a publish of a new epoch clears."""

    def __init__(self, srec, ids, nxt, next_use, header, streams: int, capacity: int,
                 num_samples: int, counters):
        self._srec, self._ids, self._nxt, self._next = srec, ids, nxt, next_use
        self._header, self._counters = header, counters
        self.streams, self.capacity, self.num_samples = streams, capacity, num_samples

    def close(self) -> None:
        self._srec = self._ids = self._nxt = self._next = self._header = None

    # ---- the writer side (one process per stream) --------------------------------------------
    def _check_stream(self, stream: int) -> int:
        if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
            raise TypeError(f"stream must be an int, got {type(stream).__name__}")
        if not 0 <= stream < self.streams:
            raise IndexError(f"stream {stream} is not in 0..{self.streams - 1}")
        return int(stream)
    def publish(self, stream: int, epoch: int, order, epoch_length=None) -> int:
        """Publishes `order` (sample ids) as stream's order for `epoch`; returns how many entries
        were published (at most `capacity`). The cursor goes back to 0. epoch_length: how many of
        the entries are the epoch's (the rest are the head of the next one; default all)."""
        s = self._check_stream(stream)
        ids = np.asarray(order)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise TypeError("order must be a 1-D array of integer sample ids")
        ids = ids[:self.capacity].astype(np.int64, copy=False)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples):
            bad = ids[(ids < 0) | (ids >= self.num_samples)][0]
            raise IndexError(f"sample id {int(bad)} is out of range 0..{self.num_samples - 1}")
        m = ids.size
        k = np.arange(m, dtype=np.int64)
        # next occurrence in the same order: sort by (id, position), link neighbours of equal id
        srt = np.lexsort((k, ids))
        nxt = np.full(m, NONE, dtype=np.int32)
        same = ids[srt[1:]] == ids[srt[:-1]] if m > 1 else np.zeros(0, bool)
        nxt[srt[:-1][same]] = srt[1:][same]
        rec = self._srec[s]
        # odd: readers keep away. A writer killed mid-publish left seq odd; adding 1 would make
        # it even (readers would take the order being written), so go to the NEXT odd value.
        seq = int(rec[S_SEQ])
        odd = seq + 1 if seq % 2 == 0 else seq + 2
        rec[S_SEQ] = odd
        fence()
        self._ids[s, :m] = ids
        self._nxt[s, :m] = nxt
        row = self._next[s]
        row[:] = NONE
        row[ids[::-1]] = k[::-1].astype(np.int32)    # the last write per id wins: its first k
        rec[S_LENGTH] = m
        rec[S_EPOCH_LENGTH] = m if epoch_length is None else min(max(int(epoch_length), 0), m)
        rec[S_EPOCH] = int(epoch)
        rec[S_CURSOR] = 0
        fence()
        rec[S_SEQ] = odd + 1         # even: a consistent order is up
        self._counters.epoch_published(int(epoch))
        return m
    def published(self, stream: int) -> np.ndarray:
        """A copy of the ids the stream shows now (the writer's own view: no seqlock needed by the
        stream's one writer; empty before its first publish)."""
        s = self._check_stream(stream)
        if int(self._srec[s, S_SEQ]) == 0:
            return np.empty(0, dtype=np.int64)
        return self._ids[s, :int(self._srec[s, S_LENGTH])].copy()
    def set_cursor(self, stream: int, k: int) -> None:
        """The DataLoader has taken entries [0, k) of the stream's order (one aligned store)."""
        self._srec[stream, S_CURSOR] = k
    def consumed(self, stream: int, first: int, last: int) -> np.ndarray:
        """Entries [first, last) were taken: each of their samples' next use in this stream moves
        to its following occurrence (or NONE). Returns those samples' ids."""
        ids = self._ids[stream, first:last]
        # in position order, so a sample taken twice in the range ends at its latest successor
        self._next[stream][ids] = self._nxt[stream, first:last]
        return ids
    def rewrite(self, stream: int, positions, ids, lo: int) -> np.ndarray:
        """Entries `positions` of the stream's order (not taken by the loader yet: >= lo) now hold
        `ids` (the sampler moved or replaced them while the epoch runs). A seqlock write, as
        publish: the chains (nxt) of every id that left or entered those entries are rebuilt, and
        each such id's next use becomes its first position >= lo. Positions past the published
        length are ignored. Returns the ids whose next use changed (for the clairvoyant policy)."""
        s = self._check_stream(stream)
        rec = self._srec[s]
        length = int(rec[S_LENGTH])
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        new = np.asarray(ids, dtype=np.int64).reshape(-1)
        if pos.shape != new.shape:
            raise ValueError(f"{pos.size} positions but {new.size} ids")
        keep = pos < length
        pos, new = pos[keep], new[keep]
        if pos.size == 0:
            return np.empty(0, dtype=np.int64)
        if pos.min() < lo or (new.size and (new.min() < 0 or new.max() >= self.num_samples)):
            raise IndexError(f"rewrite: positions must be >= {lo} and ids in 0..{self.num_samples - 1}")
        row = self._ids[s, :length]
        touched = np.unique(np.concatenate([row[pos], new]))
        seq = int(rec[S_SEQ])
        odd = seq + 1 if seq % 2 == 0 else seq + 2
        rec[S_SEQ] = odd
        fence()
        row[pos] = new
        at = np.flatnonzero(np.isin(row, touched))        # every entry of a touched id, in order
        srt = at[np.argsort(row[at], kind="stable")]       # by id, then position
        same = row[srt[1:]] == row[srt[:-1]]
        nxt = self._nxt[s]
        nxt[srt] = NONE
        nxt[srt[:-1][same]] = srt[1:][same]
        nu = self._next[s]
        nu[touched] = NONE
        later = srt[srt >= lo]
        nu[row[later][::-1]] = later[::-1].astype(np.int32)   # the last write per id: its first
        fence()
        rec[S_SEQ] = odd + 1
        return touched

    # ---- the reader side ---------------------------------------------------------------------
    def snapshot(self, stream: int, window: Optional[int] = None):
        """(epoch, ids from the cursor on (at most `window` of them), cursor), or None when the
        stream has published nothing or is being written. A consistent copy (seqlock)."""
        s = self._check_stream(stream)
        rec = self._srec[s]
        for _ in range(100):
            seq = int(rec[S_SEQ])
            if seq == 0:
                return None
            if seq & 1:
                time.sleep(0.0005)
                continue
            fence()
            epoch, length, cursor = int(rec[S_EPOCH]), int(rec[S_LENGTH]), int(rec[S_CURSOR])
            cursor = min(max(cursor, 0), length)
            end = length if window is None else min(length, cursor + int(window))
            ids = self._ids[s, cursor:end].copy()
            fence()
            if int(rec[S_SEQ]) == seq:
                return epoch, ids, cursor
        return None   # a writer died mid-publish (odd seq forever) or keeps rewriting
    def next_use(self, ids) -> np.ndarray:
        """Global position (epoch * capacity + k) of the next read of each id by any stream, or
        -1 where no stream knows one. Benign races: see the module docstring."""
        ids = np.asarray(ids, dtype=np.int64)
        best = np.full(ids.size, np.iinfo(np.int64).max, dtype=np.int64)
        for s in range(self.streams):
            if int(self._srec[s, S_SEQ]) == 0:
                continue
            k = self._next[s][ids].astype(np.int64)
            pos = np.where(k == NONE, np.iinfo(np.int64).max,
                           int(self._srec[s, S_EPOCH]) * self.capacity + k)
            np.minimum(best, pos, out=best)
        best[best == np.iinfo(np.int64).max] = -1
        return best
    def pending(self, ids) -> np.ndarray:
        """Bool mask: which ids some stream still reads in its current epoch (after its cursor:
        taken entries have moved their next use on; the next epoch's head does not count).
        Without the seqlock, as next_use: a publish under way may show an id as not pending."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros(ids.size, dtype=bool)
        for s in range(self.streams):
            if int(self._srec[s, S_SEQ]) == 0:
                continue
            out |= self._next[s][ids] < int(self._srec[s, S_EPOCH_LENGTH])
        return out

    def now(self) -> int:
        """The global position of the most advanced cursor (-1: none published)."""
        best = -1
        for s in range(self.streams):
            rec = self._srec[s]
            if int(rec[S_SEQ]):
                best = max(best, int(rec[S_EPOCH]) * self.capacity + int(rec[S_CURSOR]))
        return best

    def marks(self) -> bytes:
        """What changes whenever a stream publishes, rewrites or moves its cursor, or a reader
        asks for a sample on its way (WANTED): the streams' (seq, epoch, cursor) words and the
        WANTED count, as bytes (one copy). Equal marks: none of that happened since."""
        return (self._srec[:self.streams, [S_SEQ, S_EPOCH, S_CURSOR]].tobytes()
                + self._header[H_WANTED_SEQ // 8].tobytes())
    def stream_state(self, stream: int) -> dict:
        rec = self._srec[self._check_stream(stream)]
        return {"seq": int(rec[S_SEQ]), "epoch": int(rec[S_EPOCH]), "length": int(rec[S_LENGTH]),
                "cursor": int(rec[S_CURSOR])}

    def epoch_of(self, stream: int) -> int:
        """The epoch `stream` published last, else the latest any stream has (-1: none yet)."""
        rec = self._srec[stream]
        return int(rec[S_EPOCH]) if int(rec[S_SEQ]) else self.current_epoch()

    def current_epoch(self) -> int:
        """The latest epoch any stream has published (-1: none yet)."""
        seqs = self._srec[:self.streams, S_SEQ]
        epochs = self._srec[:self.streams, S_EPOCH][seqs != 0]
        return int(epochs.max()) if epochs.size else -1
