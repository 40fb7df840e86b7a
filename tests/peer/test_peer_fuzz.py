"""A wire-protocol fuzzer against a live peer server: malformed, oversized, truncated,
out-of-order, forged and random messages, each on its own connection. Most come after a real
handshake and are sealed with the connection's keys (an authenticated client that breaks the
protocol); some carry a bad tag or no seal at all (a middleman, or a client that skips the
encryption); a share attack the handshake itself. The server must answer each with correct sealed
replies to whatever was well formed, an ERROR, or a closed connection; send nothing but its HELLO
and at most a clear ERROR to a connection that has not proven itself; and keep serving a
well-behaved client throughout.

Short seeded run in the suite; the long run (>= 100k messages):
    PYTHONPATH=. python tests/peer/test_peer_fuzz.py --messages 100000 --seed 1
A failing case is saved to tests/fuzz_failures/peer-<seed>-<case>.bin and replays with
    PYTHONPATH=. python tests/peer/test_peer_fuzz.py --replay FILE
(The in-process fuzz surface tests/fuzz/fuzz_peer.py covers the handshake and the native frame
readers of both ends with a million inputs.)
"""
import argparse
import os
import pickle
import random
import socket
import struct
import sys
import time

import numpy as np

import shadecache as sc
from shadecache.peer import PeerClient, new_secret, wire
from shadecache.peer.auth import client_handshake
from shadecache.peer.identity import identity_of

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fuzz"))
from fuzz_peer import check_replies  # noqa: E402  (the one reader of sealed replies the fuzzers share)

N = 200
SECRET = new_secret().encode()


def _get(rng, opaque):
    ids = [rng.randrange(N) for _ in range(rng.randrange(1, 80))]
    return wire.pack_header(wire.GET, len(ids), 8 * len(ids), opaque), struct.pack(f"<{len(ids)}Q", *ids)


def malformed(rng: random.Random) -> tuple:
    """(attack_handshake, payload): raw bytes sent instead of the handshake, or a list of
    (header, body, how) sent after it, how = "seal" (a valid tag), "badtag" or "raw" (no seal)."""
    kind = rng.randrange(13)
    head, body = _get(rng, rng.getrandbits(64))
    if kind == 0:    # bit flips in a header that is then sealed as it is (the tag covers it)
        h = bytearray(head)
        for _ in range(rng.randrange(1, 4)):
            h[rng.randrange(len(h))] ^= 1 << rng.randrange(8)
        return False, [(bytes(h), body, "seal")]
    if kind == 1:    # truncated: part of a sealed message, then EOF
        return False, [(head, body, "truncate")]
    if kind == 2:    # oversized count / body length
        count = rng.choice([wire.MAX_BATCH + 1, 2 ** 32 - 1, rng.getrandbits(32)])
        return False, [(wire.pack_header(wire.GET, count, rng.choice([8 * count & 0xFFFFFFFF, 2 ** 32 - 1]), 1),
                        b"", "raw")]
    if kind == 3:    # body length that disagrees with the count
        return False, [(wire.pack_header(wire.GET, 3, 16, 1), bytes(16), "seal")]
    if kind == 4:    # opcodes this state does not allow (replies, handshake ones, unknown)
        op = rng.choice([0, wire.HELLO, wire.PROOF, wire.GET_REPLY, wire.PONG, wire.ERROR, wire.STATS_REPLY, 10, 255])
        b = os.urandom(rng.randrange(0, 40))
        return False, [(wire.pack_header(op, rng.randrange(3), len(b), 1), b, "seal")]
    if kind == 5:    # ids out of range
        ids = [rng.choice([N, 2 ** 63, 2 ** 64 - 1, rng.getrandbits(64)]) for _ in range(rng.randrange(1, 5))]
        return False, [(wire.pack_header(wire.GET, len(ids), 8 * len(ids), 1), struct.pack(f"<{len(ids)}Q", *ids),
                        "seal")]
    if kind == 6:    # pure garbage after the handshake
        return False, [(os.urandom(24), os.urandom(rng.randrange(0, 200)), "raw")]
    if kind == 7:    # wrong magic / version, sealed
        h = bytearray(head)
        if rng.random() < 0.5:
            h[0:4] = os.urandom(4)
        else:
            h[4] = rng.choice([0, 1, 3, 255])
        return False, [(bytes(h), body, "seal")]
    if kind == 8:    # valid messages pipelined, then a forged one
        msgs = [_get(rng, k) + ("seal",) for k in range(rng.randrange(1, 4))]
        msgs.append(_get(rng, 9) + (rng.choice(["badtag", "raw"]),))
        return False, msgs
    if kind == 9:    # PING and STATS, then a message whose body is replayed from the first
        return False, [(wire.pack_header(wire.PING), b"", "seal"), (wire.pack_header(wire.STATS), b"", "seal"),
                       (head, body, "replay")]
    if kind == 10:   # handshake attacks: garbage, forged proofs, messages of the wrong size
        hello = wire.pack_header(wire.HELLO, 0, wire.HELLO_BYTES, N) + os.urandom(wire.NONCE_BYTES) + bytes(32)
        forged = wire.pack_header(wire.PROOF, 0, 32) + os.urandom(32)
        return True, rng.choice([hello + forged, os.urandom(rng.randrange(1, 120)), head + body,
                                 (hello + forged)[:rng.randrange(120)],
                                 wire.pack_header(wire.HELLO, 0, 512 << 20, N) + os.urandom(64),
                                 wire.pack_header(wire.GET_REPLY, 1, 512 << 20, N) + os.urandom(64)])
    if kind == 11:   # another data set's HELLO
        return True, (wire.pack_header(wire.HELLO, 0, wire.HELLO_BYTES, N + 1) + os.urandom(64)
                      + wire.pack_header(wire.PROOF, 0, 32) + os.urandom(32))
    return False, [(head, body, "badtag")]   # a middleman's bit flip in a sealed body


def _wire(session, msgs) -> bytes:
    out = []
    for head, body, how in msgs:
        if how == "raw":
            out.append(head + body)
            continue
        sealed = session.seal(head, body)
        if how == "badtag":
            sealed = sealed[:-1] + bytes([sealed[-1] ^ 1])
        elif how == "truncate":
            sealed = sealed[:len(sealed) // 2]
        elif how == "replay":
            sealed = out[0][wire.HEADER_BYTES:] if out else sealed
        out.append(head + sealed)
    return b"".join(out)


def run_case(address: str, attack_handshake: bool, payload, truth: dict, identity) -> str:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        session = None
        if not attack_handshake:
            session = client_handshake(s, SECRET, identity, time.monotonic() + 5)
            payload = _wire(session, payload)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except OSError:   # the server already closed on an earlier part of the payload
            pass
        chunks = []
        reset = False
        while True:
            try:
                c = s.recv(1 << 16)
            except ConnectionResetError:   # a closed connection (RST): what arrived is checked
                reset = True
                break
            if not c:
                break
            chunks.append(c)
    data = b"".join(chunks)
    if attack_handshake:
        # the challenge (HELLO), then at most an ERROR in clear text: never a sample
        head = wire.HEADER_BYTES + wire.HELLO_BYTES
        if not data.startswith(wire.MAGIC) or data[5] != wire.HELLO:
            return "no challenge first"
        rest = data[head:]
        if rest and (len(rest) < wire.HEADER_BYTES or rest[5] != wire.ERROR
                     or len(rest) > wire.HEADER_BYTES + wire.MAX_ERROR):
            return f"server sent opcode {rest[5] if len(rest) > 5 else '?'} to an unauthenticated client"
        return ""
    return check_replies(data, truth, session, reset)


def fuzz(messages: int, seed: int, progress: bool = False) -> dict:
    """Runs `messages` malformed cases against a fresh server; returns counts. Raises
    AssertionError (after saving the case) on a crash or a wrong reply."""
    from tqdm import tqdm

    rng = random.Random(seed)
    store_rng = np.random.default_rng(seed)
    values = [store_rng.integers(0, 256, int(store_rng.integers(0, 2000)), dtype=np.uint8).tobytes() for _ in range(N)]
    name = f"fuzz-{os.getpid()}-{seed}"
    cache = sc.Cache.create(name, N, 4 << 20, policy="lru", max_item_bytes=4096)
    cached = list(range(0, N, 2))
    cache.put_many(np.asarray(cached), [values[i] for i in cached])
    truth = {i: values[i] for i in cached if cache.contains(i)}
    server = sc.Node(None, cache, read_ahead=False).serve(secret=SECRET)
    identity = identity_of(cache)
    good = PeerClient(server.address, SECRET, cache)
    counts = {"messages": 0, "checks": 0}
    try:
        for case in tqdm(range(messages), disable=not progress, unit="msg", desc="peer fuzz"):
            attack, payload = malformed(rng)
            problem = run_case(server.address, attack, payload, truth, identity)
            if not problem and case % 100 == 0:
                if server.alive:
                    ids = list(range(0, N, 3))
                    if good.get_many(ids, timeout=5) != [truth.get(i) for i in ids]:
                        problem = "a good client got wrong bytes"
                    counts["checks"] += 1
                else:
                    problem = "server died"
            if problem:
                os.makedirs(os.path.join(os.path.dirname(__file__), "fuzz_failures"), exist_ok=True)
                path = os.path.join(os.path.dirname(__file__), "fuzz_failures", f"peer-{seed}-{case}.bin")
                with open(path, "wb") as f:
                    pickle.dump((attack, payload), f)
                raise AssertionError(f"case {case}: {problem} (saved to {path})")
            counts["messages"] += 1
        assert server.alive, "server died"
    finally:
        good.close()
        server.close()
        cache.close()
        cache.unlink()
    return counts


def test_peer_fuzz_short():
    counts = fuzz(messages=int(os.environ.get("SHADECACHE_PEER_FUZZ", "1500")), seed=7)
    assert counts["messages"] >= 1500 and counts["checks"] >= 15


def main(argv=None):
    ap = argparse.ArgumentParser(description="fuzz the peer wire protocol against a live server")
    ap.add_argument("--messages", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replay", help="a saved failing case")
    args = ap.parse_args(argv)
    if args.replay:
        with open(args.replay, "rb") as f:
            rng_payload = pickle.load(f)   # a case this script saved
        global malformed
        malformed = lambda rng: rng_payload  # noqa: E731  (the one case, replayed)
        args.messages = 1
    t0 = time.time()
    counts = fuzz(args.messages, args.seed, progress=True)
    print(f"{counts['messages']} malformed messages, {counts['checks']} good-client checks, "
          f"no crash, no wrong reply ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
