"""The packed store's on-disk layout as tests need it (docs/store_format.md, version 2): the
header's fields, forging a consistent header (checksum recomputed, as an attacker would) and a
writer of the old version-1 format that `shadecache pack` converts."""
import json
import struct

import numpy as np

from shadecache import _io

HEADER = struct.Struct("<8sIIIIQQQQQIIQQQIIQ12sI")
FIELDS = ("magic", "version", "header_bytes", "len_width", "label_width", "n", "data_off",
          "data_bytes", "dir_off", "dir_bytes", "dir_crc", "meta_crc", "meta_off", "meta_bytes",
          "file_bytes", "placement", "reserved0", "seed", "reserved", "header_crc")
F = {name: i for i, name in enumerate(FIELDS)}
OFF_HCRC = 124
TRAILER = 16


def header(raw) -> dict:
    return dict(zip(FIELDS, HEADER.unpack_from(raw)))


def forge(raw, **fields) -> bytes:
    """`raw` with header fields replaced (by name above) and the header checksum redone."""
    h = list(HEADER.unpack_from(raw))
    for name, value in fields.items():
        h[F[name]] = value % (1 << 64) if isinstance(value, int) else value
    for name in ("version", "header_bytes", "len_width", "label_width", "dir_crc", "meta_crc",
                 "placement", "reserved0", "header_crc"):
        h[F[name]] %= 1 << 32
    out = bytearray(raw)
    HEADER.pack_into(out, 0, *h)
    struct.pack_into("<I", out, OFF_HCRC, _io.crc32c(bytes(out[:OFF_HCRC])))
    return bytes(out)


def crc32c_of_zeros(n: int) -> int:
    """crc32c of `n` zero bytes (the hole of a sparse file), in 64 MiB pieces (the seed chains)."""
    zero = bytes(64 << 20)
    crc = 0
    while n:
        k = min(n, len(zero))
        crc = _io.crc32c(memoryview(zero)[:k], crc)
        n -= k
    return crc


def columns(raw) -> tuple:
    """(lengths, crcs, labels) as numpy arrays, read from the directory of `raw`."""
    h = header(raw)
    n, at = h["n"], h["dir_off"]
    ltype = {1: "<u1", 2: "<u2", 4: "<u4"}[h["len_width"]]
    btype = {1: "<i1", 2: "<i2", 4: "<i4", 8: "<i8"}[h["label_width"]]
    lengths = np.frombuffer(raw, ltype, n, at)
    at += n * h["len_width"]
    crcs = np.frombuffer(raw, "<u4", n, at)
    at += 4 * n
    labels = np.frombuffer(raw, btype, n, at)
    return lengths, crcs, labels


def write_version_one(path, samples, labels, meta=None) -> None:
    """A store of format version 1 (every sample at a multiple of 4096, 24-byte entries), as the
    shadecache of before the dense format wrote it."""
    out = bytearray(4096)
    entries = []
    for data, label in zip(samples, labels):
        entries.append(struct.pack("<QIIq", len(out), len(data), _io.crc32c(data), label))
        out += data
        out += bytes(-len(out) % 4096)
    directory = b"".join(entries)
    meta_bytes = json.dumps(meta or {}).encode()
    dir_off = len(out)
    out += directory + meta_bytes
    h = struct.pack("<8sIIIIQQQIIQQQ44s", b"SHDCPACK", 1, 4096, 4096, 24, len(samples), dir_off,
                    len(directory), _io.crc32c(directory), _io.crc32c(meta_bytes),
                    dir_off + len(directory), len(meta_bytes), len(out), bytes(44))
    h += struct.pack("<I", _io.crc32c(h))
    out[:128] = h
    with open(path, "wb") as f:
        f.write(out)
