"""Reading a store of format version 1, to convert it (`shadecache pack OLD.shc NEW.shc`).

Version 1 started every sample on a 4 KiB boundary and kept a 24-byte directory entry per sample
(offset, length, crc32c, label): a sample smaller than 4 KiB took a whole block on disk, so small
samples took many times their own size (docs/benchmark_history.md, "The dense store (format
version 2)").
PackedStore refuses it with a message naming this conversion; this module reads it once, checking
every checksum, so that pack() can write it again in the current format. Nothing else reads it.

Layout (little-endian): a 4096-byte header block (the 128-byte header below), samples at multiples
of 4096, the directory at dir_offset (num_samples x (u64 offset, u32 length, u32 crc32c,
i64 label)), then the metadata JSON.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from .. import _io
from ..errors import CorruptSampleError, StoreFormatError

__all__ = ["VersionOneStore", "format_version"]

_HEADER = struct.Struct("<8sIIIIQQQIIQQQ44sI")
_ENTRY = np.dtype([("offset", "<u8"), ("length", "<u4"), ("crc", "<u4"), ("label", "<i8")])
MAGIC = b"SHDCPACK"
_ONE_READ = 1 << 30   # bytes asked of one pread (Linux returns at most 2 GiB - 4 KiB of one)


def format_version(path) -> int | None:
    """The format version a store file says it has, or None when it is not a store. A file this
    user may not read is a PermissionError naming it (it may well be a store)."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except IsADirectoryError:
        return None
    if len(head) < 12 or head[:8] != MAGIC:
        return None
    return struct.unpack_from("<I", head, 8)[0]


class VersionOneStore:
    """A map-style data set over a version-1 store: ``len()``, ``store[i] -> (bytes, label)``
    (a bytearray for a sample over 1 GiB, read in pieces into one buffer),
    ``meta``. Every header field, the directory's and the metadata's checksums are checked at
    open; each sample's checksum when it is read (CorruptSampleError)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._load()
        except BaseException:
            os.close(self._fd)
            raise

    def _fail(self, why):
        raise StoreFormatError(f"{self.path}: {why}")

    def _read(self, off, n, what):
        if n <= _ONE_READ:
            b = os.pread(self._fd, n, off)
            if len(b) != n:
                self._fail(f"truncated while reading the {what}")
            return b
        # One pread returns at most 2 GiB - 4 KiB (Linux): a larger read is completed in pieces
        # (into one buffer: a sample of up to 4 GiB - 1 is not held twice).
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = os.preadv(self._fd, [view[got:got + _ONE_READ]], off + got)
            if k == 0:
                self._fail(f"truncated while reading the {what}")
            got += k
        return buf

    def _load(self):
        size = os.fstat(self._fd).st_size
        if size < _HEADER.size:
            self._fail("not a shadecache store: shorter than the header")
        raw = self._read(0, _HEADER.size, "header")
        (magic, version, header_bytes, align, entry_bytes, n, dir_off, dir_bytes, dir_crc,
         meta_crc, meta_off, meta_bytes, file_bytes, _reserved, header_crc) = _HEADER.unpack(raw)
        if magic != MAGIC or version != 1:
            self._fail(f"not a version-1 store (magic {magic!r}, version {version})")
        if _io.crc32c(raw[:124]) != header_crc:
            self._fail("header damaged: checksum mismatch")
        if (header_bytes, align, entry_bytes) != (4096, 4096, 24) or dir_bytes != n * 24 \
                or meta_off != dir_off + dir_bytes or file_bytes != meta_off + meta_bytes:
            self._fail("header fields are inconsistent")
        if size < file_bytes:
            self._fail(f"truncated: {size} bytes, the header says {file_bytes}")
        directory = self._read(dir_off, dir_bytes, "sample directory")
        if _io.crc32c(directory) != dir_crc:
            self._fail("sample directory damaged: checksum mismatch")
        self._dir = np.frombuffer(directory, dtype=_ENTRY)
        # Offsets are bounded first: offset + length in uint64 would wrap for one near 2^64.
        offsets = self._dir["offset"]
        ends = offsets.astype(np.uint64) + self._dir["length"]
        if n and (offsets.min() < 4096 or offsets.max() > dir_off or ends.max() > dir_off):
            self._fail("sample directory damaged: an entry lies outside the data region")
        meta = self._read(meta_off, meta_bytes, "metadata")
        if _io.crc32c(meta) != meta_crc:
            self._fail("metadata damaged: checksum mismatch")
        try:
            self.meta = json.loads(meta) if meta else {}
        except (ValueError, RecursionError):
            self._fail("metadata is not JSON")
        if not isinstance(self.meta, dict):
            self._fail("metadata is not a JSON object")

    def __len__(self) -> int:
        return len(self._dir)

    def __getitem__(self, i: int) -> tuple:
        e = self._dir[i]
        data = self._read(int(e["offset"]), int(e["length"]), f"sample {i}")
        if _io.crc32c(data) != int(e["crc"]):
            raise CorruptSampleError(f"{self.path}: sample {i} at file offset {int(e['offset'])} is "
                                     "corrupt (checksum mismatch)", i, int(e["offset"]))
        return data, int(e["label"])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
