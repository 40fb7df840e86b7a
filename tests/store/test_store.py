"""Packed store: round trip, sources of pack(), and every kind of bad input.

Real files in tmp_path; both backends (io_uring where this machine allows it, and the pread pool)
and both buffered and O_DIRECT reads.
"""
import os
import struct

import numpy as np
import pytest

import shadecache as sc
from shadecache import _io

from store_layout import columns, forge as _forge, header, write_version_one

HEADER = 4096
# header field offsets (csrc/io/store_format.h)
OFF_NUM, OFF_DIR = 24, 48

SIZES = [0, 1, 4096, 4095, 4097, 8192, 12345, 3 * 2**20 + 7, 1, 0, 100]

MODES = [("pread", False), ("pread", True)]
if _io.built_with_uring() and _io.probe_backend("io_uring", 8)[0] == "io_uring":
    MODES += [("io_uring", False), ("io_uring", True)]


def make_samples(seed=0, sizes=SIZES):
    rng = np.random.default_rng(seed)
    return [rng.bytes(s) for s in sizes], [int(x) for x in rng.integers(-5, 1000, len(sizes))]


@pytest.fixture
def packed(tmp_path):
    data, labels = make_samples()
    path = tmp_path / "s.shc"
    with sc.PackWriter(path, meta={"note": "test"}) as w:
        for d, lab in zip(data, labels):
            w.add(d, lab)
    return path, data, labels


@pytest.mark.parametrize("backend,direct", MODES)
def test_round_trip_every_size(packed, backend, direct):
    path, data, labels = packed
    with sc.PackedStore(path, backend=backend, direct=direct, queue_depth=4) as s:
        assert s.backend == backend
        assert len(s) == len(data)
        assert [s.read(i) for i in range(len(s))] == data
        # a batch larger than the queue depth, with repeats and an odd order
        ids = list(range(len(s)))[::-1] * 3 + [7, 7, 0]
        assert s.read_many(ids) == [data[i] for i in ids]
        assert s.read_many(np.array(ids, dtype=np.int32)) == [data[i] for i in ids]
        assert s.read_many([]) == []
        assert [s.label(i) for i in range(len(s))] == labels
        assert s.labels.tolist() == labels
        assert s.lengths.tolist() == [len(d) for d in data]
        assert s[3] == (data[3], labels[3])
        assert s.__getitems__([2, 1]) == [(data[2], labels[2]), (data[1], labels[1])]
        assert s.version == sc.store.FORMAT_VERSION == 2
        assert s.meta["note"] == "test"


@pytest.mark.parametrize("shuffle", [True, False])
def test_layout_is_dense(tmp_path, shuffle):
    """Samples lie back to back after the header block, in placement order: a seeded shuffle of
    the ids (recorded, so the same seed lays them out the same way) or id order."""
    data, labels = make_samples()
    path = tmp_path / "s.shc"
    with sc.PackWriter(path, shuffle=shuffle, seed=11) as w:
        for d, lab in zip(data, labels):
            w.add(d, lab)
    s = sc.PackedStore(path)
    order = s.disk_order()
    want = _io.placement_order(len(data), 11) if shuffle else np.arange(len(data))
    assert order.tolist() == want.tolist()
    assert sorted(order.tolist()) == list(range(len(data)))
    at = HEADER
    for i in order.tolist():
        assert s.offset(i) == at
        at += len(data[i])
    raw = path.read_bytes()
    assert header(raw)["dir_off"] == at == HEADER + sum(map(len, data))
    assert s.file_bytes == os.path.getsize(path)
    assert s.placement == ("shuffled" if shuffle else "as written")
    assert s.placement_seed == (11 if shuffle else 0)
    assert s.read_many(range(len(s))) == data


def test_placement_order_is_a_seeded_permutation():
    a, b, c = (_io.placement_order(1000, s) for s in (0, 0, 1))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
    assert sorted(a.tolist()) == list(range(1000))
    assert _io.placement_order(0, 3).tolist() == [] and _io.placement_order(1, 3).tolist() == [0]


def test_small_samples_take_little_more_than_their_bytes(tmp_path):
    """10,000 samples of 256 bytes with 10 classes: <= 1.05x the raw data on disk (the header
    block, 2 + 4 + 1 bytes of directory per sample, the metadata)."""
    path = tmp_path / "small.shc"
    rng = np.random.default_rng(1)
    with sc.PackWriter(path) as w:
        for i in range(10_000):
            w.add(rng.bytes(256), i % 10)
    raw = path.read_bytes()
    assert len(raw) <= 1.05 * 10_000 * 256, len(raw) / (10_000 * 256)
    h = header(raw)
    assert (h["len_width"], h["label_width"]) == (2, 1)
    lengths, _, labels = columns(raw)
    assert (lengths == 256).all() and labels.tolist() == [i % 10 for i in range(10_000)]


def test_columns_take_the_narrowest_width(tmp_path):
    for lengths, labels, widths in (([0, 255], [-128, 127], (1, 1)),
                                    ([256, 1], [-129, 0], (2, 2)),
                                    ([65536], [1 << 31], (4, 8)),
                                    ([3], [-(1 << 31)], (1, 4))):
        p = tmp_path / "w.shc"
        with sc.PackWriter(p) as w:
            for n, lab in zip(lengths, labels):
                w.add(b"x" * n, lab)
        h = header(p.read_bytes())
        assert (h["len_width"], h["label_width"]) == widths
        with sc.PackedStore(p) as s:
            assert s.labels.tolist() == labels and s.lengths.tolist() == lengths


def test_a_version_one_store_is_refused_and_converted(tmp_path):
    """The old format (samples padded to 4 KiB) is a StoreFormatError naming the conversion;
    pack() (and `shadecache pack OLD NEW`) converts it, keeping ids, labels and metadata."""
    data, labels = make_samples(3)
    old = tmp_path / "old.shc"
    write_version_one(old, data, labels, meta={"classes": ["a", "b"]})
    with pytest.raises(sc.StoreFormatError, match="format version 1.*shadecache pack"):
        sc.PackedStore(old)
    new = tmp_path / "new.shc"
    assert sc.pack(str(old), new, progress=False) == len(data)
    with sc.PackedStore(new) as s:
        assert s.read_many(range(len(s))) == data
        assert s.labels.tolist() == labels
        assert s.classes == ["a", "b"]
        assert s.meta["converted_from"]["format_version"] == 1
        assert s.placement == "shuffled"
    assert os.path.getsize(new) < os.path.getsize(old)
    # a damaged old store is refused, not converted into a valid new one
    raw = bytearray(old.read_bytes())
    raw[8192 + 3] ^= 1   # sample 2 (ids 0 and 1 take one block: 0 and 1 bytes)
    bad = tmp_path / "bad_old.shc"
    bad.write_bytes(bytes(raw))
    with pytest.raises(sc.CorruptSampleError):
        sc.pack(str(bad), tmp_path / "never.shc", progress=False)
    assert not (tmp_path / "never.shc").exists()
    with pytest.raises(ValueError, match="same file"):
        sc.pack(str(new), new, progress=False)


def test_large_batch_many_samples(tmp_path):
    rng = np.random.default_rng(1)
    data = [rng.bytes(int(n)) for n in rng.integers(0, 20000, 3000)]
    path = tmp_path / "many.shc"
    assert sc.pack([(d, i % 7) for i, d in enumerate(data)], path, progress=False) == 3000
    ids = rng.integers(0, 3000, 5000)
    for backend, direct in MODES:
        s = sc.PackedStore(path, backend=backend, direct=direct, queue_depth=32)
        assert s.read_many(ids) == [data[i] for i in ids], (backend, direct)


def test_pack_sources(tmp_path):
    data, labels = make_samples(2, [10, 0, 5000, 77])
    # an ImageFolder tree: classes sorted, files sorted, labels = class index
    root = tmp_path / "tree"
    layout = {"b_dog": [("x2.bin", data[0]), ("x1.bin", data[1])], "a_cat": [("z.bin", data[2])],
              "c_emu": [("sub/q.bin", data[3])]}
    for cls, files in layout.items():
        for name, d in files:
            p = root / cls / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(d)
    (root / ".hidden").mkdir()
    (root / ".hidden" / "f").write_bytes(b"ignored")
    (root / "a_cat" / ".DS_Store").write_bytes(b"ignored")
    assert sc.pack(root, tmp_path / "tree.shc", progress=False) == 4
    s = sc.PackedStore(tmp_path / "tree.shc")
    assert s.read_many(range(4)) == [data[2], data[1], data[0], data[3]]
    assert s.labels.tolist() == [0, 1, 1, 2]
    assert s.classes == ["a_cat", "b_dog", "c_emu"]

    # a list of (path, label)
    files = [(root / "b_dog" / "x2.bin", 5), (str(root / "a_cat" / "z.bin"), 6)]
    assert sc.pack(files, tmp_path / "list.shc", progress=False) == 2
    s = sc.PackedStore(tmp_path / "list.shc")
    assert s.read_many([0, 1]) == [data[0], data[2]] and s.labels.tolist() == [5, 6]

    # a map-style data set: another store, and numpy arrays as data
    assert sc.pack(sc.PackedStore(tmp_path / "tree.shc"), tmp_path / "copy.shc",
                   progress=False) == 4
    assert sc.PackedStore(tmp_path / "copy.shc").read_many(range(4)) == \
        sc.PackedStore(tmp_path / "tree.shc").read_many(range(4))
    arrays = [(np.arange(n, dtype=np.float32), n) for n in (0, 3, 1000)]
    sc.pack(arrays, tmp_path / "np.shc", progress=False)
    s = sc.PackedStore(tmp_path / "np.shc")
    assert [np.frombuffer(b, np.float32).tolist() for b in s.read_many([0, 1, 2])] == \
        [a.tolist() for a, _ in arrays]


def test_pack_replaces_existing_store_atomically(tmp_path):
    path = tmp_path / "r.shc"
    sc.pack([(b"old", 1)], path, progress=False)
    w = sc.PackWriter(path)
    w.add(b"new", 2)
    assert sc.PackedStore(path).read(0) == b"old"  # untouched until close
    w.close()
    assert sc.PackedStore(path).read(0) == b"new"
    assert os.listdir(tmp_path) == ["r.shc"]  # no temporary left behind


def test_writer_abort_and_exception_leave_nothing(tmp_path):
    path = tmp_path / "a.shc"
    with pytest.raises(RuntimeError):
        with sc.PackWriter(path) as w:
            w.add(b"x" * 10000, 0)
            assert os.path.exists(w.temp_path)
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    w = sc.PackWriter(path)
    w.add(b"y", 0)
    tmp = w.temp_path
    del w
    assert not os.path.exists(tmp) and not os.path.exists(path)


# ---- bad input -------------------------------------------------------------------------------

def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("backend,direct", MODES)
def test_flipped_byte_names_id_and_offset(packed, backend, direct):
    path, data, _ = packed
    s0 = sc.PackedStore(path)
    victim = 6  # 12345 bytes
    off = s0.offset(victim)
    flip_byte(path, off + 5000)
    s = sc.PackedStore(path, backend=backend, direct=direct)
    with pytest.raises(sc.CorruptSampleError) as ei:
        s.read(victim)
    assert ei.value.sample_id == victim and ei.value.offset == off
    assert f"sample {victim}" in str(ei.value) and str(off) in str(ei.value)
    with pytest.raises(sc.CorruptSampleError) as ei:
        s.read_many([0, 2, victim, 3])
    assert ei.value.sample_id == victim
    # the other samples still read, the store is usable after the error
    assert s.read_many([2, 3]) == [data[2], data[3]]
    assert s.verify() == [victim]
    # verification can be switched off: the damaged bytes come back as they are
    raw = sc.PackedStore(path, backend=backend, direct=direct, verify=False).read(victim)
    assert raw != data[victim] and len(raw) == len(data[victim])


def test_truncated_data_file(packed, tmp_path):
    path, data, _ = packed
    size = os.path.getsize(path)
    for cut in (size - 1, HEADER + 100, 100, 0):
        p = tmp_path / f"cut{cut}.shc"
        p.write_bytes(path.read_bytes()[:cut])
        with pytest.raises(sc.StoreFormatError) as ei:
            sc.PackedStore(p)
        assert str(p) in str(ei.value)
    with pytest.raises(sc.StoreFormatError, match="truncated"):
        sc.PackedStore(tmp_path / f"cut{size - 1}.shc")


def test_missing_or_damaged_directory(packed, tmp_path):
    path, data, _ = packed
    raw = path.read_bytes()
    dir_off = struct.unpack_from("<Q", raw, OFF_DIR)[0]
    # directory cut off entirely
    p = tmp_path / "nodir.shc"
    p.write_bytes(raw[:dir_off])
    with pytest.raises(sc.StoreFormatError, match="directory at offset .* is missing"):
        sc.PackedStore(p)
    # one byte of the directory flipped
    p = tmp_path / "baddir.shc"
    p.write_bytes(raw)
    flip_byte(p, dir_off + 30)
    with pytest.raises(sc.StoreFormatError, match="sample directory damaged"):
        sc.PackedStore(p)
    # header damaged
    p = tmp_path / "badhdr.shc"
    p.write_bytes(raw)
    flip_byte(p, OFF_NUM)
    with pytest.raises(sc.StoreFormatError, match="header damaged"):
        sc.PackedStore(p)
    # not a store at all
    p = tmp_path / "junk.shc"
    p.write_bytes(b"hello" * 2000)
    with pytest.raises(sc.StoreFormatError, match="bad magic"):
        sc.PackedStore(p)


def test_other_format_version(packed, tmp_path):
    path, _, _ = packed
    # a consistent header of version 3 (checksum updated), as a future writer would produce
    p = tmp_path / "v3.shc"
    p.write_bytes(_forge(path.read_bytes(), version=3))
    with pytest.raises(sc.StoreFormatError, match="format version 3.*reads version 2"):
        sc.PackedStore(p)


def test_hostile_headers_and_entries_are_refused_before_any_allocation(packed, tmp_path):
    """A checksum is easy to forge. Counts and offsets whose sums wrap past 2^64 (2^26 samples
    'fitting' a 20 KB file; metadata of 2^64 - 1 bytes; lengths that add up past the data region
    or wrap) are StoreFormatError naming the file, not gigabytes allocated, a bad_alloc or an
    OSError later."""
    import resource

    path, _, _ = packed
    raw = path.read_bytes()
    h = header(raw)
    n = 1 << 26
    dir_bytes = n * (h["len_width"] + 4 + h["label_width"]) + 16
    cases = {
        "wrapped directory": _forge(raw, n=n, dir_bytes=dir_bytes, data_bytes=-dir_bytes,
                                    dir_off=4096 - dir_bytes, meta_off=4096, meta_bytes=0,
                                    meta_crc=0, file_bytes=4096),
        "wrapped metadata": _forge(raw, meta_bytes=-1, file_bytes=h["meta_off"] - 1),
    }
    d = bytearray(raw[h["dir_off"]:h["dir_off"] + h["dir_bytes"]])
    width = h["len_width"]
    d[2 * width:3 * width] = b"\xff" * width      # sample 2 longer than the data region allows
    entry = bytearray(raw)
    entry[h["dir_off"]:h["dir_off"] + len(d)] = d
    cases["lengths past the data region"] = _forge(bytes(entry), dir_crc=_io.crc32c(bytes(d)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for what, data in cases.items():
        p = tmp_path / (what.replace(" ", "_") + ".shc")
        p.write_bytes(data)
        with pytest.raises(sc.StoreFormatError, match=str(p)):
            sc.PackedStore(p)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert grown_mib < 256, f"opening hostile stores raised the peak RSS by {grown_mib:.0f} MiB"


def test_a_directory_without_its_trailer_is_damaged(packed, tmp_path):
    path, _, _ = packed
    raw = bytearray(path.read_bytes())
    h = header(raw)
    at = h["dir_off"] + h["dir_bytes"] - 16
    raw[at:at + 16] = bytes(16)
    p = tmp_path / "notrailer.shc"
    p.write_bytes(bytes(raw))
    with pytest.raises(sc.StoreFormatError, match="trailer"):
        sc.PackedStore(p)


def test_metadata_that_is_not_an_object_is_a_format_error(tmp_path):
    """Metadata with a valid checksum but the wrong shape is StoreFormatError, not an
    AttributeError deep inside `classes` or the CLI."""
    p = tmp_path / "m.shc"
    with sc.PackWriter(p, meta={"classes": 5}) as w:
        w.add(b"x", 0)
    raw = p.read_bytes()
    meta_off = header(raw)["meta_off"]
    for data, what in ((raw, "not a list of names"),
                       (_forge(raw[:meta_off] + b"[1, 2]", meta_bytes=6, file_bytes=meta_off + 6,
                               meta_crc=_io.crc32c(b"[1, 2]")), "JSON list")):
        p.write_bytes(data)
        s = sc.PackedStore(p)
        with pytest.raises(sc.StoreFormatError, match=what):
            s.classes
        s.close()


def test_non_integer_ids_are_refused(packed):
    """read_many with float, bool or string ids raises TypeError (a cast read sample 1 for 1.9)."""
    path, _, _ = packed
    s = sc.PackedStore(path)
    for ids in ([1.9], np.array([True]), np.array(["2"])):
        with pytest.raises(TypeError, match="ids must be integers"):
            s.read_many(ids)
    assert s.read_many([]) == [] and s.read_many(np.array([], dtype=np.int64)) == []
    s.close()


def test_id_out_of_range_and_bad_arguments(packed, tmp_path):
    path, data, _ = packed
    s = sc.PackedStore(path)
    n = len(data)
    for bad in (n, -1, 10**12):
        with pytest.raises(IndexError, match=f"sample id {bad} out of range"):
            s.read(bad)
        with pytest.raises(IndexError):
            s.read_many([0, bad])
        with pytest.raises(IndexError):
            s.label(bad)
    with pytest.raises(ValueError, match="backend"):
        sc.PackedStore(path, backend="spdk")
    with pytest.raises(ValueError, match="queue_depth"):
        sc.PackedStore(path, queue_depth=0)
    with pytest.raises(FileNotFoundError):
        sc.PackedStore(tmp_path / "nope.shc")
    s.close()
    with pytest.raises(sc.ClosedError):
        s.read(0)


def test_empty_sources_are_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no samples found under"):
        sc.pack(tmp_path / "empty", tmp_path / "e.shc", progress=False)
    (tmp_path / "empty" / "cls").mkdir()
    with pytest.raises(ValueError, match="1 class folder"):
        sc.pack(tmp_path / "empty", tmp_path / "e.shc", progress=False)
    with pytest.raises(ValueError, match="empty"):
        sc.pack([], tmp_path / "e.shc", progress=False)
    with pytest.raises(FileNotFoundError):
        sc.pack(tmp_path / "absent", tmp_path / "e.shc", progress=False)
    with pytest.raises(TypeError, match="item 0"):
        sc.pack([(b"x", 1, 2)], tmp_path / "e.shc", progress=False)
    with pytest.raises(TypeError, match="bytes-like"):
        sc.pack([(12345, 1)], tmp_path / "e.shc", progress=False)
    assert os.listdir(tmp_path) == ["empty"]  # failed packs leave no file


def test_pickle_reopens_by_path_with_options(packed):
    import pickle

    path, data, _ = packed
    s = sc.PackedStore(path, backend="pread", direct=True, queue_depth=7, verify=False,
                       gap_bytes=5000, device={"iops": 3000, "bandwidth": 200 << 20})
    t = pickle.loads(pickle.dumps(s))
    assert (t.backend, t.direct, t.queue_depth, t.path) == ("pread", True, 7, s.path)
    assert t.read_many(range(len(data))) == data
    # the device's profile travels with the store: a worker does not measure it again
    assert t.gap_bytes == 5000 and t.device == s.device
    assert s.device["gap_bytes"] == (200 << 20) // 3000 and s.device["source"] == "given"


def test_interleaved_crc32c_matches_the_serial_one():
    """crc32c's 3-chain path (three lanes joined by a carry-less multiply, from 192 bytes) gives
    the 1-chain value at every length and alignment."""
    assert _io.crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    rng = np.random.default_rng(11)
    buf = rng.bytes(1 << 20)
    lengths = list(range(0, 2100, 7)) + [191, 192, 193, 215, 216, 1535, 1536, 1537, 3000, 4096, 131072, 131075, 1 << 20]
    for n in lengths:
        for start in (0, 1, 13):
            view = memoryview(buf)[start:start + n]
            assert _io.crc32c(view) == _io.crc32c_serial(view), (n, start)


def _crc32c_bitwise(data: bytes) -> int:
    """CRC-32C by its definition: the reflected polynomial 0x82F63B78, bit by bit."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def test_crc32c_matches_the_definition_at_every_length_the_lanes_split():
    """Both native paths against the bitwise definition, around each length where the 3-lane path
    changes how it splits its input (from 192 bytes) and at a few alignments; the serial path is
    not the only witness."""
    assert _crc32c_bitwise(b"123456789") == 0xE3069283
    rng = np.random.default_rng(12)
    buf = rng.bytes(4200)
    for n in list(range(0, 260)) + [383, 384, 385, 575, 576, 577, 1535, 1536, 1537, 3000, 4096]:
        for start in (0, 3, 61):
            data = buf[start:start + n]
            want = _crc32c_bitwise(data)
            assert _io.crc32c(data) == want and _io.crc32c_serial(data) == want, (n, start)


@pytest.mark.parametrize("backend,direct", MODES)
def test_file_truncated_after_open(packed, tmp_path, backend, direct):
    """The reads themselves notice a file cut short under an open store (end of file mid-sample)."""
    path, data, _ = packed
    p = tmp_path / "t.shc"
    p.write_bytes(path.read_bytes())
    s = sc.PackedStore(p, backend=backend, direct=direct)
    big = 7  # the 3 MB sample
    os.truncate(p, s.offset(big) + 8192)
    with pytest.raises(sc.StoreFormatError, match="truncated"):
        s.read_many([0, big])
    assert s.read_many([2, 3]) == [data[2], data[3]]  # the samples before the cut still read


def test_verify_lists_every_corrupt_sample(packed):
    path, data, _ = packed
    s = sc.PackedStore(path)
    victims = [2, 7, 10]  # 4 KB, 3 MB, 100 B
    for v in victims:
        flip_byte(path, s.offset(v) + len(data[v]) - 1)  # the last byte of each
    assert sc.PackedStore(path).verify() == victims
    assert sc.PackedStore(path).verify(batch_bytes=5000) == victims  # many small batches
