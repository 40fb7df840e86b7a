"""What every benchmark in bench/ shares: the values, the access order and the timing rule.

Contracts:
- `ValueSet(n, size)` describes n values of `size` bytes each. Value i starts with i as 8
  little-endian bytes (so a wrong id is caught by `check_value`) followed by bytes cut from a
  random block, so no two neighbouring values are equal and nothing compresses.
- Access orders (ids, batches, offsets) are generated here, outside any timed region, as the
  plain Python objects a training loop would hand over (lists of ints).
- `run_interleaved` times every contender once per repetition, in turn, and keeps every time;
  figures are medians and ratios are medians of per-repetition ratios: on these noisy, shared
  machines only ratios measured side by side mean anything.
"""
import gc
import statistics
import time

import numpy as np

_BLOCK_BYTES = 8 << 20


class ValueSet:
    """n deterministic values of `size` bytes; cheap to regenerate in any process."""

    def __init__(self, n, size, seed=0):
        if size < 8:
            raise ValueError(f"value size {size} is below the 8-byte id header")
        self.n = int(n)
        self.size = int(size)
        rng = np.random.default_rng(seed)
        self._block = rng.integers(0, 256, size=_BLOCK_BYTES + self.size, dtype=np.uint8).tobytes()
        # A stride that is not a multiple of common alignments spreads values over the block.
        self._stride = 4099 * 8

    @property
    def total_bytes(self):
        return self.n * self.size

    def value(self, i):
        start = (i * self._stride) % _BLOCK_BYTES
        return i.to_bytes(8, "little") + self._block[start:start + self.size - 8]

    def chunks(self, chunk=4096):
        """(ids, values) lists in id order, `chunk` at a time, for bulk fills."""
        for lo in range(0, self.n, chunk):
            ids = list(range(lo, min(lo + chunk, self.n)))
            yield ids, [self.value(i) for i in ids]

    def check_value(self, i, got):
        """Raise AssertionError naming the id when `got` is not exactly value i."""
        want = self.value(i)
        if got is None:
            raise AssertionError(f"id {i}: got a miss, expected {self.size} bytes")
        got = bytes(got)
        if got != want:
            header = int.from_bytes(got[:8], "little") if len(got) >= 8 else None
            raise AssertionError(f"id {i}: wrong bytes (len {len(got)}, header id {header})")


def access_order(n, count, seed=1):
    """`count` ids drawn from a random permutation of range(n) (repeated when count > n)."""
    rng = np.random.default_rng(seed)
    reps = -(-count // n)
    ids = np.concatenate([rng.permutation(n) for _ in range(reps)])[:count]
    return ids.tolist()


def batches_of(ids, batch):
    """Consecutive batches of `batch` ids (a trailing partial batch is dropped)."""
    return [ids[k:k + batch] for k in range(0, len(ids) - batch + 1, batch)]


def random_offsets(span, size, count, align=8, seed=2):
    """`count` random offsets o with o % align == 0 and o + size <= span."""
    if span < size:
        raise ValueError(f"span {span} is smaller than the copy size {size}")
    rng = np.random.default_rng(seed)
    return (rng.integers(0, (span - size) // align + 1, size=count) * align).tolist()


class Timings:
    """Seconds per repetition of each contender. `t[name]` is the median; `speedup(fast, slow)`
    the median over repetitions of slow/fast, each ratio taken within one repetition, so a slow
    spell of the machine (other processes on the other vCPU) cancels out of it."""

    def __init__(self, times):
        self.times = times

    def __getitem__(self, name):
        return statistics.median(self.times[name])

    def values(self):
        return [self[name] for name in self.times]

    def speedup(self, fast, slow):
        return statistics.median(s / f for f, s in zip(self.times[fast], self.times[slow]))


def run_interleaved(contenders, reps):
    """Time each contender `reps` times, round-robin, and return their Timings.

    `contenders` maps a name to a callable `run(rep) -> seconds` that performs one repetition
    of its loop (over the work prepared for repetition `rep`) and returns the time it measured
    around the loop alone. The order rotates from one repetition to the next, so no contender
    always runs first (or right after another's garbage); a garbage collection before each run
    keeps one contender's garbage from being collected on another's clock.
    """
    names = list(contenders)
    times = {name: [] for name in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            gc.collect()
            times[name].append(contenders[name](rep))
    return Timings(times)


def timed(loop, *args):
    """Seconds taken by `loop(*args)`, measured with perf_counter around the call."""
    t0 = time.perf_counter()
    loop(*args)
    return time.perf_counter() - t0
