"""What every reader of the packed format answers from its sample directory alone, wherever the
bytes lie (a file: PackedStore, store/packed.py; an object: S3Store, store/s3.py): the columns,
the metadata, the placement, and whether a request costs the device more than its bytes
(iops_bound: what the node's "auto" read plan asks, read_plan.py).

A class using it has `_r` (a native directory with lengths(), labels(), disk_order(), meta,
placement, placement_seed, data_bytes, file_bytes, version, offset(i): _io.PackedReader or
_io.StoreDirectory), `_labels` (the read-only labels), `path`, `device` (with gap_bytes) and
read_many(ids).
"""
from __future__ import annotations

import json
import operator
import struct

import numpy as np

from ..errors import StoreFormatError

IOPS_BOUND_FACTOR = 4          # see PackedViews.iops_bound


class PackedViews:
    """The directory's views, shared by the packed format's readers."""

    _lengths = None

    @property
    def lengths(self) -> np.ndarray:
        """Byte length of every sample (uint32)."""
        if self._lengths is None:
            self._lengths = self._r.lengths()
            self._lengths.flags.writeable = False
        return self._lengths

    @property
    def labels(self) -> np.ndarray:
        """Labels of all samples (a read-only int64 array)."""
        return self._labels

    def label(self, i: int) -> int:
        i = operator.index(i)  # TypeError for 1.5 or "3", as read() gives
        if not 0 <= i < len(self._labels):
            raise IndexError(f"sample id {i} out of range [0, {len(self._labels)})")
        return int(self._labels[i])

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, i: int) -> tuple:
        return self.read(i), self.label(i)

    def __getitems__(self, ids) -> list:
        """Batched fetch that torch's DataLoader calls with a whole batch of ids."""
        return list(zip(self.read_many(ids), (int(self._labels[i]) for i in ids)))

    @property
    def version(self) -> int:
        return self._r.version

    @property
    def placement(self) -> str:
        """How samples lie in the store: "shuffled" (a seeded shuffle of the ids, pack's default)
        or "as written" (id order)."""
        return self._r.placement

    @property
    def placement_seed(self) -> int:
        return self._r.placement_seed

    @property
    def placement_bytes(self) -> bytes:
        """The header's placement fields (bytes 96-112): what the fingerprint's check of a
        reopened file compares."""
        return struct.pack("<IIQ", 1 if self.placement == "shuffled" else 0, 0, self.placement_seed)

    def disk_order(self) -> np.ndarray:
        """The ids in the order their bytes lie in the store (int64): neighbours in this array are
        neighbours in the store, which a read of one extent gets together."""
        return self._r.disk_order()

    @property
    def data_bytes(self) -> int:
        """Bytes of sample data (the sum of all lengths)."""
        return self._r.data_bytes

    @property
    def file_bytes(self) -> int:
        return self._r.file_bytes

    def offset(self, i: int) -> int:
        """Offset of sample ``i`` in the store (what CorruptSampleError reports)."""
        return self._r.offset(i)

    @property
    def meta(self) -> dict:
        """Metadata stored at pack time (class names, source, creator). StoreFormatError when it
        is not a JSON object, or nests too deeply to parse (its checksum only proves it is what
        the writer stored)."""
        raw = self._r.meta
        if not raw:
            return {}
        try:
            meta = json.loads(raw)
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise StoreFormatError(f"{self.path}: metadata is not JSON ({exc})") from None
        except RecursionError:  # a checksum does not stop `[[[[...` nested past the parser's limit
            raise StoreFormatError(f"{self.path}: metadata is not JSON the reader accepts "
                                   "(nested too deeply)") from None
        if not isinstance(meta, dict):
            raise StoreFormatError(f"{self.path}: metadata is a JSON {type(meta).__name__}, not an object")
        return meta

    @property
    def classes(self) -> list | None:
        classes = self.meta.get("classes")
        if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
            raise StoreFormatError(f"{self.path}: metadata 'classes' is not a list of names")
        return classes

    @property
    def iops_bound(self) -> bool:
        """Whether a read of one sample costs the store at least IOPS_BOUND_FACTOR (4) times
        more in its request than in its bytes (the mean sample is under a quarter of what the
        store transfers in the time of one request): then reads of whole extents, and the order
        that reads them (the node's extent plan), pay off. Below that factor they do not: an
        extent's read also carries the samples the cache holds inside it (docs/benchmark_history.md,
        "bench/peers.py: shadecache, Mosaic Streaming 0.13.0, LitData 0.2.76", 100 KB samples)."""
        n = len(self)
        return bool(n) and IOPS_BOUND_FACTOR * self.data_bytes / n < self.device["gap_bytes"]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
