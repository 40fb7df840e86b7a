"""Sentences of docs/peer.md's threat model that no other test shows: what a middleman sees and
cannot replay, and what a holder of the secret can do (the model says so; these tests keep it
honest). Real server processes, real sockets, a recording middleman (recorder.py)."""
import socket
import threading
import time

import numpy as np
import pytest

import shadecache as sc
from peer_helpers import full_cache, pack_store, secret_in_env
from recorder import Recorder
from shadecache import _core
from shadecache._io import crc32c
from shadecache.peer import PeerClient, auth, new_secret, wire
from shadecache.peer.identity import identity_of

SECRET = new_secret()
N = 64


_secret_in_env = secret_in_env(SECRET)


@pytest.fixture
def store(tmp_path):
    s = pack_store(tmp_path / "s.shc", N, (16, 2000), seed=8)
    yield s
    s.close()


@pytest.fixture
def served(cache_factory, store):
    with sc.Node(None, full_cache(cache_factory, store), read_ahead=False).serve() as srv:
        host, port = srv.address.rsplit(":", 1)
        rec = Recorder((host, int(port)))
        yield srv, rec
        rec.close()


def test_a_recorded_client_handshake_replayed_to_the_server_is_refused(served, store):
    """A middleman records a real client's first flight (HELLO and proof) and sends it again on a
    connection of its own: the server's fresh nonce makes the old proof wrong; it answers E_AUTH
    in clear text and closes, and counts the refusal."""
    srv, rec = served
    assert PeerClient(rec.address, dataset=store).get_many([1], timeout=5) == [store.read(1)]
    flight = bytes(rec.sent[0][:auth.CLIENT_FLIGHT])
    host, port = srv.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        hello = wire.recv_exact(s, wire.HEADER_BYTES + wire.HELLO_BYTES, time.monotonic() + 5)
        assert hello[5] == wire.HELLO
        s.sendall(flight)
        answer = wire.recv_exact(s, wire.HEADER_BYTES, time.monotonic() + 5)
    op, status, _, _, _ = wire.unpack_header(answer)
    assert (op, status) == (wire.ERROR, wire.E_AUTH)
    assert PeerClient(srv.address, dataset=store).server_stats(5)["refused_auth"] == 1


def test_a_middleman_sees_every_header_in_clear_text(served, store):
    """Traffic analysis: which ids a GET asks for is sealed, how many it asks for is not (the
    header's count, the body's length), nor the data set named in both HELLOs."""
    srv, rec = served
    ids = [5, 9, 11]
    assert PeerClient(rec.address, dataset=store).get_many(ids, timeout=5) == store.read_many(ids)
    (fields, _, body), = rec.client_records(0)
    assert fields[0] == wire.GET and fields[2] == len(ids) and fields[3] == 8 * len(ids)
    assert np.asarray(ids, dtype="<u8").tobytes() not in body
    fingerprint = identity_of(store)[0]
    assert bytes(rec.received[0][wire.HEADER_BYTES + wire.NONCE_BYTES:][:32]) == fingerprint
    assert bytes(rec.sent[0][wire.HEADER_BYTES + wire.NONCE_BYTES:][:32]) == fingerprint


def test_a_holder_of_the_secret_can_open_a_recorded_connection_of_the_job(served, store):
    """No forward secrecy: the keys follow from the secret and the nonces, which travel in clear
    text. Whoever holds the secret and recorded a connection reads the ids it asked for and the
    samples it got."""
    srv, rec = served
    ids = [2, 3, 4]
    assert PeerClient(rec.address, dataset=store).get_many(ids, timeout=5) == store.read_many(ids)
    up, down = bytes(rec.sent[0]), bytes(rec.received[0])
    ident = identity_of(store)
    nonce_s = down[wire.HEADER_BYTES:wire.HEADER_BYTES + wire.NONCE_BYTES]
    nonce_c = up[wire.HEADER_BYTES:wire.HEADER_BYTES + wire.NONCE_BYTES]
    _, _, c2s, s2c = auth._keys(SECRET.encode(), nonce_s, nonce_c, ident, ident)
    (fields, head, body), = rec.client_records(0)
    as_server = _core.PeerSession(s2c, c2s)
    assert np.frombuffer(as_server.open(head, body), dtype="<u8").tolist() == ids
    reply = down[wire.HEADER_BYTES + wire.HELLO_BYTES + wire.HEADER_BYTES + wire.DIGEST_BYTES:]
    rhead = reply[:wire.HEADER_BYTES]
    count, body_len = wire.unpack_header(rhead)[2:4]
    table_end = wire.HEADER_BYTES + count * wire.ENTRY_BYTES + wire.TAG_BYTES
    as_client = _core.PeerSession(c2s, s2c)
    table = np.frombuffer(as_client.open(rhead, reply[wire.HEADER_BYTES:table_end]), dtype=wire.ENTRY)
    values_len = body_len - count * wire.ENTRY_BYTES
    values = as_client.open(b"", reply[table_end:table_end + values_len + wire.TAG_BYTES])
    assert table["id"].tolist() == ids and values == b"".join(store.read_many(ids))


def test_a_holder_of_the_secret_can_serve_other_bytes_with_their_own_crc32c(store):
    """The crc32c guards against damage, not against a malicious node of the job: a server that
    holds the secret sends other bytes with the crc32c of those bytes, and the client takes them."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    lie = b"not the store's sample"

    def serve():
        conn, _ = srv.accept()
        with conn:
            session = auth.server_handshake(conn, SECRET.encode(), identity_of(store), time.monotonic() + 5)
            code, detail = session.recv_message(conn.fileno(), [wire.GET], 5, 5)
            opaque = detail[3]
            table = np.zeros(1, dtype=wire.ENTRY)
            table[0] = (7, len(lie), crc32c(lie))
            head = wire.pack_header(wire.GET_REPLY, 1, wire.ENTRY_BYTES + len(lie), opaque)
            conn.sendall(head + session.seal(head, table.tobytes()) + session.seal(b"", lie))
            time.sleep(0.5)

    threading.Thread(target=serve, daemon=True).start()
    got = PeerClient("127.0.0.1:%d" % srv.getsockname()[1], dataset=store).get_many([7], timeout=5)
    srv.close()
    assert got == [lie] != [store.read(7)]


def test_every_row_of_the_threat_model_names_tests_that_exist():
    """docs/peer.md's threat model: every row of its tables names at least one test, and every
    test it names is defined in the file it names (a renamed or removed test fails here)."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    doc = open(os.path.join(root, "docs", "peer.md")).read()
    model = doc[doc.index("## Security: the threat model"):doc.index("## Faults")]
    rows = [line for line in model.splitlines() if line.startswith("| ") and not line.startswith("| |")]
    assert len(rows) >= 20
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = [n.strip() for n in cells[-1].split(",")]
        assert names and all("::" in n for n in names), row
        for name in names:
            path, test = name.split("::")
            path = path if path.startswith("tests/") else f"tests/peer/{path}.py"
            test = re.sub(r"\[.*\]$", "", test)
            source = open(os.path.join(root, path)).read()
            assert re.search(rf"^def {re.escape(test)}\(", source, re.M), f"{name}: no such test"
