"""Converting a store of format version 1 (`shadecache pack OLD NEW`, shadecache/store/legacy.py)
when the old store is hostile, empty, unreadable or holds a sample larger than one read: each
case ends in a clear exception naming the file (or a complete sample), never an unrelated error,
a misleading message or a descriptor left open."""
import os
import struct

import numpy as np
import pytest
import tqdm  # noqa: F401  (imported before run_as forks: the other user cannot import it)

import shadecache as sc
import shadecache.store.legacy  # noqa: F401  (likewise)
import shadecache.store.writer  # noqa: F401
from shadecache import _io
from shadecache.store.legacy import VersionOneStore

from other_user import VICTIM, PrivateDir, needs_root, run_as  # noqa: E402
from store_layout import crc32c_of_zeros, write_version_one  # noqa: E402

V1_HEADER = struct.Struct("<8sIIIIQQQIIQQQ44sI")
V1_DIR_OFF, V1_DIR_BYTES, V1_DIR_CRC = 32, 40, 48   # byte offsets of those header fields


def _recheck(raw: bytearray) -> bytes:
    """`raw` (a version-1 store) with its directory and header checksums recomputed, as an
    attacker who edits the directory would leave it."""
    dir_off, dir_bytes = struct.unpack_from("<QQ", raw, V1_DIR_OFF)
    struct.pack_into("<I", raw, V1_DIR_CRC, _io.crc32c(bytes(raw[dir_off:dir_off + dir_bytes])))
    struct.pack_into("<I", raw, 124, _io.crc32c(bytes(raw[:124])))
    return bytes(raw)


def _fds_on(path) -> list:
    """This process's descriptors open on `path`."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(path):
                out.append(fd)
        except OSError:   # the descriptor listdir itself used, gone by now
            pass
    return out


def test_an_entry_whose_end_wraps_past_2_64_is_refused_at_open(tmp_path):
    """An entry at offset 2^64 - 10 with 30 bytes ends at 20 in 64-bit arithmetic: inside the
    data region by a wrapped sum. It is a StoreFormatError at open, and pack() writes nothing
    (before: it opened, and the conversion died in os.pread with an OverflowError)."""
    old = tmp_path / "old.shc"
    write_version_one(old, [b"abc" * 10], [0])
    raw = bytearray(old.read_bytes())
    dir_off = struct.unpack_from("<Q", raw, V1_DIR_OFF)[0]
    struct.pack_into("<Q", raw, dir_off, (1 << 64) - 10)   # entry 0's offset
    old.write_bytes(_recheck(raw))
    with pytest.raises(sc.StoreFormatError, match="outside the data region") as ei:
        VersionOneStore(old)
    assert str(old) in str(ei.value)
    with pytest.raises(sc.StoreFormatError, match="outside the data region"):
        sc.pack(str(old), tmp_path / "new.shc", progress=False)
    assert not (tmp_path / "new.shc").exists()
    assert _fds_on(old) == []


def test_converting_an_empty_version_one_store_leaves_no_descriptor_open(tmp_path):
    """pack() refuses an empty source; the old store it opened to find that out is closed."""
    old = tmp_path / "empty.shc"
    write_version_one(old, [], [])
    with pytest.raises(ValueError, match="empty"):
        sc.pack(str(old), tmp_path / "new.shc", progress=False)
    assert _fds_on(old) == []
    assert not (tmp_path / "new.shc").exists()


@needs_root
def test_a_store_the_user_cannot_read_is_a_permission_error(tmp_path):
    """A store file another user keeps 0600: pack() says it may not be read (PermissionError
    naming it), not that the file is no store at all."""
    d = PrivateDir(VICTIM)
    try:
        src = os.path.join(d.path, "theirs.shc")
        with sc.PackWriter(src) as w:
            w.add(b"sample", 0)
        os.chmod(src, 0o600)   # root's, unreadable by VICTIM in VICTIM's own directory
        dst = os.path.join(d.path, "mine.shc")

        def convert():
            try:
                sc.pack(src, dst, progress=False)
            except Exception as e:   # noqa: BLE001 - the type and message come back
                return type(e).__name__, str(e)
            return "converted", ""

        kind, message = run_as(VICTIM, convert)
        assert kind == "PermissionError" and src in message, (kind, message)
        assert not os.path.exists(dst)
    finally:
        d.cleanup()


def test_a_sample_larger_than_one_read_is_converted_whole(tmp_path):
    """One pread returns at most 2 GiB - 4 KiB (Linux): a 2 GiB + 1 MiB sample of an old store
    (zeros, a hole of a sparse file: nothing of it is on disk) is read whole, its checksum holds.
    Before, the first short read was taken for a truncated file."""
    length = (2 << 30) + (1 << 20)
    crc = crc32c_of_zeros(length)
    dir_off = 4096 + length          # a multiple of 4096, as version 1 placed everything
    entry = struct.pack("<QIIq", 4096, length, crc, 7)
    meta = b"{}"
    h = V1_HEADER.pack(b"SHDCPACK", 1, 4096, 4096, 24, 1, dir_off, len(entry), _io.crc32c(entry),
                       _io.crc32c(meta), dir_off + len(entry), len(meta),
                       dir_off + len(entry) + len(meta), bytes(44), 0)
    h = h[:124] + struct.pack("<I", _io.crc32c(h[:124]))
    old = tmp_path / "big.shc"
    with open(old, "wb") as f:
        f.write(h)
        f.seek(dir_off)
        f.write(entry + meta)
    assert os.stat(old).st_blocks * 512 < (1 << 20)   # really sparse
    with VersionOneStore(old) as s:
        data, label = s[0]
        assert (len(data), label) == (length, 7)
        assert not np.frombuffer(data, np.uint8, 1 << 20, length - (1 << 20)).any()
        del data
