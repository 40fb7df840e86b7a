"""Requests to an S3 (or S3-compatible) object store: ranged GETs into a caller's buffer, retried
until they bring the right bytes or fail with a clear error; the multipart upload of a store.

The client library is botocore (boto3's core), chosen by measurement (docs/object_store.md): the
standard AWS configuration comes with it (the default credential chain: environment, profile,
web identity, container and instance roles, refreshed before they expire; the region; the
endpoint from AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3, plain http only when that URL says http).
botocore's own retries are off: this module retries, so that every retry is counted (stats())
and a truncated body is read again, which botocore's retry layer never sees.

What each fault gets (a request = one ranged GET of one extent):
  503 / SlowDown               backoff with full jitter, and this process's concurrency halved
                               (then grown back by one per `limit` successes: AIMD, so the
                               request rate drops while the prefix scales)
  500 / 502 / 504, RequestTimeout, InternalError
                               backoff with full jitter, read again
  reset, timeout, truncated body (fewer bytes than asked)
                               read the range again
  ExpiredToken and its kin     credentials refreshed now, read again
  a 200 answer to a ranged GET (the server sent the whole object)
                               the bytes before the range are skipped, the range kept, the rest
                               of the body dropped with its connection; counted
  412 PreconditionFailed, or an ETag that is not the pinned one
                               ObjectChangedError naming the object: never bytes of two versions
  403 / 404 and other 4xx      PermissionError / FileNotFoundError / ObjectStoreError at once
After `max_attempts` attempts a request fails with ObjectStoreError naming the object, the range
and the last cause.

Fork safety: a botocore client (its connection pool, its threads) belongs to the process that made
it. Each ObjectClient keeps the pid that built its client; the first request in another pid (a
forked DataLoader worker) builds a new one there, and the parent's is left alone (never closed in
the child: its sockets are the parent's). Pickled (spawned workers), a client is its settings.

Every request holds a slot of the node's bound (node_slots.py) while it runs.
"""
from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..errors import ObjectChangedError, ObjectStoreError
from .node_slots import NodeSlots

__all__ = ["ObjectClient", "parse_url", "is_object_url", "DEFAULT_CONNECTIONS"]

DEFAULT_CONNECTIONS = 16       # requests in flight per node and endpoint (AWS: 8-16 MB GETs, ~90 MB/s each)
_READ_PIECE = 1 << 20
_THROTTLED = {"SlowDown", "ServiceUnavailable", "Throttling", "ThrottlingException", "RequestLimitExceeded",
              "TooManyRequestsException", "503"}
_TRANSIENT = {"InternalError", "RequestTimeout", "RequestTimeTooSkewed", "500", "502", "504", "BadGateway",
              "GatewayTimeout", "OperationAborted"}
_STALE_CREDENTIALS = {"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired", "RequestExpired",
                      "InvalidToken"}
_CHANGED = {"PreconditionFailed", "412"}
_MISSING = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}


def is_object_url(path) -> bool:
    """Whether `path` names an object (s3://bucket/key) rather than a file."""
    return isinstance(path, str) and path.startswith("s3://")


def parse_url(url: str) -> tuple:
    """(bucket, key) of s3://bucket/key; ValueError naming the URL otherwise."""
    if not is_object_url(url):
        raise ValueError(f"not an object URL (s3://bucket/key): {url!r}")
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket or not key or key.endswith("/"):
        raise ValueError(f"{url!r} does not name an object: give s3://bucket/key")
    return bucket, key


@dataclass
class Counters:
    """What this process's requests did (stats())."""
    requests: int = 0           # GETs and HEADs sent, retries included
    bytes: int = 0              # body bytes kept (the ranges asked)
    bytes_received: int = 0     # body bytes read, skipped and partial ones included
    retries: int = 0            # requests sent again, by cause below
    throttled: int = 0          # 503 / SlowDown answers
    server_errors: int = 0      # 500 / 502 / 504 and kin
    broken: int = 0             # resets, timeouts, truncated bodies
    credential_refreshes: int = 0
    whole_object_answers: int = 0   # 200 to a ranged GET
    in_flight_max: int = 0      # requests in flight at once in this process, at most
    limit_now: float = 0.0      # this process's concurrency now (AIMD)
    causes: dict = field(default_factory=dict)   # kind of cause -> retries it caused


class _Gate:
    """This process's concurrency, lowered on throttling (AIMD): halved by a SlowDown, grown by
    1/limit per success back up to `most`."""

    def __init__(self, most: int):
        self.most = float(most)
        self.limit = float(most)
        self.in_flight = 0
        self.cv = threading.Condition()

    def __enter__(self):
        with self.cv:
            while self.in_flight >= max(1, int(self.limit)):
                self.cv.wait()
            self.in_flight += 1
            return self.in_flight

    def __exit__(self, *exc):
        with self.cv:
            self.in_flight -= 1
            self.cv.notify()

    def throttled(self):
        with self.cv:
            self.limit = max(1.0, self.limit / 2)

    def succeeded(self):
        with self.cv:
            if self.limit < self.most:
                self.limit = min(self.most, self.limit + 1.0 / self.limit)
                self.cv.notify_all()


def _short_lived_credentials(source: Callable[[], dict]):
    """botocore RefreshableCredentials over `source` (a callable returning access_key,
    secret_key, token (optional) and expiry_time (datetime or ISO 8601)), refreshed a quarter of
    their lifetime before they expire (botocore's windows, 15 and 10 minutes, would refresh
    credentials that live two minutes on every request)."""
    import datetime

    from botocore.credentials import RefreshableCredentials

    def metadata():
        m = dict(source())
        exp = m["expiry_time"]
        if isinstance(exp, datetime.datetime):
            if exp.tzinfo is None:
                exp = exp.replace(tzinfo=datetime.timezone.utc)
            m["expiry_time"] = exp.isoformat()
        m.setdefault("token", None)
        return m

    first = metadata()

    class ShortLived(RefreshableCredentials):
        pass

    life = (datetime.datetime.fromisoformat(first["expiry_time"])
            - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    if life > 0:
        ShortLived._advisory_refresh_timeout = min(RefreshableCredentials._advisory_refresh_timeout, life / 4)
        ShortLived._mandatory_refresh_timeout = min(RefreshableCredentials._mandatory_refresh_timeout, life / 8)
    return ShortLived.create_from_metadata(first, refresh_using=metadata, method="shadecache-credentials")


class ObjectClient:
    """Requests to one endpoint, bounded node-wide to `connections` in flight.

    endpoint_url / region: None takes them from the AWS configuration (AWS_ENDPOINT_URL,
    AWS_REGION, the profile). credentials: None for the default chain, or a picklable callable
    returning a dict (access_key, secret_key, token, expiry_time), called again before they
    expire. connections: the node's bound on requests in flight to this endpoint
    ($SHADECACHE_S3_CONNECTIONS when None). slot_dir: where the bound's lock file lives
    (node_slots.py). max_attempts: tries per request before ObjectStoreError."""

    def __init__(self, endpoint_url: str | None = None, region: str | None = None,
                 credentials: Optional[Callable[[], dict]] = None, connections: int | None = None,
                 slot_dir: str | None = None, max_attempts: int = 10, connect_timeout: float = 5.0,
                 read_timeout: float = 20.0, backoff_base: float = 0.05, backoff_cap: float = 5.0):
        if connections is None:
            connections = int(os.environ.get("SHADECACHE_S3_CONNECTIONS", DEFAULT_CONNECTIONS))
        if not isinstance(connections, int) or connections < 1:
            raise ValueError(f"connections must be an integer >= 1, not {connections!r}")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, not {max_attempts!r}")
        self._settings = dict(endpoint_url=endpoint_url, region=region, credentials=credentials,
                              connections=connections, slot_dir=slot_dir, max_attempts=max_attempts,
                              connect_timeout=connect_timeout, read_timeout=read_timeout,
                              backoff_base=backoff_base, backoff_cap=backoff_cap)
        self.connections = connections
        self.max_attempts = max_attempts
        self._backoff = (backoff_base, backoff_cap)
        self._mu = threading.Lock()
        self._pid = None
        self._client = None
        self._pool = None
        self.counters = Counters()
        self._gate = _Gate(connections)
        self.endpoint = self._botocore()[1].meta.endpoint_url
        self.slots = NodeSlots(self.endpoint, connections, slot_dir)

    # ---- the per-process botocore client ----------------------------------------------------
    def _botocore(self):
        """(session, client) of this process, made on first use in each pid."""
        with self._mu:
            if self._pid != os.getpid():
                if self._client is not None:
                    _LEFT_TO_PARENT.append((self._client, self._pool))   # never closed here
                self._client, self._pool = self._make_client(), None
                self.counters = Counters()
                self._gate = _Gate(self.connections)
                self._pid = os.getpid()
            return self._session, self._client

    def _make_client(self):
        import botocore.session
        from botocore.config import Config
        from botocore.credentials import CredentialProvider

        s = self._settings
        session = botocore.session.get_session()
        if s["credentials"] is not None:
            given = _short_lived_credentials(s["credentials"])

            class Given(CredentialProvider):
                METHOD = "shadecache-credentials"

                def load(self):
                    return given
            session.get_component("credential_provider").insert_before("env", Given())
        config = Config(max_pool_connections=s["connections"], retries={"total_max_attempts": 1},
                        connect_timeout=s["connect_timeout"], read_timeout=s["read_timeout"],
                        tcp_keepalive=True, request_checksum_calculation="when_required",
                        response_checksum_validation="when_required")
        self._session = session
        return session.create_client("s3", endpoint_url=s["endpoint_url"], region_name=s["region"],
                                     config=config)

    def pool(self):
        """This process's threads for requests in parallel (one per connection of the bound)."""
        self._botocore()
        with self._mu:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(max_workers=self.connections, thread_name_prefix="sc-s3")
            return self._pool

    def __reduce__(self):
        return (_remake, (self._settings,))

    # ---- requests ---------------------------------------------------------------------------
    def head(self, bucket: str, key: str) -> dict:
        """{size, etag, version} of the object."""
        r = self._request(f"s3://{bucket}/{key}", "HEAD", lambda c: c.head_object(Bucket=bucket, Key=key))
        return {"size": int(r["ContentLength"]), "etag": r.get("ETag"), "version": r.get("VersionId")}

    def get_first(self, bucket: str, key: str, n: int) -> tuple:
        """(the first n bytes (fewer when the object is shorter), {size, etag, version}) in one
        GET: the object's size comes from Content-Range (or the whole body's length)."""
        url = f"s3://{bucket}/{key}"
        out = {}

        def go(c):
            r = c.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{n - 1}")
            status = r["ResponseMetadata"]["HTTPStatusCode"]
            if status == 206:
                size = int(r["ContentRange"].rsplit("/", 1)[1])
            else:
                size = int(r["ContentLength"])
            want = min(n, size)
            buf = bytearray(want)
            self._fill(r["Body"], memoryview(buf), 0, url, f"bytes 0-{want - 1}")
            r["Body"].close()
            out.update(size=size, etag=r.get("ETag"), version=r.get("VersionId"))
            return bytes(buf)
        data = self._request(url, "GET", go)
        return data, out

    def get_into(self, bucket: str, key: str, start: int, view: memoryview, etag: str | None,
                 version: str | None = None) -> None:
        """Fills `view` with the object's bytes [start, start + len(view)), from the version
        pinned by `etag` (If-Match) or `version`. ObjectChangedError when the object is another
        one now."""
        url = f"s3://{bucket}/{key}"
        n = len(view)
        end = start + n - 1
        what = f"bytes {start}-{end}"

        def go(c):
            kw = dict(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}")
            if etag:
                kw["IfMatch"] = etag
            if version:
                kw["VersionId"] = version
            r = c.get_object(**kw)
            body = r["Body"]
            try:
                if etag and r.get("ETag") not in (None, etag):
                    raise ObjectChangedError(f"{url} was replaced since the store was opened (ETag "
                                             f"{r.get('ETag')}, pinned {etag}): reopen the store")
                status = r["ResponseMetadata"]["HTTPStatusCode"]
                skip = 0
                if status == 200:   # the whole object: the range lies `start` bytes in
                    with self._mu:
                        self.counters.whole_object_answers += 1
                    skip = start
                    if int(r.get("ContentLength", 0)) < start + n:
                        raise _Broken(f"a 200 answer of {r.get('ContentLength')} bytes to {what}")
                elif status == 206:
                    got = r.get("ContentRange", "")
                    if not got.startswith(f"bytes {start}-{end}/"):
                        raise _Broken(f"Content-Range {got!r} for {what}")
                else:
                    raise _Broken(f"HTTP {status} for {what}")
                self._fill(body, view, skip, url, what)
            finally:
                body.close()   # a 200's rest is dropped with its connection, not read
        self._request(url, "GET " + what, go)
        with self._mu:
            self.counters.bytes += n

    def _fill(self, body, view: memoryview, skip: int, url: str, what: str) -> None:
        """Reads `skip` bytes to drop, then len(view) into view; _Broken when the body ends first."""
        while skip:
            chunk = body.read(min(skip, _READ_PIECE))
            if not chunk:
                raise _Broken(f"body ended {skip} bytes before {what}")
            skip -= len(chunk)
            self._received(len(chunk))
        got, n = 0, len(view)
        while got < n:
            chunk = body.read(min(n - got, _READ_PIECE))
            if not chunk:
                raise _Broken(f"truncated body: {got} of {n} bytes of {what}")
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
            self._received(len(chunk))

    def _received(self, n: int) -> None:
        with self._mu:
            self.counters.bytes_received += n

    def _request(self, url: str, what: str, call):
        """call(client) under a node slot and this process's gate, retried by the rules of the
        module docstring."""
        import botocore.exceptions as bx

        session, client = self._botocore()
        last = None
        for attempt in range(self.max_attempts):
            if attempt:
                with self._mu:
                    self.counters.retries += 1
                base, cap = self._backoff
                time.sleep(random.uniform(0, min(cap, base * 2 ** attempt)))
            cause = None
            with self._gate as in_flight, self.slots.acquire():
                with self._mu:
                    self.counters.requests += 1
                    self.counters.in_flight_max = max(self.counters.in_flight_max, in_flight)
                try:
                    result = call(client)
                    self._gate.succeeded()
                    return result
                except bx.ClientError as e:
                    err = e.response.get("Error", {})
                    code = str(err.get("Code", ""))
                    status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
                    if code in _CHANGED or status == "412":
                        raise ObjectChangedError(f"{url} was replaced since the store was opened "
                                                 f"(If-Match failed on {what}): reopen the store") from None
                    if code in _MISSING or status == "404":
                        raise FileNotFoundError(2, f"no such object: {url} ({code or status})") from None
                    if code in _STALE_CREDENTIALS:
                        self._refresh_credentials(session)
                        cause = f"credentials: {code}"
                    elif code in _THROTTLED or status == "503":
                        self._gate.throttled()
                        with self._mu:
                            self.counters.throttled += 1
                        cause = f"throttled: {code or status}"
                    elif code in _TRANSIENT or status in ("500", "502", "504"):
                        with self._mu:
                            self.counters.server_errors += 1
                        cause = f"server error: {code or status}"
                    elif code in _DENIED or status == "403":
                        raise PermissionError(13, f"{url}: {what} refused ({code}: {err.get('Message', '')})") from None
                    else:
                        raise ObjectStoreError(f"{url}: {what} failed: {code or status} "
                                               f"{err.get('Message', '')}") from None
                except (_Broken, bx.BotoCoreError, OSError) as e:
                    if isinstance(e, (ObjectChangedError, FileNotFoundError, PermissionError)):
                        raise
                    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError,
                                      bx.NoRegionError, bx.ParamValidationError)):
                        raise ObjectStoreError(f"{url}: {what}: {e}") from None
                    with self._mu:
                        self.counters.broken += 1
                    cause = f"{type(e).__name__}: {e}"
            last = cause
            kind = cause.split(":")[0]
            with self._mu:
                self.counters.causes[kind] = self.counters.causes.get(kind, 0) + 1
        raise ObjectStoreError(f"{url}: {what} failed {self.max_attempts} times; last: {last}")

    def _refresh_credentials(self, session) -> None:
        creds = session.get_credentials()
        refresh = getattr(creds, "_protected_refresh", None)
        if refresh is not None:
            with self._mu:
                self.counters.credential_refreshes += 1
            try:
                refresh(is_mandatory=True)
            except Exception:   # the retry reports what the next request says
                pass

    # ---- upload -----------------------------------------------------------------------------
    def upload_file(self, path: str, bucket: str, key: str, part_bytes: int = 64 << 20) -> dict:
        """Uploads the file at `path` as the object, in one multipart upload that either
        completes or is aborted (no object appears, an older one stays). Returns head()."""
        url = f"s3://{bucket}/{key}"
        size = os.path.getsize(path)
        part_bytes = max(5 << 20, int(part_bytes))   # S3: every part but the last >= 5 MiB
        up = self._request(url, "CreateMultipartUpload",
                           lambda c: c.create_multipart_upload(Bucket=bucket, Key=key))["UploadId"]
        try:
            parts = []
            with open(path, "rb") as f:
                for number, start in enumerate(range(0, max(size, 1), part_bytes), 1):
                    f.seek(start)
                    data = f.read(part_bytes)
                    r = self._request(url, f"UploadPart {number}",
                                      lambda c, d=data, k=number: c.upload_part(
                                          Bucket=bucket, Key=key, UploadId=up, PartNumber=k, Body=d))
                    parts.append({"ETag": r["ETag"], "PartNumber": number})
            self._request(url, "CompleteMultipartUpload", lambda c: c.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts}))
        except BaseException:
            try:
                self._request(url, "AbortMultipartUpload", lambda c: c.abort_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=up))
            except Exception:   # the upload's own error is the one to report
                pass
            raise
        return self.head(bucket, key)

    def stats(self) -> dict:
        """This process's counters (Counters) and the bound."""
        with self._mu:
            d = dict(self.counters.__dict__)
            d["causes"] = dict(d["causes"])
        d["limit_now"] = self._gate.limit
        d["connections"] = self.connections
        d["endpoint"] = self.endpoint
        return d

    def close(self) -> None:
        with self._mu:
            if self._pid == os.getpid():
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
                if self._client is not None:
                    self._client.close()
            self._client = self._pool = None
            self._pid = None
        self.slots.close()


class _Broken(Exception):
    """A response that cannot be the bytes asked for (truncated, wrong range): read again."""


_LEFT_TO_PARENT: list = []   # clients inherited across fork: the parent's, never touched here


def _remake(settings: dict) -> "ObjectClient":
    return ObjectClient(**settings)
