"""FolderStore: the store interface over one file per sample (an ImageFolder tree, or a list of
files), for users who will not convert their data; each batch opens, reads and closes its files
through io_uring (up to queue_depth at a time) or the pread pool (csrc/io/folder_reader.h).
"""
from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from .. import _io
from ..memory import tune_malloc_once
from .reader import NativeStore, check_backend_args, native_path, warn_fallback

__all__ = ["FolderStore", "scan_image_folder"]


def scan_image_folder(root: str | os.PathLike) -> tuple:
    """(paths, labels, classes) of an ImageFolder tree: root/<class>/<...>/<file>.

    Classes are the sorted subfolder names and labels their index; files are taken in sorted order
    within each class (recursively, as torchvision does); hidden entries (".name") are skipped.
    Raises ValueError when the tree holds no sample.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        if os.path.exists(root):
            raise NotADirectoryError(f"{root} is not a directory (expected root/<class>/<file>)")
        raise FileNotFoundError(f"no such directory: {root}")
    classes = sorted(e.name for e in os.scandir(root)
                     if e.is_dir() and not e.name.startswith("."))
    paths, labels = [], []
    for label, cls in enumerate(classes):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls), followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if not name.startswith("."):
                    paths.append(os.path.join(dirpath, name))
                    labels.append(label)
    if not paths:
        raise ValueError(f"no samples found under {root}: expected files in class folders "
                         f"({root}/<class>/<file>), found {len(classes)} class folder(s) "
                         "and no files in them")
    return paths, labels, classes


class FolderStore(NativeStore):
    """The PackedStore interface over one file per sample (an ImageFolder tree, or explicit paths).

    Ids follow sorted order (classes sorted, files sorted in each); labels are class indices.
    ``read_many`` opens, reads and closes a whole batch of files through io_uring (up to
    queue_depth files at a time), or the pread pool where io_uring is refused.
    """

    def __init__(self, root: str | os.PathLike | None = None, backend: str = "auto",
                 queue_depth: int = 64, *, files: Iterable | None = None):
        check_backend_args(backend, queue_depth)
        if (root is None) == (files is None):
            raise ValueError("FolderStore needs a root folder or files=[(path, label), ...]")
        if root is not None:
            self.root = os.fspath(root)
            paths, labels, self.classes = scan_image_folder(self.root)
        else:
            self.root = None
            pairs = list(files)
            if not pairs:
                raise ValueError("FolderStore: the list of files is empty")
            paths = [os.path.abspath(os.fspath(p)) for p, _ in pairs]
            labels = [int(lab) for _, lab in pairs]
            self.classes = None
        self._options = (backend, int(queue_depth))
        self._files = files if root is None else None
        self._r = _io.FolderReader([native_path(p) for p in paths], backend, int(queue_depth))
        tune_malloc_once()
        warn_fallback(self._r.fallback_reason)
        self._labels = np.asarray(labels, dtype=np.int64)
        self._labels.flags.writeable = False

    def path(self, i: int) -> str:
        return os.fsdecode(self._r.path(i))

    @property
    def paths(self) -> list:
        return [self.path(i) for i in range(len(self))]

    def close(self) -> None:
        """Frees this store's ring, or its share of the pread pool (the last store joins it)."""
        self._r.close()

    def __reduce__(self):
        if self.root is not None:
            return (FolderStore, (self.root,) + self._options)
        files = list(zip(self.paths, self._labels.tolist()))
        return (_folder_from_files, (files,) + self._options)

    def __repr__(self) -> str:
        return (f"FolderStore({self.root!r}, {len(self)} samples, backend={self.backend!r}, "
                f"queue_depth={self.queue_depth})")


def _folder_from_files(files, backend, queue_depth):
    return FolderStore(None, backend, queue_depth, files=files)
