"""A wire-protocol fuzzer against a live peer server: malformed, oversized, truncated, out-of-order
and random messages, each on its own authenticated connection (a share of them attack the
handshake itself). The server must answer each with correct replies to whatever was well formed,
an ERROR, or a closed connection, and keep serving a well-behaved client throughout.

Short seeded run in the suite; the long run (>= 100k messages):
    PYTHONPATH=. python tests/peer/test_peer_fuzz.py --messages 100000 --seed 1
A failing case is saved to tests/fuzz_failures/peer-<seed>-<case>.bin and replays with
    PYTHONPATH=. python tests/peer/test_peer_fuzz.py --replay FILE
"""
import argparse
import json
import os
import random
import socket
import struct
import sys
import time

import numpy as np

import shadecache as sc
from shadecache._io import crc32c
from shadecache.peer import PeerClient, wire
from shadecache.peer.auth import client_handshake

N = 200
SECRET = b"fuzz-secret"


def _valid_get(rng, opaque):
    ids = [rng.randrange(N) for _ in range(rng.randrange(0, 80))]
    return wire.pack_header(wire.GET, len(ids), 8 * len(ids), opaque) + struct.pack(f"<{len(ids)}Q", *ids)


def malformed(rng: random.Random) -> tuple:
    """(attack_handshake, bytes) of one malformed message (or sequence ending in one)."""
    kind = rng.randrange(12)
    good = _valid_get(rng, rng.getrandbits(64))
    if kind == 0:    # bit flips anywhere
        b = bytearray(good)
        for _ in range(rng.randrange(1, 6)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return False, bytes(b)
    if kind == 1:    # truncated
        return False, good[:rng.randrange(len(good))]
    if kind == 2:    # oversized count / body length
        count = rng.choice([wire.MAX_BATCH + 1, 2 ** 32 - 1, rng.getrandbits(32)])
        return False, wire.pack_header(wire.GET, count, rng.choice([8 * count & 0xFFFFFFFF, 2 ** 32 - 1]), 1)
    if kind == 3:    # body length that disagrees with the count
        return False, wire.pack_header(wire.GET, 3, 16, 1) + bytes(16)
    if kind == 4:    # unknown or out-of-order opcodes (server-side ones, handshake ones)
        op = rng.choice([0, wire.HELLO, wire.PROOF, wire.GET_REPLY, wire.PONG, wire.ERROR, wire.STATS, wire.STATS_REPLY, 10, 200, 255])
        body = os.urandom(rng.randrange(0, 40))
        return False, wire.pack_header(op, rng.randrange(3), len(body), 1) + body
    if kind == 5:    # ids out of range
        ids = [rng.choice([N, 2 ** 63, 2 ** 64 - 1, rng.getrandbits(64)]) for _ in range(rng.randrange(1, 5))]
        return False, wire.pack_header(wire.GET, len(ids), 8 * len(ids), 1) + struct.pack(f"<{len(ids)}Q", *ids)
    if kind == 6:    # pure garbage
        return False, os.urandom(rng.randrange(1, 200))
    if kind == 7:    # wrong magic / version
        b = bytearray(good)
        if rng.random() < 0.5:
            b[0:4] = os.urandom(4)
        else:
            b[4] = rng.choice([0, 2, 255])
        return False, bytes(b)
    if kind == 8:    # valid messages pipelined, then junk
        return False, b"".join(_valid_get(rng, k) for k in range(rng.randrange(1, 4))) + os.urandom(rng.randrange(1, 30))
    if kind == 9:    # a valid GET with junk appended to its body length
        extra = rng.randrange(1, 64)
        ids = [rng.randrange(N)]
        return False, wire.pack_header(wire.GET, 1, 8 + extra, 1) + struct.pack("<Q", ids[0]) + os.urandom(extra)
    if kind == 10:   # handshake attacks: garbage or a forged proof instead of the answer
        forged = wire.pack_header(wire.PROOF, 0, 32) + os.urandom(32)
        return True, rng.choice([forged, os.urandom(rng.randrange(1, 80)), good, forged[:rng.randrange(56)]])
    return True, wire.pack_header(wire.HELLO, 0, 32) + os.urandom(32)   # our HELLO before answering


def _parse_replies(data: bytes, truth: dict, reset: bool = False) -> str:
    """'' when `data` is a sequence of correct GET_REPLYs / PONGs, optionally ended by an ERROR
    (or, when the connection was reset, by a message cut short: a client never accepts that);
    otherwise what is wrong."""
    off = 0
    while off < len(data):
        if len(data) - off < wire.HEADER_BYTES:
            return "" if reset else f"truncated header at {off}"
        try:
            op, status, count, body_len, _ = wire.unpack_header(data[off:off + wire.HEADER_BYTES])
        except wire.ProtocolError as e:
            return f"bad reply header: {e}"
        body = data[off + wire.HEADER_BYTES: off + wire.HEADER_BYTES + body_len]
        if len(body) != body_len:
            return "" if reset else "truncated reply body"
        off += wire.HEADER_BYTES + body_len
        if op == wire.ERROR:
            return "" if off == len(data) else "bytes after ERROR"
        if op == wire.PONG:
            continue
        if op == wire.STATS_REPLY:
            if not isinstance(json.loads(body), dict):
                return "STATS reply is not an object"
            continue
        if op != wire.GET_REPLY:
            return f"unexpected reply opcode {op}"
        entries = np.frombuffer(body[:count * wire.ENTRY_BYTES], dtype=wire.ENTRY)
        pos = count * wire.ENTRY_BYTES
        for e in entries:
            i, n, crc = int(e["id"]), int(e["length"]), int(e["crc"])
            if n == wire.MISS:
                if i in truth:
                    return f"miss reported for cached id {i}"
                continue
            v = body[pos:pos + n]
            pos += n
            if truth.get(i) != v or crc32c(v) != crc:
                return f"wrong bytes for id {i}"
        if pos != body_len:
            return "reply lengths do not add up"
    return ""


def run_case(address: str, attack_handshake: bool, payload: bytes, truth: dict) -> str:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        if not attack_handshake:
            client_handshake(s, SECRET)
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
        # the challenge (HELLO + nonce), then at most an ERROR: never a sample
        head = wire.HEADER_BYTES + wire.NONCE_BYTES
        if not data.startswith(wire.MAGIC) or data[5] != wire.HELLO:
            return "no challenge first"
        rest = data[head:]
        if rest and (len(rest) < wire.HEADER_BYTES or rest[5] != wire.ERROR):
            return f"server sent opcode {rest[5] if len(rest) > 5 else '?'} to an unauthenticated client"
        return ""
    return _parse_replies(data, truth, reset)


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
    server = sc.serve(cache, secret=SECRET)
    good = PeerClient(server.address, SECRET)
    counts = {"messages": 0, "checks": 0}
    try:
        for case in tqdm(range(messages), disable=not progress, unit="msg", desc="peer fuzz"):
            attack, payload = malformed(rng)
            problem = run_case(server.address, attack, payload, truth)
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
                    f.write(bytes([attack]) + payload)
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
        raw = open(args.replay, "rb").read()
        rng_payload = (bool(raw[0]), raw[1:])
        global malformed
        malformed = lambda rng: rng_payload  # noqa: E731  (the one case, replayed)
        args.messages = 1
    t0 = time.time()
    counts = fuzz(args.messages, args.seed, progress=True)
    print(f"{counts['messages']} malformed messages, {counts['checks']} good-client checks, "
          f"no crash, no wrong reply ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
