"""Writing a packed store (format: docs/store_format.md).

- ``PackWriter``: appends samples to a temporary file and publishes it atomically on ``close()``.
- ``pack``: packs a folder (ImageFolder layout), a list of (path, label) files, a store file (of
  this format, or of version 1: the conversion), or any map-style data set yielding (bytes-like,
  label) into one store; files are read in batches through a FolderStore (io_uring where
  available).

Placement: by default the samples are laid out in a seeded shuffle of their ids (the seed is kept
in the header), so that neighbours on disk are unrelated samples while ids stay the order they
were added in: a read of a run of neighbours (an extent, docs/store_format.md) is then a random
draw of the data set, whatever order the source had (an ImageFolder is sorted by class).
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

    def __init__(self, path: str | os.PathLike, meta: dict | None = None, *, shuffle: bool = True,
                 seed: int = 0):
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            raise IsADirectoryError(f"PackWriter: {self.path} is a directory")
        if not isinstance(shuffle, bool):
            raise TypeError(f"PackWriter: shuffle must be True or False, not {shuffle!r}")
        seed = operator.index(seed)
        if not 0 <= seed < (1 << 64):
            raise ValueError(f"PackWriter: seed must be in [0, 2**64), not {seed}")
        self.meta = dict(meta or {})
        # bytes: see PackedStore. With shuffle, samples are staged in an anonymous file and laid
        # out in placement order at close (csrc/io/pack_writer.h).
        self._w = _io.PackWriter(native_path(self.path), shuffle, seed)

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
         batch: int = 256, backend: str = "auto", shuffle: bool = True, seed: int = 0,
         client=None) -> int:
    """Packs ``src`` into the store file ``dst`` atomically; returns the number of samples.

    dst may be an object URL (s3://bucket/key.shc): the store is packed into a temporary file
    (in $SHADECACHE_PACK_TMPDIR, else the system's temporary directory: the store's size once
    more, twice with the shuffled placement), then uploaded in one multipart upload that either
    completes or is aborted (no object appears; an older object stays). src may be one too (a
    store in an object, read with ranged GETs). client: the ObjectClient for both (default: one
    from the AWS configuration, store/object_client.py).

    src may be:
    - a folder in ImageFolder layout (``src/<class>/<file>``): labels are class indices and the
      class names are kept in the store's metadata;
    - a store file: one of this format (packed again, e.g. with another placement) or of format
      version 1, which is converted (its metadata is kept);
    - a list of ``(path, label)`` pairs: each file becomes one sample;
    - any map-style data set (``len()`` and ``ds[i] -> (bytes-like, label)``), e.g. a PackedStore.
    Files are read in batches through a FolderStore (io_uring where available). shuffle/seed: the
    placement (module docstring); ids always stay the source's order.
    """
    from tqdm import tqdm

    from .legacy import VersionOneStore, format_version
    from .object_client import is_object_url
    from .packed import PackedStore

    if is_object_url(dst):
        return _pack_to_object(src, dst, client, progress=progress, meta=meta, batch=batch,
                               backend=backend, shuffle=shuffle, seed=seed)
    dst = os.fspath(dst)
    meta = dict(meta or {})
    folder = None
    opened = None
    if _is_path(src) and os.path.isfile(src):
        version = format_version(src)
        if version is None:
            raise ValueError(f"pack: {os.fspath(src)} is a file but not a shadecache store; give a "
                             "folder (SRC/<class>/<file>) or a store to convert")
        if os.path.exists(dst) and os.path.samefile(src, dst):
            raise ValueError(f"pack: the source and the destination are the same file ({dst}); "
                             "write the converted store to another path")
        opened = VersionOneStore(src) if version == 1 else PackedStore(src, backend=backend)
        for k, v in opened.meta.items():
            meta.setdefault(k, v)
        meta["converted_from"] = {"path": os.path.abspath(os.fspath(src)), "format_version": version}
        meta.pop("created_by", None)
        src = opened
    elif is_object_url(src):
        from .s3 import S3Store
        opened = S3Store(src, client=client)
        for k, v in opened.meta.items():
            meta.setdefault(k, v)
        meta["converted_from"] = {"path": src, "format_version": opened.version}
        meta.pop("created_by", None)
        src = opened
    elif _is_path(src):
        folder = FolderStore(src, backend=backend)
        meta.setdefault("classes", folder.classes)
        meta.setdefault("source", os.path.abspath(os.fspath(src)))
    elif isinstance(src, (list, tuple)) and src and _is_pair_of_path(src[0]):
        folder = FolderStore(None, backend=backend, files=src)
        meta.setdefault("source", "file list")
    elif not (hasattr(src, "__len__") and hasattr(src, "__getitem__")):
        raise TypeError("pack: src must be a folder, a list of (path, label) or a map-style data "
                        f"set yielding (bytes, label), not {type(src).__name__}")
    try:   # from here on, a store opened above is closed whatever happens
        n = len(folder) if folder is not None else len(src)
        if n == 0:
            raise ValueError(f"pack: the source {src!r} is empty; there is nothing to pack")
        if folder is None:
            meta.setdefault("source", type(src).__name__)
        _write(src, folder, dst, meta, n, batch, progress, shuffle, seed, tqdm)
    finally:
        if opened is not None:
            opened.close()
    return n


def _pack_to_object(src, url: str, client, **kw) -> int:
    """pack() into a temporary file, then its upload to `url` (pack's docstring)."""
    import shutil
    import tempfile

    from .object_client import ObjectClient, parse_url

    bucket, key = parse_url(url)
    client = client or ObjectClient()
    tmp = tempfile.mkdtemp(prefix="shadecache-pack-", dir=os.environ.get("SHADECACHE_PACK_TMPDIR"))
    try:
        path = os.path.join(tmp, os.path.basename(key) or "store.shc")
        n = pack(src, path, client=client, **kw)
        client.upload_file(path, bucket, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return n


def _write(src, folder, dst, meta, n, batch, progress, shuffle, seed, tqdm) -> None:
    batched = folder if folder is not None else (src if hasattr(src, "read_many") else None)
    with PackWriter(dst, meta=meta, shuffle=shuffle, seed=seed) as w, \
            tqdm(total=n, unit="sample", desc=f"pack {os.path.basename(dst)}",
                 disable=not progress) as bar:
        if batched is not None:
            labels = batched.labels
            for start in range(0, n, batch):
                ids = np.arange(start, min(start + batch, n))
                for i, data in zip(ids, batched.read_many(ids)):
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


def _is_pair_of_path(x) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 2 and _is_path(x[0])
