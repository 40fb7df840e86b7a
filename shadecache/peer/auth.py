"""The shared-secret handshake, both directions, before anything else crosses a connection.

The shape of Python's multiprocessing.connection (deliver_challenge / answer_challenge): each side
sends a random 32-byte nonce (HELLO) and proves it knows the secret by answering the other side's
nonce with HMAC-SHA256(secret, role || nonce) (PROOF). The role label differs per direction, so a
proof cannot be reflected back to the side that asked. Digests are compared with
hmac.compare_digest. The server challenges first and sends nothing else until the client has
answered; a wrong answer gets ERROR(E_AUTH) and a closed connection.

No secret (None or b"") means the empty key: the handshake still runs (so a client that has a
secret and a server that has none refuse each other), and serve() binds only to loopback.
"""
import hashlib
import hmac
import os

from . import wire

_SERVER_ROLE = b"shadecache-peer/1 server"
_CLIENT_ROLE = b"shadecache-peer/1 client"


class AuthenticationError(ConnectionError):
    """The other side does not know the shared secret (or speaks another handshake)."""


def secret_bytes(secret) -> bytes:
    """The key: bytes as given, a str as UTF-8, None as empty."""
    if secret is None:
        return b""
    if isinstance(secret, str):
        return secret.encode("utf-8")
    if isinstance(secret, (bytes, bytearray)):
        return bytes(secret)
    raise TypeError(f"secret must be str, bytes or None, got {type(secret).__name__}")


def _proof(key: bytes, role: bytes, nonce) -> bytes:
    return hmac.new(key, role + bytes(nonce), hashlib.sha256).digest()


def _challenge(sock, key: bytes, role: bytes) -> None:
    """Sends a nonce; checks the PROOF that comes back."""
    nonce = os.urandom(wire.NONCE_BYTES)
    sock.sendall(wire.pack_header(wire.HELLO, 0, len(nonce)) + nonce)
    _, _, _, _, body = wire.recv_message(sock, expect=wire.PROOF)
    if len(body) != wire.DIGEST_BYTES or not hmac.compare_digest(bytes(body), _proof(key, role, nonce)):
        try:
            sock.sendall(wire.error_message(wire.E_AUTH, "authentication failed"))
        except OSError:
            pass
        raise AuthenticationError("peer failed the shared-secret challenge")


def _answer(sock, key: bytes, role: bytes) -> None:
    """Receives a nonce (HELLO); sends its PROOF."""
    _, _, _, _, nonce = wire.recv_message(sock, expect=wire.HELLO)
    if len(nonce) != wire.NONCE_BYTES:
        raise AuthenticationError(f"challenge of {len(nonce)} bytes (want {wire.NONCE_BYTES})")
    proof = _proof(key, role, nonce)
    sock.sendall(wire.pack_header(wire.PROOF, 0, len(proof)) + proof)


def server_handshake(sock, key: bytes) -> None:
    """The server's half: challenge the client, then answer the client's challenge."""
    _challenge(sock, key, _CLIENT_ROLE)
    _answer(sock, key, _SERVER_ROLE)


def client_handshake(sock, key: bytes) -> None:
    """The client's half: answer the server's challenge, then challenge the server."""
    try:
        _answer(sock, key, _CLIENT_ROLE)
        _challenge(sock, key, _SERVER_ROLE)
    except wire.RemoteError as e:
        raise AuthenticationError(f"server refused the handshake ({e})") from None
