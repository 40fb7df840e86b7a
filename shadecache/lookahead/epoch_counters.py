"""The order board's per-epoch counters: the prefetcher's (one writer, node-wide), the readers'
and the samplers' (any process of the job, atomic adds), in rows of the last EPOCH_SLOTS epochs;
and the job's totals (any process of the job, atomic adds)."""
from __future__ import annotations

import weakref

from .board_layout import COUNTERS, EPOCH_SLOTS, JOB_COUNTERS, READER_COUNTERS, SAMPLER_COUNTERS


class EpochCounters:
    """The counter rows of one job's board (board.py: OrderBoard.counters): the prefetcher's rows
    (the node's file; None for a view that does not count them), the job's reader and sampler
    rows and its totals (the job's file). orders: the job's Orders, which say in which epoch a
    stream's reads count."""

    def __init__(self, counters, readers, samplers, totals):
        self._counters, self._readers, self._samplers = counters, readers, samplers
        self._totals = totals
        self._orders = None   # bind_orders: the board's Orders, made after these rows

    def bind_orders(self, orders) -> None:
        # Weakly: the Orders refer to these rows, and a cycle would keep the board's mapping
        # (and an unlinked board's /dev/shm pages) alive until the cyclic collector runs.
        self._orders = weakref.proxy(orders)

    def close(self) -> None:
        self._counters = self._readers = self._samplers = self._totals = None

    def count_job(self, **deltas) -> None:
        """Adds to the job's totals (JOB_COUNTERS; any process, atomic adds)."""
        from .. import _io
        for name, v in deltas.items():
            if v:
                _io.atomic_add(self._totals, JOB_COUNTERS.index(name), int(v))

    def job_totals(self) -> dict:
        """The job's totals, with the sampler rows' repeats and deferrals summed over the epochs
        kept: what `shadecache stats` lists per job."""
        d = dict(zip(JOB_COUNTERS, (int(v) for v in self._totals)))
        ws = len(SAMPLER_COUNTERS)
        for k, name in enumerate(SAMPLER_COUNTERS):
            d[name] = int(sum(int(self._samplers[r * ws + k]) for r in range(EPOCH_SLOTS)))
        return d

    def epoch_published(self, e: int) -> None:
        """A stream published epoch `e`. A row is never zeroed while it can be counted into:
        other ranks may already count reads of this epoch (atomic adds) while this publish runs,
        so zeroing this epoch's row lost their counts. Rows start at zero when the board is
        created; the row of the NEXT epoch is cleared (of the counts of EPOCH_SLOTS epochs ago)
        by the publishes of this epoch, before any rank can read in the next one (a rank
        publishes the next epoch only after this one, and then stamps it, which stops the
        clearing)."""
        w = len(READER_COUNTERS)
        row = self._readers[(e % EPOCH_SLOTS) * w:(e % EPOCH_SLOTS + 1) * w]
        if row[0] != e:
            row[0] = e
        nxt = self._readers[((e + 1) % EPOCH_SLOTS) * w:((e + 1) % EPOCH_SLOTS + 1) * w]
        if nxt[0] != e + 1:
            if nxt[1:].any():
                nxt[1:] = 0
            ws = len(SAMPLER_COUNTERS)
            srow = self._samplers[((e + 1) % EPOCH_SLOTS) * ws:((e + 1) % EPOCH_SLOTS + 1) * ws]
            if srow.any():
                srow[:] = 0

    def count(self, epoch: int, **deltas) -> None:
        """Adds to epoch's counters (prefetcher only: the single writer of the counter rows)."""
        row = self._counters[int(epoch) % EPOCH_SLOTS]
        if row[0] != epoch:
            row[1:] = 0
            row[0] = epoch
        for key, v in deltas.items():
            row[COUNTERS.index(key)] += int(v)
    def count_reads(self, stream: int, samples: int, hits: int, prefetch_hits: int, wait_ns: int) -> None:
        """Adds one batch of reads to the reader row of `stream`'s epoch (any process; atomic adds;
        the stream whose epoch a process's reads count in: publish.reader_stream). Ranks of a node
        may be an epoch apart for a moment, and each read counts in its own rank's epoch."""
        from .. import _io
        epoch = self._orders.epoch_of(stream)
        if epoch < 0:
            return
        base = (epoch % EPOCH_SLOTS) * len(READER_COUNTERS)
        for name, v in (("samples", samples), ("hits", hits), ("prefetch_hits", prefetch_hits),
                        ("wait_ns", wait_ns)):
            if v:
                _io.atomic_add(self._readers, base + READER_COUNTERS.index(name), int(v))
    def count_sampler(self, epoch: int, **deltas) -> None:
        """Adds to epoch's sampler row (any process; atomic adds): accuracy_repeats,
        stall_deferrals, stall_repeats (SAMPLER_COUNTERS)."""
        from .. import _io
        base = (int(epoch) % EPOCH_SLOTS) * len(SAMPLER_COUNTERS)
        for name, v in deltas.items():
            if v:
                _io.atomic_add(self._samplers, base + SAMPLER_COUNTERS.index(name), int(v))
    def epoch_counters(self) -> list:
        """[{epoch, prefetched, prefetch_wasted, prefetched_bytes, reads_issued, samples, hits,
        prefetch_hits, wait_s, accuracy_repeats, stall_deferrals, stall_repeats}] of the epochs
        recorded, oldest first (the last EPOCH_SLOTS epochs): the prefetcher's counters, what the
        loaders read (CachedDataset) and what the samplers' orders repeated or deferred."""
        by_epoch = {}
        for r in self._counters:
            d = dict(zip(COUNTERS, (int(v) for v in r)))
            if any(d[c] for c in COUNTERS[1:]):
                by_epoch[d["epoch"]] = d
        w = len(READER_COUNTERS)
        for k in range(EPOCH_SLOTS):
            d = dict(zip(READER_COUNTERS, (int(v) for v in self._readers[k * w:(k + 1) * w])))
            ws = len(SAMPLER_COUNTERS)
            sd = dict(zip(SAMPLER_COUNTERS, (int(v) for v in self._samplers[k * ws:(k + 1) * ws])))
            if any(d[c] for c in READER_COUNTERS[1:]) or any(sd.values()):
                row = by_epoch.setdefault(d["epoch"], {c: 0 for c in COUNTERS} | {"epoch": d["epoch"]})
                row.update(samples=d["samples"], hits=d["hits"], prefetch_hits=d["prefetch_hits"],
                           wait_s=d["wait_ns"] / 1e9, **sd)
        for row in by_epoch.values():
            for c in ("samples", "hits", "prefetch_hits") + SAMPLER_COUNTERS:
                row.setdefault(c, 0)
            row.setdefault("wait_s", 0.0)
        return [by_epoch[e] for e in sorted(by_epoch)]
    def totals(self) -> dict:
        t = {c: 0 for c in COUNTERS[1:]}
        for r in self.epoch_counters():
            for c in t:
                t[c] += r[c]
        return t
