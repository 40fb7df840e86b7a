"""A connection to one peer server: handshake, batched GET, replies authenticated and verified.

Every call finishes by a deadline the caller gives (time.monotonic()), the handshake included; a
peer that is slow, hung (SIGSTOP), gone or dribbling makes the call raise (socket.timeout /
ConnectionError / ProtocolError) by then, and the connection is closed: the next call
reconnects. A reply is trusted only after its frames' authentication tags, framing and ids check
out (otherwise nothing of it is returned), and each value only after its crc32c does too (a value
that fails it is refused: None, read from the next tier).

The connection names its data set (`dataset`: a store, a Cache, or (fingerprint, num_samples));
a server of another data set is refused with FingerprintError naming both.

Not thread-safe: one client per thread (the Cluster keeps one per peer per process).
"""
import json
import os
import socket
import time

import numpy as np

from . import auth, identity, wire
from . import secret as secrets_
from .. import _core
from ..errors import FingerprintError
from ..memory import tune_malloc_once


def split_address(address: str) -> tuple:
    """("host", port) of "host:port" ("[v6]:port" too). ValueError naming the address."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"peer address must be 'host:port', got {address!r}")
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port)
    except ValueError:
        raise ValueError(f"peer address {address!r}: port is not a number") from None
    if not host or not 0 < port <= 65535:
        raise ValueError(f"peer address {address!r}: want host:port with port in 1..65535")
    return host, port


def _warn_refused(address, n):
    import warnings

    warnings.warn(f"shadecache: peer {address} sent {n} value(s) that failed their crc32c; "
                  "refused, read from the next tier", RuntimeWarning, stacklevel=4)


class PeerClient:
    def __init__(self, address: str, secret=None, dataset=None):
        """address "host:port"; secret: see secret.py (default: $SHADECACHE_SECRET or the file
        $SHADECACHE_SECRET_FILE names); dataset: what this node reads (required for get_many)."""
        self.address = address
        self.host, self.port = split_address(address)
        self.key = secrets_.resolve(secret)
        self.identity = identity.identity_of(dataset) if dataset is not None else None
        self.sock = None
        self.session = None
        self._opaque = 0
        self.refused = 0      # values whose crc32c did not match (damaged at the peer or on the way)
        # Replies land in fresh bytes objects of up to MAX_VALUE: without this, glibc returns
        # the freed heap top to the kernel after every batch and the next one page-faults it
        # back in (64 x 100 KB replies: 6.4 -> 1.7 ms). Same tuning as the store readers.
        tune_malloc_once()

    def connect(self, deadline: float) -> None:
        """Connects and runs the handshake, both by `deadline`."""
        self.close()
        if self.identity is None:
            raise ValueError(f"PeerClient({self.address!r}) names no data set: give dataset= (the store "
                             "this node reads)")
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("no time left to connect")
        sock = socket.create_connection((self.host, self.port), timeout=left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                session = auth.client_handshake(sock, self.key, self.identity, deadline)
            except FingerprintError as e:
                raise FingerprintError(f"peer {self.address}: {e}") from None
        except BaseException:
            sock.close()
            raise
        self.sock, self.session = sock, session

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self.session = None

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            self.close()
            raise socket.timeout(f"peer {self.address}: no time left")
        return left

    def _check(self, code: int, detail):
        """detail of a native result 0; otherwise closes the connection and raises."""
        if code == 0:
            return detail
        self.close()   # a half-read or half-sent message leaves the stream unusable
        if code == 1:
            raise socket.timeout(f"peer {self.address}: no complete reply by the deadline")
        if code == 2:
            raise ConnectionError(f"peer {self.address} closed the connection")
        if code == 3:
            raise OSError(detail, f"peer {self.address}: {os.strerror(detail)}")
        if code == 5:
            status, msg = detail
            raise wire.RemoteError(f"peer {self.address} error {status}: {msg.decode('utf-8', 'replace')}")
        if code == 6:
            raise auth.ForgedFrameError(f"peer {self.address}: a frame failed its authentication tag "
                                        "(altered or forged on the way); nothing of it was used")
        status, msg = detail
        raise wire.ProtocolError(f"peer {self.address}: {msg}", status)

    def send_get(self, ids, deadline: float) -> int:
        """Sends one GET for `ids` (1 to wire.MAX_BATCH of them); returns its opaque word."""
        a = np.ascontiguousarray(ids, dtype="<u8")
        if not 0 < a.size <= wire.MAX_BATCH:
            raise ValueError(f"a GET asks for 1 to {wire.MAX_BATCH} ids, got {a.size}")
        if self.sock is None:
            self.connect(deadline)
        self._opaque = (self._opaque + 1) & 0xFFFFFFFFFFFFFFFF
        try:
            code, detail = self.session.send_message(self.sock.fileno(), wire.GET, a.size, self._opaque, 0, a,
                                                     self._left(deadline))
        except BaseException:
            self.close()
            raise
        self._check(code, detail)
        return self._opaque

    def recv_get(self, ids, opaque: int, deadline: float) -> list:
        """The reply to the GET sent for `ids`: bytes (tag and crc32c verified) or None per id. One
        native call reads every chunk of the reply, opens its sealed table and values, checks the
        framing and ids, reads the values straight into the result bytes and verifies each
        crc32c, without the GIL (bindings/peer_io.cc). A value whose crc32c (the one the peer's
        cache recorded at put: the store's) does not match is refused: None, as a miss, so that it
        comes from the next tier; `refused` counts them."""
        a = np.ascontiguousarray(ids, dtype="<u8")
        try:
            code, detail = self.session.recv_get_reply(self.sock.fileno(), a, opaque, self._left(deadline))
        except BaseException:
            self.close()
            raise
        values, refused = self._check(code, detail)
        if refused:
            self.refused += refused
            _warn_refused(self.address, refused)
        return values

    def get_many(self, ids, timeout: float = 1.0) -> list:
        if not len(ids):
            return []
        deadline = time.monotonic() + timeout
        a = np.ascontiguousarray(ids, dtype="<u8")   # once for both calls
        op = self.send_get(a, deadline)
        return self.recv_get(a, op, deadline)

    def _ask(self, opcode: int, answer: int, deadline: float):
        if self.sock is None:
            self.connect(deadline)
        try:
            fd = self.sock.fileno()
            self._check(*self.session.send_message(fd, opcode, 0, 0, 0, b"", self._left(deadline)))
            left = self._left(deadline)   # as idle and timeout both: the reply is whole by the deadline
            op, status, _, _, body = self._check(*self.session.recv_message(fd, [answer, wire.ERROR], left, left))
        except BaseException:
            self.close()
            raise
        if op == wire.ERROR:
            self.close()
            raise wire.RemoteError(f"peer {self.address} error {status}: {body.decode('utf-8', 'replace')}")
        return body

    def server_stats(self, timeout: float = 1.0) -> dict:
        """The server's counters (requests, ids, cache_hits, ssd_hits, store_reads, bytes_sent...)."""
        body = self._ask(wire.STATS, wire.STATS_REPLY, time.monotonic() + timeout)
        d = json.loads(body)
        if not isinstance(d, dict):
            raise wire.ProtocolError(f"peer {self.address}: STATS reply is not an object")
        return d

    def ping(self, timeout: float = 1.0) -> float:
        """Round trip time in seconds (a connection made first is not counted)."""
        deadline = time.monotonic() + timeout
        if self.sock is None:
            self.connect(deadline)
        t0 = time.monotonic()
        self._ask(wire.PING, wire.PONG, deadline)
        return time.monotonic() - t0
