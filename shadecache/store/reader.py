"""What the two native stores share (store/packed.py, store/folder.py): their read interface over
a native reader of shadecache._io (csrc/io), the checks of the backend arguments, the one-time
warning when io_uring is refused, and paths as the bytes the native code opens.
"""
from __future__ import annotations

import operator
import os
import warnings
from typing import Any, Sequence

import numpy as np

from .. import _io

FORMAT_VERSION = _io.FORMAT_VERSION
_BACKENDS = ("auto", "io_uring", "pread")
_warned: set = set()  # fallback reasons already reported in this process


def warn_fallback(reason: str) -> None:
    """Says once per process (and per reason) that io_uring is not used, and why."""
    if reason and reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"shadecache: io_uring unavailable ({reason}); using the pread thread pool",
                      RuntimeWarning, stacklevel=3)


def check_backend_args(backend: str, queue_depth: int) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, not {backend!r}")
    if not isinstance(queue_depth, (int, np.integer)) or not 1 <= queue_depth <= 4096:
        raise ValueError(f"queue_depth must be an integer in [1, 4096], not {queue_depth!r}")


def probe_backend(backend: str = "auto", queue_depth: int = 64) -> tuple:
    """(name, fallback_reason) of the I/O backend this process would get (``shadecache info``)."""
    check_backend_args(backend, queue_depth)
    return tuple(_io.probe_backend(backend, queue_depth))


def native_path(path) -> bytes:
    """`path` as the bytes the native code opens. A NUL would end the path there (c_str), so
    it is refused as Python's open() refuses it."""
    b = os.fsencode(path)
    if b"\0" in b:
        raise ValueError(f"embedded null byte in path {os.fsdecode(b)!r}")
    return b


class NativeStore:
    """What PackedStore and FolderStore share over their native reader (``_r``, made by each): the
    read interface and the map-style data set view (``store[i] -> (bytes, label)``), so a store
    can itself be packed or put behind a DataLoader."""

    _r: Any
    _labels: np.ndarray

    def read(self, i: int) -> bytes:
        """The bytes of sample ``i`` (checksum verified for packed stores unless verify=False)."""
        return self._r.read(i)

    def read_many(self, ids: Sequence[int] | np.ndarray) -> list:
        """The bytes of every id, read as one batch with the GIL released while it waits."""
        return self._r.read_many(ids)

    def label(self, i: int) -> int:
        i = operator.index(i)  # TypeError for 1.5 or "3", as read() gives
        if not 0 <= i < len(self._labels):
            raise IndexError(f"sample id {i} out of range [0, {len(self._labels)})")
        return int(self._labels[i])

    @property
    def labels(self) -> np.ndarray:
        """Labels of all samples (a read-only int64 array)."""
        return self._labels

    @property
    def backend(self) -> str:
        """The I/O backend this process uses: "io_uring" or "pread"."""
        return self._r.backend

    @property
    def fallback_reason(self) -> str:
        """Why io_uring is not in use ("" when it is, or when pread was asked for)."""
        return self._r.fallback_reason

    @property
    def queue_depth(self) -> int:
        return self._r.queue_depth

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, i: int) -> tuple:
        return self._r.read(i), self.label(i)

    def __getitems__(self, ids: Sequence[int]) -> list:
        """Batched fetch that torch's DataLoader calls with a whole batch of ids."""
        return list(zip(self._r.read_many(ids), (int(self._labels[i]) for i in ids)))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass
