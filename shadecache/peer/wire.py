"""The peer protocol's wire format: one fixed header per message, then a bounded, sealed body.

Modelled on memcached's binary protocol: a fixed 24-byte header carries the magic, the protocol
version, an opcode, a status, an item count, the body length and an opaque word that the reply
echoes (so a client that pipelines requests matches replies to them). Every length is checked
against the bound of its opcode, and the opcode against the state of the connection, BEFORE a
byte is allocated for it; nothing is ever unpickled.

    header  = magic "SHCP" | version u8 | opcode u8 | status u16 | count u32 | body_len u32 | opaque u64
              (little endian, 24 bytes)

The handshake (auth.py), in clear text, every message of a fixed size; nothing else is accepted
before it completes, and the server gives it HANDSHAKE_TIMEOUT seconds in all:

    server -> client  HELLO   opaque = num_samples, body = nonce (32) || data set fingerprint (32)
    client -> server  HELLO   the same, the client's            } sent together
    client -> server  PROOF   body = the client's proof (32)    }
    server -> client  PROOF   body = the server's proof (32)
    (the server instead: ERROR in clear text, E_AUTH / E_BUSY / a protocol error, then it closes;
     a clear ERROR proves nothing and is never more than a failure to the client)

After it, every message in either direction is sealed (csrc/bindings/peer_io.cc): the header in
clear text, authenticated as the additional data of an AES-256-GCM record holding the body, then
the record's 16-byte tag (keys and nonces: csrc/net/session_keys.h, csrc/net/aead.h). body_len
counts the plain body; a message takes HEADER_BYTES + body_len + TAG_BYTES on the wire, a GET
reply (two records) one TAG_BYTES more.

    GET        request        count ids, body: count x u64
    GET reply                 one or more chunks (status MORE on all but the last), each
                              count entries (id u64, length u32, crc32c u32) in a record of their
                              own, then the values of the entries that hit, in order, in a second
                              record (length MISS = the peer has no copy; crc32c of the bytes
                              otherwise: the store's checksum, carried end to end)
    PING / PONG               count 0, body empty
    STATS      request        count 0, body empty
    STATS_REPLY               body: the server's counters, a JSON object (<= MAX_STATS bytes)
    ERROR      reply          status = an error code, body: a UTF-8 message (<= MAX_ERROR bytes);
                              the sender closes the connection after it

The version is bumped on any change of layout; a peer of another version is refused.
"""
import socket
import struct
import time

import numpy as np

from .. import _core

# The constants are defined once, in the native framing (csrc/net/peer_wire.h, net/aead.h), and
# taken from there: the two sides of a connection cannot disagree on them.
_W = _core.WIRE
MAGIC, VERSION = _W["MAGIC"], _W["VERSION"]
HEADER = struct.Struct("<4sBBHIIQ")   # the native Header's fields, packed
HEADER_BYTES = _W["HEADER_BYTES"]     # 24
assert HEADER.size == HEADER_BYTES

# opcodes
HELLO, PROOF, GET, GET_REPLY, PING, PONG, ERROR, STATS, STATS_REPLY = (
    _W[k] for k in ("HELLO", "PROOF", "GET", "GET_REPLY", "PING", "PONG", "ERROR", "STATS", "STATS_REPLY"))
OPCODE_NAMES = {HELLO: "HELLO", PROOF: "PROOF", GET: "GET", GET_REPLY: "GET_REPLY",
                PING: "PING", PONG: "PONG", ERROR: "ERROR", STATS: "STATS", STATS_REPLY: "STATS_REPLY"}

# status codes of an ERROR reply
(E_BAD_MAGIC, E_BAD_VERSION, E_BAD_OPCODE, E_TOO_LARGE, E_BAD_LENGTH, E_AUTH, E_BAD_ID, E_INTERNAL,
 E_DATASET, E_BUSY) = (_W[k] for k in ("E_BAD_MAGIC", "E_BAD_VERSION", "E_BAD_OPCODE", "E_TOO_LARGE",
                                       "E_BAD_LENGTH", "E_AUTH", "E_BAD_ID", "E_INTERNAL", "E_DATASET",
                                       "E_BUSY"))

# bounds (refused before anything is allocated for them); the handshake's sizes are Python's alone
NONCE_BYTES = 32
FINGERPRINT_BYTES = 32
HELLO_BYTES = NONCE_BYTES + FINGERPRINT_BYTES
DIGEST_BYTES = 32                # a PROOF body
TAG_BYTES = _W["TAG_BYTES"]      # the AEAD tag ending every sealed record
MAX_BATCH = _W["MAX_BATCH"]      # ids per GET
MAX_VALUE = _W["MAX_VALUE"]      # bytes of one sample
ENTRY_BYTES = _W["ENTRY_BYTES"]
MAX_REPLY = _W["MAX_REPLY"]      # body of one GET reply chunk
MAX_ERROR = _W["MAX_ERROR"]      # bytes of an ERROR message
MAX_STATS = _W["MAX_STATS"]      # bytes of a STATS reply
MISS = _W["MISS"]                # entry length of a sample the peer does not hold
MORE = _W["MORE"]                # GET_REPLY status: more chunks of this request follow

ENTRY = np.dtype([("id", "<u8"), ("length", "<u4"), ("crc", "<u4")])
assert ENTRY.itemsize == ENTRY_BYTES


class ProtocolError(ValueError):
    """A message broke the protocol: wrong magic or version, an opcode the connection's state
    does not allow, a length out of bounds, a body that does not match its header. `code` is the
    ERROR status to send back."""

    def __init__(self, message, code=E_BAD_LENGTH):
        super().__init__(message)
        self.code = code


class RemoteError(OSError):
    """The peer answered with an ERROR message."""


def pack_header(opcode: int, count: int = 0, body_len: int = 0, opaque: int = 0, status: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, opcode, status, count, body_len, opaque)


def unpack_header(buf) -> tuple:
    """(opcode, status, count, body_len, opaque) of a 24-byte header, checked for magic and
    version (ProtocolError otherwise); the caller checks the opcode and length against its state."""
    magic, version, opcode, status, count, body_len, opaque = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r} (want {MAGIC!r})", E_BAD_MAGIC)
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} (this side speaks {VERSION})", E_BAD_VERSION)
    return opcode, status, count, body_len, opaque


def error_message(code: int, text: str, opaque: int = 0) -> bytes:
    """An ERROR in clear text: only before the handshake has made keys."""
    body = text.encode("utf-8", "replace")[:MAX_ERROR]
    return pack_header(ERROR, 0, len(body), opaque, status=code) + body


def recv_exact(sock, n: int, deadline: float) -> bytes:
    """Exactly n bytes from `sock`, all by `deadline` (time.monotonic(); socket.timeout if not).
    ConnectionError on EOF."""
    view = memoryview(bytearray(n))
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"timed out after {got} of {n} bytes")
        sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(view)


def send_all(sock, data: bytes, deadline: float) -> None:
    """sendall, finished by `deadline` (socket.timeout if not)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("no time left to send")
    sock.settimeout(left)
    sock.sendall(data)
