"""The peer server: serves this node's cache (and SSD tier, and the store read through) to the
other nodes of a job.

It runs in its own process (`serve()` starts it and hands it its configuration over a pipe), so
serving peers never takes the training process's GIL. Inside that process: one accept loop, one
thread per connection, requests on a connection answered in order.

A connection is first a handshake (auth.py), run with every other pending one by the accept loop
(one event loop over non-blocking sockets, serve_forever): a connection gets a thread of its own
only once it has proven it holds the secret. An unproven connection holds a descriptor and a few
hundred bytes (its fixed-size messages, or a clear ERROR of at most 1 KiB), for at most
HANDSHAKE_TIMEOUT seconds; the server holds up to MAX_PENDING of them (fewer under a low descriptor
limit). A new connection that finds them all taken is never refused: the oldest pending connection
of the largest source group is closed instead (told E_BUSY). A source group is one IPv4 address,
one IPv6 /64 (what one host may hold), or all of loopback (every user of the node owns all of
127.0.0.0/8 and ::1): a flood from a few addresses, or from one user of the node, churns its own
connections first, and silent connections hold nothing for long. To close an honest handshake
before it completes, a flood must make the server accept MAX_PENDING connections within that
handshake's round trip. What this does not stop is written in docs/peer.md (the threat model).
Authenticated connections (at most MAX_CONNECTIONS) exchange sealed frames only
(csrc/bindings/peer_io.cc), and only requests: GET, PING, STATS.

A GET is answered in chunks of at most CHUNK_ITEMS ids and CHUNK_BYTES of values (one value larger
than that goes alone), one GET_REPLY message each, status MORE on all but the last. The misses of
a chunk are filled first (SSD tier, then the store: read-through, so that the home node reads its
own samples from shared storage once and caches them by its policy), then one native call seals
the chunk as messages of at most 256 ids, each pinning its cached values (pins from a pool shared
by all connections, waiting at most PIN_WAIT) only while it encrypts them straight from shared
memory; only then does the server wait for the client to take the bytes, under IO_TIMEOUT: a
client that reads slowly holds nothing another client needs. Every value carries its crc32c.

A client that breaks the protocol gets an ERROR and a closed connection; the server goes on
serving everyone else. An error from accept() (out of descriptors, say), or a connection whose
thread cannot start (out of memory, or of the user's process limit: that connection is closed),
is counted and accepting resumes after a backoff (the handshakes in progress go on), never the
end of serving. close() ends every connection
and joins every thread it started: a thread left inside a native call while the interpreter
exits aborts the process.
"""
import collections
import ipaddress
import json
import os
import pickle
import resource
import selectors
import socket
import struct
import sys
import threading
import time

import numpy as np

from . import auth, identity, wire
from . import secret as secrets_
from .. import status as tier_status
from ..errors import FingerprintError
from ..tiers import STORE

MAX_CONNECTIONS = 256            # authenticated connections
MAX_PENDING = 1024               # connections in their handshake, all together (module docstring)
# Connections the kernel queues before accept(): a flood of new connections must not overflow it,
# since a dropped SYN costs an honest client a retransmission after a second, past its timeout.
LISTEN_BACKLOG = 4096
ACCEPT_BATCH = 64                # accepts per turn of the event loop, between handshake steps
DRAIN_BYTES = 64 << 10           # what a refused connection may still send us before we close
FD_HEADROOM = 128                # descriptors left to the rest of the process (store, cache, SSD files)
CHUNK_ITEMS = 256         # ids per reply chunk (and pins one connection holds at once)
CHUNK_BYTES = 2 << 20     # value bytes per reply chunk (a chunk holds at least one sample)
PIN_WAIT = 1.0            # the longest a chunk waits for pins; then its cached values go as misses
IO_TIMEOUT = 10.0         # a partial message or a stalled reader is dropped after this
IDLE_TIMEOUT = 300.0      # an idle connection is closed after this
ACCEPT_BACKOFF = (0.01, 1.0)   # seconds between accept() attempts after an error: doubling
REQUESTS = [wire.GET, wire.PING, wire.STATS]   # what an authenticated client may send


def source_group(host: str) -> str:
    """The group a connection from `host` counts in when a pending handshake has to be closed to
    make room (the largest group loses its oldest): all of loopback is one group (every user of the
    node owns all of 127.0.0.0/8 and ::1), an IPv6 address its /64, an IPv4 address itself (an
    IPv4-mapped IPv6 address as that IPv4 address); anything else (a socketpair) by its name."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if ip.version == 6:
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def pending_limit() -> int:
    """MAX_PENDING, or fewer when the process's descriptor limit leaves less room beside the
    authenticated connections and FD_HEADROOM."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_PENDING
    return max(16, min(MAX_PENDING, soft - MAX_CONNECTIONS - FD_HEADROOM))


def is_loopback(host: str) -> bool:
    """True when `host` resolves to a loopback address (127.0.0.0/8, ::1, localhost)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_bind(host: str) -> None:
    if not isinstance(host, str):
        raise TypeError(f"host must be a str, got {type(host).__name__}")


def _linger(conn, limit: int = 1 << 20, seconds: float = 1.0) -> None:
    """Closes our side gracefully: FIN after the replies already queued, then reads and drops
    what the client still sends (up to `limit` bytes or `seconds`). Closing a socket with unread
    input makes the kernel send RST, which discards the replies still in flight to the client."""
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(seconds)
    deadline = time.monotonic() + seconds
    while limit > 0 and time.monotonic() < deadline:
        k = len(conn.recv(min(limit, 1 << 16)))
        if not k:
            return
        limit -= k


def seal_reply(cache, session, fd: int, ids, fills: dict, opaque: int, more: bool,
               max_bytes: int, pin_wait: float, flush_timeout: float = -1.0):
    """A GET reply chunk of `cache`, sealed by `session` (csrc/bindings/peer_io.cc) onto socket
    `fd`: the cached values of the leading ids that fit `max_bytes` are pinned only while they
    are encrypted straight from shared memory (waiting at most `pin_wait` s for pins); fills
    {position: bytes} gives the values the server read below the cache. What the kernel did not
    take waits for session.flush, or, with flush_timeout >= 0, is sent by this call within that
    many seconds (pins released first)."""
    return session.seal_get_reply(fd, cache.engine, ids, fills, opaque, more, max_bytes, pin_wait,
                                  flush_timeout)


class _Pending:
    """A connection in its handshake: what it sent so far (`got` of the `need` bytes the next step
    wants), or, once refused, being closed gracefully (`draining`: its input read and dropped)."""
    __slots__ = ("conn", "group", "deadline", "hs", "buf", "got", "need", "draining")

    def __init__(self, conn, group, deadline, hs=None):
        self.conn, self.group, self.deadline, self.hs = conn, group, deadline, hs
        self.buf = bytearray(auth.CLIENT_FLIGHT)
        self.got, self.need, self.draining = 0, wire.HEADER_BYTES, False


class HandshakeSlots:
    """Which connections hold a handshake slot, with no I/O: in arrival order, which is deadline
    order (each gets the same time from its arrival), and per source group, oldest first. Owned by
    the event loop's thread."""

    def __init__(self, limit: int):
        self.limit = limit
        self._all = collections.OrderedDict()   # conn -> _Pending
        self._groups = {}                       # source group -> OrderedDict(conn -> _Pending)

    def __len__(self):
        return len(self._all)

    def __contains__(self, p) -> bool:
        return self._all.get(p.conn) is p

    def __iter__(self):
        return iter(list(self._all.values()))

    def add(self, p: _Pending):
        """Gives `p` a slot. When all are taken, the oldest of the largest group makes room: it is
        taken out and returned (the caller closes it); else None."""
        victim = None
        if len(self._all) >= self.limit:
            victim = next(iter(max(self._groups.values(), key=len).values()))
            self.remove(victim)
        self._all[p.conn] = p
        self._groups.setdefault(p.group, collections.OrderedDict())[p.conn] = p
        return victim

    def remove(self, p: _Pending) -> None:
        del self._all[p.conn]
        group = self._groups[p.group]
        del group[p.conn]
        if not group:
            del self._groups[p.group]

    def overdue(self, now: float) -> list:
        """The slots past their deadline at `now`, taken out, oldest first."""
        out = []
        while self._all:
            p = next(iter(self._all.values()))
            if p.deadline > now:
                break
            self.remove(p)
            out.append(p)
        return out

    def next_deadline(self):
        """The earliest deadline of the slots taken (None: none is)."""
        return next(iter(self._all.values())).deadline if self._all else None


class PeerService:
    """The serving loop over one listening socket (in the process that serves)."""

    def __init__(self, node, host="127.0.0.1", port=0, secret=None):
        """node: the sc.Node it serves (its cache; its misses read through the node's SSD tier
        and store, its admission rule, its read plan: Node.server_misses)."""
        self.key = secrets_.resolve(secret)
        check_bind(host)
        cache, store = node.cache, node.store
        self.identity = identity.of_server(cache, store)
        self.cache, self.ssd, self.store = cache, node.ssd, store
        # The node's miss path less the home peer (this server answers for the ids it is home
        # to); its own counters are the published status, not the data set's. Reads and
        # admissions take turns per process where the chain needs it (MissPath.turn): never
        # held with _lock, nor across a send or a pin wait.
        self.misses = node.server_misses()
        self.num_samples = node.cache.num_samples
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(LISTEN_BACKLOG)
        self.address = "%s:%d" % self.sock.getsockname()[:2]
        self._conns = set()       # authenticated connections (close() shuts them down)
        self._threads = set()
        self._authenticated = 0
        # Pending handshakes, owned by the event loop's thread: in arrival order, which is deadline
        # order (every one gets HANDSHAKE_TIMEOUT from its accept), and per source group, oldest first.
        self._pending = HandshakeSlots(pending_limit())
        # Made here, before the address is published: a loop that made them when it starts could
        # find the process out of descriptors (or memory) already, and end before serving anyone.
        self._sel = selectors.DefaultSelector()
        self._woken, self._wake = socket.socketpair()   # close() writes to _wake to end the loop
        self._looping = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self.counters = {"connections": 0, "evicted": 0, "refused_busy": 0, "refused_auth": 0,
                         "refused_dataset": 0, "forged": 0, "accept_errors": 0, "thread_errors": 0, "memory_errors": 0,
                         "requests": 0, "ids": 0,
                         "cache_hits": 0, "ssd_hits": 0, "store_reads": 0, "misses": 0, "pin_waits": 0,
                         "bytes_sent": 0, "errors": 0, "get_ns": 0}
        self.peers = []           # the other nodes' addresses, when the launcher told us

    # ---- the published status (status.py) -----------------------------------------------
    def status(self) -> dict:
        c = dict(self.counters)
        c["mean_get_seconds"] = c["get_ns"] / c["requests"] / 1e9 if c["requests"] else 0.0
        return {"pid": os.getpid(), "address": self.address, "server": c,
                "ssd": self.ssd.stats() if self.ssd is not None else None,
                "store": repr(self.store) if self.store is not None else None,
                "tiers": [list(t) for t in self.misses.chain.describe()],
                "peers": list(self.peers), "updated": time.time()}

    def publish_forever(self, every: float = 1.0) -> None:
        while not self._closed:
            try:
                tier_status.write(self.cache.name, self.status())
            except OSError:
                pass
            self._stop.wait(every)

    # ---- threads -------------------------------------------------------------------------------
    def start(self, publish: bool = False) -> None:
        """Serves from threads of this service (and publishes its status once a second)."""
        self._spawn(self.serve_forever)
        if publish:
            self._spawn(self.publish_forever)

    def _spawn(self, target, *args) -> None:
        """Runs target(*args) in a thread of this service (close() joins it). RuntimeError when no
        thread can be started (out of memory, or of the user's process limit)."""
        def run():
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        t = threading.Thread(target=run, daemon=True)
        with self._lock:
            self._threads.add(t)
        try:
            t.start()
        except RuntimeError:
            with self._lock:
                self._threads.discard(t)   # never started: close() must not join it
            raise

    # ---- the event loop: accept and handshakes -------------------------------------------------
    def serve_forever(self) -> None:
        """Accepts connections and runs every handshake on this thread until close() (module
        docstring); a proven connection goes on in a thread of its own."""
        with self._lock:
            if self._closed:
                return
            self._looping = True
        sel = self._sel
        self._woken.setblocking(False)
        sel.register(self._woken, selectors.EVENT_READ, None)
        self.sock.setblocking(False)
        sel.register(self.sock, selectors.EVENT_READ, self)
        delay, resume = 0.0, None    # accepting stops for a backoff after an accept or thread error
        try:
            while not self._closed:
                now = time.monotonic()
                if resume is not None and now >= resume:
                    sel.register(self.sock, selectors.EVENT_READ, self)
                    resume = None
                timeout = self._expire(sel, now)
                if resume is not None:
                    timeout = resume - now if timeout is None else min(timeout, resume - now)
                for key, _ in sel.select(timeout):
                    if key.data is None:          # close() woke us
                        continue
                    if key.data is not self and key.data not in self._pending:
                        continue                  # closed earlier in this turn
                    try:
                        ok = self._accept_some(sel) if key.data is self else self._step(sel, key.data)
                    except MemoryError:           # what this connection needed was not there
                        if key.data is not self and key.data in self._pending:
                            self._drop(sel, key.data)
                        self.counters["memory_errors"] += 1
                        ok = False
                    if ok:
                        if key.data is self:
                            delay = 0.0
                    elif resume is None:          # out of something: accepting waits a while
                        delay = min(max(2 * delay, ACCEPT_BACKOFF[0]), ACCEPT_BACKOFF[1])
                        resume = time.monotonic() + delay
                        sel.unregister(self.sock)
        finally:
            for p in self._pending:
                self._drop(sel, p)
            self._close_loop()

    def _close_loop(self) -> None:
        """The event loop's own objects: the listening socket, the selector, the wake-up pair."""
        self._sel.close()
        self._woken.close()
        self._wake.close()
        self.sock.close()

    def _accept_some(self, sel) -> bool:
        """Accepts up to ACCEPT_BATCH waiting connections and sends each its HELLO. False after an
        accept() error (out of descriptors or memory, a connection aborted before it was taken):
        the listening socket is fine; the loop stops accepting for a backoff."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, addr = self.sock.accept()
            except BlockingIOError:
                return True
            except OSError:
                if self._closed:
                    return True
                self.counters["accept_errors"] += 1
                return False
            self.counters["connections"] += 1
            try:
                hs = auth.ServerHandshake(self.key, self.identity)
                conn.setblocking(False)
                if conn.family != socket.AF_UNIX:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if conn.send(hs.hello) != len(hs.hello):   # a fresh socket's buffer takes 88 bytes
                    raise ConnectionError("the HELLO did not fit")
            except (OSError, MemoryError):
                conn.close()
                self.counters["refused_auth"] += 1
                continue
            host = addr[0] if isinstance(addr, tuple) else str(addr)
            self._hold(sel, _Pending(conn, source_group(host), time.monotonic() + auth.HANDSHAKE_TIMEOUT, hs))
        return True

    def _hold(self, sel, p: _Pending) -> None:
        """Gives `p` a handshake slot and watches it; the connection that made room, if one had
        to (HandshakeSlots.add), is told E_BUSY and closed."""
        try:
            sel.register(p.conn, selectors.EVENT_READ, p)
        except OSError:                 # the kernel's own limit on watched descriptors
            p.conn.close()
            return
        victim = self._pending.add(p)
        if victim is not None:
            try:
                victim.conn.send(wire.error_message(wire.E_BUSY, "too many connections in their handshake"))
            except OSError:
                pass
            sel.unregister(victim.conn)
            victim.conn.close()
            self.counters["evicted"] += 1

    def _release(self, sel, p: _Pending) -> None:
        """Takes `p` out of the pending handshakes (the socket stays open)."""
        sel.unregister(p.conn)
        self._pending.remove(p)

    def _drop(self, sel, p: _Pending) -> None:
        self._release(sel, p)
        p.conn.close()

    def _expire(self, sel, now: float):
        """Closes the pending connections past their deadline; returns the seconds until the next
        deadline (None: none pending)."""
        for p in self._pending.overdue(now):
            if not p.draining:
                self.counters["refused_auth"] += 1   # too slow, or silent
            sel.unregister(p.conn)
            p.conn.close()
        deadline = self._pending.next_deadline()
        return None if deadline is None else deadline - now

    def _step(self, sel, p: _Pending) -> bool:
        """What a pending connection sent: the next part of its first flight, or (once refused)
        input to drop. Concludes the handshake when the flight is whole. False when a proven
        connection could not get a thread (the loop backs off accepting)."""
        if p.draining:
            try:
                k = len(p.conn.recv(4096))
            except BlockingIOError:
                return True
            except OSError:
                k = 0
            p.got += k
            if not k or p.got > DRAIN_BYTES:
                self._drop(sel, p)
            return True
        try:
            k = p.conn.recv_into(memoryview(p.buf)[p.got:p.need])
        except BlockingIOError:
            return True
        except OSError:
            k = 0
        if not k:                                  # gone before proving anything
            self.counters["refused_auth"] += 1
            self._drop(sel, p)
            return True
        p.got += k
        if p.got < p.need:
            return True
        try:
            if p.need == wire.HEADER_BYTES:        # the first header says how long the flight is
                p.need = p.hs.flight_size(bytes(p.buf[:wire.HEADER_BYTES]))
                if len(p.buf) < p.need:
                    p.buf.extend(bytes(p.need - len(p.buf)))   # a clear ERROR: MAX_ERROR at most
                if p.got < p.need:
                    return True
            session = p.hs.conclude(bytes(p.buf[:p.need]))
        except FingerprintError:
            self.counters["refused_dataset"] += 1
            self._refuse(sel, p)
            return True
        except (auth.AuthenticationError, wire.ProtocolError):
            self.counters["refused_auth"] += 1
            self._refuse(sel, p)
            return True
        try:
            if p.conn.send(p.hs.reply) != len(p.hs.reply):   # our proof: 56 bytes into an idle socket
                raise ConnectionError("the proof did not fit")
        except OSError:
            self.counters["refused_auth"] += 1
            self._drop(sel, p)
            return True
        self._release(sel, p)
        return self._proven(sel, p, session)

    def _refuse(self, sel, p: _Pending) -> None:
        """The handshake's reply to a refused connection (a clear ERROR, or our proof to a node of
        another data set), then a graceful close: FIN now, the input read and dropped until the
        other side closes, DRAIN_BYTES, or the handshake's deadline (closing with unread input
        would send RST, which discards the reply on its way)."""
        try:
            if p.hs.reply:
                p.conn.send(p.hs.reply)
            p.conn.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(sel, p)
            return
        p.draining, p.got = True, 0

    def _proven(self, sel, p: _Pending, session) -> bool:
        """A connection that has proven itself: a thread of its own, or, past MAX_CONNECTIONS, a
        sealed E_BUSY and a graceful close. False when no thread could start for it."""
        conn = p.conn
        if not self._take_slot(conn):
            self.counters["refused_busy"] += 1
            try:
                session.send_message(conn.fileno(), wire.ERROR, 0, 0, wire.E_BUSY,
                                     f"more than {MAX_CONNECTIONS} connections".encode(), 0.05)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                conn.close()
                return True
            # its slot again, at the back: a fresh deadline keeps arrival order the deadline order
            p.draining, p.got, p.deadline = True, 0, time.monotonic() + auth.HANDSHAKE_TIMEOUT
            self._hold(sel, p)
            return True
        try:
            conn.settimeout(IO_TIMEOUT)
            self._spawn(self._serve, conn, session)
        except RuntimeError:
            # No thread for it (out of memory, or of the user's process limit): this connection
            # is closed, and accepting waits for a backoff, as after an accept error.
            self._end(conn)
            self.counters["thread_errors"] += 1
            return False
        return True

    def _take_slot(self, conn) -> bool:
        """Counts an authenticated connection in (False past MAX_CONNECTIONS)."""
        with self._lock:
            if self._authenticated >= MAX_CONNECTIONS:
                return False
            self._authenticated += 1
            self._conns.add(conn)
        return True

    def _end(self, conn) -> None:
        """Counts an authenticated connection out and closes it."""
        with self._lock:
            self._authenticated -= 1
            self._conns.discard(conn)
        conn.close()

    def close(self, timeout: float = 5.0) -> bool:
        """Stops accepting, ends every connection and joins every thread this service started.
        True when they all ended within `timeout`."""
        with self._lock:
            self._closed = True
            looping = self._looping
        self._stop.set()
        if looping:                    # the event loop closes the listening socket as it ends
            try:
                self._wake.send(b"x")
            except OSError:
                pass
        else:
            self._close_loop()
        with self._lock:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads if t is not threading.current_thread())

    # ---- one connection ----------------------------------------------------------------------
    def _serve(self, conn, session) -> None:
        """An authenticated connection (counted in by _take_slot), to its end."""
        try:
            self._requests(conn, session)
        finally:
            self._end(conn)

    def _connection(self, conn, host: str, deadline: float) -> None:
        """One connection handed over already accepted (a socketpair: the fuzzers), from its
        handshake (auth.server_handshake on this thread, by `deadline`: the same steps as the event
        loop's) to its end, with the same counters and cap."""
        c = self.counters
        c["connections"] += 1
        try:
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session = auth.server_handshake(conn, self.key, self.identity, deadline)
        except FingerprintError:
            c["refused_dataset"] += 1
            conn.close()
            return
        except (auth.AuthenticationError, wire.ProtocolError, OSError, ValueError):
            c["refused_auth"] += 1   # a wrong proof, another protocol, too slow, gone
            conn.close()
            return
        if not self._take_slot(conn):
            c["refused_busy"] += 1
            self._error(conn, session, wire.E_BUSY, f"more than {MAX_CONNECTIONS} connections")
            conn.close()
            return
        self._serve(conn, session)

    def _requests(self, conn, session) -> None:
        """Answers the requests of an authenticated connection, in order, until it ends."""
        c = self.counters
        fd = conn.fileno()
        while not self._closed:
            code, detail = session.recv_message(fd, REQUESTS, IDLE_TIMEOUT, IO_TIMEOUT)
            if code == 4:            # a malformed request
                c["errors"] += 1
                self._error(conn, session, *detail)
                return
            if code == 6:            # a frame that fails its tag: a middleman, or a broken peer
                c["forged"] += 1
                return
            if code != 0:            # EOF, a timeout, a reset
                return
            opcode, _, count, opaque, body = detail
            if opcode == wire.GET:
                ok = self._get(conn, session, count, body, opaque)
            elif opcode == wire.PING:
                ok = session.send_message(fd, wire.PONG, 0, opaque, 0, b"", IO_TIMEOUT)[0] == 0
            else:
                stats = json.dumps(self.counters).encode()[:wire.MAX_STATS]
                ok = session.send_message(fd, wire.STATS_REPLY, 0, opaque, 0, stats, IO_TIMEOUT)[0] == 0
            if not ok:
                return

    def _error(self, conn, session, code: int, text: str) -> None:
        """A sealed ERROR, then a graceful close."""
        body = text.encode("utf-8", "replace")[:wire.MAX_ERROR]
        try:
            if session.send_message(conn.fileno(), wire.ERROR, 0, 0, code, body, IO_TIMEOUT)[0] == 0:
                _linger(conn)
        except OSError:
            pass

    def _get(self, conn, session, count: int, body, opaque: int) -> bool:
        ids = np.frombuffer(body, dtype="<u8")
        if count and int(ids.max()) >= self.num_samples:
            self.counters["errors"] += 1
            self._error(conn, session, wire.E_BAD_ID,
                        f"sample id {int(ids.max())} out of range 0..{self.num_samples - 1}")
            return False
        c = self.counters
        t0 = time.perf_counter_ns()
        c["requests"] += 1
        c["ids"] += count
        try:
            return self._get_chunks(conn, session, ids, count, opaque)
        finally:
            c["get_ns"] += time.perf_counter_ns() - t0

    def _get_chunks(self, conn, session, ids, count: int, opaque: int) -> bool:
        """Answers one GET, a chunk at a time: the misses of the next CHUNK_ITEMS ids are filled
        (SSD tier, store), then one native call pins, seals and sends the chunk (see the module
        comment); values filled past a chunk's byte bound wait for the next chunk."""
        c = self.counters
        fd = conn.fileno()
        fills = {}          # position in the request -> bytes filled and not yet sent
        filled_to = 0       # positions below this have had their misses filled
        first = 0
        while first < count:
            end = min(first + CHUNK_ITEMS, count)
            fresh = None
            if end > filled_to:
                lo = max(first, filled_to)
                part = ids[lo:end]
                missed = self.cache.missed(part)
                take = self._fill_budget(part, missed)
                if take < len(missed):   # the rest of the window waits for the next chunk
                    end = lo + missed[take]
                    missed = missed[:take]
                if missed:
                    out, fresh = self._fill_misses(part.tolist(), missed)
                    for pos, value in out:
                        fills[lo + pos] = value
                filled_to = end
            window = {p - first: v for p, v in fills.items() if p < end} if fills else {}
            # With nothing read to offer the cache, the same native call sends the rest too.
            code, detail = seal_reply(self.cache, session, fd, ids[first:end], window, opaque, end < count,
                                      CHUNK_BYTES, PIN_WAIT, -1.0 if fresh is not None else IO_TIMEOUT)
            if fresh is not None:    # the chunk's pins are released: nothing the cache does now hurts it
                # the home node keeps its own samples: the cache by its policy, the SSD tier
                # what the cache refused (a value too large for the cache counts as refused)
                self.misses.admit(fresh)
                if code == 0:
                    code = session.flush(fd, IO_TIMEOUT)[0]
            if code != 0:            # the client stopped reading, or went away
                return False
            k, hits, sent, busy = detail
            c["cache_hits"] += hits
            c["bytes_sent"] += sent
            c["pin_waits"] += bool(busy)
            for p in [p for p in fills if p < first + k]:
                del fills[p]
            first += k
        return True

    def _fill_budget(self, ids, missed) -> int:
        """How many of the positions `missed` (of `ids`) to fill for one chunk: as many as fit in
        CHUNK_BYTES by the store's sample lengths (at least one), so that the values read for a
        chunk, not only those sent, stay within its bound."""
        lengths = getattr(self.store, "lengths", None)
        if not missed or not isinstance(lengths, np.ndarray):
            return len(missed)
        sizes = np.cumsum(lengths[ids[missed]].astype(np.int64))
        return max(1, int(np.searchsorted(sizes, CHUNK_BYTES, side="right")))

    def _fill_misses(self, ids, missed) -> tuple:
        """(out, read): out is (position, bytes) for the positions in `missed` that the tiers below
        the cache hold: the SSD tier, then, read-through, the store, through the tier chain
        (shadecache/tiers.py); read is the chain's Read, admitted by _get_chunks once the chunk is
        sealed (offered to the cache before, it could evict the very values the chunk is about to
        pin)."""
        c = self.counters
        want = list(dict.fromkeys(ids[k] for k in missed))
        r = self.misses.read(want)
        got = dict(zip(want, r.values))
        for name, key in (("ssd", "ssd_hits"), (STORE, "store_reads")):
            if name in r.counts:
                c[key] += r.counts[name].hits
        out = [(k, got[ids[k]]) for k in missed if got[ids[k]] is not None]
        c["misses"] += len(missed) - len(out)
        return out, r


# ---- the server process ------------------------------------------------------------------------
def main() -> None:
    """The server process that serve() starts: reads its configuration (a length-prefixed
    pickle, written by serve() in the parent: our own process, never the network) from stdin,
    prints its address on stdout, serves until stdin closes (the parent exited or closed it)."""
    stdin = sys.stdin.buffer
    (n,) = struct.unpack("<I", stdin.read(4))
    cfg = pickle.loads(stdin.read(n))
    # Room for every pending handshake and authenticated connection beside the process's files:
    # the soft descriptor limit is often 1024, the hard one far above (pending_limit).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_PENDING + MAX_CONNECTIONS + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    node = pickle.loads(cfg["node"])   # attaches the cache, reopens the store and the SSD tier
    cache = node.cache
    service = PeerService(node, cfg["host"], cfg["port"], cfg["secret"])
    sys.stdout.write(service.address + "\n")
    sys.stdout.flush()
    service.start(publish=True)
    # Later messages from the parent (same framing): {"peers": [...]}. EOF: the parent closed
    # the pipe or died.
    while True:
        head = stdin.read(4)
        if len(head) < 4:
            break
        (n,) = struct.unpack("<I", head)
        msg = pickle.loads(stdin.read(n))
        if "peers" in msg:
            service.peers = [str(a) for a in msg["peers"]]
            try:
                tier_status.write(cache.name, service.status())
            except OSError:   # the status file is for people; it never takes the server down
                pass
    joined = service.close()
    tier_status.remove(cache.name, os.getpid())
    if not joined:   # a thread still inside a native call: leave without finalizing under it
        sys.stdout.flush()
        os._exit(0)
