"""Regression tests for the store defects the store fuzzer found: each file here was built
the way a hostile (or unlucky) user builds it, and each failed on the code before the fix.

1. a named pipe given as a store blocked forever (open, verify, info);
3. deeply nested metadata JSON raised RecursionError;
4. a 0-byte directory entry with a non-zero checksum read as b"" with verification on;
5. a sparse file whose header claims a 3 GiB directory allocated 3 GiB before any check (now:
   refused at its trailer, which lies in the hole, before the hole is read);
6. pread-backend threads outlived close(), and a thread that could not start was a RuntimeError.
"""
import os
import struct
import subprocess
import sys
import textwrap

import pytest

import shadecache as sc
from shadecache import _io

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from store_layout import crc32c_of_zeros, forge, header  # noqa: E402  (tests/store_layout.py: the header's fields)


def run_py(code, timeout=60):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def small_store(tmp_path):
    p = tmp_path / "s.shc"
    with sc.PackWriter(p, meta={"classes": ["a", "b"]}) as w:
        for i in range(4):
            w.add(bytes([i]) * (100 + i), i % 2)
    return p


# ---- 1. a FIFO --------------------------------------------------------------------------------

def test_a_fifo_is_refused_not_waited_on(tmp_path):
    """Run in a child under a timeout: on the old code the open waits for a writer forever."""
    fifo = tmp_path / "f.shc"
    os.mkfifo(fifo)
    r = run_py(f"""
        import shadecache as sc
        for backend in ("pread", "auto"):
            try:
                sc.PackedStore({str(fifo)!r}, backend=backend)
            except sc.StoreFormatError as e:
                assert "not a regular file" in str(e) and {str(fifo)!r} in str(e), e
            else:
                raise SystemExit("opened a FIFO")
        print("refused")
    """, timeout=30)
    assert r.returncode == 0 and "refused" in r.stdout, r.stderr
    # the CLI: one clear line, no wait
    for cmd in ("verify", "info"):
        r = subprocess.run([sys.executable, "-m", "shadecache.cli", cmd, str(fifo)],
                           env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert "StoreFormatError" in r.stderr and "not a regular file" in r.stderr
        assert "Traceback" not in r.stderr


def test_a_fifo_in_a_folder_store_fails_alone(tmp_path):
    """FolderStore opens non-blocking too (both backends): the FIFO is an OSError naming it."""
    (tmp_path / "ok").write_bytes(b"data")
    os.mkfifo(tmp_path / "pipe")
    r = run_py(f"""
        import shadecache as sc
        for backend in ("pread", "auto"):
            s = sc.FolderStore(files=[({str(tmp_path / "ok")!r}, 0), ({str(tmp_path / "pipe")!r}, 1)],
                               backend=backend)
            assert s.read(0) == b"data"
            try:
                s.read_many([0, 1])
            except OSError as e:
                assert "sample 1" in str(e) and "pipe" in str(e), e
            else:
                raise SystemExit("read a FIFO")
        print("refused")
    """, timeout=30)
    assert r.returncode == 0 and "refused" in r.stdout, (r.stdout, r.stderr)


def test_a_directory_or_device_is_refused(tmp_path):
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        sc.PackedStore(tmp_path)
    with pytest.raises(sc.StoreFormatError, match="not a regular file"):
        sc.PackedStore("/dev/zero")


# ---- 3. deeply nested metadata ----------------------------------------------------------------

def _with_meta(raw, meta: bytes):
    meta_off = header(raw)["meta_off"]
    return forge(raw[:meta_off] + meta, meta_bytes=len(meta), file_bytes=meta_off + len(meta),
                 meta_crc=_io.crc32c(meta))


def test_deeply_nested_metadata_is_a_format_error(small_store, tmp_path):
    p = tmp_path / "deep.shc"
    p.write_bytes(_with_meta(small_store.read_bytes(), b"[" * 100_000 + b"]" * 100_000))
    s = sc.PackedStore(p)
    with pytest.raises(sc.StoreFormatError, match="metadata"):
        s.meta
    with pytest.raises(sc.StoreFormatError, match="metadata"):
        s.classes
    s.close()
    r = subprocess.run([sys.executable, "-m", "shadecache.cli", "info", str(p)],
                       env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "StoreFormatError" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# ---- 4. a 0-byte entry with a checksum --------------------------------------------------------

def test_zero_length_entry_with_a_nonzero_checksum_is_damaged(small_store, tmp_path):
    """Sample 1's length given to sample 2, sample 1's
    checksum left as it was: the lengths still add up to the data region, but entry 1 says 0
    bytes with a non-zero checksum."""
    raw = small_store.read_bytes()
    h = header(raw)
    n, w = h["n"], h["len_width"]
    d = bytearray(raw[h["dir_off"]:h["dir_off"] + h["dir_bytes"]])
    lengths = [int.from_bytes(d[i * w:(i + 1) * w], "little") for i in range(n)]
    crc1 = int.from_bytes(d[n * w + 4:n * w + 8], "little")
    assert lengths[1] == 101 and crc1 != 0
    d[1 * w:2 * w] = (0).to_bytes(w, "little")
    d[2 * w:3 * w] = (lengths[2] + 101).to_bytes(w, "little")
    out = bytearray(raw)
    out[h["dir_off"]:h["dir_off"] + len(d)] = d
    p = tmp_path / "zero.shc"
    p.write_bytes(forge(bytes(out), dir_crc=_io.crc32c(bytes(d))))
    for backend in ("pread", "auto"):
        with pytest.raises(sc.StoreFormatError, match=r"entry 1 .*length 0.*checksum"):
            sc.PackedStore(p, backend=backend)
    # a real 0-byte sample (checksum 0) still opens and reads as b""
    q = tmp_path / "real-zero.shc"
    with sc.PackWriter(q) as w:
        w.add(b"", 0)
        w.add(b"x", 1)
    with sc.PackedStore(q) as s:
        assert s.read_many([0, 1, 0]) == [b"", b"x", b""]


# ---- 5. a huge claimed directory in a sparse file ---------------------------------------------

def test_a_sparse_file_claiming_a_huge_directory_allocates_nothing(small_store, tmp_path):
    """3 GiB of directory claimed by a sparse file (every checksum recomputed: the directory CRC
    of 3 GiB of zeros, over the hole). Opened under a 1 GiB address-space limit in a child:
    StoreFormatError naming the file (the directory's trailer is in the hole), at once."""
    raw = small_store.read_bytes()
    per = 1 + 4 + 1
    n = (3 << 30) // per
    dir_off = 4096
    dir_bytes = n * per + 16
    crc = crc32c_of_zeros(dir_bytes)
    meta_off = dir_off + dir_bytes
    p = tmp_path / "sparse.shc"
    with open(p, "wb") as f:
        f.write(forge(raw[:4096], n=n, len_width=1, label_width=1, data_bytes=0, dir_off=dir_off,
                      dir_bytes=dir_bytes, dir_crc=crc, meta_off=meta_off, meta_bytes=0,
                      meta_crc=0, file_bytes=meta_off))
        f.truncate(meta_off)
    assert os.stat(p).st_blocks * 512 < (1 << 20)  # really sparse
    r = run_py(f"""
        import resource, time, shadecache as sc
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        t = time.monotonic()
        try:
            sc.PackedStore({str(p)!r}, backend="pread")
        except sc.StoreFormatError as e:
            assert {str(p)!r} in str(e) and "trailer" in str(e), e
            assert time.monotonic() - t < 5, "the hole was read"
            print("refused:", e)
        """, timeout=120)
    assert r.returncode == 0 and "refused" in r.stdout, (r.stdout, r.stderr)


# ---- 6. pread pool threads --------------------------------------------------------------------

def _threads():
    return len(os.listdir("/proc/self/task"))


def test_closed_pread_stores_leave_no_threads(small_store):
    base = _threads()
    for _ in range(20):
        s = sc.PackedStore(small_store, backend="pread", queue_depth=64)
        assert s.read_many([0, 1, 2, 3] * 8)[1] == bytes([1]) * 101
        s.close()
        with pytest.raises(sc.ClosedError):
            s.read(0)
    assert _threads() == base


def test_open_pread_stores_share_one_pool(small_store):
    base = _threads()
    stores = [sc.PackedStore(small_store, backend="pread", queue_depth=64) for _ in range(8)]
    for s in stores:
        s.read_many([0, 1, 2, 3] * 16)
    grown = _threads() - base
    assert 0 < grown < min(64, max(16, 8 * os.cpu_count())), grown
    for s in stores:
        s.close()
    assert _threads() == base


def test_a_thread_that_cannot_start_is_an_oserror(small_store):
    """Under an address-space limit just above what the process maps, a thread's stack cannot be
    mapped: the read raises OSError naming the cause (was: RuntimeError from std::thread)."""
    r = run_py(f"""
        import resource, shadecache as sc
        s = sc.PackedStore({str(small_store)!r}, backend="pread", queue_depth=64)
        vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1])
        lim = vm * 1024 + (4 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        try:
            s.read_many(list(range(4)) * 8)
        except OSError as e:
            assert "thread" in str(e), e
            print("oserror:", e)
        else:
            print("no error")
        """)
    assert r.returncode == 0, r.stderr
    assert "oserror:" in r.stdout, r.stdout


# ---- found by the CLI fuzzer: a path that is not UTF-8 -----------------------------------------

def test_paths_that_are_not_utf8(tmp_path):
    """Linux paths are bytes; os.listdir gives a non-UTF-8 name as a str with surrogates. pack,
    PackedStore and FolderStore take it, and errors name it (was: pybind11's TypeError)."""
    odd = os.fsdecode(b"\xe9t\xffe")
    root = tmp_path / "tree"
    (root / odd).mkdir(parents=True)
    (root / odd / (odd + ".bin")).write_bytes(b"sample")
    dst = tmp_path / (odd + ".shc")
    assert sc.pack(root, dst, progress=False) == 1
    with sc.PackedStore(dst) as s:
        assert s.read(0) == b"sample" and s.classes == [odd]
    f = sc.FolderStore(root)
    assert f.read(0) == b"sample" and f.path(0).endswith(odd + ".bin")
    with pytest.raises(FileNotFoundError) as ei:
        sc.PackedStore(tmp_path / (odd + "-missing.shc"))
    assert odd in str(ei.value)
    bad = tmp_path / (odd + "-bad.shc")
    bad.write_bytes(b"x" * 5000)
    with pytest.raises(sc.StoreFormatError, match="bad magic") as ei:
        sc.PackedStore(bad)
    assert odd in str(ei.value)


def test_single_ids_beyond_int64_are_index_errors(small_store):
    """As in the cache: an id beyond int64 is out of range, not a type."""
    with sc.PackedStore(small_store) as s:
        for big in (2**63, 2**64, -2**63 - 1):
            for call in (s.read, s.label, s.offset, lambda i: s.read_many([i])):
                with pytest.raises(IndexError, match="out of range"):
                    call(big)
        for not_int in (1.5, "3", None):
            for call in (s.read, s.label, s.offset):
                with pytest.raises(TypeError):
                    call(not_int)
