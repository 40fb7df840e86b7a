"""The prefetcher's automatic lookahead (lookahead_samples=None): how far ahead of the cursors it
reads, from the loaders' pace and its reads' latency."""
from __future__ import annotations


class Pace:
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
