"""The peer protocol's wire format: one fixed header per message, then a bounded body.

Modelled on memcached's binary protocol: a fixed 24-byte header carries the magic, the protocol
version, an opcode, a status, an item count, the body length and an opaque word that the reply
echoes (so a client that pipelines requests matches replies to them). Every length is checked
against a limit BEFORE a byte is allocated for it; nothing is ever unpickled.

    header  = magic "SHCP" | version u8 | opcode u8 | status u16 | count u32 | body_len u32 | opaque u64
              (little endian, 24 bytes)

    HELLO      (either side)  body: 32-byte nonce          -- the HMAC challenge (auth.py)
    PROOF      (either side)  body: 32-byte HMAC-SHA256    -- the answer to the other side's nonce
    GET        request        count ids, body: count x u64
    GET reply                 count entries, body: count x (id u64, length u32, crc32c u32),
                              then the values of the entries that hit, in order
                              (length MISS = the peer has no copy; crc32c of the bytes otherwise)
    PING / PONG               count 0, body empty
    STATS      request        count 0, body empty
    STATS_REPLY               body: the server's counters, a JSON object (<= MAX_STATS bytes)
    ERROR      reply          status = an error code, body: a UTF-8 message (<= MAX_ERROR bytes);
                              the server closes the connection after sending it

The version is bumped on any change of layout; a peer of another version is refused with ERROR.
"""
import socket
import struct
import time

import numpy as np

MAGIC = b"SHCP"
VERSION = 1
HEADER = struct.Struct("<4sBBHIIQ")
HEADER_BYTES = HEADER.size  # 24

# opcodes
HELLO, PROOF, GET, GET_REPLY, PING, PONG, ERROR, STATS, STATS_REPLY = 1, 2, 3, 4, 5, 6, 7, 8, 9
OPCODE_NAMES = {HELLO: "HELLO", PROOF: "PROOF", GET: "GET", GET_REPLY: "GET_REPLY",
                PING: "PING", PONG: "PONG", ERROR: "ERROR", STATS: "STATS", STATS_REPLY: "STATS_REPLY"}

# status codes of an ERROR reply
E_BAD_MAGIC, E_BAD_VERSION, E_BAD_OPCODE, E_TOO_LARGE, E_BAD_LENGTH, E_AUTH, E_BAD_ID, E_INTERNAL = range(1, 9)
MORE = 1                         # GET_REPLY status: more chunks of this request follow

# bounds (the server refuses anything larger before allocating it)
NONCE_BYTES = 32
DIGEST_BYTES = 32
MAX_BATCH = 4096                 # ids per GET
MAX_VALUE = 64 << 20             # bytes of one sample
MAX_REPLY = 512 << 20            # bytes of one GET reply body
MAX_ERROR = 1024                 # bytes of an ERROR message
MAX_STATS = 4096                 # bytes of a STATS reply
MISS = 0xFFFFFFFF                # entry length of a sample the peer does not hold

ENTRY = np.dtype([("id", "<u8"), ("length", "<u4"), ("crc", "<u4")])
ENTRY_BYTES = ENTRY.itemsize  # 16


class ProtocolError(ValueError):
    """A message broke the protocol: wrong magic or version, unknown opcode, a length out of
    bounds, a body that does not match its header. `code` is the ERROR status to send back."""

    def __init__(self, message, code=E_BAD_LENGTH):
        super().__init__(message)
        self.code = code


class RemoteError(OSError):
    """The peer answered with an ERROR message."""


def pack_header(opcode: int, count: int = 0, body_len: int = 0, opaque: int = 0, status: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, opcode, status, count, body_len, opaque)


def unpack_header(buf) -> tuple:
    """(opcode, status, count, body_len, opaque) of a 24-byte header, checked for magic and
    version and for a body length within the bound of its opcode (ProtocolError otherwise)."""
    magic, version, opcode, status, count, body_len, opaque = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r} (want {MAGIC!r})", E_BAD_MAGIC)
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} (this side speaks {VERSION})", E_BAD_VERSION)
    limit = body_limit(opcode, count)
    if body_len > limit:
        raise ProtocolError(f"{OPCODE_NAMES[opcode]} body of {body_len} bytes exceeds {limit}", E_TOO_LARGE)
    return opcode, status, count, body_len, opaque


def body_limit(opcode: int, count: int) -> int:
    """The largest body a message of `opcode` with `count` items may carry."""
    if opcode == HELLO:
        return NONCE_BYTES
    if opcode == PROOF:
        return DIGEST_BYTES
    if opcode == GET:
        if count > MAX_BATCH:
            raise ProtocolError(f"GET of {count} ids exceeds {MAX_BATCH}", E_TOO_LARGE)
        return 8 * count
    if opcode == GET_REPLY:
        if count > MAX_BATCH:
            raise ProtocolError(f"GET reply of {count} entries exceeds {MAX_BATCH}", E_TOO_LARGE)
        return MAX_REPLY
    if opcode in (PING, PONG, STATS):
        return 0
    if opcode == STATS_REPLY:
        return MAX_STATS
    if opcode == ERROR:
        return MAX_ERROR
    raise ProtocolError(f"unknown opcode {opcode}", E_BAD_OPCODE)


def error_message(code: int, text: str, opaque: int = 0) -> bytes:
    body = text.encode("utf-8", "replace")[:MAX_ERROR]
    return pack_header(ERROR, 0, len(body), opaque, status=code) + body


def recv_exact(sock, n: int, buf=None, deadline=None) -> memoryview:
    """Exactly n bytes from `sock` (into `buf` when given). ConnectionError on EOF. With a
    `deadline` (time.monotonic()), the whole read must finish by then (socket.timeout if not);
    without one the socket's own timeout applies to each recv."""
    view = memoryview(buf if buf is not None else bytearray(n))[:n]
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"timed out after {got} of {n} bytes")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return view


def recv_message(sock, expect=None, deadline=None) -> tuple:
    """(opcode, status, count, opaque, body) of the next message; ProtocolError if it breaks
    the format, RemoteError if it is an ERROR and `expect` names another opcode."""
    opcode, status, count, body_len, opaque = unpack_header(recv_exact(sock, HEADER_BYTES, deadline=deadline))
    body = recv_exact(sock, body_len, deadline=deadline) if body_len else memoryview(b"")
    if opcode == ERROR and expect is not None and expect != ERROR:
        raise RemoteError(f"peer error {status}: {bytes(body).decode('utf-8', 'replace')}")
    if expect is not None and opcode != expect:
        raise ProtocolError(f"expected {OPCODE_NAMES.get(expect)}, got {OPCODE_NAMES.get(opcode)}",
                            E_BAD_OPCODE)
    return opcode, status, count, opaque, body


# sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call
_IOV_MAX = 1000


def send_buffers(sock, buffers) -> None:
    """Sends every buffer in order with scatter/gather sendmsg (no joining copy in Python),
    resuming after partial sends."""
    pending = [b if isinstance(b, bytes) else memoryview(b).cast("B") for b in buffers]
    i, n = 0, len(pending)
    while i < n:
        sent = sock.sendmsg(pending[i:i + _IOV_MAX])
        while i < n and sent >= len(pending[i]):   # the buffers sent whole
            sent -= len(pending[i])
            i += 1
        if sent:                                   # the tail of one sent in part
            pending[i] = memoryview(pending[i])[sent:]
