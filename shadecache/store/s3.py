"""S3Store: a packed store (docs/store_format.md) kept as one object in S3 or an S3-compatible
object store, read with ranged GETs (docs/object_store.md).

    store = sc.PackedStore("s3://bucket/train.shc")            # or sc.S3Store(url, ...)
    store.read_many(ids)   # the extents of the batch as ranged GETs in parallel, every sample
                           # checked against the directory's crc32c

Open: one GET of the first 4 KiB (the header; the object's size and ETag come with it), then the
directory and the metadata (the object's tail, [dir_offset, end)) in ranged GETs of at most
`max_extent_bytes` in parallel, If-Match the ETag; validated as a file's directory is
(csrc/io/store_directory.h). With `cache_dir` (an SSD tier's directory, or any local one) the
tail is kept there under the object's ETag, and the next open on the node reads it from disk
after the one GET of the header.

The object is pinned at open: every GET carries If-Match with the ETag seen then, and a replaced
object is ObjectChangedError naming it (never the bytes of two versions); a pickled store (a
spawned worker) reopens on the same ETag or fails the same way.

Reads: a batch's samples are planned into ranges as a file's are (neighbours at most gap_bytes
apart in one range, at most max_extent_bytes: csrc/io/fetched_batch.h), fetched in parallel by
the client's threads (object_client.py: retries, the node-wide bound), and each range's samples
are checked as it lands; a range whose samples do not match is fetched once more before its
samples are reported as corrupt. stream() keeps ranges in flight across batches (the prefetcher's
pipeline).

Two gaps. `gap_bytes` is what one request costs in bytes of one connection: `device` ({"iops",
"bandwidth"}: requests a second and bytes a second of one connection), by default S3's published
figures (about 20 ms to the first byte, about 93 MB/s a connection): 1 MiB (the cap). It sizes
the sampler's extent order (16 x gap_bytes, at most 8 MiB: the size AWS recommends for ranged
GETs) and says whether the store is IOPS-bound, as a file's does. The gap a batch's ranges merge
across is smaller, MERGE_GAP (64 KiB), unless gap_bytes is given: requests to an object store run
in parallel, so another request costs latency, not the node's bandwidth, while every gap byte
read does cost bandwidth (with a 1 MiB merge gap, a batch of 256 random 3 KB samples of a 117 MiB
store read the whole store). Under the extent order a batch's ids are whole extents, which
touch, and merge at any gap. max_extent_bytes: 8 MiB plus the largest sample by default (an
extent of the sampler's layout is 8 MiB plus at most one sample, and is then one GET).
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, wait

import numpy as np

from .. import _io, node_files
from ..errors import ClosedError, ObjectChangedError
from .object_client import ObjectClient, parse_url
from .packed import DEFAULT_MAX_EXTENT, device_profile
from .packed_views import PackedViews

__all__ = ["S3Store", "S3Stream", "OBJECT_STORE_DEVICE"]

# What one request costs on S3 (one connection): ~20 ms to the first byte at p90, ~93 MB/s.
OBJECT_STORE_DEVICE = {"iops": 50.0, "bandwidth": 93e6,
                       "source": "S3's published figures: 20 ms to first byte, 93 MB/s a connection"}
_HEAD_BYTES = 4096          # the header block
MERGE_GAP = 64 << 10        # see the module docstring: "Two gaps"


class S3Store(PackedViews):
    """A packed store in an object: see the module docstring. Answers the store protocol
    (shadecache/store/protocol.py) and what PackedStore adds (disk_order, iops_bound, stream(),
    verify(), fingerprint), so the tier chain, CachedDataset, the prefetcher and the peer server
    take it as they take a PackedStore.

    url: s3://bucket/key. verify: check every sample's crc32c. gap_bytes / max_extent_bytes /
    device: the shape of the ranges (module docstring). cache_dir: a local directory for the
    header and directory (None: kept in memory only). client: an ObjectClient to share (its
    endpoint, credentials and node-wide bound); else one is made from endpoint_url, region,
    credentials, connections and slot_dir (object_client.ObjectClient)."""

    def __init__(self, url: str, *, verify: bool = True, gap_bytes: int | None = None,
                 max_extent_bytes: int | None = None, device: dict | None = None,
                 cache_dir: str | None = None, client: ObjectClient | None = None,
                 endpoint_url: str | None = None, region: str | None = None, credentials=None,
                 connections: int | None = None, slot_dir: str | None = None, etag: str | None = None):
        self.path = self.url = url
        self.bucket, self.key = parse_url(url)
        if client is None:
            client = ObjectClient(endpoint_url=endpoint_url, region=region, credentials=credentials,
                                  connections=connections, slot_dir=slot_dir)
        self.client = client
        self.verify_samples = bool(verify)
        if max_extent_bytes is not None and (not isinstance(max_extent_bytes, (int, np.integer))
                                             or not 4096 <= max_extent_bytes <= 1 << 31):
            raise ValueError(f"max_extent_bytes must be in [4096, 2 GiB], not {max_extent_bytes!r}")
        self.max_extent_bytes = int(max_extent_bytes or DEFAULT_MAX_EXTENT)   # the open's pieces
        self.cache_dir = cache_dir
        self._closed = False
        self._open(etag)
        self.device = device_profile(self, OBJECT_STORE_DEVICE if device is None else device)
        if gap_bytes is None:
            self._gap, self.merge_gap_bytes = int(self.device["gap_bytes"]), min(MERGE_GAP, self.device["gap_bytes"])
        elif not isinstance(gap_bytes, (int, np.integer)) or gap_bytes < 0:
            raise ValueError(f"gap_bytes must be None or an integer >= 0, not {gap_bytes!r}")
        else:
            self._gap = self.merge_gap_bytes = int(gap_bytes)
        self._given_gap = gap_bytes
        self._labels = self._r.labels()
        self._labels.flags.writeable = False
        self._lengths = None
        if max_extent_bytes is None:
            self.max_extent_bytes = DEFAULT_MAX_EXTENT + (int(self.lengths.max()) if len(self) else 0)
        self._fingerprint = None
        self._counts = {"samples": 0, "requests": 0, "bytes": 0, "refetched": 0}
        self._mu = threading.Lock()

    @classmethod
    def from_packed_arguments(cls, url, backend: str = "auto", direct: bool = False, queue_depth: int = 64,
                              verify: bool = True, **kwargs) -> "S3Store":
        """PackedStore(url, ...)'s arguments as an S3Store's: backend, direct and queue_depth
        concern a file's reads and are accepted only at their defaults."""
        if (backend, direct) != ("auto", False):
            raise ValueError(f"{url}: backend and direct apply to store files, not to objects")
        return cls(url, verify=verify, **kwargs)

    # ---- open -------------------------------------------------------------------------------
    def _open(self, pinned: str | None) -> None:
        head, info = self.client.get_first(self.bucket, self.key, _HEAD_BYTES)
        self.etag, self.version_id, self.object_bytes = info["etag"], info["version"], info["size"]
        if pinned is not None and self.etag != pinned:
            raise ObjectChangedError(f"{self.url} was replaced since the store was opened (ETag "
                                     f"{self.etag}, pinned {pinned}): reopen the store")
        dir_offset, file_bytes, _ = _io.StoreDirectory.check_header(self.url, head, self.object_bytes)
        tail = self._cached_tail(dir_offset, file_bytes)
        if tail is None:
            tail = self._fetch_tail(dir_offset, file_bytes)
            self._keep_tail(tail)
        self._r = _io.StoreDirectory(self.url, self.object_bytes, head, tail, dir_offset)
        self._image = (bytes(head[:124]), tail)   # what the fingerprint is taken of

    def _fetch_tail(self, start: int, end: int) -> bytearray:
        tail = bytearray(end - start)
        view = memoryview(tail)
        piece = self.max_extent_bytes
        starts = range(0, len(tail), piece)
        if len(starts) <= 1:
            self.client.get_into(self.bucket, self.key, start, view, self.etag)
            return tail
        pool = self.client.pool()
        futs = [pool.submit(self.client.get_into, self.bucket, self.key, start + s, view[s:s + piece],
                            self.etag) for s in starts]
        _wait_all(futs)
        return tail

    def _tail_path(self) -> str | None:
        if self.cache_dir is None:
            return None
        tag = hashlib.sha256(f"{self.client.endpoint}\0{self.url}\0{self.etag}".encode()).hexdigest()[:32]
        return os.path.join(self.cache_dir, f"s3-directory-{tag}")

    def _cached_tail(self, start: int, end: int):
        path = self._tail_path()
        if path is None:
            return None
        try:
            fd = node_files.open_file(path, os.O_RDONLY, "the object store's directory cache")
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        # a cached tail of the wrong size is left to be replaced; its content is checked as the
        # fetched one is (the directory's and the metadata's checksums, against the header)
        return bytearray(data) if len(data) == end - start else None

    def _keep_tail(self, tail) -> None:
        path = self._tail_path()
        if path is None:
            return
        dfd = node_files.own_directory(self.cache_dir, "the object store's cache_dir")
        try:
            node_files.replace(self.cache_dir, os.path.basename(path), bytes(tail),
                               "the object store's directory cache", dir_fd=dfd)
        finally:
            os.close(dfd)

    def keep_directory(self, directory: str) -> None:
        """Keeps the header and directory in `directory` (this user's own) from now on, when no
        cache_dir was given: the node passes its SSD tier's directory, so that the next job on
        this node opens the object without fetching its directory again."""
        if self.cache_dir is not None:
            return
        self.cache_dir = directory
        self._keep_tail(self._image[1])

    # ---- reads ------------------------------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise ClosedError(f"S3Store {self.url} is closed")

    def _batch(self, ids):
        self._check_open()
        return self._r.batch(ids, self.merge_gap_bytes, self.max_extent_bytes, self.verify_samples)

    def _fetch_range(self, batch, x: int, offset: int) -> None:
        """Range x of `batch` fetched and landed; fetched once more when its samples do not
        match (a damaged transfer), then landed whatever it holds (a sample of the object that
        does not match its checksum is then reported by finish())."""
        view = batch.view(x)
        self.client.get_into(self.bucket, self.key, offset, view, self.etag, self.version_id)
        if not batch.intact(x):
            with self._mu:
                self._counts["refetched"] += 1
            self.client.get_into(self.bucket, self.key, offset, view, self.etag, self.version_id)
        batch.land(x)

    def _start(self, batch) -> list:
        """Futures of every range of `batch` on the client's threads."""
        ranges = batch.ranges()
        pool = self.client.pool()
        return [pool.submit(self._fetch_range, batch, x, int(ranges[x, 0])) for x in range(len(ranges))]

    def _finish(self, batch, n: int) -> list:
        requests, nbytes = len(batch), batch.range_bytes
        values = batch.finish(self.url)
        with self._mu:
            self._counts["samples"] += n
            self._counts["requests"] += requests
            self._counts["bytes"] += nbytes
        return values

    def read_many(self, ids) -> list:
        """The bytes of every id, in order: the batch's ranges fetched in parallel, every sample
        checked (CorruptSampleError naming the object, the id and its offset)."""
        batch = self._batch(ids)
        ranges = batch.ranges()
        if len(ranges) == 1:   # no thread hop for a batch of one range
            self._fetch_range(batch, 0, int(ranges[0, 0]))
        elif len(ranges):
            _wait_all(self._start(batch))
        return self._finish(batch, int(np.size(ids)))

    def read(self, i: int) -> bytes:
        import operator
        return self.read_many([operator.index(i)])[0]

    def stream(self, queue_depth: int = 32, lanes: int = 2, submission: str = "single") -> "S3Stream":
        """Batches whose ranges stay in flight across batch boundaries (the prefetcher's
        pipeline): submit(ids), take(), close(). queue_depth, lanes and submission concern a
        file's reads; here the client's threads and the node's bound decide."""
        return S3Stream(self)

    def verify(self, progress: bool = False, batch_bytes: int = 64 << 20) -> list:
        """Reads every sample (in ranges of the store's order on disk) and returns the ids whose
        checksum does not match (sorted)."""
        from tqdm import tqdm

        from ..errors import CorruptSampleError

        order = self.disk_order()
        sizes = self.lengths.astype(np.int64)[order]
        ends = np.cumsum(sizes)
        bad: list = []
        with tqdm(total=len(order), unit="sample", desc="verify", disable=not progress) as bar:
            first = 0
            while first < len(order):
                base = ends[first - 1] if first else 0
                last = max(first + 1, int(np.searchsorted(ends, base + batch_bytes, side="right")))
                ids = order[first:last]
                try:
                    self.read_many(ids)
                except CorruptSampleError:
                    bad.extend(self._corrupt_among(ids))
                bar.update(len(ids))
                first = last
        return sorted(bad)

    def _corrupt_among(self, ids) -> list:
        """The ids of `ids` whose bytes do not match, one range of them at a time."""
        from ..errors import CorruptSampleError

        out = []
        for i in ids.tolist():
            try:
                self.read_many([i])
            except CorruptSampleError:
                out.append(i)
        return out

    # ---- identity and counters --------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """sha256 of the header, the directory and the metadata: the same value a PackedStore of
        the same file gives (store/packed.py), so a cache or SSD tier made over the local file
        accepts the object and the other way round."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(self._image[0])
            h.update(self._image[1])
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @property
    def gap_bytes(self) -> int:
        """What one request costs in bytes of one connection (module docstring, "Two gaps"):
        what the sampler's extent order is sized by."""
        return self._gap

    def io_counters(self) -> dict:
        """What this process's reads asked of the object store: samples handed out, requests
        (ranges) and bytes requested, as a PackedStore's io_counters."""
        with self._mu:
            return {k: self._counts[k] for k in ("samples", "requests", "bytes")}

    def stats(self) -> dict:
        """This process's reads (io_counters, ranges fetched again) and its client's requests:
        retries by cause, throttling, whole-object answers, requests in flight at most."""
        with self._mu:
            out = dict(self._counts)
        out["client"] = self.client.stats()
        return out

    def close(self) -> None:
        self._closed = True

    def __reduce__(self):
        return (_reopen, (self.url, self.client, dict(
            verify=self.verify_samples, gap_bytes=self._given_gap, max_extent_bytes=self.max_extent_bytes,
            device=self.device, cache_dir=self.cache_dir,
            etag=self.etag)))

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, {len(self)} samples, ETag {self.etag})"


def _reopen(url, client, options):
    return S3Store(url, client=client, **options)


def _wait_all(futs) -> None:
    """Waits for every future (none may still write into a batch's buffers when this returns),
    then raises the first failure."""
    done, _ = wait(futs, return_when=FIRST_EXCEPTION)
    wait(futs)
    for f in futs:
        if f.exception() is not None:
            raise f.exception()


class S3Stream:
    """An S3Store's batches in flight: submit(ids) starts every range of the batch on the
    client's threads and returns at once; take() waits for the oldest batch and returns its bytes
    in id order (a corrupt sample or a failed request of a batch is raised by its take());
    close() waits for what is in flight and drops it. One thread submits and takes."""

    def __init__(self, store: S3Store):
        self.store = store
        self._inflight = deque()   # (batch, futures, n)

    def submit(self, ids) -> None:
        n = int(np.size(ids))
        batch = self.store._batch(ids)
        self._inflight.append((batch, self.store._start(batch), n))

    def take(self) -> list:
        batch, futs, n = self._inflight.popleft()
        _wait_all(futs)
        return self.store._finish(batch, n)

    @property
    def pending(self) -> int:
        return len(self._inflight)

    def close(self) -> None:
        while self._inflight:
            _, futs, _ = self._inflight.popleft()
            wait(futs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
