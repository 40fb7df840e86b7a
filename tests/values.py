"""Self-describing test values: any reader can verify one without knowing what was put.

Layout: id (8 bytes LE) | version (8) | crc32 of the payload (4) | payload (deterministic from
id and version). A value read back for id i must name i and match its own checksum; a torn or
misplaced value fails one of the two.
"""
import random
import struct
import zlib

_HDR = struct.Struct("<QQI")


def make_value(sample_id: int, version: int, size: int) -> bytes:
    size = max(size, _HDR.size)
    rnd = random.Random(sample_id * 1_000_003 + version)
    payload = rnd.randbytes(size - _HDR.size)
    return _HDR.pack(sample_id, version, zlib.crc32(payload)) + payload


def verify_value(sample_id: int, value: bytes) -> str:
    """'' when `value` is a whole, intact value of `sample_id`, else what is wrong with it."""
    if len(value) < _HDR.size:
        return f"id {sample_id}: value of {len(value)} bytes is shorter than its header"
    got_id, version, crc = _HDR.unpack_from(value)
    if got_id != sample_id:
        return f"id {sample_id}: got the value of id {got_id}"
    if zlib.crc32(value[_HDR.size:]) != crc:
        return f"id {sample_id}: checksum mismatch (version {version}, {len(value)} bytes)"
    return ""
