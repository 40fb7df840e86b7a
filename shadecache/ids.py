"""Sample ids: the one rule every Python entry point that takes a batch of them applies
(CachedDataset, ImportanceTable and ShadeSampler; the native calls apply the same rule in
csrc/bindings/ids.h).

An id batch is any sequence, array or tensor of integers (of any shape: it is flattened, in order);
a bool, a float or a string is not an id (TypeError naming it: in a list, a bool among ints is
refused too, though numpy would read it as 0 or 1), and every id lies in 0..n-1 (IndexError naming
the first one out of range, as it was given, and its position).
"""
import numpy as np

_BOOLS = (bool, np.bool_)


def check_ids(ids, n: int) -> np.ndarray:
    """`ids` as a 1-D int64 array (see the module docstring)."""
    a = np.asarray(ids)
    if a.ndim != 1:
        a = a.reshape(-1)
    if not a.size:
        return a.astype(np.int64, copy=False)
    if a.dtype.kind not in "iu" or (isinstance(ids, (list, tuple)) and holds_bool(ids)):
        bad = next((i for i in _flat(ids, a) if isinstance(i, _BOOLS)
                    or not isinstance(i, (int, np.integer))), None)
        if bad is not None:
            raise TypeError(f"sample ids must be integers, got {bad!r}")
    if a.dtype.kind == "i":
        if a.min() >= 0 and a.max() < n:
            return a.astype(np.int64, copy=False)
        bad = (a < 0) | (a >= n)
    elif a.dtype.kind == "u":   # compared unsigned: 2**63 must not read as -2**63
        bad = a >= n
    else:                       # Python ints, some beyond int64: compared as given
        bad = np.array([not 0 <= i < n for i in a.tolist()], dtype=bool)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise IndexError(f"sample id {a[k]} is out of range 0..{n - 1} (position {k})")
    return a.astype(np.int64, copy=False)


def holds_bool(seq) -> bool:
    """Whether a (nested) list or tuple holds a bool: one C-level pass over the element types."""
    types = set(map(type, seq))
    if types.intersection(_BOOLS):
        return True
    return bool(types & {list, tuple}) and any(holds_bool(s) for s in seq if isinstance(s, (list, tuple)))


def _flat(ids, a: np.ndarray):
    """The elements as given: a (nested) list's own objects (numpy would turn 1 among floats into
    1.0), else the array's."""
    if not isinstance(ids, (list, tuple)):
        yield from a.tolist()
        return
    for i in ids:
        if isinstance(i, (list, tuple)):
            yield from _flat(i, None)
        else:
            yield i
