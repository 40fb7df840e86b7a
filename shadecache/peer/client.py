"""A connection to one peer server: handshake, batched GET, replies authenticated and verified.

Every call finishes by a deadline the caller gives (time.monotonic()), the handshake and the
lookup of a host name included (a resolver that does not answer is left behind, on a thread of
its own, one per name at a time); a peer that is slow, hung (SIGSTOP), gone or dribbling makes the
call raise (socket.timeout / ConnectionError / ProtocolError) by then, and the connection is
closed: the next call reconnects. A reply is trusted only after its frames' authentication tags, framing and ids check
out (otherwise nothing of it is returned), and each value only after its crc32c does too (a value
that fails it is refused: None, read from the next tier).

The connection names its data set (`dataset`: a store, a Cache, or (fingerprint, num_samples));
a server that proves it holds the secret and serves another data set is refused with
FingerprintError naming both; one that proves nothing fails the handshake as any stranger does
(AuthenticationError, a ConnectionError), whatever data set its clear-text HELLO names.

A connection is used only by the process that opened it: every public method first checks the
pid, and in a forked child drops its copy of the parent's connection (the parent's stays open)
and opens its own when it needs one. Two processes writing under one session would seal two
records under one key and sequence number; two reading one stream would take each other's replies.
(The native session refuses to be used in another process too: bindings/peer_io.cc.)

Not thread-safe: one client per thread (the Cluster keeps one per peer per process).
"""
import ipaddress
import json
import os
import socket
import threading
import time

import numpy as np

from . import auth, identity, wire
from . import secret as secrets_
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


class _Lookup:
    """One getaddrinfo of (host, port) on a thread of its own, so that a caller can stop waiting
    for it at its deadline. Callers that need the same name while it runs wait for the same one."""

    def __init__(self, key):
        self.key = key
        self.done = threading.Event()
        self.result = self.error = None
        threading.Thread(target=self._run, name="shadecache-peer-lookup", daemon=True).start()

    def _run(self):
        try:
            self.result = socket.getaddrinfo(*self.key, type=socket.SOCK_STREAM)
        except Exception as e:   # OSError, and UnicodeError for a name IDNA refuses ("a..b")
            self.error = e
        finally:
            with _lookups_lock:
                if _lookups.get(self.key) is self:
                    del _lookups[self.key]
            self.done.set()


_lookups = {}                   # (host, port) -> the _Lookup in flight
_lookups_lock = threading.Lock()


def _forget_lookups():          # a forked child has none of its parent's threads
    global _lookups_lock
    _lookups.clear()
    _lookups_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_lookups)


def resolve(host: str, port: int, deadline: float) -> list:
    """getaddrinfo's TCP answers for (host, port), by `deadline`: a numeric address at once, a
    name by a lookup the caller stops waiting for at its deadline (socket.timeout); the lookup
    itself runs on until the resolver answers."""
    try:
        ipaddress.ip_address(host)
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except ValueError:
        pass
    with _lookups_lock:
        lookup = _lookups.get((host, port))
        if lookup is None:
            lookup = _lookups[(host, port)] = _Lookup((host, port))
    if not lookup.done.wait(max(0.0, deadline - time.monotonic())):
        raise socket.timeout(f"no answer for the name {host!r} from the resolver in time")
    if isinstance(lookup.error, OSError):
        raise lookup.error
    if lookup.error is not None:   # a peer failure like any other, not a crash of the caller
        raise OSError(f"the peer name {host!r} cannot be looked up: {lookup.error}") from lookup.error
    return lookup.result


def connect_by(host: str, port: int, deadline: float) -> socket.socket:
    """A TCP connection to (host, port), name lookup included, by `deadline`; each address the
    name has is tried in turn, as socket.create_connection does."""
    error = None
    for family, kind, proto, _, where in resolve(host, port, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(where)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error if error is not None else socket.timeout(f"no time left to connect to {host}:{port}")


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
        self._pid = os.getpid()
        self._parent = None   # the pid whose connection this process dropped after a fork
        self._opaque = 0
        self.refused = 0      # values whose crc32c did not match (damaged at the peer or on the way)
        # Replies land in fresh bytes objects of up to MAX_VALUE: without this, glibc returns
        # the freed heap top to the kernel after every batch and the next one page-faults it
        # back in (64 x 100 KB replies: 6.4 -> 1.7 ms). Same tuning as the store readers.
        tune_malloc_once()

    def _own(self) -> None:
        """Every public method first: a connection this process did not open (a forked child's
        copy of its parent's) is dropped without a word on it: the descriptor is closed here, the
        connection stays the parent's."""
        if self._pid != os.getpid():
            if self.sock is not None:
                self.sock.close()
                self.sock = self.session = None
                self._parent = self._pid
            self._pid = os.getpid()

    def connect(self, deadline: float) -> None:
        """Connects and runs the handshake, both by `deadline`."""
        self.close()
        if self.identity is None:
            raise ValueError(f"PeerClient({self.address!r}) names no data set: give dataset= (the store "
                             "this node reads)")
        if deadline - time.monotonic() <= 0:
            raise socket.timeout("no time left to connect")
        sock = connect_by(self.host, self.port, deadline)
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
        self._own()
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
        self._own()
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
        comes from the next tier; `refused` counts them. ConnectionError when this process has no
        connection the GET could have been sent on (closed after a failure, or opened by the
        process this one was forked from)."""
        self._own()
        if self.sock is None:
            if self._parent is not None:
                raise ConnectionError(f"peer {self.address}: the connection was opened by process {self._parent}; "
                                      "this process is a fork of it and sent no request of its own")
            raise ConnectionError(f"peer {self.address}: no connection (closed after a failure)")
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
        self._own()
        if not len(ids):
            return []
        deadline = time.monotonic() + timeout
        a = np.ascontiguousarray(ids, dtype="<u8")   # once for both calls
        op = self.send_get(a, deadline)
        return self.recv_get(a, op, deadline)

    def _ask(self, opcode: int, answer: int, deadline: float):
        self._own()
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
        self._own()
        deadline = time.monotonic() + timeout
        if self.sock is None:
            self.connect(deadline)
        t0 = time.monotonic()
        self._ask(wire.PING, wire.PONG, deadline)
        return time.monotonic() - t0
