"""Writing a packed store (format: docs/store_format.md).

- ``PackWriter``: appends samples to a temporary file and publishes it atomically on ``close()``.
- ``pack``: packs a folder (ImageFolder layout), a list of (path, label) files, or any map-style
  data set yielding (bytes-like, label) into one store; files are read in batches through a
  FolderStore (io_uring where available).
"""
from __future__ import annotations

import json
import operator
import os
import re

import numpy as np

from .. import _io
from .._version import __version__
from .folder import FolderStore
from .reader import native_path

__all__ = ["PackWriter", "pack"]


def _contiguous_bytes(data, what: str):
    """``data`` as a buffer whose bytes are the sample, or TypeError.

    An object array exposes the pointers of its Python objects, which mean nothing outside this
    process (the cache refuses them for the same reason); a strided buffer has no single run of
    bytes to store."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"{what}: data must be bytes-like, not {type(data).__name__}") from None
    dtype = getattr(data, "dtype", None)
    has_objects = (dtype.hasobject if isinstance(getattr(dtype, "hasobject", None), bool)
                   else "O" in re.sub(r":[^:]*:", "", view.format))   # field names sit in colons
    if has_objects:
        raise TypeError(f"{what}: an array of Python objects holds pointers, not sample bytes; "
                        "pass bytes or an array of numbers")
    if not view.c_contiguous:
        raise TypeError(f"{what}: data must be a C-contiguous buffer (a strided or "
                        "Fortran-order view was given)")
    return view


def _label(label, what: str) -> int:
    """A label as an int64: integers only (1.5 or "3" would be stored as something else)."""
    try:
        value = operator.index(label)
    except TypeError:
        raise TypeError(f"{what}: a label must be an integer, not {type(label).__name__}") from None
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError(f"{what}: label {value} does not fit in 64 bits")
    return value


class PackWriter:
    """Writes a packed store atomically: nothing appears at ``path`` until ``close()``.

    >>> with PackWriter("train.shc", meta={"classes": ["cat", "dog"]}) as w:
    ...     w.add(b"...", 1)

    Leaving the ``with`` block by an exception (or dropping an unclosed writer) discards the
    temporary file; an existing store at ``path`` is replaced only by a successful close.
    """

    def __init__(self, path: str | os.PathLike, meta: dict | None = None):
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            raise IsADirectoryError(f"PackWriter: {self.path} is a directory")
        self.meta = dict(meta or {})
        self._w = _io.PackWriter(native_path(self.path))  # bytes: see PackedStore

    def add(self, data, label: int = 0) -> int:
        """Appends one sample (any contiguous bytes-like object); returns its id."""
        return self._w.add(_contiguous_bytes(data, "PackWriter.add"), _label(label, "PackWriter.add"))

    def close(self) -> str:
        """Writes the directory and header, fsyncs and renames into place; returns the path."""
        if self._w.is_open:
            meta = dict(self.meta)
            meta.setdefault("created_by", f"shadecache {__version__}")
            self._w.close(json.dumps(meta, sort_keys=True))
        return self.path

    def abort(self) -> None:
        """Discards everything written; ``path`` is left as it was."""
        self._w.abort()

    @property
    def temp_path(self) -> str:
        return os.fsdecode(self._w.temp_path)

    def __len__(self) -> int:
        return self._w.num_samples

    def __enter__(self) -> "PackWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _is_path(x) -> bool:
    return isinstance(x, (str, os.PathLike))


def pack(src, dst: str | os.PathLike, *, progress: bool = True, meta: dict | None = None,
         batch: int = 256, backend: str = "auto") -> int:
    """Packs ``src`` into the store file ``dst`` atomically; returns the number of samples.

    src may be:
    - a folder in ImageFolder layout (``src/<class>/<file>``): labels are class indices and the
      class names are kept in the store's metadata;
    - a list of ``(path, label)`` pairs: each file becomes one sample;
    - any map-style data set (``len()`` and ``ds[i] -> (bytes-like, label)``), e.g. a PackedStore.
    Files are read in batches through a FolderStore (io_uring where available).
    """
    from tqdm import tqdm

    dst = os.fspath(dst)
    meta = dict(meta or {})
    folder = None
    if _is_path(src):
        folder = FolderStore(src, backend=backend)
        meta.setdefault("classes", folder.classes)
        meta.setdefault("source", os.path.abspath(os.fspath(src)))
    elif isinstance(src, (list, tuple)) and src and _is_pair_of_path(src[0]):
        folder = FolderStore(None, backend=backend, files=src)
        meta.setdefault("source", "file list")
    elif not (hasattr(src, "__len__") and hasattr(src, "__getitem__")):
        raise TypeError("pack: src must be a folder, a list of (path, label) or a map-style data "
                        f"set yielding (bytes, label), not {type(src).__name__}")
    n = len(folder) if folder is not None else len(src)
    if n == 0:
        raise ValueError(f"pack: the source {src!r} is empty; there is nothing to pack")
    if folder is None:
        meta.setdefault("source", type(src).__name__)
    with PackWriter(dst, meta=meta) as w, \
            tqdm(total=n, unit="sample", desc=f"pack {os.path.basename(dst)}",
                 disable=not progress) as bar:
        if folder is not None:
            labels = folder.labels
            for start in range(0, n, batch):
                ids = np.arange(start, min(start + batch, n))
                for i, data in zip(ids, folder.read_many(ids)):
                    w.add(data, int(labels[i]))
                bar.update(len(ids))
        else:
            for i in range(n):
                item = src[i]
                try:
                    data, label = item
                except (TypeError, ValueError):
                    raise TypeError(f"pack: item {i} of the data set is not a (bytes, label) "
                                    f"pair: {type(item).__name__}") from None
                w.add(_contiguous_bytes(data, f"pack: item {i}"), _label(label, f"pack: item {i}"))
                bar.update(1)
    return n


def _is_pair_of_path(x) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 2 and _is_path(x[0])
