"""PackedStore: a packed sample store file read in batches (format: docs/store_format.md).

The sample directory lives in memory; every batch of reads goes to the kernel at once through
io_uring (or a pread thread pool where io_uring is refused), checked against the directory's
crc32c (csrc/io/packed_reader.h). PackedStream keeps batches in flight across batch boundaries
(the prefetcher's reads). This module adds the Python conveniences: argument checking, the
fingerprint, pickling for spawned workers. Writing a store is store/writer.py; one file per
sample, store/folder.py.
"""
from __future__ import annotations

import os

import numpy as np

from .. import _io
from ..errors import StoreFormatError
from ..memory import tune_malloc_once
from .object_client import is_object_url
from .packed_views import PackedViews
from .reader import NativeStore, check_backend_args, native_path, warn_fallback

__all__ = ["PackedStore", "PackedStream", "FORMAT_VERSION"]

FORMAT_VERSION = _io.FORMAT_VERSION
DEFAULT_MAX_EXTENT = 8 << 20   # bytes of one read request at most (unless one sample is larger)


class PackedStore(PackedViews, NativeStore):
    """A packed sample store opened for reading.

    backend: "auto" (io_uring, or the pread pool with a one-time warning when io_uring is
    refused), "io_uring" (refusal is an error) or "pread". direct: read with O_DIRECT (bypass the
    page cache; each read is widened to the 4096-byte blocks that cover it). queue_depth: reads kept in flight per batch.
    verify: check every sample's crc32c (a mismatch raises CorruptSampleError). A store of an
    older format version is refused (StoreFormatError) with the command that converts it.

    Reads of a batch are coalesced into extents (csrc/io/extent_read.h): samples whose bytes lie
    at most `gap_bytes` apart are read in one request. gap_bytes=None: from the device, measured
    at open (`device`: under a second of reads; not for stores under 16 MiB, where it is 0), or from
    `device={"iops": ..., "bandwidth": ...}` when given. max_extent_bytes caps one request.

    Fork-safe: a forked DataLoader worker builds its own ring on first use; spawned workers get
    the store by pickling, which reopens it by path with the same options.

    An object URL (``PackedStore("s3://bucket/key.shc", ...)``) opens the same format in an
    object store: an S3Store (store/s3.py), given the arguments that apply to it (verify,
    gap_bytes, max_extent_bytes, device, and S3Store's own keywords).
    """

    def __new__(cls, path, *args, **kwargs):
        if is_object_url(path):
            from .s3 import S3Store
            return S3Store.from_packed_arguments(path, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike, backend: str = "auto", direct: bool = False,
                 queue_depth: int = 64, verify: bool = True, *, gap_bytes: int | None = None,
                 max_extent_bytes: int = DEFAULT_MAX_EXTENT, device: dict | None = None):
        check_backend_args(backend, queue_depth)
        self.path = os.fspath(path)
        self._options = (backend, bool(direct), int(queue_depth), bool(verify))
        # fsencode: a Linux path is bytes, and one that is not UTF-8 (os.listdir gives it as a str
        # with surrogates) must still open.
        self._r = _io.PackedReader(native_path(self.path), backend, bool(direct), int(queue_depth),
                                   bool(verify))
        tune_malloc_once()
        warn_fallback(self._r.fallback_reason)
        self.device = device_profile(self, device)
        if gap_bytes is None:
            gap_bytes = self.device["gap_bytes"]
        elif not isinstance(gap_bytes, (int, np.integer)) or gap_bytes < 0:
            raise ValueError(f"gap_bytes must be None or an integer >= 0, not {gap_bytes!r}")
        self._r.set_shape(int(gap_bytes), int(max_extent_bytes))
        self._shape_options = {"gap_bytes": int(gap_bytes), "max_extent_bytes": int(max_extent_bytes),
                               "device": self.device}
        self._labels = self._r.labels()
        self._labels.flags.writeable = False
        self._lengths = None
        self._fingerprint = None
        st = os.stat(self.path)
        self._identity = (st.st_dev, st.st_ino)   # the fingerprint is read from this file only

    @property
    def direct(self) -> bool:
        return self._r.direct

    @property
    def fingerprint(self) -> str:
        """A stable identity of the store's contents (64 hex digits).

        sha256 over the header, the sample directory (every sample's offset, length, crc32c and
        label) and the metadata, so it changes when any sample, label or the metadata changes and
        not when the file is copied or moved: what a cache kept across a restart can be checked
        against the store it came from. Computed once, on first use: it reads the directory
        (24 bytes a sample) again, not the samples."""
        if self._fingerprint is None:
            self._fingerprint = _fingerprint_of(self.path, self._identity, self)
        return self._fingerprint

    def stream(self, queue_depth: int = 32, lanes: int = 2,
               submission: str = "single") -> "PackedStream":
        """Batches of reads kept in flight across batch boundaries (the prefetcher's pipeline):
        ``queue_depth`` reads in flight in all, on ``lanes`` threads of their own (io_uring, or
        the pread pool); ``submission``: "single" (one io_uring lane, every read submitted
        alone), "spread" (every lane) or "auto" (the faster, measured as it runs); the pread pool
        always spreads (csrc/io/read_stream.h). See PackedStream."""
        return PackedStream(self, queue_depth, lanes, submission)

    def verify(self, progress: bool = False, batch_bytes: int = 64 << 20) -> list:
        """Reads every sample and returns the ids whose checksum does not match (sorted)."""
        from tqdm import tqdm

        n = len(self)
        bad: list = []
        lengths = self.lengths.astype(np.int64)
        ends = np.cumsum(lengths)
        with tqdm(total=n, unit="sample", desc="verify", disable=not progress) as bar:
            first = 0
            while first < n:
                # the largest run of samples starting at `first` whose bytes fit in batch_bytes
                base = ends[first - 1] if first else 0
                last = int(np.searchsorted(ends, base + batch_bytes, side="right"))
                count = max(1, min(last, n) - first)
                bad.extend(self._r.find_corrupt(first, count))
                first += count
                bar.update(count)
        return bad

    @property
    def gap_bytes(self) -> int:
        """Neighbours on disk at most this many bytes apart are read in one request (an
        extent). From the device's measured cost of a request unless given at open."""
        return self._r.shape[0]

    def io_counters(self) -> dict:
        """What this process's reads of the store asked of the device: samples handed out, read
        requests issued (extents) and bytes requested (gaps and O_DIRECT widening included)."""
        return self._r.counters()

    def close(self) -> None:
        self._r.close()

    def __reduce__(self):
        return (_reopen, (self.path, self._options, self._shape_options))

    def __repr__(self) -> str:
        return (f"PackedStore({self.path!r}, {len(self)} samples, backend={self.backend!r}, "
                f"direct={self.direct}, queue_depth={self.queue_depth})")


def _reopen(path, options, shape_options):
    return PackedStore(path, *options, **shape_options)


# A store smaller than this is not probed (its reads are few, and the page cache holds it soon):
# extents then merge touching samples only.
_PROBE_MIN_BYTES = 16 << 20
_GAP_CAP = 1 << 20


def device_profile(store: "PackedStore", given: dict | None) -> dict:
    """What a read request costs on the store's device: {iops, bandwidth, gap_bytes, source}.
    gap_bytes = bandwidth / iops, the bytes the device transfers in the time of one request, so
    reading a gap up to it never costs more than one more request would (capped at 1 MiB)."""
    if given is not None and given.get("iops") is None and given.get("gap_bytes") == 0:
        return dict(given)     # "not measured" carried over by pickling
    if given is not None:
        try:
            iops, bw = float(given["iops"]), float(given["bandwidth"])
        except (KeyError, TypeError, ValueError):
            raise ValueError("device must be a dict with 'iops' and 'bandwidth' (numbers > 0), "
                             f"not {given!r}") from None
        if not (iops > 0 and bw > 0):
            raise ValueError(f"device iops and bandwidth must be > 0, not {given!r}")
        source = given.get("source", "given")
    elif store.data_bytes < _PROBE_MIN_BYTES:
        return {"iops": None, "bandwidth": None, "gap_bytes": 0, "source": "not measured (small store)"}
    else:
        iops, bw, direct = store._r.probe_device()
        source = "measured" + (" (O_DIRECT)" if direct else " (buffered)")
    gap = int(min(_GAP_CAP, bw / iops))
    return {"iops": iops, "bandwidth": bw, "gap_bytes": gap, "source": source}


class PackedStream:
    """A PackedStore's reads in flight across batches (csrc/io/read_stream.h): submit(ids) queues a
    batch and returns at once; take() waits for the oldest batch and returns its bytes in id order
    (checksums verified as the store's read_many does; a corrupt sample or I/O error of a batch is
    raised by its take()); close() stops the lanes (batches not taken are dropped). One thread
    submits and takes."""

    def __init__(self, store: "PackedStore", queue_depth: int = 32, lanes: int = 2,
                 submission: str = "single"):
        check_backend_args("auto", queue_depth)
        self._reader = store._r
        self._stream = _io.ReadStream(self._reader, "auto", int(queue_depth), int(lanes),
                                      str(submission))

    @property
    def submission(self) -> str:
        """The submission mode the lanes run now ("spread" or "single")."""
        return self._stream.submission

    @property
    def mode_switches(self) -> int:
        """How many times the "auto" submission changed mode."""
        return self._stream.mode_switches

    def submit(self, ids) -> None:
        self._stream.submit(self._reader, ids)

    def take(self) -> list:
        return self._stream.take()

    @property
    def pending(self) -> int:
        """Batches submitted and not yet taken."""
        return self._stream.pending

    def close(self) -> None:
        self._stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_HEADER_SUMMED = 124          # header bytes [0, 124): everything but the header's own crc
_FINGERPRINT_CHUNK = 16 << 20


def _fingerprint_of(path: str, identity: tuple, store: "PackedStore") -> str:
    """sha256 of a packed store's header, directory and metadata (the layout of
    docs/store_format.md), read again from `path`. What is read must be what `store` validated at
    open: the same file (device and inode), the same size and sample count, a directory with the
    checksum it had (it holds every sample's length, checksum and label, and the header its
    placement) and the same metadata; a file replaced or rewritten in place since
    (`cp other.shc path`) is refused."""
    import hashlib
    import struct

    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != identity:
            raise StoreFormatError(f"{path} was replaced since the store was opened; reopen it "
                                   "to take its fingerprint")
        header = os.pread(fd, _HEADER_SUMMED, 0)
        if len(header) != _HEADER_SUMMED:
            raise StoreFormatError(f"{path}: truncated header while taking the fingerprint")
        h.update(header)
        (num_samples,) = struct.unpack_from("<Q", header, 24)
        dir_offset, dir_bytes = struct.unpack_from("<QQ", header, 48)
        (dir_crc,) = struct.unpack_from("<I", header, 64)
        meta_offset, meta_bytes, file_bytes = struct.unpack_from("<QQQ", header, 72)
        changed = (num_samples != len(store) or file_bytes != store.file_bytes
                   or dir_crc != store._r.dir_crc or header[96:112] != store.placement_bytes)
        parts = {}
        for part, start, size in (("dir", dir_offset, dir_bytes), ("meta", meta_offset, meta_bytes)):
            if changed:
                break
            buf = bytearray()
            while len(buf) < size:
                chunk = os.pread(fd, min(_FINGERPRINT_CHUNK, size - len(buf)), start + len(buf))
                if not chunk:
                    raise StoreFormatError(f"{path}: the file was cut short while taking the "
                                           "fingerprint")
                buf += chunk
            h.update(buf)
            parts[part] = buf
        if not changed:
            changed = (_io.crc32c(bytes(parts["dir"])) != store._r.dir_crc
                       or bytes(parts["meta"]) != store._r.meta)
        if changed:
            raise StoreFormatError(f"{path} was rewritten since the store was opened; reopen it "
                                   "to take its fingerprint")
    finally:
        os.close(fd)
    return h.hexdigest()
