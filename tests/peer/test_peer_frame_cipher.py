"""The peer frames' cipher (csrc/net/aead.h): standard AES-256-GCM whichever implementation the
process chose (intel-ipsec-mb when built with it, OpenSSL's libcrypto otherwise or with
SHADECACHE_AEAD=openssl). Checked against an independent implementation (the `cryptography`
package's AESGCM) and against each other, byte for byte, over the lengths that take the partial
block paths; a record altered in any byte does not open."""
import os
import subprocess
import sys

import numpy as np
import pytest

from shadecache import _core, _io

AESGCM = pytest.importorskip("cryptography.hazmat.primitives.ciphers.aead").AESGCM

SEND, RECV = bytes(range(32)), bytes(range(100, 132))
AAD = b"SHCP-header-of-24-bytes!"
LENGTHS = [0, 1, 15, 16, 17, 63, 3000, 4095, 100_000, (1 << 20) + 3]


def body(n: int) -> bytes:
    return (bytes(range(7, 256)) * (n // 249 + 1))[:n]


def nonce(seq: int) -> bytes:
    return bytes(4) + seq.to_bytes(8, "big")   # the record's sequence number of its direction


def test_the_process_names_its_implementation():
    name = _core.peer_aead()
    assert name == "openssl" or name.startswith("intel-ipsec-mb")


def test_sealed_records_are_standard_aes_256_gcm():
    s = _core.PeerSession(SEND, RECV)
    ref = AESGCM(SEND)
    for seq, n in enumerate(LENGTHS):
        sealed = s.seal(AAD if seq % 2 else b"", body(n))
        assert sealed == ref.encrypt(nonce(seq), body(n), AAD if seq % 2 else None), n


def test_standard_records_open_and_altered_ones_do_not():
    s = _core.PeerSession(SEND, RECV)
    ref = AESGCM(RECV)
    seq = 0
    for n in LENGTHS:
        good = ref.encrypt(nonce(seq), body(n), AAD)
        assert s.open(AAD, good) == body(n), n
        seq += 1
        for where in {0, len(good) // 2, len(good) - 1}:   # body and tag bytes
            bad = bytearray(ref.encrypt(nonce(seq), body(n), AAD))
            bad[where] ^= 0x40
            assert s.open(AAD, bytes(bad)) is None, (n, where)
            seq += 1
        wrong_aad = ref.encrypt(nonce(seq), body(n), AAD)
        assert s.open(AAD[:-1] + b"?", wrong_aad) is None
        seq += 1
        replayed = ref.encrypt(nonce(seq - 1), body(n), AAD)   # the sequence number of a record gone by
        assert s.open(AAD, replayed) is None
        seq += 1


def test_both_implementations_seal_the_same_bytes():
    code = ("import sys; from shadecache import _core; s = _core.PeerSession(bytes(range(32)), bytes(32)); "
            "sys.stdout.buffer.write(b''.join(s.seal(b'ab', bytes([k % 251]) * k) for k in (0, 1, 17, 3000, 70001)))")
    out = {}
    for forced in ("", "openssl"):
        env = dict(os.environ, SHADECACHE_AEAD=forced)
        out[forced] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True).stdout
    assert out[""] == out["openssl"] and len(out[""]) == 0 + 1 + 17 + 3000 + 70001 + 5 * 16
    name = subprocess.run([sys.executable, "-c", "from shadecache import _core; print(_core.peer_aead())"],
                          env=dict(os.environ, SHADECACHE_AEAD="openssl"), capture_output=True, text=True,
                          check=True).stdout.strip()
    assert name == "openssl"


def test_the_frame_costs_helper_times_each_part_of_a_sealed_reply():
    """bench/cluster.py's parts: one seal, one open (which must authenticate what was sealed, or
    the helper raises), one crc32c pass and one memcpy over the bytes, each a positive time; bad
    sizes are refused by name."""
    c = _core.peer_frame_costs(768_000, 3000, repeats=2)
    assert set(c) == {"seal", "open", "crc32c", "memcpy"}
    assert all(0 < v < 1 for v in c.values())
    c = _core.peer_frame_costs(100_001, 100_001, repeats=1)   # one value, one odd length
    assert all(v > 0 for v in c.values())
    with pytest.raises(ValueError, match="sizes > 0"):
        _core.peer_frame_costs(0, 3000)


def _frame_stream_checksum(total, value):
    """What peer_frame_stream's client must have received: the XOR of each value's crc32c over
    the helper's source bytes, (k * 131 + k // 512) mod 256 at offset k."""
    k = np.arange(total, dtype=np.uint64)
    src = ((k * 131 + (k >> 9)) & 0xFF).astype(np.uint8).tobytes()
    out = 0
    for off in range(0, total, value):
        out ^= _io.crc32c(src[off:off + value])
    return out


def test_the_frame_stream_helper_moves_sealed_and_clear_frames_over_loopback():
    """bench/cluster.py's bound: the GET's frames alone over a real loopback connection, sealed
    (every record's tag checked, or the helper raises) and in clear, and every value arrives as
    the source had it (opened, when sealed: ciphertext would not match); records of 256 small
    values, a value larger than a reply message, an odd total; bad arguments refused by name."""
    for total, value in ((768_000, 3000), (3000, 10), (1_500_001, 700_000)):
        for sealed in (True, False):
            r = _core.peer_frame_stream(total, value, 0.02, sealed=sealed)
            assert set(r) == {"seconds", "cpu", "transfers", "crc32c"}
            assert r["transfers"] >= 1 and 0 < r["seconds"] < 1 and r["cpu"] > 0
            assert r["crc32c"] == _frame_stream_checksum(total, value), (total, value, sealed)
    with pytest.raises(ValueError, match="0 < value"):
        _core.peer_frame_stream(768_000, 0, 0.01)
    for seconds in (-1.0, float("nan"), 1e30):
        with pytest.raises(ValueError, match="seconds"):
            _core.peer_frame_stream(768_000, 3000, seconds)
