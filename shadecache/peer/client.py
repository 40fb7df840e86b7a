"""A connection to one peer server: handshake, batched GET, replies checked and verified.

Every call finishes by a deadline the caller gives (time.monotonic()); a peer that is slow, hung
(SIGSTOP) or gone makes the call raise (socket.timeout / ConnectionError / ProtocolError) by then,
and the connection is closed: the next call reconnects. A reply is trusted only after its framing
and its ids check out (otherwise nothing of it is returned), and each value only after its
crc32c does (otherwise that value is refused: None, read from the next tier).

Not thread-safe: one client per thread (the Cluster keeps one per peer per process).
"""
import json
import os
import socket
import time

import numpy as np

from . import auth, wire
from .. import _core
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
    def __init__(self, address: str, secret=None):
        self.address = address
        self.host, self.port = split_address(address)
        self.key = auth.secret_bytes(secret)
        self.sock = None
        self._opaque = 0
        self.refused = 0      # values whose crc32c did not match (damaged at the peer or on the way)
        # Replies land in fresh bytes objects of up to MAX_VALUE: without this, glibc returns
        # the freed heap top to the kernel after every batch and the next one page-faults it
        # back in (64 x 100 KB replies: 6.4 -> 1.7 ms). Same tuning as the store readers.
        tune_malloc_once()

    def connect(self, deadline: float) -> None:
        """Connects and runs the handshake, both by `deadline`."""
        self.close()
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("no time left to connect")
        sock = socket.create_connection((self.host, self.port), timeout=left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            auth.client_handshake(sock, self.key)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send_get(self, ids, deadline: float) -> int:
        """Sends one GET for `ids` (at most wire.MAX_BATCH); returns its opaque word."""
        if self.sock is None:
            self.connect(deadline)
        a = np.ascontiguousarray(ids, dtype="<u8")
        if a.size > wire.MAX_BATCH:
            raise ValueError(f"GET of {a.size} ids exceeds {wire.MAX_BATCH}")
        self._opaque = (self._opaque + 1) & 0xFFFFFFFFFFFFFFFF
        self.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            wire.send_buffers(self.sock, [wire.pack_header(wire.GET, a.size, 8 * a.size, self._opaque), a])
        except BaseException:
            self.close()
            raise
        return self._opaque

    def recv_get(self, ids, opaque: int, deadline: float) -> list:
        """The reply to the GET sent for `ids`: bytes (crc32c verified) or None per id. One native
        call reads every chunk of the reply, checks its framing and ids, reads the values straight
        into the result bytes and verifies each crc32c, without the GIL (bindings/peer_io.cc). A
        value whose crc32c (the one the peer's cache recorded at put: the store's) does not match
        is refused: None, as a miss, so that it comes from the next tier; `refused` counts them."""
        a = np.ascontiguousarray(ids, dtype="<u8")
        try:
            code, detail = _core.recv_get_reply(self.sock.fileno(), a, opaque, deadline - time.monotonic())
        except BaseException:
            self.close()
            raise
        if code == 0:
            values, refused = detail
            if refused:
                self.refused += refused
                _warn_refused(self.address, refused)
            return values
        self.close()   # a half-read reply leaves the stream unusable
        if code == 1:
            raise socket.timeout(f"peer {self.address}: no complete reply by the deadline")
        if code == 2:
            raise ConnectionError(f"peer {self.address} closed the connection")
        if code == 3:
            raise OSError(detail, f"peer {self.address}: {os.strerror(detail)}")
        if code == 5:
            status, msg = detail
            raise wire.RemoteError(f"peer {self.address} error {status}: {msg.decode('utf-8', 'replace')}")
        raise wire.ProtocolError(f"peer {self.address}: {detail}")

    def get_many(self, ids, timeout: float = 1.0) -> list:
        deadline = time.monotonic() + timeout
        op = self.send_get(ids, deadline)
        return self.recv_get(ids, op, deadline)

    def server_stats(self, timeout: float = 1.0) -> dict:
        """The server's counters (requests, ids, cache_hits, ssd_hits, store_reads, bytes_sent...)."""
        deadline = time.monotonic() + timeout
        if self.sock is None:
            self.connect(deadline)
        try:
            self.sock.sendall(wire.pack_header(wire.STATS))
            body = wire.recv_message(self.sock, expect=wire.STATS_REPLY, deadline=deadline)[4]
            d = json.loads(bytes(body))
        except BaseException:
            self.close()
            raise
        if not isinstance(d, dict):
            raise wire.ProtocolError(f"peer {self.address}: STATS reply is not an object")
        return d

    def ping(self, timeout: float = 1.0) -> float:
        """Round trip time in seconds."""
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        if self.sock is None:
            self.connect(deadline)
        try:
            self.sock.sendall(wire.pack_header(wire.PING))
            wire.recv_message(self.sock, expect=wire.PONG, deadline=deadline)
        except BaseException:
            self.close()
            raise
        return time.monotonic() - t0
