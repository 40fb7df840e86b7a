"""The order board's layout: its constants and byte offsets, shared by the board's concerns
(board.py the handle, orders.py, handoff.py, epoch_counters.py, control.py); board.py's docstring
draws the layout and states the memory contract."""
import numpy as np

from .. import shm

MAGIC = 0x3152454452_4F4353   # "SCORDER1"-ish tag; any other value is not a board
VERSION = 1
HEADER_BYTES = 4096
STREAM_BYTES = 64
MAX_STREAMS = 64
NONE = np.iinfo(np.int32).max          # "no known next use" in nxt / next_use
EPOCH_SLOTS = 32                       # per-epoch counter rows kept (epoch mod EPOCH_SLOTS)
# Entries a stream keeps by default beyond an epoch's order: the head of the next epoch, when the
# sampler knows it already (a uniform order the cache does not rearrange). Far more than any
# lookahead window needs; 12 bytes each per stream.
NEXT_EPOCH_ROOM = 65536
# flags[i]: brought and unused / being read or held by the prefetcher / that, and a reader waits
PREFETCHED, ON_WAY, WANTED = 1, 2, 3
COUNTERS = ("epoch", "prefetched", "prefetch_wasted", "prefetched_bytes", "reads_issued")
COUNTER_OFF = 128                     # header offset of the counter rows
# The readers' per-epoch rows (CachedDataset in any process of the node adds to them with an
# atomic add; the stream writer that publishes an epoch first zeroes its row): what the training
# loop saw, per epoch. In the header's spare bytes (zeros in a board of an older writer).
READER_COUNTERS = ("epoch", "samples", "hits", "prefetch_hits", "wait_ns")
READER_OFF = 2048
# The samplers' per-epoch rows (ShadeSampler in any rank of the node adds with an atomic add): the
# repeats and deferrals its epoch's order holds. Epoch e's row is slot e % EPOCH_SLOTS, stamped by
# the reader row of that slot; cleared with it. The header's last spare bytes (3328..4096).
SAMPLER_COUNTERS = ("accuracy_repeats", "stall_deferrals", "stall_repeats")
SAMPLER_OFF = READER_OFF + EPOCH_SLOTS * len(READER_COUNTERS) * 8

# header words (int64 each) at these byte offsets
H_MAGIC, H_VERSION, H_STREAMS, H_CAPACITY, H_N = 0, 8, 16, 24, 32
H_CREATOR, H_CREATOR_START = shm.BOARD_CREATOR_AT, shm.BOARD_CREATOR_START_AT   # shm.py sweeps by them
H_PREFETCHER, H_STOP = 48, 56
H_PREFETCHER_START = 72   # the prefetcher's start time: with its pid, one process (pids are reused)
H_READ_RULE, H_REACH = 80, 88   # what the prefetcher reads ahead, and how far (its own words)
# Counts every WANTED a reader sets (atomic add): the prefetcher's hand-over looks at it (and the
# streams' words) to tell whether anything that decides a hand-over moved, without a scan of N
# flags each poll.
H_WANTED_SEQ = 96
# The prefetcher's read rule, written by it when it starts (0 in a board no prefetcher ran on):
# READS_EVERY_MISS  every miss of its window, making room in a full cache (no copying tier);
# READS_ADMITTED    once the cache is full, only what it would admit when due (an SSD tier keeps
#                   the rest, and the loader reads it from there);
# READS_UNTIL_FULL  nothing once the cache is full (the extent plan: the loader's own reads are
#                   whole extents)
READS_EVERY_MISS, READS_ADMITTED, READS_UNTIL_FULL = 1, 2, 3
# stream record words
S_SEQ, S_EPOCH, S_LENGTH, S_CURSOR = 0, 1, 2, 3


def fence():
    """A full hardware fence around a seqlock's sequence word (board.py's memory contract)."""
    from .. import _io
    _io.memory_fence()


def sizes(streams: int, capacity: int, n: int):
    """(offset of ids, of nxt, of next_use, of flags, total bytes) of a board of this shape."""
    off_streams = HEADER_BYTES
    off_ids = off_streams + MAX_STREAMS * STREAM_BYTES
    off_nxt = off_ids + streams * capacity * 8
    off_next = off_nxt + streams * capacity * 4
    off_flags = off_next + streams * n * 4
    total = off_flags + n
    return off_ids, off_nxt, off_next, off_flags, total
