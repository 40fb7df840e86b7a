"""The peer server: serves this node's cache (and SSD tier, and the store read through) to the
other nodes of a job.

It runs in its own process (`serve()` starts it and hands it its configuration over a pipe), so
serving peers never takes the training process's GIL. Inside that process: one accept loop, one
thread per connection, requests on a connection answered in order.

A connection is first a handshake (auth.py): at most MAX_HANDSHAKES of them at once, at most
MAX_HANDSHAKES_PER_ADDRESS from one address, each given HANDSHAKE_TIMEOUT seconds in all, and
nothing allocated for them but their fixed-size messages; a connection over those caps is told
E_BUSY and closed at once. Authenticated connections (at most MAX_CONNECTIONS) exchange sealed
frames only (csrc/bindings/peer_io.cc), and only requests: GET, PING, STATS.

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
is counted and retried after a backoff, never the end of serving. close() ends every connection
and joins every thread it started: a thread left inside a native call while the interpreter
exits aborts the process.
"""
import ipaddress
import json
import os
import pickle
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
MAX_HANDSHAKES = 128             # connections not yet authenticated, all together
MAX_HANDSHAKES_PER_ADDRESS = 16  # ... from one address (a node's DataLoader workers connect at once)
CHUNK_ITEMS = 256         # ids per reply chunk (and pins one connection holds at once)
CHUNK_BYTES = 2 << 20     # value bytes per reply chunk (a chunk holds at least one sample)
PIN_WAIT = 1.0            # the longest a chunk waits for pins; then its cached values go as misses
IO_TIMEOUT = 10.0         # a partial message or a stalled reader is dropped after this
IDLE_TIMEOUT = 300.0      # an idle connection is closed after this
ACCEPT_BACKOFF = (0.01, 1.0)   # seconds between accept() attempts after an error: doubling
REQUESTS = [wire.GET, wire.PING, wire.STATS]   # what an authenticated client may send


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
        self.sock.listen(128)
        self.address = "%s:%d" % self.sock.getsockname()[:2]
        self._conns = set()
        self._threads = set()
        self._handshaking = 0
        self._per_address = {}
        self._authenticated = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self.counters = {"connections": 0, "refused": 0, "refused_busy": 0, "refused_auth": 0,
                         "refused_dataset": 0, "forged": 0, "accept_errors": 0, "thread_errors": 0,
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

    # ---- accept loop -------------------------------------------------------------------------
    def serve_forever(self) -> None:
        delay = 0.0
        while not self._closed:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                # Out of descriptors (EMFILE/ENFILE) or memory, a connection aborted before it was
                # taken: the listening socket is fine; try again after a backoff.
                self.counters["accept_errors"] += 1
                delay = self._back_off(delay)
                continue
            host = addr[0]
            if not self._take(conn, host):
                continue
            try:
                self._spawn(self._connection, conn, host, time.monotonic() + auth.HANDSHAKE_TIMEOUT)
            except RuntimeError:
                # No thread for it (out of memory, or of the user's process limit): this
                # connection is closed, and the next waits for a backoff, as after an accept error.
                with self._lock:
                    self._handshake_ended(host)
                    self._conns.discard(conn)
                conn.close()
                self.counters["thread_errors"] += 1
                delay = self._back_off(delay)
                continue
            delay = 0.0

    def _back_off(self, delay: float) -> float:
        """Waits the next step of ACCEPT_BACKOFF after `delay` (or until close()); returns it."""
        delay = min(max(2 * delay, ACCEPT_BACKOFF[0]), ACCEPT_BACKOFF[1])
        self._stop.wait(delay)
        return delay

    def _take(self, conn, host: str) -> bool:
        """Counts a new connection from `host` into the handshake caps; over them, tells it E_BUSY
        and closes it (False)."""
        with self._lock:
            busy = (self._handshaking >= MAX_HANDSHAKES
                    or self._per_address.get(host, 0) >= MAX_HANDSHAKES_PER_ADDRESS)
            if not busy:
                self._handshaking += 1
                self._per_address[host] = self._per_address.get(host, 0) + 1
                self._conns.add(conn)
                self.counters["connections"] += 1
        if busy:
            self.counters["refused"] += 1
            try:
                conn.setblocking(False)
                conn.send(wire.error_message(wire.E_BUSY, "too many connections in their handshake"))
            except OSError:
                pass
            conn.close()
        return not busy

    def _handshake_ended(self, host: str) -> None:
        """Counts a connection from `host` out of the handshake caps (_take counted it in).
        Caller holds self._lock."""
        self._handshaking -= 1
        left = self._per_address[host] - 1
        if left:
            self._per_address[host] = left
        else:
            del self._per_address[host]

    def close(self, timeout: float = 5.0) -> bool:
        """Stops accepting, ends every connection and joins every thread this service started.
        True when they all ended within `timeout`."""
        self._closed = True
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
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
    def _connection(self, conn, host: str, deadline: float) -> None:
        """One connection, taken by _take, from its handshake (by `deadline`) to its end."""
        c = self.counters
        try:
            try:
                if conn.family != socket.AF_UNIX:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                session = auth.server_handshake(conn, self.key, self.identity, deadline)
            except FingerprintError:
                c["refused_dataset"] += 1
                return
            except (auth.AuthenticationError, wire.ProtocolError, OSError, ValueError):
                c["refused_auth"] += 1   # a wrong proof, another protocol, too slow, gone
                return
            finally:
                with self._lock:
                    self._handshake_ended(host)
            with self._lock:
                full = self._authenticated >= MAX_CONNECTIONS
                if not full:
                    self._authenticated += 1
            if full:
                c["refused_busy"] += 1
                self._error(conn, session, wire.E_BUSY, f"more than {MAX_CONNECTIONS} connections")
                return
            try:
                self._requests(conn, session)
            finally:
                with self._lock:
                    self._authenticated -= 1
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

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
    node = cfg["node"]   # attaches the cache, reopens the store and the SSD tier by name
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
