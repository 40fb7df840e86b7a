"""What a CachedLoader hands out and where it writes it: RaggedBatch (variable-size samples), the
pool of reused output buffers for fixed-size batches, and labels narrowed for the batch gather."""
import sys
import threading

import numpy as np
import torch


class RaggedBatch:
    """A batch of variable-size samples: `data` (uint8, every sample back to back) and `offsets`
    (int64, B + 1 entries): sample i is data[offsets[i]:offsets[i + 1]]."""

    __slots__ = ("data", "offsets")

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor):
        self.data = data
        self.offsets = offsets

    def __len__(self):
        return self.offsets.numel() - 1

    def __getitem__(self, i):
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a batch of {len(self)}")
        i %= len(self)
        return self.data[int(self.offsets[i]):int(self.offsets[i + 1])]

    def tolist(self) -> list:
        """One uint8 tensor (a view into `data`) per sample."""
        o = self.offsets.tolist()
        return [self.data[o[i]:o[i + 1]] for i in range(len(o) - 1)]

    def pin_memory(self) -> "RaggedBatch":
        return RaggedBatch(self.data.pin_memory(), self.offsets.pin_memory())

    def __repr__(self):
        return f"RaggedBatch({len(self)} samples, {self.data.numel()} bytes)"


def narrow_labels(labels: np.ndarray) -> np.ndarray:
    """The labels in the narrowest signed integer type that holds them (gather_rows reads int8 to
    int64 and returns int64): a million int8 labels (1 MiB) stay in the CPU caches while a batch's
    values stream past them; as int64 (8 MiB) each label read would miss them."""
    lo, hi = (int(labels.min()), int(labels.max())) if labels.size else (0, 0)
    for t in (np.int8, np.int16, np.int32):
        if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max:
            return np.ascontiguousarray(labels, dtype=t)
    return np.ascontiguousarray(labels, dtype=np.int64)


def _refcounts(arrays: list) -> list:
    return [sys.getrefcount(a) for a in arrays]


_IDLE_REFS = _refcounts([np.empty(0)])[0]   # an array that only the list given refers to


class BufferPool:
    """The (B, S) uint8 output buffers of fixed-size raw batches, reused without a contract for
    the caller: a buffer is written again only when nothing refers to it but this pool.

    A batch's tensor is torch.from_numpy of a buffer (or of a view of it), and its storage holds a
    reference to the numpy buffer until the storage is freed, i.e. until the last tensor, view,
    .numpy() array or C++ holder (autograd's saved tensors, a DataLoader queue) of it is gone. So
    the buffer's reference count is _IDLE_REFS exactly when no batch made in it is alive anywhere
    in this process, and a batch the caller keeps (in a list, across steps) is never overwritten:
    the pool hands out another buffer, or a fresh one when its `keep` buffers are all in use
    (that one is not kept). Reusing saves the page faults and the kernel's zeroing of a fresh
    buffer per call (for small samples a sizeable share of the copy itself:
    docs/benchmark_history.md, "CachedLoader vs `np.take`: the Python around the call"), and the
    lowest idle buffer is taken first, so the same one or two are written again while they are
    still in the CPU caches. The pool keeps at most `keep` buffers
    of `rows` rows for the loader's life (keep x rows x S <= _POOL_BYTES). Under a lock:
    the assembly threads share it (a reference is taken inside it, so a buffer found idle cannot
    be handed out twice). Relies on CPython's reference counts (this package's interpreter).
    One exception, torch's own: pickling a batch for another process (a torch.multiprocessing
    Queue.put) moves its storage to shared memory and lets go of the buffer, so a .numpy() array
    or DLPack export made of it before then still points at the buffer, which a later batch fills
    (with torch.empty's memory it would point at freed memory); make such arrays after the put."""

    def __init__(self, rows: int, row_bytes: int, keep: int):
        self.rows = rows
        self._shape = (rows, row_bytes)
        self._keep = keep
        self._bufs = []
        self._lock = threading.Lock()

    def __reduce__(self):
        """Pickled (a loader sent to a spawned process) as an empty pool of the same shape: the
        buffers are this process's memory, and a lock does not pickle."""
        return BufferPool, (self._shape[0], self._shape[1], self._keep)

    def take(self, n: int) -> np.ndarray:
        """An (n, S) uint8 array that no live batch refers to (contents undefined)."""
        if n > self._shape[0]:
            return np.empty((n, self._shape[1]), dtype=np.uint8)
        with self._lock:
            refs = _refcounts(self._bufs)
            if _IDLE_REFS in refs:
                buf = self._bufs[refs.index(_IDLE_REFS)]
            else:
                buf = np.empty(self._shape, dtype=np.uint8)
                if len(self._bufs) < self._keep:
                    self._bufs.append(buf)
        return buf if n == self._shape[0] else buf[:n]
