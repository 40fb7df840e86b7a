"""The device probe (csrc/io/device_probe.h) called directly: batch sizes it cannot hold are
refused before anything is read, and a probe that fails leaves no descriptor open."""
import os

import pytest

import shadecache as sc


def _fds_on(path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(path)
        except OSError:   # the descriptor listdir itself used, gone by now
            pass
    return n


@pytest.fixture
def store(tmp_path):
    p = tmp_path / "s.shc"
    with sc.PackWriter(p) as w:
        for i in range(64):
            w.add(bytes([i]) * 3000, 0)
    with sc.PackedStore(p, backend="pread") as s:
        yield s


@pytest.mark.parametrize("small,large", [(0, 8), (128, 0)])
def test_empty_probe_batches_are_refused(store, small, large):
    """No reads of a kind measure nothing (a rate of 0, a gap of bandwidth / 0). (With neither,
    the probe's warm-up read also wrote past its buffer: not run here, on the code before.)"""
    with pytest.raises(ValueError, match="small and large"):
        store._r.probe_device(small=small, large=large)


def test_a_probe_whose_buffer_cannot_be_allocated_closes_its_descriptor(store):
    """2^31 reads of 4 KiB want 8 TiB of buffer: MemoryError, and the O_DIRECT descriptor the
    probe opened on the store is closed again."""
    before = _fds_on(store.path)
    with pytest.raises(MemoryError):
        store._r.probe_device(small=1 << 31, large=8)
    assert _fds_on(store.path) == before
