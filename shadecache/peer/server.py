"""The peer server: serves this node's cache (and SSD tier, and optionally the store) to the
other nodes of a job.

It runs in its own process (`serve()` starts `python -m shadecache.peer` and hands it its
configuration over a pipe), so serving peers never takes the training process's GIL. Inside that
process: one accept loop, one thread per connection (at most MAX_CONNECTIONS), requests on a
connection answered in order.

A GET is answered in chunks (one GET_REPLY message each, status MORE on all but the last), so
that at most CHUNK_ITEMS samples of one request are pinned at a time: the values of a chunk are
pinned cache views (Cache.view), handed to sendmsg as a scatter/gather list (no copy in Python)
and released when the chunk is sent. A sample the cache does not hold comes from the SSD tier,
then, when the server has a store (read-through: the home node reads its own samples from
shared storage and caches them, so the cluster reads each sample once), from the store: the
node's tier chain (shadecache/tiers.py), which offers what it read to the cache (admitted by its
policy) and what the cache refused to the SSD tier. Every value carries its crc32c.

A client that breaks the protocol gets an ERROR reply and a closed connection; the server goes on
serving everyone else. A client that stops reading is dropped after IO_TIMEOUT seconds (its pins
are released with it).
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

from . import auth, wire
from . import status as tier_status
from .. import _core
from ..tiers import STORE, TierChain

MAX_CONNECTIONS = 256
CHUNK_ITEMS = 256         # samples pinned at once per request
CHUNK_BYTES = 8 << 20     # bytes per reply chunk (a chunk holds at least one sample)
IO_TIMEOUT = 10.0         # a partial message or a stalled reader is dropped after this
IDLE_TIMEOUT = 300.0      # an idle connection is closed after this
MORE = 1                  # GET_REPLY status: more chunks of this request follow


def is_loopback(host: str) -> bool:
    """True when `host` resolves to a loopback address (127.0.0.0/8, ::1, localhost)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_bind(host: str, key: bytes) -> None:
    """No secret: only loopback may be bound (ValueError otherwise)."""
    if not isinstance(host, str):
        raise TypeError(f"host must be a str, got {type(host).__name__}")
    if not key and not is_loopback(host):
        raise ValueError(f"refusing to serve on {host!r} without a secret: give secret= (or "
                         "SHADECACHE_SECRET) or bind to 127.0.0.1")


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


class _PinSlots:
    """Counts the views this process holds, below the engine's per-process limit, so that many
    connections pinning at once wait for each other instead of failing."""

    def __init__(self, limit: int):
        self._free = limit
        self._cv = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cv:
            while self._free < n:
                self._cv.wait()
            self._free -= n

    def release(self, n: int) -> None:
        with self._cv:
            self._free += n
            self._cv.notify_all()


class PeerService:
    """The serving loop over one listening socket (in the process that serves)."""

    def __init__(self, cache, host="127.0.0.1", port=0, secret=None, ssd=None, store=None):
        self.key = auth.secret_bytes(secret)
        check_bind(host, self.key)
        self.cache, self.ssd, self.store = cache, ssd, store
        if ssd is not None:   # the tier it serves must hold this store's samples
            ssd.bind_store(store)
        # A miss goes to the SSD tier, then (read-through) the store: the node's tier chain.
        self.chain = TierChain([("ssd", ssd)] if ssd is not None else [], store, cache=cache)
        self.num_samples = cache.num_samples
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.address = "%s:%d" % self.sock.getsockname()[:2]
        self._pins = _PinSlots(max(CHUNK_ITEMS, cache.MAX_VIEWS_PER_PROCESS - 16))
        self._conns = set()
        self._lock = threading.Lock()
        self._closed = False
        self.counters = {"connections": 0, "refused": 0, "requests": 0, "ids": 0, "cache_hits": 0,
                         "ssd_hits": 0, "store_reads": 0, "misses": 0, "bytes_sent": 0, "errors": 0,
                         "get_ns": 0}
        self.peers = []           # the other nodes' addresses, when the launcher told us

    # ---- the published status (status.py) -----------------------------------------------
    def status(self) -> dict:
        c = dict(self.counters)
        c["mean_get_seconds"] = c["get_ns"] / c["requests"] / 1e9 if c["requests"] else 0.0
        return {"pid": os.getpid(), "address": self.address, "server": c,
                "ssd": self.ssd.stats() if self.ssd is not None else None,
                "store": repr(self.store) if self.store is not None else None,
                "peers": list(self.peers), "updated": time.time()}

    def publish_forever(self, every: float = 1.0) -> None:
        while not self._closed:
            try:
                tier_status.write(self.cache.name, self.status())
            except OSError:
                pass
            time.sleep(every)

    # ---- accept loop -------------------------------------------------------------------------
    def serve_forever(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                raise
            with self._lock:
                if len(self._conns) >= MAX_CONNECTIONS:
                    self.counters["refused"] += 1
                    conn.close()
                    continue
                self._conns.add(conn)
                self.counters["connections"] += 1
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self._closed = True
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

    # ---- one connection ----------------------------------------------------------------------
    def _connection(self, conn) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(IO_TIMEOUT)
            auth.server_handshake(conn, self.key)   # nothing else before this succeeds
            while True:
                conn.settimeout(IDLE_TIMEOUT)
                head = wire.recv_exact(conn, 1)     # wait for a request, then bound the rest of it
                conn.settimeout(IO_TIMEOUT)
                rest = wire.recv_exact(conn, wire.HEADER_BYTES - 1)
                opcode, status, count, body_len, opaque = wire.unpack_header(bytes(head) + bytes(rest))
                body = wire.recv_exact(conn, body_len) if body_len else b""
                if opcode == wire.GET:
                    self._get(conn, count, body, opaque)
                elif opcode == wire.PING:
                    conn.sendall(wire.pack_header(wire.PONG, 0, 0, opaque))
                elif opcode == wire.STATS:
                    body = json.dumps(self.counters).encode()[:wire.MAX_STATS]
                    conn.sendall(wire.pack_header(wire.STATS_REPLY, 0, len(body), opaque) + body)
                else:
                    raise wire.ProtocolError(f"unexpected {wire.OPCODE_NAMES[opcode]} request",
                                             wire.E_BAD_OPCODE)
        except wire.ProtocolError as e:
            self.counters["errors"] += 1
            try:
                conn.sendall(wire.error_message(e.code, str(e)))
                _linger(conn)
            except OSError:
                pass
        except (OSError, struct.error):   # EOF, timeouts, resets, a failed handshake
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _get(self, conn, count: int, body, opaque: int) -> None:
        if len(body) != 8 * count:
            raise wire.ProtocolError(f"GET of {count} ids carries {len(body)} bytes", wire.E_BAD_LENGTH)
        ids = np.frombuffer(body, dtype="<u8")
        if count and int(ids.max()) >= self.num_samples:
            raise wire.ProtocolError(f"sample id {int(ids.max())} out of range 0..{self.num_samples - 1}",
                                     wire.E_BAD_ID)
        c = self.counters
        t0 = time.perf_counter_ns()
        c["requests"] += 1
        c["ids"] += count
        try:
            self._get_chunks(conn, ids, count, opaque)
        finally:
            c["get_ns"] += time.perf_counter_ns() - t0

    def _get_chunks(self, conn, ids, count: int, opaque: int) -> None:
        """Answers one GET, a chunk at a time: _core.PinnedReply pins the chunk's values, the
        misses are filled here (SSD tier, store), then one native call computes the crc32c of
        every value and sends header, entry table and values with sendmsg straight from shared
        memory, without the GIL (csrc/bindings/peer_io.cc)."""
        c = self.counters
        fd = conn.fileno()
        first = 0
        while first < count:
            want = ids[first:first + CHUNK_ITEMS]
            self._pins.acquire(want.size)
            try:
                reply = _core.PinnedReply(self.cache._core, want, CHUNK_BYTES)
                try:
                    k = reply.count
                    missed = reply.missed()
                    c["cache_hits"] += k - len(missed)
                    if missed:
                        for pos, value in self._fill_misses(want[:k].tolist(), missed):
                            reply.fill(pos, value)
                    code, detail = reply.send(fd, opaque, first + k < count, IO_TIMEOUT)
                finally:
                    reply.release()
            finally:
                self._pins.release(want.size)
            if code == 1:
                raise socket.timeout("client stopped reading")
            if code != 0:
                raise ConnectionError(f"sending a reply failed (code {code}, {detail})")
            c["bytes_sent"] += detail
            first += k

    def _fill_misses(self, ids, missed) -> list:
        """(position, bytes) for the positions in `missed` that the tiers below the cache hold:
        the SSD tier, then, read-through, the store, through the tier chain (shadecache/tiers.py),
        which offers what it read to the cache (admitted by its score) and what the cache refused
        to the SSD tier."""
        c = self.counters
        want = list(dict.fromkeys(ids[k] for k in missed))
        r = self.chain.read(want)
        self.chain.admit(r)
        got = dict(zip(want, r.values))
        for name, key in (("ssd", "ssd_hits"), (STORE, "store_reads")):
            if name in r.counts:
                c[key] += r.counts[name].hits
        out = [(k, got[ids[k]]) for k in missed if got[ids[k]] is not None]
        c["misses"] += len(missed) - len(out)
        return out


# ---- the server process ------------------------------------------------------------------------
def _main() -> None:
    """`python -m shadecache.peer`: reads its configuration (a length-prefixed pickle,
    written by serve() in the parent: our own process, never the network) from stdin, prints
    its address on stdout, serves until stdin closes (the parent exited or closed it)."""
    from ..cache import Cache

    stdin = sys.stdin.buffer
    (n,) = struct.unpack("<I", stdin.read(4))
    cfg = pickle.loads(stdin.read(n))
    cache = Cache.attach(cfg["cache"])
    service = PeerService(cache, cfg["host"], cfg["port"], cfg["secret"], cfg.get("ssd"), cfg.get("store"))
    sys.stdout.write(service.address + "\n")
    sys.stdout.flush()
    threading.Thread(target=service.serve_forever, daemon=True).start()
    threading.Thread(target=service.publish_forever, daemon=True).start()
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
    service.close()
    tier_status.remove(cache.name, os.getpid())
