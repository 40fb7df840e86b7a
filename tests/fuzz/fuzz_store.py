"""Fuzz surface: the packed store file (header, directory, metadata, samples).

Input: one mode byte + the bytes of a store file. Mode bit 0: O_DIRECT; bit 1: the io_uring
backend ("auto"), else the pread pool; bit 2: verify=False; bit 3: the file is extended with a
hole to the size its header claims (up to 8 GiB), as a sparse file that claims gigabytes of
directory it never wrote. Files come from the seed corpus
(corpus/store/*.shc, written by the real PackWriter) with structure-aware mutations: header fields
set to edge values with the header checksum recomputed, directory entries edited with the
directory checksum recomputed, metadata replaced, samples changed with or without fixing their
checksum, truncation, junk appended, random byte flips.

Oracle: an independent reading of docs/store_format.md (ref_parse below). A file opens if and only
if the reference says it is valid (else StoreFormatError); every byte handed out equals the file's
bytes at the directory's offset, and with verify on only when their crc32c matches the directory
(else CorruptSampleError naming the first bad id); labels, lengths, meta and verify() agree.
"""
from __future__ import annotations

import glob
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus", "store")
BUDGET_MB = 256      # inputs are < 1 MiB: nothing may need more
TIMEOUT_S = 20.0
CALLS_PER_INPUT = None

_HDR = struct.Struct("<8sIIIIQQQIIQQQ44sI")
_ENT = struct.Struct("<QIIq")
MAGIC = b"SHDCPACK"
(F_MAGIC, F_VERSION, F_HBYTES, F_ALIGN, F_EBYTES, F_N, F_DIR_OFF, F_DIR_BYTES, F_DIR_CRC,
 F_META_CRC, F_META_OFF, F_META_BYTES, F_FILE_BYTES, F_RESERVED, F_HCRC) = range(15)
U64 = 1 << 64
MAX_FILE = 1 << 20


def align_up(n):
    return (n + 4095) // 4096 * 4096


def crc32c(b) -> int:
    from shadecache import _io
    return _io.crc32c(bytes(b))


# ---- the reference reading of the format --------------------------------------------------------

class Sparse:
    """The file's bytes: `raw`, then zeros up to `size` (a sparse file whose tail is a hole)."""

    def __init__(self, raw: bytes, size: int):
        self.raw, self.size = raw, max(size, len(raw))

    def get(self, off: int, n: int) -> bytes:
        b = self.raw[off:off + n]
        return b + bytes(min(n, max(0, self.size - off)) - len(b))


def ref_parse(f: Sparse):
    """(None, entries, meta) for a valid store, or (reason, None, None)."""
    if f.size < _HDR.size:
        return "short", None, None
    h = _HDR.unpack(f.get(0, _HDR.size))
    if h[F_MAGIC] != MAGIC:
        return "magic", None, None
    if h[F_VERSION] != 1:
        return "version", None, None
    if crc32c(f.get(0, 124)) != h[F_HCRC]:
        return "header crc", None, None
    if (h[F_HBYTES], h[F_ALIGN], h[F_EBYTES]) != (4096, 4096, 24):
        return "geometry", None, None
    n, d_off, d_bytes = h[F_N], h[F_DIR_OFF], h[F_DIR_BYTES]
    m_off, m_bytes, f_bytes = h[F_META_OFF], h[F_META_BYTES], h[F_FILE_BYTES]
    if (d_off % 4096 or d_off < 4096 or n * 24 >= U64 or d_bytes != n * 24
            or d_off + d_bytes >= U64 or m_off != d_off + d_bytes
            or m_off + m_bytes >= U64 or f_bytes != m_off + m_bytes):
        return "inconsistent", None, None
    if f.size < f_bytes:
        return "truncated", None, None
    entries, min_off = [], 4096
    for i in range(n):  # stops at the first bad entry: a hole of zeros fails at once
        off, length, crc, label = _ENT.unpack(f.get(d_off + 24 * i, 24))
        if (off % 4096 or off < min_off or off > d_off or length > d_off - off
                or align_up(off + length) > d_off or (length == 0 and crc != 0)):
            return "entry", None, None
        min_off = off + align_up(length)
        entries.append((off, length, crc, label))
    if crc32c(f.get(d_off, d_bytes)) != h[F_DIR_CRC]:
        return "dir crc", None, None
    if m_bytes and m_off + m_bytes > len(f.raw):  # reaches into the hole: zeros, never read whole
        return "meta nul", None, None
    meta = f.get(m_off, m_bytes)
    if b"\0" in meta:
        return "meta nul", None, None
    if crc32c(meta) != h[F_META_CRC]:
        return "meta crc", None, None
    return None, entries, meta


# ---- inputs ------------------------------------------------------------------------------------

def write_corpus() -> None:
    """The seed corpus, written by the real PackWriter (run `python tests/fuzz corpus`)."""
    import random

    import shadecache as sc

    os.makedirs(CORPUS, exist_ok=True)
    rng = random.Random(13)
    specs = {
        "empty-samples": [0, 0, 1, 0],
        "mixed": [rng.randrange(0, 6000) for _ in range(10)] + [0, 4096, 4095, 4097],
        "one": [100],
    }
    for name, sizes in specs.items():
        meta = {"classes": ["cat", "dog", "émile"]} if name != "one" else {}
        with sc.PackWriter(os.path.join(CORPUS, name + ".shc"), meta=meta) as w:
            for k, n in enumerate(sizes):
                w.add(bytes(rng.randrange(256) for _ in range(n)), rng.randrange(-3, 3))


_seeds: list = []


def seeds() -> list:
    if not _seeds:
        _seeds.extend(open(p, "rb").read() for p in sorted(glob.glob(os.path.join(CORPUS, "*.shc"))))
    return _seeds


INTERESTING = [0, 1, 2, 23, 24, 25, 4095, 4096, 4097, 8192, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
               2**32 + 4096, 2**63 - 1, 2**63, 2**64 - 1, 2**64 - 4096, (3 << 30) // 24,
               (3 << 30), 2**26]
METAS = [b"", b"{}", b"[]", b"null", b"1e999", b'"x"', b"[" * 5000 + b"]" * 5000,
         b'{"a":' * 3000 + b"1" + b"}" * 3000, b"\xff\xfe", b'{"classes": 5}',
         b'{"classes": [1, 2]}', b'{"classes": ["a", null]}', b'{"classes": ["a"]}', b"{\0}",
         b'{"classes": ["' + b"x" * 100000 + b'"]}', b"{" + b" " * 1000 + b"}", b"\xc3\x28",
         b'{"a": NaN}', b'{"a": 1' + b"0" * 5000 + b"}"]


class _File:
    """A store file being mutated, with helpers that keep checksums honest when asked to."""

    def __init__(self, raw: bytes):
        self.b = bytearray(raw)

    def header(self):
        return list(_HDR.unpack_from(self.b)) if len(self.b) >= _HDR.size else None

    def set_header(self, h, fix=True):
        h = [v % U64 if isinstance(v, int) else v for v in h]
        for f in (F_VERSION, F_HBYTES, F_ALIGN, F_EBYTES, F_DIR_CRC, F_META_CRC, F_HCRC):
            h[f] %= 1 << 32
        _HDR.pack_into(self.b, 0, *h)
        if fix:
            struct.pack_into("<I", self.b, 124, crc32c(self.b[:124]))

    def fix_dir_crc(self, h):
        d = self.b[h[F_DIR_OFF]:h[F_DIR_OFF] + h[F_DIR_BYTES]]
        h[F_DIR_CRC] = crc32c(d)
        self.set_header(h)


def _entry_at(h, size, rng):
    """File offset of a random directory entry that lies inside the file, or None."""
    n = min(h[F_N], max(0, (size - h[F_DIR_OFF]) // 24))
    return h[F_DIR_OFF] + 24 * rng.randrange(n) if n > 0 else None


def _mutate(rng, f: _File) -> None:
    h = f.header()
    op = rng.randrange(11)
    size = len(f.b)
    if h is None or op == 0:  # random byte flips anywhere
        for _ in range(rng.randrange(1, 8)):
            if f.b:
                f.b[rng.randrange(len(f.b))] ^= 1 << rng.randrange(8)
        return
    if op == 1:  # a header field to an edge value, checksum recomputed (usually)
        fld = rng.choice([F_VERSION, F_HBYTES, F_ALIGN, F_EBYTES, F_N, F_DIR_OFF, F_DIR_BYTES,
                          F_META_OFF, F_META_BYTES, F_FILE_BYTES])
        h[fld] = rng.choice(INTERESTING + [size, size - 1, size + 1, h[fld] + rng.randrange(-9, 9)])
        f.set_header(h, fix=rng.random() < 0.9)
    elif op == 2:  # num_samples with every derived field kept consistent
        n = rng.choice([0, 1, h[F_N] - 1, h[F_N] + 1, (3 << 30) // 24, 2**26, 2**60])
        h[F_N], h[F_DIR_BYTES] = n, n * 24
        h[F_META_OFF] = h[F_DIR_OFF] + n * 24
        h[F_FILE_BYTES] = h[F_META_OFF] + h[F_META_BYTES]
        f.set_header(h)
    elif op in (3, 4) and _entry_at(h, size, rng) is not None:  # an entry edited
        at = _entry_at(h, size, rng)
        e = list(_ENT.unpack_from(f.b, at))
        k = rng.randrange(4)
        if k == 0:
            e[0] = rng.choice(INTERESTING + [e[0] + 4096, e[0] - 4096, h[F_DIR_OFF]]) % U64
        elif k == 1:
            e[1] = rng.choice(INTERESTING + [e[1] + 1, e[1] - 1]) % (1 << 32)
        elif k == 2:
            e[2] = rng.choice([0, 1, e[2] ^ 1, 0xFFFFFFFF])
        else:
            e[3] = rng.choice([-(2**63), 2**63 - 1, -1, 0])
        if k == 1 and rng.random() < 0.5 and e[0] + e[1] <= size:  # keep the sample honest
            e[2] = crc32c(f.b[e[0]:e[0] + e[1]])
        _ENT.pack_into(f.b, at, *e)
        if op == 3:
            f.fix_dir_crc(h)
    elif op == 5 and 128 <= h[F_META_OFF] <= MAX_FILE:  # metadata replaced, everything fixed
        meta = rng.choice(METAS)
        del f.b[h[F_META_OFF]:]
        f.b += meta
        h[F_META_BYTES], h[F_FILE_BYTES] = len(meta), h[F_META_OFF] + len(meta)
        h[F_META_CRC] = crc32c(meta)
        f.set_header(h)
    elif op == 6:  # truncated
        cut = rng.choice([rng.randrange(size + 1), h[F_DIR_OFF], h[F_META_OFF], 4096, 128, 127])
        del f.b[min(cut, size):]
    elif op == 7:  # junk or zeros appended
        f.b += rng.choice([b"\0", b"x"]) * rng.choice([1, 4096, 10000])
    elif op in (8, 9) and _entry_at(h, size, rng) is not None:  # sample bytes changed
        at = _entry_at(h, size, rng)
        e = list(_ENT.unpack_from(f.b, at))
        if e[1] and e[0] + e[1] <= size:
            f.b[e[0] + rng.randrange(e[1])] ^= 1 << rng.randrange(8)
            if op == 9:  # ... and its checksum fixed: an honest file with other bytes
                e[2] = crc32c(f.b[e[0]:e[0] + e[1]])
                _ENT.pack_into(f.b, at, *e)
                f.fix_dir_crc(h)
    elif op == 10 and _entry_at(h, size, rng) is not None:  # entries swapped
        a, b = _entry_at(h, size, rng), _entry_at(h, size, rng)
        f.b[a:a + 24], f.b[b:b + 24] = f.b[b:b + 24], f.b[a:a + 24]
        f.fix_dir_crc(h)


def generate(rng) -> bytes:
    f = _File(rng.choice(seeds()))
    for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3, 5])):
        _mutate(rng, f)
    mode = rng.randrange(8) | (8 if rng.random() < 0.125 else 0)
    return bytes([mode]) + bytes(f.b[:MAX_FILE])


# ---- running one input -------------------------------------------------------------------------

def setup(workdir):
    import shadecache as sc

    # One store stays open for the child's life (as in a training process), so the pread pool
    # is warm; each input then opens, reads and closes stores of its own.
    anchor = sc.PackedStore(sorted(glob.glob(os.path.join(CORPUS, "*.shc")))[0], backend="pread")
    anchor.read_many(list(range(len(anchor))))
    sc.PackedStore(anchor.path, backend="auto", direct=True).close()  # io_uring's first ring
    path = os.path.join(workdir, "in.shc")
    # Rewritten in place (pwrite + ftruncate): open(..., "wb") on ext4 flushes the old data of a
    # truncated file (auto_da_alloc) and cost 3 ms per input here.
    return {"path": path, "fd": os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "anchor": anchor}


def run(state, data: bytes) -> None:
    import numpy as np

    import shadecache as sc
    from fuzz_harness import Finding, allowed

    mode, raw = data[0] if data else 0, data[1:]
    direct, backend, verify = bool(mode & 1), ("auto" if mode & 2 else "pread"), not mode & 4
    size = len(raw)
    if mode & 8 and len(raw) >= _HDR.size:
        size = max(size, min(_HDR.unpack_from(raw)[F_FILE_BYTES], 8 << 30))
    path = state["path"]
    os.pwrite(state["fd"], raw, 0)
    os.ftruncate(state["fd"], len(raw))  # the previous input's tail goes first ...
    if size > len(raw):
        os.ftruncate(state["fd"], size)  # ... so that the extension is a hole of zeros
    f = Sparse(raw, size)
    reason, entries, meta = ref_parse(f)
    try:
        s = sc.PackedStore(path, backend=backend, direct=direct, queue_depth=8, verify=verify)
    except Exception as e:
        allowed(e, (sc.StoreFormatError,), "PackedStore()")
        if reason is None:
            raise Finding("disagree", f"a valid store was refused: {e}")
        return
    with s:
        if reason is not None:
            raise Finding("disagree", f"opened a store the format forbids ({reason})")
        n = len(entries)
        if len(s) != n or s.labels.tolist() != [e[3] for e in entries] or \
                s.lengths.tolist() != [e[1] for e in entries]:
            raise Finding("wrong-bytes", "len/labels/lengths differ from the directory")
        want = [f.get(e[0], e[1]) for e in entries]
        bad = [i for i, e in enumerate(entries) if crc32c(want[i]) != e[2]]
        ids = list(range(min(n, 64)))
        if n:
            ids += [n - 1, 0]
        _check_read(s, ids, want, bad if verify else [], lambda: s.read_many(ids), "read_many")
        if n:
            i = ids[len(ids) // 2]
            _check_read(s, [i], want, bad if verify else [], lambda: [s.read(i)], "read")
            _check_read(s, [i], want, bad if verify else [], lambda: s.read_many(np.array([i], np.uint16)),
                        "read_many(uint16)")
        for bad_id in (n, -1, 2**63, 2**64):
            try:
                s.read(bad_id)
                raise Finding("unchecked", f"read({bad_id}) of a {n}-sample store returned")
            except Exception as e:
                allowed(e, (IndexError,), f"read({bad_id})")
        try:  # what meta must give: the object, or StoreFormatError for anything else
            want_meta = json.loads(meta) if meta else {}
        except (ValueError, RecursionError):
            want_meta = None
        if not isinstance(want_meta, dict):
            want_meta = None
        try:
            got_meta = s.meta
        except Exception as e:
            allowed(e, (sc.StoreFormatError,), "meta")
            if want_meta is not None:
                raise Finding("disagree", f"meta refused a JSON object: {e}")
        else:
            if want_meta is None:
                raise Finding("unchecked", "meta returned for metadata that is not a JSON object")
            if repr(want_meta) != repr(got_meta):
                raise Finding("wrong-bytes", "meta differs from the file's")
        try:
            s.classes
        except Exception as e:
            allowed(e, (sc.StoreFormatError,), "classes")
        if n <= 64:
            got_bad = s.verify()
            if got_bad != bad:
                raise Finding("wrong-bytes", f"verify() said {got_bad}, the file has {bad}")


def _check_read(s, ids, want, bad, call, what):
    import shadecache as sc
    from fuzz_harness import Finding, allowed

    first_bad = next((i for i in ids if i in bad), None)
    try:
        got = call()
    except Exception as e:
        allowed(e, (sc.CorruptSampleError,), what)
        if first_bad is None:
            raise Finding("disagree", f"{what}: {e} but every checksum matches")
        if e.sample_id != first_bad or e.offset != s.offset(first_bad):
            raise Finding("wrong-bytes", f"{what}: names sample {e.sample_id}, first bad is {first_bad}")
        return
    if first_bad is not None:
        raise Finding("wrong-bytes", f"{what}: sample {first_bad} returned without a matching checksum")
    for i, g in zip(ids, got):
        if g != want[i]:
            raise Finding("wrong-bytes", f"{what}: sample {i} differs from the file's bytes")
