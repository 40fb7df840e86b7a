"""Fuzz surface: the peer protocol's handshake and sealed frames, both ends, in one process.

Input: one mode byte, then a program of bytes (any byte string is a program). The ends talk over
a socketpair; the server end is the real PeerService connection handler, the client end the real
handshake and native reply reader.

  mode 0  server, before authentication: the program's bytes are what a stranger sends. Oracle:
          the server sends its HELLO and at most one ERROR in clear text, nothing else; its
          handler ends without an exception.
  mode 1  server, after a real handshake: the program is a list of messages (opcodes of every
          state, counts, ids in and out of range, body lengths that disagree), each sealed with
          the connection's key, sealed with a bad tag, sent unsealed, cut short or replayed.
          Oracle: every reply opens under the connection's key; a GET reply holds the store's
          exact bytes (or MISS) with their crc32c; an ERROR is the last thing sent.
  mode 2  client, the reply to a GET: the program is a list of reply chunks from a lying but
          authenticated server (ids, lengths, crc32c, counts, opaques, statuses of its choice;
          values with bytes missing or extra), some records with a bad tag or none. Oracle: a
          value is returned only if the server sealed exactly those bytes at that position with a
          valid tag and their crc32c matches its entry; otherwise a result code, never a raise.
  mode 3  client, the handshake against a hostile server: raw bytes, or a valid HELLO followed by
          forged proofs. Oracle: one of the handshake's documented errors, never a session.

Every mode runs under the harness's address-space limit: an allocation a length in the input
asks for (a 512 MiB body, a huge count) is a MemoryError, which is a finding.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
import uuid

import numpy as np

import shadecache as sc
from shadecache import _core
from shadecache._io import crc32c
from shadecache.peer import auth, identity, wire
from shadecache.peer.server import PeerService

from fuzz_harness import Finding

BUDGET_MB = 96
TIMEOUT_S = 20.0
CALLS_PER_INPUT = None
N = 64
# fixed (a replayed finding must run under the same keys), and random: a patterned one is refused
SECRET = b"f68434ffbb268a7d2880710ffa8b028d64626b23a425066b7bf137b16a2120df"
HUGE = [0, 1, 2, 7, 8, 16, 24, 63, 64, 255, 256, 4095, 4096, 4097, 65535, 1 << 20, (1 << 29) + 7, 512 << 20,
        (1 << 31) - 1, 1 << 31, (1 << 32) - 1]
OPCODES = [wire.GET, wire.GET, wire.GET, wire.PING, wire.STATS, wire.HELLO, wire.PROOF, wire.GET_REPLY,
           wire.PONG, wire.ERROR, wire.STATS_REPLY, 0, 10, 255]


class Program:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def byte(self) -> int:
        b = self.data[self.at] if self.at < len(self.data) else 0
        self.at += 1
        return b

    def pick(self, pool):
        return pool[self.byte() % len(pool)]

    def more(self) -> bool:
        return self.at < len(self.data)


def generate(rng) -> bytes:
    mode = rng.randrange(4)
    if mode == 0 and rng.random() < 0.5:   # a plausible start: a HELLO, then junk or a PROOF
        hello = wire.pack_header(wire.HELLO, 0, rng.choice([64, 64, 32, 0, 1 << 30]), rng.choice([N, N + 1, 0]))
        return bytes([0]) + hello + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 120)))
    return bytes([mode]) + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 160)))


def setup(workdir):
    import threading as th

    th.stack_size(512 << 10)   # the server thread of mode 1, under the address-space limit
    rng = np.random.default_rng(11)
    path = os.path.join(workdir, "peer.shc")
    with sc.PackWriter(path) as w:
        for i in range(N):
            w.add(rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes(), 0)
    store = sc.PackedStore(path)
    truth = store.read_many(list(range(N)))
    cache = sc.Cache.create(f"fuzz-peer-{os.getpid()}-{uuid.uuid4().hex[:8]}", N, 1 << 20, policy="lru",
                            max_item_bytes=4096, fingerprint=store.fingerprint)
    cache.put_many(np.arange(0, N, 2), truth[0::2])
    service = PeerService(sc.Node(store, cache, read_ahead=False), "127.0.0.1", 0, SECRET)
    service.sock.close()   # connections come from socketpairs here
    ident = identity.identity_of(store)
    # warm every code path once before the limit (imports, first allocations)
    state = {"store": store, "truth": truth, "cache": cache, "service": service, "identity": ident}
    for mode in range(4):
        run(state, bytes([mode]) + bytes(range(40)))
    return state


def teardown(state):
    state["cache"].close()
    state["cache"].unlink()
    state["store"].close()


def run(state, data: bytes) -> None:
    if not data:
        return
    mode, prog = data[0] % 4, Program(data[1:])
    (_server_before_auth, _server_after_auth, _client_reply, _client_handshake)[mode](state, prog, data[1:])


# ---- the server ---------------------------------------------------------------------------------

def _serve_once(state, sock, errors):
    """The service's real connection handler on `sock`; an exception escaping it goes to `errors`."""
    service = state["service"]
    try:
        service._connection(sock, "fuzz", time.monotonic() + 5)
    except BaseException as e:   # noqa: BLE001 (reported as a finding by the caller)
        errors.append(e)


def _read_all(sock, seconds=5.0) -> bytes:
    sock.settimeout(seconds)
    out = []
    while True:
        try:
            b = sock.recv(1 << 16)
        except (ConnectionResetError, socket.timeout):
            break
        if not b:
            break
        out.append(b)
    return b"".join(out)


def _raise_escaped(errors, where):
    if errors:
        e = errors[0]
        kind = "alloc" if isinstance(e, MemoryError) else "unlisted"
        raise Finding(kind, f"{where} raised {type(e).__name__}: {e}")


def _server_before_auth(state, prog, raw):
    ours, theirs = socket.socketpair()
    errors = []
    try:
        try:
            ours.sendall(raw)
            ours.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        _serve_once(state, theirs, errors)   # the input is all there: the handler runs to EOF
        out = _read_all(ours)
    finally:
        ours.close()
    _raise_escaped(errors, "the server's handler")
    head = wire.HEADER_BYTES + wire.HELLO_BYTES
    if len(out) < head or out[5] != wire.HELLO:
        raise Finding("protocol", f"no HELLO first ({out[:8].hex()})")
    rest = out[head:]
    if rest and (len(rest) < wire.HEADER_BYTES or rest[5] != wire.ERROR
                 or len(rest) > wire.HEADER_BYTES + wire.MAX_ERROR):
        raise Finding("leak", f"sent {rest[:8].hex()} ({len(rest)} bytes) to a connection that has not proven itself")


def _message(prog, session, seq_log):
    """(clear header, wire bytes) of one message of the program."""
    op = prog.pick(OPCODES)
    how = prog.byte() % 12
    count = prog.byte() % 80 if op == wire.GET else prog.pick([0, 0, 0, 1, 5])
    ids = [prog.pick(list(range(N)) + [N, N + 1, 2 ** 63, 2 ** 64 - 1]) for _ in range(count if op == wire.GET else 0)]
    body = struct.pack(f"<{len(ids)}Q", *ids) if op == wire.GET else bytes(prog.pick([0, 0, 0, 3, 40]))
    body_len = len(body) if prog.byte() % 8 else prog.pick(HUGE)
    head = wire.pack_header(op, count, body_len, prog.byte(), 0)
    if how == 11:                  # a header with one bit flipped after it was sealed
        sealed = session.seal(head, body)
        h = bytearray(head)
        h[prog.byte() % len(h)] ^= 1 << (prog.byte() % 8)
        return bytes(h) + sealed
    if how == 10:
        return head + body         # unsealed
    sealed = session.seal(head, body)
    seq_log.append(head + sealed)
    if how == 9:                   # a bad tag
        return head + sealed[:-1] + bytes([sealed[-1] ^ 0x80])
    if how == 8:                   # cut short
        return (head + sealed)[:prog.byte() % (len(head) + len(sealed))]
    if how == 7 and len(seq_log) > 1:
        return seq_log[0]          # an earlier message again: its sequence number is spent
    return head + sealed


def _server_after_auth(state, prog, raw):
    ours, theirs = socket.socketpair()
    errors = []
    t = threading.Thread(target=_serve_once, args=(state, theirs, errors), daemon=True)
    t.start()
    try:
        try:
            session = auth.client_handshake(ours, SECRET, state["identity"], time.monotonic() + 5)
        except Exception as e:   # noqa: BLE001
            raise Finding("handshake", f"a good client was refused: {type(e).__name__}: {e}")
        log = []
        out = []
        for _ in range(1 + prog.byte() % 4):
            out.append(_message(prog, session, log))
            if not prog.more():
                break
        try:
            ours.sendall(b"".join(out))
            ours.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        replies = _read_all(ours)
    finally:
        ours.close()
        t.join(10)
    if t.is_alive():
        raise Finding("hang", "the server's handler did not end after EOF")
    _raise_escaped(errors, "the server's handler")
    problem = check_replies(replies, dict(enumerate(state["truth"])), session)
    if problem:
        raise Finding("wrong-reply", problem)


def check_replies(data: bytes, truth: dict, session, reset: bool = False) -> str:
    """'' when `data` is a sequence of sealed replies that all open under `session`: GET replies
    whose values are truth[id] with their crc32c (a MISS is always allowed: a value may be
    evicted, pins may be busy), PONGs, STATS replies, optionally ended by an ERROR (or, when the
    connection was reset, by a message cut short: a client never accepts that); otherwise what
    is wrong. (tests/peer/test_peer_fuzz.py checks a live server's replies with it too.)"""
    off = 0

    def record(aad, n):
        nonlocal off
        raw = data[off:off + n + wire.TAG_BYTES]
        if len(raw) < n + wire.TAG_BYTES:
            return None, "" if reset else "a reply cut short"
        off += n + wire.TAG_BYTES
        body = session.open(aad, raw)
        return body, "" if body is not None else "a reply that fails its tag"

    while off < len(data):
        head = data[off:off + wire.HEADER_BYTES]
        if len(head) < wire.HEADER_BYTES:
            return "" if reset else "a header cut short"
        try:
            op, _, count, body_len, _ = wire.unpack_header(head)
        except wire.ProtocolError as e:
            return f"bad reply header: {e}"
        off += wire.HEADER_BYTES
        if op == wire.GET_REPLY:
            table, why = record(head, count * wire.ENTRY_BYTES)
            if table is None:
                return why
            values, why = record(b"", body_len - count * wire.ENTRY_BYTES)
            if values is None:
                return why
            pos = 0
            for e in np.frombuffer(table, dtype=wire.ENTRY):
                i, n, crc = int(e["id"]), int(e["length"]), int(e["crc"])
                if n == wire.MISS:
                    continue
                v = values[pos:pos + n]
                pos += n
                if truth.get(i) != v or crc32c(v) != crc:
                    return f"wrong bytes for id {i}"
            if pos != len(values):
                return "reply lengths do not add up"
            continue
        body, why = record(head, body_len)
        if body is None:
            return why
        if op == wire.ERROR:
            return "" if off == len(data) else "bytes after an ERROR"
        if op == wire.STATS_REPLY and not isinstance(json.loads(body), dict):
            return "a STATS reply that is not an object"
        if op not in (wire.PONG, wire.STATS_REPLY):
            return f"reply opcode {op}"
    return ""


# ---- the client ---------------------------------------------------------------------------------

def _pair():
    a, b = os.urandom(32), os.urandom(32)
    return _core.PeerSession(a, b), _core.PeerSession(b, a)   # (server, client)


def _client_reply(state, prog, raw):
    server_s, client_s = _pair()
    n = 1 + prog.byte() % 40
    ids = [prog.byte() % N for _ in range(n)]
    opaque = 7
    sent = []       # per chunk: (entries [(id, length, crc)], values bytes, tags valid)
    out = []
    got = 0
    for _ in range(1 + prog.byte() % 3):
        # Half the chunks are honest; the others tell one lie (or a few, in the last case), so
        # that complete replies get through often enough for the value oracle to bite.
        lie = prog.byte() % 20
        lie = lie - 10 if lie >= 10 else -1
        k = max(0, n - got if lie != 0 else prog.pick([1, 2, 0, n, n - got + 1]))
        entries = []
        values = bytearray()
        for j in range(k):
            pos = got + j
            i = ids[pos] if pos < n and (lie != 1 or prog.byte() % 4) else prog.byte()
            kind = prog.byte() % 8 if lie in (2, 9) else (0 if prog.byte() % 4 == 0 else 1)
            v = state["truth"][i % N] if kind < 6 else bytes(prog.byte() % 50)
            length = wire.MISS if kind == 0 else len(v) if kind < 7 else prog.pick(HUGE)
            crc = crc32c(v) if lie not in (3, 9) or prog.byte() % 4 else prog.byte()
            entries.append((i, length, crc))
            if length != wire.MISS:
                values += v
        if lie in (4, 9):
            values += bytes(prog.byte() % 9)
        table = b"".join(struct.pack("<QII", *e) for e in entries)
        body_len = len(table) + len(values) if lie not in (5, 9) else prog.pick(HUGE)
        status = wire.MORE if got + k < n or lie in (6, 9) and prog.byte() % 2 else 0
        op = wire.GET_REPLY if lie not in (7, 9) or prog.byte() % 2 else prog.pick(OPCODES)
        head = wire.pack_header(op, k, body_len, opaque if lie not in (7, 9) or prog.byte() % 2 else opaque + 1, status)
        how = prog.byte() % 10 if lie in (8, 9) else 0
        sealed_table = server_s.seal(head, table)
        sealed_values = server_s.seal(b"", bytes(values))
        valid = how < 7
        if how == 7:
            sealed_values = sealed_values[:-1] + bytes([sealed_values[-1] ^ 1])
        elif how == 8:
            sealed_table = table + bytes(16)
        elif how == 9:
            sealed_values = bytes(values)
        out.append(head + sealed_table + sealed_values)
        sent.append((entries, bytes(values), valid))
        got += k
        if got >= n and lie == -1:
            break
    ours, theirs = socket.socketpair()
    try:
        try:
            ours.sendall(b"".join(out)[:prog.pick([1 << 30] * 7 + [10, 100, 1000])])
            ours.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            code, detail = client_s.recv_get_reply(theirs.fileno(), np.asarray(ids, dtype="<u8"), opaque, 0.2)
        except MemoryError as e:
            raise Finding("alloc", f"recv_get_reply: {e}")
        except Exception as e:   # noqa: BLE001
            raise Finding("unlisted", f"recv_get_reply raised {type(e).__name__}: {e}")
    finally:
        ours.close()
        theirs.close()
    if code not in (0, 1, 2, 3, 4, 5, 6):
        raise Finding("unlisted", f"result code {code}")
    if code != 0:
        return
    values, refused = detail
    if len(values) != n:
        raise Finding("wrong-bytes", f"{len(values)} values for {n} ids")
    # what the server sealed, position by position, in chunks whose every tag was valid
    expect, pos = {}, 0
    for entries, vals, valid in sent:
        at = 0
        for (i, length, crc) in entries:
            if length != wire.MISS:
                expect[pos] = (vals[at:at + length], crc, valid)
                at += length
            pos += 1
    for p, v in enumerate(values):
        if v is None:
            continue
        if p not in expect:
            raise Finding("wrong-bytes", f"a value at position {p}, which the server sent as a miss")
        want, crc, valid = expect[p]
        if not valid:
            raise Finding("forged", f"a value from a chunk whose tag was not valid, at position {p}")
        if v != want or crc32c(v) != crc:
            raise Finding("wrong-bytes", f"position {p}: a value that is not what was sealed, or fails its crc32c")


HANDSHAKE_ERRORS = (auth.AuthenticationError, sc.FingerprintError, ConnectionRefusedError, ConnectionError,
                    socket.timeout)


def _client_handshake(state, prog, raw):
    fp, n = state["identity"]
    kind = prog.byte() % 3
    if kind == 0:
        data = raw
    else:
        hello = wire.pack_header(wire.HELLO, 0, wire.HELLO_BYTES, n if prog.byte() % 8 else n + 1) + os.urandom(32) + fp
        proof = wire.pack_header(wire.PROOF, 0, wire.DIGEST_BYTES) + bytes(prog.byte() for _ in range(32))
        data = hello + (proof if kind == 1 else raw[prog.at:])
    ours, theirs = socket.socketpair()
    try:
        try:
            ours.sendall(data)
            ours.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            auth.client_handshake(theirs, SECRET, state["identity"], time.monotonic() + 0.5)
        except HANDSHAKE_ERRORS:
            return
        except MemoryError as e:
            raise Finding("alloc", f"client_handshake: {e}")
        except Exception as e:   # noqa: BLE001
            raise Finding("unlisted", f"client_handshake raised {type(e).__name__}: {e}")
        raise Finding("forged", "the client completed a handshake with a server that does not know the secret")
    finally:
        ours.close()
        theirs.close()
