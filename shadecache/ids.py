"""Sample ids: the one rule every Python entry point that takes a batch of them applies
(CachedDataset, ImportanceTable and ShadeSampler; the native calls apply the same rule in
csrc/bindings/ids.h).

An id batch is any sequence, array or tensor of integers (of any shape: it is flattened, in order);
a bool, a float or a string is not an id (TypeError naming it), and every id lies in 0..n-1
(IndexError naming the first one out of range and its position).
"""
import numpy as np


def check_ids(ids, n: int) -> np.ndarray:
    """`ids` as a 1-D int64 array (see the module docstring)."""
    a = np.asarray(ids)
    if a.ndim != 1:
        a = a.reshape(-1)
    if a.size and a.dtype.kind not in "iu":
        for i in a.tolist():
            if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
                raise TypeError(f"sample ids must be integers, got {i!r}")
    a = a.astype(np.int64, copy=False)
    if a.size and (a.min() < 0 or a.max() >= n):
        k = int(np.flatnonzero((a < 0) | (a >= n))[0])
        raise IndexError(f"sample id {int(a[k])} is out of range 0..{n - 1} (position {k})")
    return a
