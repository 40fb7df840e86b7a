"""The order board's layout: its two files, their constants and byte offsets, shared by the board's
concerns (board.py the handle, orders.py, handoff.py, epoch_counters.py, control.py, jobs.py,
job_scores.py); board.py's docstring draws the layout and states the memory contract,
docs/jobs.md the registry's.

Two files. The node's (`shadecache-order.<cache>`): what every process of the node shares whatever
job it serves: the prefetcher's words and counters, the hand-off flags, the registry of jobs. A
job's (`shadecache-job.<cache>.<slot>`): what is that job's own: its ranks' orders, its per-epoch
rows and totals, its score table.
"""
import numpy as np

from .. import shm

# ---- both files -----------------------------------------------------------------------------------
HEADER_BYTES = 4096
NONE = np.iinfo(np.int32).max          # "no known next use" in nxt / next_use
EPOCH_SLOTS = 32                       # per-epoch counter rows kept (epoch mod EPOCH_SLOTS)
# header words (int64 each) at these byte offsets, in both files
H_MAGIC, H_VERSION, H_N = 0, 8, 32
H_CREATOR, H_CREATOR_START = shm.BOARD_CREATOR_AT, shm.BOARD_CREATOR_START_AT   # shm.py sweeps by them

# ---- the node's file ----------------------------------------------------------------------------------
MAGIC = 0x3152454452_4F4353   # "SCORDER1"-ish tag; any other value is not a board
VERSION = 2                   # 1: one file with the orders of one job
H_PREFETCHER, H_STOP = 48, 56
H_PREFETCHER_START = 72   # the prefetcher's start time: with its pid, one process (pids are reused)
H_READ_RULE, H_REACH = 80, 88   # what the prefetcher reads ahead, and how far (its own words)
# Counts every WANTED a reader sets (atomic add): the prefetcher's hand-over looks at it (and the
# streams' words) to tell whether anything that decides a hand-over moved, without a scan of N
# flags each poll.
H_WANTED_SEQ = 96
H_SCORE_MERGE = 104    # how the live jobs' scores are merged into the cache's (SCORE_MERGES)
H_GENERATIONS = 112    # the last generation given to a job that registered (jobs.py)
# The prefetcher's read rule, written by it when it starts (0 in a board no prefetcher ran on):
# READS_EVERY_MISS  every miss of its window, making room in a full cache (no copying tier);
# READS_ADMITTED    once the cache is full, only what it would admit when due (an SSD tier keeps
#                   the rest, and the loader reads it from there);
# READS_UNTIL_FULL  nothing once the cache is full (the extent plan: the loader's own reads are
#                   whole extents)
READS_EVERY_MISS, READS_ADMITTED, READS_UNTIL_FULL = 1, 2, 3
COUNTERS = ("epoch", "prefetched", "prefetch_wasted", "prefetched_bytes", "reads_issued")
COUNTER_OFF = 128                     # header offset of the prefetcher's counter rows
# The registry (jobs.py): MAX_JOBS slots after the header; the flags after the registry.
MAX_JOBS, JOB_TABLE_AT, JOB_SLOT_BYTES = shm.MAX_JOBS, shm.JOB_TABLE_AT, shm.JOB_SLOT_BYTES
JOB_LIVE_AT = shm.JOB_LIVE_AT          # + slot: the byte the job's processes hold (process.hold_byte)
REGISTRY_LOCK_AT = JOB_LIVE_AT - 1     # the byte whose exclusive lock guards the registry
# slot words (int64 each): generation (0: free), registering pid and its start time, registered at
# (unix ns); the job's name from J_NAME (NUL-padded UTF-8)
J_GENERATION, J_PID, J_START, J_SINCE, J_NAME = 0, 8, 16, 24, 64
JOB_NAME_BYTES = JOB_SLOT_BYTES - J_NAME
FLAGS_AT = JOB_TABLE_AT + MAX_JOBS * JOB_SLOT_BYTES
# flags[i]: brought and unused / being read or held by the prefetcher / that, and a reader waits
PREFETCHED, ON_WAY, WANTED = 1, 2, 3
# How the cache's score table holds the live jobs' scores (job_scores.py; docs/jobs.md)
SCORE_MERGES = {"uses": 1, "max": 2, "sum": 3, "last": 4}


def node_bytes(n: int) -> int:
    """Bytes of the node's file for a data set of n samples."""
    return FLAGS_AT + n


# ---- a job's file ----------------------------------------------------------------------------------
JOB_MAGIC = 0x3142_4F4A5F4353   # "SC_JOB1"-ish tag
JOB_VERSION = 1
STREAM_BYTES = 64
MAX_STREAMS = 64
H_STREAMS, H_CAPACITY = 16, 24
H_SLOT, H_GENERATION = shm.JOB_SLOT_AT, shm.JOB_GENERATION_AT   # which registration the file is of
H_SCORE_BATCH = 72      # the batch size the job's scores were ranked in (job_scores.py), 0: none
# Entries a stream keeps by default beyond an epoch's order: the head of the next epoch, when the
# sampler knows it already (a uniform order the cache does not rearrange). Far more than any
# lookahead window needs; 12 bytes each per stream.
NEXT_EPOCH_ROOM = 65536
# The job's totals (any process of the job adds, atomically): what `shadecache stats` lists per job.
JOB_COUNTERS = ("samples", "hits", "prefetch_hits", "wait_ns", "store_reads", "store_bytes")
JOB_COUNTER_OFF = 256
# The readers' per-epoch rows (CachedDataset in any process of the job adds to them with an
# atomic add; the stream writer that publishes an epoch first zeroes its row): what the training
# loop saw, per epoch.
READER_COUNTERS = ("epoch", "samples", "hits", "prefetch_hits", "wait_ns")
READER_OFF = 2048
# The samplers' per-epoch rows (ShadeSampler in any rank of the job adds with an atomic add): the
# repeats and deferrals its epoch's order holds. Epoch e's row is slot e % EPOCH_SLOTS, stamped by
# the reader row of that slot; cleared with it. The header's last bytes (3328..4096).
SAMPLER_COUNTERS = ("accuracy_repeats", "stall_deferrals", "stall_repeats")
SAMPLER_OFF = READER_OFF + EPOCH_SLOTS * len(READER_COUNTERS) * 8
# stream record words: seq, epoch, length published, cursor, and how many of the entries are the
# epoch's (the rest: the head of the next epoch)
S_SEQ, S_EPOCH, S_LENGTH, S_CURSOR, S_EPOCH_LENGTH = 0, 1, 2, 3, 4


def fence():
    """A full hardware fence around a seqlock's sequence word (board.py's memory contract)."""
    from .. import _io
    _io.memory_fence()


def sizes(streams: int, capacity: int, n: int):
    """(offset of ids, of nxt, of next_use, of the scores, total bytes) of a job's file of this
    shape."""
    off_streams = HEADER_BYTES
    off_ids = off_streams + MAX_STREAMS * STREAM_BYTES
    off_nxt = off_ids + streams * capacity * 8
    off_next = off_nxt + streams * capacity * 4
    off_scores = off_next + streams * n * 4
    total = off_scores + n * 4
    return off_ids, off_nxt, off_next, off_scores, total
