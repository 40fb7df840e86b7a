"""Process-wide memory tuning for the readers that hand out a fresh bytes object per value (the
store readers, the peer client's replies).

glibc returns the memory of a freed batch to the kernel (heap trim; mmap for blocks >= 128 KB),
so the next batch's bytes objects fault in and zero fresh pages: a page-fault storm on every
batch, which cost large store reads and peer replies most of their speed (docs/store_format.md,
"Memory: glibc trimming"; the peer replies: docs/benchmark_history.md, "Peer layer and SSD tier:
store reads per epoch and peer throughput"). Keeping up to 64 MiB of freed heap, and serving
blocks below 16 MiB from the heap, removes it. Once per process; skipped when the user tunes
malloc through its own environment variables or sets SHADECACHE_NO_MALLOC_TUNING.
"""
import os

from . import _io

MMAP_THRESHOLD = 16 << 20
TRIM_THRESHOLD = 64 << 20
_tuned = False


def tune_malloc_once() -> None:
    """Raises glibc's mmap and trim thresholds once in this process (see the module docstring)."""
    global _tuned
    if _tuned:
        return
    _tuned = True
    env = os.environ
    if env.get("SHADECACHE_NO_MALLOC_TUNING") or any(
            k in env for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return
    _io.tune_malloc(MMAP_THRESHOLD, TRIM_THRESHOLD)
