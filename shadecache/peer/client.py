"""A connection to one peer server: handshake, batched GET, replies checked and verified.

Every call finishes by a deadline the caller gives (time.monotonic()); a peer that is slow, hung
(SIGSTOP) or gone makes the call raise (socket.timeout / ConnectionError / ProtocolError) by then,
and the connection is closed: the next call reconnects. A reply is trusted only after its framing,
its ids and every sample's crc32c check out; otherwise nothing of it is returned.

Not thread-safe: one client per thread (the Cluster keeps one per peer per process).
"""
import json
import socket
import time

import numpy as np

from . import auth, wire
from .._io import crc32c
from .server import MORE


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


class PeerClient:
    def __init__(self, address: str, secret=None):
        self.address = address
        self.host, self.port = split_address(address)
        self.key = auth.secret_bytes(secret)
        self.sock = None
        self._opaque = 0

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
        """The reply to the GET sent for `ids`: bytes (crc32c verified) or None per id."""
        try:
            return self._recv_get(list(ids), opaque, deadline)
        except BaseException:
            self.close()   # a half-read reply leaves the stream unusable
            raise

    def _recv_get(self, ids, opaque, deadline) -> list:
        out = []
        more = True
        while more:
            opcode, status, count, body_len, op = wire.unpack_header(
                wire.recv_exact(self.sock, wire.HEADER_BYTES, deadline=deadline))
            if opcode == wire.ERROR:
                msg = bytes(wire.recv_exact(self.sock, body_len, deadline=deadline)).decode("utf-8", "replace")
                raise wire.RemoteError(f"peer {self.address} error {status}: {msg}")
            if opcode != wire.GET_REPLY or op != opaque:
                raise wire.ProtocolError(f"peer {self.address}: reply {wire.OPCODE_NAMES.get(opcode)} "
                                         f"opaque {op} does not answer GET {opaque}")
            table_len = count * wire.ENTRY_BYTES
            if body_len < table_len or len(out) + count > len(ids):
                raise wire.ProtocolError(f"peer {self.address}: malformed GET reply")
            body = wire.recv_exact(self.sock, body_len, deadline=deadline)
            entries = np.frombuffer(body[:table_len], dtype=wire.ENTRY)
            want = ids[len(out):len(out) + count]
            if not np.array_equal(entries["id"], np.asarray(want, dtype=np.uint64)):
                raise wire.ProtocolError(f"peer {self.address}: reply ids do not match the request")
            lengths = entries["length"]
            hit = lengths != wire.MISS
            if int(lengths[hit].astype(np.int64).sum()) + table_len != body_len:
                raise wire.ProtocolError(f"peer {self.address}: reply lengths do not add up")
            off = table_len
            for n, crc, h in zip(lengths.tolist(), entries["crc"].tolist(), hit.tolist()):
                if not h:
                    out.append(None)
                    continue
                v = body[off:off + n]
                if crc32c(v) != crc:
                    raise wire.ProtocolError(f"peer {self.address}: checksum mismatch in reply")
                out.append(bytes(v))
                off += n
            more = bool(status & MORE)
        if len(out) != len(ids):
            raise wire.ProtocolError(f"peer {self.address}: reply has {len(out)} of {len(ids)} entries")
        return out

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
