"""The handshake that opens every peer connection: both sides prove they know the shared secret,
agree on the data set, and derive the keys that seal every later frame.

    server -> client  HELLO  nonce_s, fingerprint, num_samples     (clear text, fixed sizes)
    client -> server  HELLO  nonce_c, fingerprint, num_samples
    client -> server  PROOF  client proof
    server -> client  PROOF  server proof

    (client proof, server proof, client->server key, server->client key)
        = HKDF-SHA256(secret, salt = nonce_s || nonce_c, info = label || fingerprint || num_samples)

(csrc/net/session_keys.h.) The shape of multiprocessing.connection's challenge-response (each side
answers the other's fresh nonce; proofs compared with hmac.compare_digest), with keys in the
manner of TLS 1.3 PSK and WireGuard: the proofs and keys depend on both nonces (no replay), differ
by direction (no reflection), and bind the data set (a side that names another one derives
other keys). A middleman that relays the handshake learns nothing it can use: without the secret
it can neither read nor alter a sealed frame (peer_io.cc). The server sends nothing but its HELLO
until the client has proven itself, reads only messages of the fixed sizes it expects (nothing is
allocated for a length the other side names), and gives the whole handshake one deadline.

A data set mismatch is refused by both sides with FingerprintError naming both data sets (the
fingerprint and size of a data set are not secret: they travel in clear text).
"""
import hmac
import os
import socket
import time

from .. import _core
from ..errors import FingerprintError
from . import identity as ids
from . import wire

LABEL = b"shadecache-peer/2 session"
HANDSHAKE_TIMEOUT = 2.0     # the server's bound on a whole handshake


class AuthenticationError(ConnectionError):
    """The other side does not know the shared secret (or speaks another handshake)."""


class ForgedFrameError(AuthenticationError):
    """A sealed frame failed its authentication tag: altered, forged, replayed or reordered on the
    way. Nothing of the message is used; the connection is dropped."""


def _hello(nonce: bytes, identity) -> bytes:
    fp, n = identity
    return wire.pack_header(wire.HELLO, 0, wire.HELLO_BYTES, n) + nonce + fp


def _proof(proof: bytes) -> bytes:
    return wire.pack_header(wire.PROOF, 0, wire.DIGEST_BYTES) + proof


def _expect(sock, opcode: int, size: int, deadline: float, errors: bool) -> tuple:
    """(header fields, body) of the next message, which must be `opcode` with a body of exactly
    `size` bytes. With `errors`, an ERROR in clear text (at most MAX_ERROR bytes) is read and
    raised as RemoteError carrying its status. Anything else: ProtocolError, nothing more read."""
    head = wire.unpack_header(wire.recv_exact(sock, wire.HEADER_BYTES, deadline))
    op, status, _, body_len, _ = head
    if errors and op == wire.ERROR and body_len <= wire.MAX_ERROR:
        text = wire.recv_exact(sock, body_len, deadline).decode("utf-8", "replace")
        e = wire.RemoteError(text)
        e.status = status
        raise e
    if op != opcode or body_len != size:
        raise wire.ProtocolError(f"handshake: expected {wire.OPCODE_NAMES[opcode]} of {size} bytes, got "
                                 f"{wire.OPCODE_NAMES.get(op, op)} of {body_len}", wire.E_BAD_OPCODE)
    return head, wire.recv_exact(sock, size, deadline)


def _keys(secret: bytes, nonce_s: bytes, nonce_c: bytes, identity) -> tuple:
    fp, n = identity
    k = _core.peer_session_keys(secret, nonce_s + nonce_c, LABEL + fp + n.to_bytes(8, "little"))
    return k[0:32], k[32:64], k[64:96], k[96:128]


def _refuse(sock, code: int, text: str, deadline: float) -> None:
    """An ERROR in clear text, then a graceful close within the handshake's deadline: our FIN, and
    what the other side still sends (at most 64 KiB) read and dropped, since closing with unread
    input would send RST, which discards the ERROR on its way."""
    try:
        wire.send_all(sock, wire.error_message(code, text), deadline)
        sock.shutdown(socket.SHUT_WR)
        budget = 64 << 10
        while budget > 0 and time.monotonic() < deadline:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            got = sock.recv(min(budget, 4096))
            if not got:
                break
            budget -= len(got)
    except OSError:
        pass


def server_handshake(sock, secret: bytes, identity, deadline: float):
    """The server's half, all by `deadline`: returns the connection's _core.PeerSession.
    AuthenticationError (a wrong or missing proof), FingerprintError (another data set),
    ProtocolError (another message than the handshake's), socket.timeout, ConnectionError."""
    nonce_s = os.urandom(wire.NONCE_BYTES)
    wire.send_all(sock, _hello(nonce_s, identity), deadline)
    try:
        try:
            head, body = _expect(sock, wire.HELLO, wire.HELLO_BYTES, deadline, errors=True)
        except wire.RemoteError as e:   # the client refused us (our data set), in clear text
            if getattr(e, "status", 0) == wire.E_DATASET:
                raise FingerprintError(f"the client refused this server's data set: {e}") from None
            raise AuthenticationError(f"the client refused the handshake ({e})") from None
        theirs = (body[wire.NONCE_BYTES:], head[4])
        if theirs != identity:
            why = f"the client reads {ids.describe(theirs)}; this server serves {ids.describe(identity)}"
            _refuse(sock, wire.E_DATASET, why, deadline)
            raise FingerprintError(why)
        nonce_c = body[:wire.NONCE_BYTES]
        client_proof, server_proof, c2s, s2c = _keys(secret, nonce_s, nonce_c, identity)
        _, proof = _expect(sock, wire.PROOF, wire.DIGEST_BYTES, deadline, errors=False)
    except wire.ProtocolError as e:
        _refuse(sock, e.code, str(e), deadline)
        raise
    if not hmac.compare_digest(proof, client_proof):
        _refuse(sock, wire.E_AUTH, "authentication failed", deadline)
        raise AuthenticationError("the client failed the shared-secret proof")
    wire.send_all(sock, _proof(server_proof), deadline)
    return _core.PeerSession(s2c, c2s)


def client_handshake(sock, secret: bytes, identity, deadline: float):
    """The client's half, all by `deadline` (the caller's): returns the connection's
    _core.PeerSession. FingerprintError when the server serves another data set;
    AuthenticationError when it refuses our proof or fails its own; ConnectionRefusedError when
    it is too busy to take us."""
    try:
        head, body = _expect(sock, wire.HELLO, wire.HELLO_BYTES, deadline, errors=True)
        theirs = (body[wire.NONCE_BYTES:], head[4])
        if theirs != identity:
            why = f"the peer serves {ids.describe(theirs)}; this node reads {ids.describe(identity)}"
            try:   # tell the server why, then go
                wire.send_all(sock, wire.error_message(wire.E_DATASET, why), deadline)
            except OSError:
                pass
            raise FingerprintError(why)
        nonce_s = body[:wire.NONCE_BYTES]
        nonce_c = os.urandom(wire.NONCE_BYTES)
        client_proof, server_proof, c2s, s2c = _keys(secret, nonce_s, nonce_c, identity)
        wire.send_all(sock, _hello(nonce_c, identity) + _proof(client_proof), deadline)
        _, proof = _expect(sock, wire.PROOF, wire.DIGEST_BYTES, deadline, errors=True)
    except wire.RemoteError as e:
        status = getattr(e, "status", 0)
        if status == wire.E_DATASET:
            raise FingerprintError(f"the peer refused this node's data set: {e}") from None
        if status == wire.E_BUSY:
            raise ConnectionRefusedError(f"the peer is too busy to take a connection: {e}") from None
        raise AuthenticationError(f"the peer refused the handshake ({e})") from None
    except wire.ProtocolError as e:
        raise AuthenticationError(f"the peer does not speak this handshake ({e})") from None
    if not hmac.compare_digest(proof, server_proof):
        raise AuthenticationError("the peer failed the shared-secret proof")
    return _core.PeerSession(c2s, s2c)
