"""One job's concerns over its board file (board_files.JobFile): its orders (orders.py), its rows
and totals (epoch_counters.py), its scores (job_scores.py). A job's own handle (board.py) and the
views of every job (all_jobs.py) are made of these."""
from __future__ import annotations

import numpy as np

from .board_layout import (EPOCH_SLOTS, HEADER_BYTES, JOB_COUNTER_OFF, JOB_COUNTERS, MAX_STREAMS,
                           READER_COUNTERS, READER_OFF, SAMPLER_COUNTERS, SAMPLER_OFF, STREAM_BYTES,
                           sizes)
from .epoch_counters import EpochCounters
from .job_scores import JobScores
from .orders import Orders


class JobView:
    """file: the job's JobFile; node_header: the node file's header words (int64: the WANTED
    count that Orders.marks includes); prefetcher_rows: the node file's prefetcher counter rows."""

    def __init__(self, file, node_header: np.ndarray, prefetcher_rows: np.ndarray):
        self.file = file
        self.slot, self.generation = file.slot, file.generation
        s, c, n = file.streams, file.capacity, file.num_samples
        off_ids, off_nxt, off_next, off_scores, _ = sizes(s, c, n)
        header = file.view(np.int64, HEADER_BYTES // 8, 0)
        self.counters = EpochCounters(
            prefetcher_rows,
            file.view(np.int64, EPOCH_SLOTS * len(READER_COUNTERS), READER_OFF),   # flat: atomic adds
            file.view(np.int64, EPOCH_SLOTS * len(SAMPLER_COUNTERS), SAMPLER_OFF),
            file.view(np.int64, len(JOB_COUNTERS), JOB_COUNTER_OFF))
        self.orders = Orders(
            file.view(np.int64, MAX_STREAMS * STREAM_BYTES // 8, HEADER_BYTES,
                      (MAX_STREAMS, STREAM_BYTES // 8)),
            file.view(np.int64, s * c, off_ids, (s, c)), file.view(np.int32, s * c, off_nxt, (s, c)),
            file.view(np.int32, s * n, off_next, (s, n)), node_header, s, c, n, self.counters)
        self.counters.bind_orders(self.orders)
        self.scores = JobScores(file.view(np.float32, n, off_scores), header)

    def close(self) -> None:
        for part in (self.orders, self.counters, self.scores):
            part.close()
        self.file.close()
