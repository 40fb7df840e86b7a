"""Fuzz surface: the packed store file (header, directory, metadata, samples).

Input: one mode byte + the bytes of a store file. Mode bit 0: O_DIRECT; bit 1: the io_uring
backend ("auto"), else the pread pool; bit 2: verify=False; bit 3: the file is extended with a
hole to the size its header claims (up to 8 GiB), as a sparse file that claims gigabytes of
directory it never wrote; bit 4: reads coalesced over gaps up to 64 KiB (else touching samples
only), bit 5: extents capped at one block (4 KiB). Files come from the seed corpus
(corpus/store/*.shc, written by the real PackWriter, shuffled and in id order) with
structure-aware mutations: header fields set to edge values with the header checksum recomputed,
directory entries edited (lengths, checksums, labels; lengths moved between samples so that they
still add up) with the directory checksum recomputed, the directory re-encoded with other column
widths, the placement or its seed changed, metadata replaced, samples changed with or without
fixing their checksum, truncation, junk appended, random byte flips.

Oracle: an independent reading of docs/store_format.md (ref_parse below, placement order
included). A file opens if and only if the reference says it is valid (else StoreFormatError);
every byte handed out equals the file's bytes at the offset the placement gives, and with verify
on only when their crc32c matches the directory (else CorruptSampleError naming the first bad
id); labels, lengths, meta and verify() agree.
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

_HDR = struct.Struct("<8sIIIIQQQQQIIQQQIIQ12sI")
MAGIC = b"SHDCPACK"
DIR_MAGIC = b"SHDCDIR\0"
(F_MAGIC, F_VERSION, F_HBYTES, F_LW, F_BW, F_N, F_DATA_OFF, F_DATA_BYTES, F_DIR_OFF, F_DIR_BYTES,
 F_DIR_CRC, F_META_CRC, F_META_OFF, F_META_BYTES, F_FILE_BYTES, F_PLACEMENT, F_RESERVED0, F_SEED,
 F_RESERVED, F_HCRC) = range(20)
U64 = 1 << 64
MAX_FILE = 1 << 20
_U32_FIELDS = (F_VERSION, F_HBYTES, F_LW, F_BW, F_DIR_CRC, F_META_CRC, F_PLACEMENT, F_RESERVED0, F_HCRC)


def crc32c(b) -> int:
    from shadecache import _io
    return _io.crc32c(bytes(b))


def placement_order(n: int, seed: int) -> list:
    """docs/store_format.md: Fisher-Yates over 0..n-1 driven by splitmix64 from the seed."""
    order = list(range(n))
    state = seed
    m = U64 - 1
    for i in range(n - 1, 0, -1):
        state = (state + 0x9E3779B97F4A7C15) & m
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        z ^= z >> 31
        j = (z * (i + 1)) >> 64
        order[i], order[j] = order[j], order[i]
    return order


# ---- the reference reading of the format --------------------------------------------------------

class Sparse:
    """The file's bytes: `raw`, then zeros up to `size` (a sparse file whose tail is a hole)."""

    def __init__(self, raw: bytes, size: int):
        self.raw, self.size = raw, max(size, len(raw))

    def get(self, off: int, n: int) -> bytes:
        b = self.raw[off:off + n]
        return b + bytes(min(n, max(0, self.size - off)) - len(b))


def _column(b: bytes, width: int, signed: bool) -> list:
    return [int.from_bytes(b[k:k + width], "little", signed=signed) for k in range(0, len(b), width)]


def ref_parse(f: Sparse):
    """(None, entries [(offset, length, crc, label)] by id, meta) for a valid store, or
    (reason, None, None)."""
    if f.size < _HDR.size:
        return "short", None, None
    h = _HDR.unpack(f.get(0, _HDR.size))
    if h[F_MAGIC] != MAGIC:
        return "magic", None, None
    if h[F_VERSION] != 2:
        return "version", None, None
    if crc32c(f.get(0, 124)) != h[F_HCRC]:
        return "header crc", None, None
    lw, bw, n = h[F_LW], h[F_BW], h[F_N]
    if (h[F_HBYTES] != 4096 or lw not in (1, 2, 4) or bw not in (1, 2, 4, 8)
            or h[F_PLACEMENT] not in (0, 1) or (h[F_PLACEMENT] == 0 and h[F_SEED] != 0)
            or h[F_RESERVED0] != 0 or h[F_RESERVED] != bytes(12)):
        return "geometry", None, None
    d_off, d_bytes = h[F_DIR_OFF], h[F_DIR_BYTES]
    m_off, m_bytes, f_bytes = h[F_META_OFF], h[F_META_BYTES], h[F_FILE_BYTES]
    if (h[F_DATA_OFF] != 4096 or h[F_DATA_OFF] + h[F_DATA_BYTES] >= U64
            or d_off != h[F_DATA_OFF] + h[F_DATA_BYTES] or n * (lw + 4 + bw) + 16 >= U64
            or d_bytes != n * (lw + 4 + bw) + 16 or d_off + d_bytes >= U64
            or m_off != d_off + d_bytes or m_off + m_bytes >= U64 or f_bytes != m_off + m_bytes):
        return "inconsistent", None, None
    if f.size < f_bytes:
        return "truncated", None, None
    trailer = f.get(d_off + d_bytes - 16, 16)
    if trailer != DIR_MAGIC + struct.pack("<Q", n):
        return "trailer", None, None
    d = f.get(d_off, d_bytes)
    lengths = _column(d[:n * lw], lw, False)
    crcs = _column(d[n * lw:n * (lw + 4)], 4, False)
    labels = _column(d[n * (lw + 4):n * (lw + 4 + bw)], bw, True)
    if sum(lengths) != h[F_DATA_BYTES]:
        return "lengths", None, None
    if any(ln == 0 and c != 0 for ln, c in zip(lengths, crcs)):
        return "entry", None, None
    if crc32c(d) != h[F_DIR_CRC]:
        return "dir crc", None, None
    if m_bytes and m_off + m_bytes > len(f.raw):  # reaches into the hole: zeros, never read whole
        return "meta nul", None, None
    meta = f.get(m_off, m_bytes)
    if b"\0" in meta:
        return "meta nul", None, None
    if crc32c(meta) != h[F_META_CRC]:
        return "meta crc", None, None
    offsets, at = [0] * n, 4096
    for i in (placement_order(n, h[F_SEED]) if h[F_PLACEMENT] == 1 else range(n)):
        offsets[i] = at
        at += lengths[i]
    return None, list(zip(offsets, lengths, crcs, labels)), meta


# ---- inputs ------------------------------------------------------------------------------------

def write_corpus() -> None:
    """The seed corpus, written by the real PackWriter (run `python tests/fuzz corpus`)."""
    import random

    import shadecache as sc

    os.makedirs(CORPUS, exist_ok=True)
    for old in glob.glob(os.path.join(CORPUS, "*.shc")):
        os.unlink(old)
    rng = random.Random(13)
    specs = {
        "empty-samples": ([0, 0, 1, 0], True),
        "mixed": ([rng.randrange(0, 6000) for _ in range(10)] + [0, 4096, 4095, 4097], True),
        "mixed-in-order": ([rng.randrange(0, 300) for _ in range(12)] + [0, 70000], False),
        "one": ([100], True),
    }
    for name, (sizes, shuffle) in specs.items():
        meta = {"classes": ["cat", "dog", "émile"]} if name != "one" else {}
        labels = [rng.randrange(-3, 3) for _ in sizes]
        if name == "mixed-in-order":
            labels = [rng.choice([-(1 << 40), 5, 300]) for _ in sizes]
        with sc.PackWriter(os.path.join(CORPUS, name + ".shc"), meta=meta, shuffle=shuffle,
                           seed=rng.randrange(1 << 64)) as w:
            for n, label in zip(sizes, labels):
                w.add(bytes(rng.randrange(256) for _ in range(n)), label)


_seeds: list = []


def seeds() -> list:
    if not _seeds:
        _seeds.extend(open(p, "rb").read() for p in sorted(glob.glob(os.path.join(CORPUS, "*.shc"))))
    return _seeds


INTERESTING = [0, 1, 2, 7, 8, 9, 15, 16, 17, 4095, 4096, 4097, 8192, 2**31 - 1, 2**31, 2**32 - 1,
               2**32, 2**32 + 4096, 2**63 - 1, 2**63, 2**64 - 1, 2**64 - 4096, (3 << 30) // 6,
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
        for f in _U32_FIELDS:
            h[f] %= 1 << 32
        _HDR.pack_into(self.b, 0, *h)
        if fix:
            struct.pack_into("<I", self.b, 124, crc32c(self.b[:124]))

    def columns(self, h):
        """(lengths, crcs, labels) as the directory holds them, or None when it lies outside."""
        n, lw, bw, at = h[F_N], h[F_LW], h[F_BW], h[F_DIR_OFF]
        if (lw not in (1, 2, 4) or bw not in (1, 2, 4, 8) or n > MAX_FILE or at < _HDR.size
                or at + n * (lw + 4 + bw) > len(self.b)):
            return None   # nowhere to re-encode a directory (it would overwrite the header)
        d = bytes(self.b[at:at + n * (lw + 4 + bw)])
        return (_column(d[:n * lw], lw, False), _column(d[n * lw:n * (lw + 4)], 4, False),
                _column(d[n * (lw + 4):], bw, True))

    def set_columns(self, h, cols, lw=None, bw=None, fix_crc=True):
        """Re-encodes the directory (widths may change: the tail moves), fixes the header."""
        lengths, crcs, labels = cols
        lw, bw = lw or h[F_LW], bw or h[F_BW]
        d = b"".join(int(v % (1 << (8 * lw))).to_bytes(lw, "little") for v in lengths)
        d += b"".join(int(v % (1 << 32)).to_bytes(4, "little") for v in crcs)
        d += b"".join(int(v % (1 << (8 * bw))).to_bytes(bw, "little") for v in labels)
        d += DIR_MAGIC + struct.pack("<Q", len(lengths))
        meta = bytes(self.b[h[F_META_OFF]:h[F_META_OFF] + h[F_META_BYTES]])
        del self.b[h[F_DIR_OFF]:]
        self.b += d + meta
        h[F_LW], h[F_BW], h[F_DIR_BYTES] = lw, bw, len(d)
        h[F_META_OFF] = h[F_DIR_OFF] + len(d)
        h[F_FILE_BYTES] = h[F_META_OFF] + len(meta)
        if fix_crc:
            h[F_DIR_CRC] = crc32c(d)
        self.set_header(h)

    def offsets(self, h, lengths):
        order = placement_order(len(lengths), h[F_SEED]) if h[F_PLACEMENT] == 1 else range(len(lengths))
        out, at = [0] * len(lengths), 4096
        for i in order:
            out[i] = at
            at += lengths[i]
        return out


def _mutate(rng, f: _File) -> None:
    h = f.header()
    op = rng.randrange(13)
    size = len(f.b)
    cols = f.columns(h) if h is not None else None
    if h is None or op == 0:  # random byte flips anywhere
        for _ in range(rng.randrange(1, 8)):
            if f.b:
                f.b[rng.randrange(len(f.b))] ^= 1 << rng.randrange(8)
        return
    if op == 1:  # a header field to an edge value, checksum recomputed (usually)
        fld = rng.choice([F_VERSION, F_HBYTES, F_LW, F_BW, F_N, F_DATA_OFF, F_DATA_BYTES, F_DIR_OFF,
                          F_DIR_BYTES, F_META_OFF, F_META_BYTES, F_FILE_BYTES, F_PLACEMENT,
                          F_RESERVED0, F_SEED])
        h[fld] = rng.choice(INTERESTING + [size, size - 1, size + 1, h[fld] + rng.randrange(-9, 9)])
        f.set_header(h, fix=rng.random() < 0.9)
    elif op == 2:  # num_samples with every derived field kept consistent
        n = rng.choice([0, 1, h[F_N] - 1, h[F_N] + 1, (3 << 30) // 6, 2**26, 2**60])
        h[F_N], h[F_DIR_BYTES] = n, n * (h[F_LW] + 4 + h[F_BW]) + 16
        h[F_META_OFF] = h[F_DIR_OFF] + h[F_DIR_BYTES]
        h[F_FILE_BYTES] = h[F_META_OFF] + h[F_META_BYTES]
        f.set_header(h)
    elif op in (3, 4) and cols and cols[0]:  # an entry edited
        lengths, crcs, labels = (list(c) for c in cols)
        i = rng.randrange(len(lengths))
        k = rng.randrange(4)
        if k == 0:   # bytes moved from one sample to another: the lengths still add up
            j = rng.randrange(len(lengths))
            move = rng.randrange(lengths[i] + 1)
            lengths[i] -= move
            lengths[j] += move
        elif k == 1:
            lengths[i] = rng.choice(INTERESTING + [lengths[i] + 1, lengths[i] - 1])
        elif k == 2:
            crcs[i] = rng.choice([0, 1, crcs[i] ^ 1, 0xFFFFFFFF])
        else:
            labels[i] = rng.choice([-(2**63), 2**63 - 1, -1, 0, 127, -129])
        if k in (0, 1) and rng.random() < 0.5:  # keep the samples honest where they now lie
            offs = f.offsets(h, lengths)
            crcs = [crc32c(f.b[o:o + ln]) if o + ln <= size else c
                    for o, ln, c in zip(offs, lengths, crcs)]
        f.set_columns(h, (lengths, crcs, labels), fix_crc=op == 3)
    elif op == 5 and 128 <= h[F_META_OFF] <= MAX_FILE:  # metadata replaced, everything fixed
        meta = rng.choice(METAS)
        del f.b[h[F_META_OFF]:]
        f.b += meta
        h[F_META_BYTES], h[F_FILE_BYTES] = len(meta), h[F_META_OFF] + len(meta)
        h[F_META_CRC] = crc32c(meta)
        f.set_header(h)
    elif op == 6:  # truncated
        cut = rng.choice([rng.randrange(size + 1), h[F_DIR_OFF], h[F_META_OFF], 4096, 128, 127,
                          h[F_DIR_OFF] + h[F_DIR_BYTES] - 1])
        del f.b[max(0, min(cut, size)):]
    elif op == 7:  # junk or zeros appended
        f.b += rng.choice([b"\0", b"x"]) * rng.choice([1, 4096, 10000])
    elif op in (8, 9) and cols and cols[0]:  # sample bytes changed
        lengths, crcs, labels = cols
        i = rng.randrange(len(lengths))
        off = f.offsets(h, lengths)[i]
        if lengths[i] and off + lengths[i] <= size:
            f.b[off + rng.randrange(lengths[i])] ^= 1 << rng.randrange(8)
            if op == 9:  # ... and its checksum fixed: an honest file with other bytes
                crcs = list(crcs)
                crcs[i] = crc32c(f.b[off:off + lengths[i]])
                f.set_columns(h, (lengths, crcs, labels))
    elif op == 10 and cols and cols[0]:  # two entries swapped
        lengths, crcs, labels = (list(c) for c in cols)
        a, b = rng.randrange(len(lengths)), rng.randrange(len(lengths))
        for c in (lengths, crcs, labels):
            c[a], c[b] = c[b], c[a]
        f.set_columns(h, (lengths, crcs, labels))
    elif op == 11 and cols is not None:  # the directory re-encoded with other widths
        f.set_columns(h, cols, lw=rng.choice([1, 2, 4, 3]), bw=rng.choice([1, 2, 4, 8, 5]))
    elif op == 12:  # the placement or its seed changed: samples are looked for elsewhere
        if rng.random() < 0.5:
            h[F_PLACEMENT] = rng.choice([0, 1, 2])
            h[F_SEED] = 0 if h[F_PLACEMENT] == 0 and rng.random() < 0.8 else h[F_SEED]
        else:
            h[F_SEED] = rng.choice([h[F_SEED] + 1, 0, 2**64 - 1])
        f.set_header(h)


def generate(rng) -> bytes:
    f = _File(rng.choice(seeds()))
    for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3, 5])):
        _mutate(rng, f)
    mode = rng.randrange(8) | (8 if rng.random() < 0.125 else 0) | (rng.randrange(4) << 4)
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
        s = sc.PackedStore(path, backend=backend, direct=direct, queue_depth=8, verify=verify,
                           gap_bytes=65536 if mode & 16 else 0,
                           max_extent_bytes=4096 if mode & 32 else 8 << 20)
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
