"""The native reply reader (bindings/peer_io.cc) against a hand-written server on 127.0.0.1 that
sends good, corrupt, mismatched, truncated and stalled GET replies: the client returns exact bytes
for the good ones, refuses (None) a value that fails its crc32c, and raises for every other
(ProtocolError, RemoteError, ConnectionError, socket.timeout), never returning a wrong byte."""
import socket
import threading
import time

import numpy as np
import pytest

from shadecache._io import crc32c
from shadecache.peer import PeerClient, ProtocolError, RemoteError, auth, wire

VALUES = {3: b"abc" * 1000, 7: b"", 9: bytes(range(256)) * 40}


def _reply(ids, opaque, mutate=None, status=0):
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
    body = bytearray(entries.tobytes() + b"".join(vals))
    head = bytearray(wire.pack_header(wire.GET_REPLY, len(ids), len(body), opaque, status))
    if mutate:
        head, body = mutate(head, body)
    return bytes(head) + bytes(body)


def _serve(behaviour):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run():
        conn, _ = srv.accept()
        with conn:
            auth.server_handshake(conn, b"")
            _, _, count, opaque, body = wire.recv_message(conn)
            ids = np.frombuffer(bytes(body), dtype="<u8").tolist()
            behaviour(conn, ids, opaque)
            time.sleep(0.5)

    threading.Thread(target=run, daemon=True).start()
    return "127.0.0.1:%d" % srv.getsockname()[1], srv


def _flip_value(head, body):
    body[-1] ^= 1
    return head, body


def _wrong_id(head, body):
    body[0] ^= 1
    return head, body


def _bad_lengths(head, body):
    body[8] += 1
    return head, body


def _bad_magic(head, body):
    head[0:4] = b"XXXX"
    return head, body


CASES = {
    "good": (lambda c, ids, op: c.sendall(_reply(ids, op)), None),
    "two chunks": (lambda c, ids, op: c.sendall(_reply(ids[:2], op, status=1) + _reply(ids[2:], op)), None),
    "flipped value": (lambda c, ids, op: c.sendall(_reply(ids, op, _flip_value)), "refused"),
    "wrong id": (lambda c, ids, op: c.sendall(_reply(ids, op, _wrong_id)), ProtocolError),
    "lengths do not add up": (lambda c, ids, op: c.sendall(_reply(ids, op, _bad_lengths)), ProtocolError),
    "bad magic": (lambda c, ids, op: c.sendall(_reply(ids, op, _bad_magic)), ProtocolError),
    "wrong opaque": (lambda c, ids, op: c.sendall(_reply(ids, op + 1)), ProtocolError),
    "error reply": (lambda c, ids, op: c.sendall(wire.error_message(wire.E_BAD_ID, "nope", op)), RemoteError),
    "truncated": (lambda c, ids, op: (c.sendall(_reply(ids, op)[:-5]), c.shutdown(socket.SHUT_WR)), ConnectionError),
    "stalled": (lambda c, ids, op: (c.sendall(_reply(ids, op)[:100]), time.sleep(2)), socket.timeout),
    "fewer entries": (lambda c, ids, op: c.sendall(_reply(ids[:2], op)), ProtocolError),
}


@pytest.mark.parametrize("case", list(CASES))
def test_client_checks_every_reply(case):
    behaviour, error = CASES[case]
    address, srv = _serve(behaviour)
    ids = [3, 5, 7, 9]
    client = PeerClient(address)
    try:
        if error is None:
            assert client.get_many(ids, timeout=2) == [VALUES[3], None, VALUES[7], VALUES[9]]
        elif error == "refused":   # a value failing its crc32c is refused alone; the stream stays
            with pytest.warns(RuntimeWarning, match="failed their crc32c"):
                assert client.get_many(ids, timeout=2) == [VALUES[3], None, VALUES[7], None]
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
