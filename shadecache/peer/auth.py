"""The handshake that opens every peer connection: both sides prove they know the shared secret,
agree on the data set, and derive the keys that seal every later frame.

    server -> client  HELLO  nonce_s, fingerprint, num_samples     (clear text, fixed sizes)
    client -> server  HELLO  nonce_c, fingerprint, num_samples     } one flight, CLIENT_FLIGHT bytes
    client -> server  PROOF  client proof                          }
    server -> client  PROOF  server proof

    (client proof, server proof, client->server key, server->client key)
        = HKDF-SHA256(secret, salt = nonce_s || nonce_c,
                      info = label || the server's data set || the client's data set)

(csrc/net/session_keys.h.) The shape of multiprocessing.connection's challenge-response (each side
answers the other's fresh nonce; proofs compared with hmac.compare_digest), with keys in the
manner of TLS 1.3 PSK and WireGuard: the proofs and keys depend on both nonces (no replay), differ
by direction (no reflection), and bind both data sets as each side named them. A middleman that
relays the handshake learns nothing it can use: without the secret it can neither read nor alter
a sealed frame (peer_io.cc), nor change a HELLO without failing both proofs.

The data sets: nothing in clear text decides anything. A HELLO naming another data set, or a clear
ERROR (E_DATASET, E_AUTH, ...), comes from whoever answers at the address, with or without the
secret: the client goes on with its proof and waits for the server's. Only a side that proves it
holds the secret over a transcript naming another data set makes the other raise FingerprintError
(both sides name both data sets: a mistake in the job, not an attack). A side that proves nothing
fails the handshake as any stranger does: AuthenticationError (a ConnectionError, so the cluster
counts it as a peer failure and reads the ids from the next tier). When the data sets differ, the
server that checked the client's proof answers with its own proof and closes: no keys are used.

The server's half is steps over bytes (ServerHandshake): the server runs the handshakes of all its
pending connections on one thread (server.py) and gives a connection a thread of its own only once
it has proven itself. It sends nothing but its HELLO until then, reads only messages of the fixed
sizes it expects (nothing is allocated for a length the other side names, beyond a clear ERROR of
at most MAX_ERROR bytes) and gives the whole handshake one deadline (HANDSHAKE_TIMEOUT).
"""
import hmac
import os
import socket
import time

from .. import _core
from ..errors import FingerprintError
from . import identity as ids
from . import wire

LABEL = b"shadecache-peer/3 session"
HANDSHAKE_TIMEOUT = 2.0     # the server's bound on a whole handshake
CLIENT_FLIGHT = 2 * wire.HEADER_BYTES + wire.HELLO_BYTES + wire.DIGEST_BYTES   # the client's HELLO and PROOF


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


def _check(head: tuple, opcode: int, size: int) -> None:
    """ProtocolError unless the header fields `head` are those of `opcode` with a `size`-byte body."""
    op, _, _, body_len, _ = head
    if op != opcode or body_len != size:
        raise wire.ProtocolError(f"handshake: expected {wire.OPCODE_NAMES[opcode]} of {size} bytes, got "
                                 f"{wire.OPCODE_NAMES.get(op, op)} of {body_len}", wire.E_BAD_OPCODE)


def _expect(sock, opcode: int, size: int, deadline: float) -> tuple:
    """(header fields, body) of the next message, which must be `opcode` with a body of exactly
    `size` bytes. An ERROR in clear text (at most MAX_ERROR bytes) is read and raised as
    RemoteError carrying its status. Anything else: ProtocolError, nothing more read."""
    head = wire.unpack_header(wire.recv_exact(sock, wire.HEADER_BYTES, deadline))
    op, status, _, body_len, _ = head
    if op == wire.ERROR and body_len <= wire.MAX_ERROR:
        text = wire.recv_exact(sock, body_len, deadline).decode("utf-8", "replace")
        e = wire.RemoteError(text)
        e.status = status
        raise e
    _check(head, opcode, size)
    return head, wire.recv_exact(sock, size, deadline)


def _keys(secret: bytes, nonce_s: bytes, nonce_c: bytes, server_identity, client_identity) -> tuple:
    info = LABEL
    for fp, n in (server_identity, client_identity):
        info += fp + n.to_bytes(8, "little")
    k = _core.peer_session_keys(secret, nonce_s + nonce_c, info)
    return k[0:32], k[32:64], k[64:96], k[96:128]


class ServerHandshake:
    """The server's half of one handshake, as steps over bytes (no socket, no waiting):

        hs = ServerHandshake(secret, identity)
        send hs.hello
        size = hs.flight_size(first HEADER_BYTES the client sent)     # the whole first flight
        session = hs.conclude(those `size` bytes)                     # PeerSession
        send hs.reply                                                 # in every outcome, then close on a raise

    flight_size and conclude raise ProtocolError (another protocol), AuthenticationError (a wrong
    proof, or the client's own clear ERROR) or FingerprintError (a client that proved it holds the
    secret and reads another data set); `reply` is what to send then: a clear ERROR, nothing, or
    this server's proof (so that such a client learns the mismatch is proven), and on success the
    server's proof."""

    def __init__(self, secret: bytes, identity):
        self.secret, self.identity = secret, identity
        self.nonce = os.urandom(wire.NONCE_BYTES)
        self.hello = _hello(self.nonce, identity)
        self.reply = b""

    def _header(self, head: bytes, opcode: int, size: int) -> tuple:
        """The fields of `head`, a header of `opcode` with a `size`-byte body (or, for the first,
        a clear ERROR). A ProtocolError leaves its clear ERROR as the reply."""
        try:
            fields = wire.unpack_header(head)
            if not (fields[0] == wire.ERROR and fields[3] <= wire.MAX_ERROR and opcode == wire.HELLO):
                _check(fields, opcode, size)
        except wire.ProtocolError as e:
            self.reply = wire.error_message(e.code, str(e))
            raise
        return fields

    def flight_size(self, head: bytes) -> int:
        """The size of the client's first flight, from its first header: its HELLO and PROOF
        (CLIENT_FLIGHT), or a clear ERROR (at most MAX_ERROR bytes of text)."""
        op, _, _, body_len, _ = self._header(head, wire.HELLO, wire.HELLO_BYTES)
        return wire.HEADER_BYTES + body_len if op == wire.ERROR else CLIENT_FLIGHT

    def conclude(self, flight: bytes):
        """The session, from the client's whole first flight (flight_size bytes)."""
        op, status, _, _, _ = wire.unpack_header(flight[:wire.HEADER_BYTES])
        if op == wire.ERROR:   # the client refused us, in clear text: proves nothing, means nothing more
            self.reply = b""
            text = flight[wire.HEADER_BYTES:].decode("utf-8", "replace")
            raise AuthenticationError(f"the client refused the handshake (error {status}: {text})")
        hello_end = wire.HEADER_BYTES + wire.HELLO_BYTES
        self._header(flight[hello_end:hello_end + wire.HEADER_BYTES], wire.PROOF, wire.DIGEST_BYTES)
        head = wire.unpack_header(flight[:wire.HEADER_BYTES])
        body = flight[wire.HEADER_BYTES:hello_end]
        theirs = (body[wire.NONCE_BYTES:], head[4])
        client_proof, server_proof, c2s, s2c = _keys(self.secret, self.nonce, body[:wire.NONCE_BYTES],
                                                     self.identity, theirs)
        if not hmac.compare_digest(flight[hello_end + wire.HEADER_BYTES:], client_proof):
            self.reply = wire.error_message(wire.E_AUTH, "authentication failed")
            raise AuthenticationError("the client failed the shared-secret proof")
        self.reply = _proof(server_proof)
        if theirs != self.identity:
            raise FingerprintError(f"a client that proved it holds the job's secret reads {ids.describe(theirs)}; "
                                   f"this server serves {ids.describe(self.identity)}")
        return _core.PeerSession(s2c, c2s)


def refuse(sock, reply: bytes, deadline: float) -> None:
    """`reply` (a clear ERROR, or a proof), then a graceful close within the handshake's deadline:
    our FIN, and what the other side still sends (at most 64 KiB) read and dropped, since closing
    with unread input would send RST, which discards the reply on its way."""
    try:
        if reply:
            wire.send_all(sock, reply, deadline)
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
    """The server's half on a blocking socket, all by `deadline` (ServerHandshake's steps; the
    server itself runs them from its event loop): returns the connection's _core.PeerSession.
    AuthenticationError (a wrong or missing proof), FingerprintError (a client that proved it
    holds the secret and reads another data set), ProtocolError (another message than the
    handshake's), socket.timeout, ConnectionError; each after the reply and a graceful close."""
    hs = ServerHandshake(secret, identity)
    wire.send_all(sock, hs.hello, deadline)
    head = wire.recv_exact(sock, wire.HEADER_BYTES, deadline)
    try:
        size = hs.flight_size(head)
        session = hs.conclude(head + wire.recv_exact(sock, size - wire.HEADER_BYTES, deadline))
    except (wire.ProtocolError, AuthenticationError, FingerprintError):
        refuse(sock, hs.reply, deadline)
        raise
    wire.send_all(sock, hs.reply, deadline)
    return session


def client_handshake(sock, secret: bytes, identity, deadline: float):
    """The client's half, all by `deadline` (the caller's): returns the connection's
    _core.PeerSession. FingerprintError only when the server proves it holds the secret and
    serves another data set; AuthenticationError when it proves nothing (a wrong proof, a clear
    ERROR, another protocol, whatever data set its HELLO named); ConnectionRefusedError when it
    says it is too busy (clear text too: an ordinary failure either way)."""
    try:
        head, body = _expect(sock, wire.HELLO, wire.HELLO_BYTES, deadline)
        theirs = (body[wire.NONCE_BYTES:], head[4])
        nonce_c = os.urandom(wire.NONCE_BYTES)
        client_proof, server_proof, c2s, s2c = _keys(secret, body[:wire.NONCE_BYTES], nonce_c, theirs, identity)
        wire.send_all(sock, _hello(nonce_c, identity) + _proof(client_proof), deadline)
        _, proof = _expect(sock, wire.PROOF, wire.DIGEST_BYTES, deadline)
    except wire.RemoteError as e:
        if getattr(e, "status", 0) == wire.E_BUSY:
            raise ConnectionRefusedError(f"the peer is too busy to take a connection: {e}") from None
        raise AuthenticationError(f"the peer refused the handshake without proving it holds the secret ({e})") \
            from None
    except wire.ProtocolError as e:
        raise AuthenticationError(f"the peer does not speak this handshake ({e})") from None
    if not hmac.compare_digest(proof, server_proof):
        raise AuthenticationError("the peer failed the shared-secret proof")
    if theirs != identity:
        raise FingerprintError(f"the peer proved it holds the job's secret and serves {ids.describe(theirs)}; "
                               f"this node reads {ids.describe(identity)}")
    return _core.PeerSession(c2s, s2c)
