"""The native reply reader (bindings/peer_io.cc) against a hand-written server on 127.0.0.1 that
runs the real handshake, then sends good, corrupt, mismatched, truncated, stalled, forged,
replayed and reordered GET replies: the client returns exact bytes for the good ones, refuses
(None) a value that fails its crc32c, and raises for every other (ProtocolError, RemoteError,
ForgedFrameError, ConnectionError, socket.timeout), never returning a wrong byte. Also: a hostile
endpoint cannot make a connecting client allocate what its headers claim, nor hold it past the
caller's deadline (that one: tests/peer/test_peer_security.py)."""
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from shadecache._io import crc32c
from shadecache.peer import ForgedFrameError, PeerClient, ProtocolError, RemoteError, auth, new_secret, wire

VALUES = {3: b"abc" * 1000, 7: b"", 9: bytes(range(256)) * 40}
N = 16
DATASET = (None, N)
SECRET = new_secret()
KEY = SECRET.encode()
IDENTITY = (bytes(32), N)


def _sealed_reply(session, ids, opaque, status=0, table_edit=None, values_edit=None, head_edit=None):
    """One GET_REPLY chunk for `ids`, sealed with the connection's keys (two records: the table,
    then the values). The edits change the plain table, the plain values or the clear header
    before sealing (a lying but authenticated server)."""
    entries = np.zeros(len(ids), dtype=wire.ENTRY)
    vals = []
    for k, i in enumerate(ids):
        entries[k]["id"] = i
        if i in VALUES:
            entries[k]["length"] = len(VALUES[i])
            entries[k]["crc"] = crc32c(VALUES[i])
            vals.append(VALUES[i])
        else:
            entries[k]["length"] = wire.MISS
    table = bytearray(entries.tobytes())
    values = bytearray(b"".join(vals))
    if table_edit:
        table_edit(table)
    if values_edit:
        values_edit(values)
    head = bytearray(wire.pack_header(wire.GET_REPLY, len(ids), len(table) + len(values), opaque, status))
    if head_edit:
        head_edit(head)
    return bytes(head) + session.seal(bytes(head), bytes(table)) + session.seal(b"", bytes(values))


def _serve(behaviour, requests=(wire.GET,)):
    """A one-connection server speaking the real handshake; `behaviour(conn, session, ids, opaque)`
    answers the first request (a GET, or another of `requests`: ids then empty)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run():
        conn, _ = srv.accept()
        with conn:
            session = auth.server_handshake(conn, KEY, IDENTITY, time.monotonic() + 5)
            code, detail = session.recv_message(conn.fileno(), list(requests), 5, 5)
            assert code == 0, detail
            ids = np.frombuffer(detail[4], dtype="<u8").tolist()
            behaviour(conn, session, ids, detail[3])
            time.sleep(0.5)

    threading.Thread(target=run, daemon=True).start()
    return "127.0.0.1:%d" % srv.getsockname()[1], srv


def _flip(b):
    b[-1] ^= 1


def _first_id(b):
    b[0] ^= 1


def _length(b):
    b[8] += 1


def _crc(b):
    b[12] ^= 1


def _send(reply):
    return lambda c, s, ids, op: c.sendall(reply(s, ids, op))


def _replayed(s, ids, op):
    first = _sealed_reply(s, ids[:2], op, status=wire.MORE)
    return first + first   # the same sealed chunk twice: its sequence number is spent


def _reordered(s, ids, op):
    a = _sealed_reply(s, ids[:2], op, status=wire.MORE)
    b = _sealed_reply(s, ids[2:], op)
    return b + a


def _tampered(s, ids, op):
    r = bytearray(_sealed_reply(s, ids, op))
    r[-wire.TAG_BYTES - 3] ^= 0x40   # a byte of the sealed values, as a middleman would flip it
    return bytes(r)


def _error(s, ids, op):
    body = b"nope"
    head = wire.pack_header(wire.ERROR, 0, len(body), op, wire.E_BAD_ID)
    return head + s.seal(head, body)


def _clear_error(s, ids, op):
    # a middleman's forgery: the text in clear with a made-up tag
    return wire.error_message(wire.E_BAD_ID, "nope", op) + os.urandom(wire.TAG_BYTES)


CASES = {
    "good": (_send(lambda s, ids, op: _sealed_reply(s, ids, op)), None),
    "two chunks": (_send(lambda s, ids, op: _sealed_reply(s, ids[:2], op, wire.MORE) + _sealed_reply(s, ids[2:], op)),
                   None),
    "value fails its crc32c": (_send(lambda s, ids, op: _sealed_reply(s, ids, op, values_edit=_flip)), "refused"),
    "crc32c wrong in the table": (_send(lambda s, ids, op: _sealed_reply(s, ids, op, table_edit=_crc)), "refused1"),
    "wrong id": (_send(lambda s, ids, op: _sealed_reply(s, ids, op, table_edit=_first_id)), ProtocolError),
    "lengths do not add up": (_send(lambda s, ids, op: _sealed_reply(s, ids, op, table_edit=_length)), ProtocolError),
    "bad magic": (_send(lambda s, ids, op: _sealed_reply(s, ids, op, head_edit=lambda h: h.__setitem__(0, 88))),
                  ProtocolError),
    "wrong opaque": (_send(lambda s, ids, op: _sealed_reply(s, ids, op + 1)), ProtocolError),
    "error reply": (_send(_error), RemoteError),
    "error reply in clear text": (_send(_clear_error), ForgedFrameError),
    "tampered value": (_send(_tampered), ForgedFrameError),
    "replayed chunk": (_send(_replayed), ForgedFrameError),
    "reordered chunks": (_send(_reordered), ForgedFrameError),
    "truncated": (lambda c, s, ids, op: (c.sendall(_sealed_reply(s, ids, op)[:-5]), c.shutdown(socket.SHUT_WR)),
                  ConnectionError),
    "stalled": (lambda c, s, ids, op: (c.sendall(_sealed_reply(s, ids, op)[:100]), time.sleep(2)), socket.timeout),
    "fewer entries": (_send(lambda s, ids, op: _sealed_reply(s, ids[:2], op)), ProtocolError),
}


@pytest.mark.parametrize("case", list(CASES))
def test_client_checks_every_reply(case):
    behaviour, error = CASES[case]
    address, srv = _serve(behaviour)
    ids = [3, 5, 7, 9]
    client = PeerClient(address, SECRET, DATASET)
    try:
        if error is None:
            assert client.get_many(ids, timeout=2) == [VALUES[3], None, VALUES[7], VALUES[9]]
        elif error in ("refused", "refused1"):
            # a value failing its crc32c is refused alone; the stream stays in step
            with pytest.warns(RuntimeWarning, match="failed their crc32c"):
                got = client.get_many(ids, timeout=2)
            assert got == ([VALUES[3], None, VALUES[7], None] if error == "refused" else [None, None, VALUES[7], VALUES[9]])
            assert client.refused == 1 and client.sock is not None
        else:
            t0 = time.monotonic()
            with pytest.raises(error):
                client.get_many(ids, timeout=0.5)
            assert time.monotonic() - t0 < 1.5
            assert client.sock is None   # the stream is dropped with the bad reply
    finally:
        client.close()
        srv.close()


def test_a_reply_that_arrives_in_parts_is_received_whole_and_the_socket_left_as_it_was():
    """The client sleeps until a reply message's values have all arrived (the socket's low-water
    mark set to the bytes still missing, so the kernel wakes it once): a reply sent in three parts
    with pauses is received whole within the deadline, and the mark is back at 1 afterwards (the
    connection's other reads wake on the first byte, as before)."""
    def in_parts(c, s, ids, op):
        reply = _sealed_reply(s, ids, op)
        cut = [0, len(reply) // 3, 2 * len(reply) // 3, len(reply)]
        for a, b in zip(cut, cut[1:]):
            c.sendall(reply[a:b])
            time.sleep(0.15)

    address, srv = _serve(in_parts)
    client = PeerClient(address, SECRET, DATASET)
    marks, done = [], threading.Event()

    def watch():   # the mark while the client waits between the parts
        while not done.is_set():
            sock = client.sock
            if sock is not None:
                try:
                    marks.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
                except OSError:
                    pass
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        t0 = time.monotonic()
        assert client.get_many([3, 5, 7, 9], timeout=3) == [VALUES[3], None, VALUES[7], VALUES[9]]
        assert time.monotonic() - t0 < 2
        assert client.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        done.set()
        watcher.join()
        client.close()
        srv.close()
    # while it waited, the mark was the bytes still missing (at most the values and their tag)
    assert 1 < max(marks) <= len(VALUES[3]) + len(VALUES[9]) + 16, max(marks)


def _hostile_endpoint(send):
    """A listener that answers every connection with `send(conn)` and then holds it open."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def run():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: (send(c), time.sleep(30)), daemon=True).start()

    threading.Thread(target=run, daemon=True).start()
    return "127.0.0.1:%d" % srv.getsockname()[1], srv


def test_a_header_before_authentication_makes_the_client_allocate_nothing():
    """A hostile endpoint answers the connection with headers claiming 512 MiB bodies: the client
    (its own process, peak RSS measured) refuses each without allocating what they claim."""
    headers = [wire.pack_header(op, 0, 512 << 20) + b"x" * 64 for op in (wire.HELLO, wire.ERROR, wire.GET_REPLY)]
    endpoints = [_hostile_endpoint(lambda c, h=h: c.sendall(h)) for h in headers]
    code = f"""
import resource, sys
from shadecache.peer import PeerClient
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for address in {[a for a, _ in endpoints]!r}:
    try:
        PeerClient(address, {SECRET!r}, (None, 16)).get_many([1], timeout=2)
    except Exception as e:
        print(type(e).__name__)
print("grew", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    for _, s in endpoints:
        s.close()
    lines = out.stdout.split()
    assert lines[:3] == ["AuthenticationError"] * 3, out.stdout + out.stderr
    assert int(lines[-1]) < 32, f"client peak RSS grew {lines[-1]} MiB"


def _dribbled(answer, body, pause, gap):
    """A behaviour for _serve: a correctly sealed `answer` message, sent after `pause` seconds and
    then one byte every `gap` seconds (a slow or hostile peer, or a middleman delaying bytes)."""
    def behaviour(conn, session, ids, opaque):
        head = wire.pack_header(answer, 0, len(body), opaque)
        message = head + session.seal(head, body)
        time.sleep(pause)
        try:
            for b in message:
                conn.send(bytes([b]))
                time.sleep(gap)
        except OSError:
            pass
    return behaviour


@pytest.mark.parametrize("ask", ["ping", "server_stats"])
def test_ping_and_stats_end_by_the_callers_deadline_against_a_dribbling_peer(ask):
    """The reply starts just inside the caller's 1-second timeout and then dribbles: the call
    raises socket.timeout by its deadline, not after a second more for the header and another
    for the body."""
    answer = (wire.PONG, b"") if ask == "ping" else (wire.STATS_REPLY, b"{}")
    address, srv = _serve(_dribbled(*answer, pause=0.7, gap=0.04), requests=(wire.PING, wire.STATS))
    client = PeerClient(address, SECRET, DATASET)
    try:
        client.connect(time.monotonic() + 5)   # the handshake is not what is timed here
        t0 = time.monotonic()
        with pytest.raises(socket.timeout):
            getattr(client, ask)(timeout=1.0)
        assert time.monotonic() - t0 < 1.3, f"{ask}(timeout=1.0) took {time.monotonic() - t0:.2f} s"
        assert client.sock is None
    finally:
        client.close()
        srv.close()
