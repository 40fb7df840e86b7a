"""What the writer refuses, and the store's fingerprint (a persisted cache checks it)."""
import os
import shutil

import numpy as np
import pytest

import shadecache as sc


def _pack(path, samples, meta=None):
    with sc.PackWriter(path, meta=meta) as w:
        for data, label in samples:
            w.add(data, label)
    return sc.PackedStore(path)


@pytest.mark.parametrize("bad", [np.array([1, "x"], dtype=object), np.array([None]),
                                 np.arange(10, dtype=np.int64)[::2]], ids=["objects", "none", "strided"])
def test_arrays_whose_bytes_are_not_the_sample_are_refused(tmp_path, bad):
    path = tmp_path / "s.shc"
    with pytest.raises(TypeError):
        with sc.PackWriter(path) as w:
            w.add(b"fine", 0)
            w.add(bad, 1)
    assert not path.exists(), "a refused sample aborts the whole store"
    with pytest.raises(TypeError, match="item 1"):
        sc.pack([(b"fine", 0), (bad, 1)], tmp_path / "p.shc", progress=False)
    assert not (tmp_path / "p.shc").exists()


def test_numeric_arrays_are_packed_as_their_bytes(tmp_path):
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    s = _pack(tmp_path / "s.shc", [(a, 0), (memoryview(b"xy"), 1)])
    assert s.read_many([0, 1]) == [a.tobytes(), b"xy"]


def test_fingerprint_is_stable_and_follows_the_contents(tmp_path):
    samples = [(bytes([i]) * (100 + i), i % 3) for i in range(20)]
    a = _pack(tmp_path / "a.shc", samples, meta={"classes": ["x", "y", "z"]})
    fp = a.fingerprint
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert sc.PackedStore(tmp_path / "a.shc").fingerprint == fp, "reopening changes nothing"
    shutil.copy(tmp_path / "a.shc", tmp_path / "copy.shc")
    assert sc.PackedStore(tmp_path / "copy.shc").fingerprint == fp, "a copy is the same data set"
    changed_byte = samples[:5] + [(b"\x00" + samples[5][0][1:], samples[5][1])] + samples[6:]
    changed_label = samples[:5] + [(samples[5][0], (samples[5][1] + 1) % 3)] + samples[6:]
    others = {
        "sample": _pack(tmp_path / "b.shc", changed_byte, meta={"classes": ["x", "y", "z"]}),
        "label": _pack(tmp_path / "c.shc", changed_label, meta={"classes": ["x", "y", "z"]}),
        "meta": _pack(tmp_path / "d.shc", samples, meta={"classes": ["x", "y", "w"]}),
        "count": _pack(tmp_path / "e.shc", samples[:-1], meta={"classes": ["x", "y", "z"]}),
    }
    for what, store in others.items():
        assert store.fingerprint != fp, f"a store with another {what} has another fingerprint"


def test_fingerprint_refuses_a_file_replaced_under_the_open_store(tmp_path):
    path = tmp_path / "a.shc"
    store = _pack(path, [(b"one", 0)])
    _pack(tmp_path / "b.shc", [(b"two", 0)])
    os.replace(tmp_path / "b.shc", path)
    with pytest.raises(sc.StoreFormatError, match="replaced"):
        store.fingerprint


def test_fingerprint_refuses_a_store_overwritten_in_place(tmp_path):
    """`cp b.shc a.shc` rewrites a.shc's inode: the open store still serves a's directory, so
    the fingerprint of what is now in the file is not its fingerprint."""
    a, b = tmp_path / "a.shc", tmp_path / "b.shc"
    _pack(a, [(b"one" * 10, 0), (b"two" * 10, 1)])
    _pack(b, [(b"ONE" * 10, 0), (b"TWO" * 10, 1), (b"3", 2)])
    store = sc.PackedStore(a)
    shutil.copyfile(b, a)
    with pytest.raises(sc.StoreFormatError, match="rewritten"):
        store.fingerprint


def test_a_structured_array_whose_field_name_holds_O_is_plain_numbers(tmp_path, cache_factory):
    a = np.zeros(3, dtype=[("Offset", "<i4"), ("x", "<f4")])
    a["Offset"] = [1, 2, 3]
    assert not a.dtype.hasobject
    _pack(tmp_path / "s.shc", [(a, 0)])
    assert sc.PackedStore(tmp_path / "s.shc").read(0) == a.tobytes()
    c = cache_factory(4)
    assert c.put(0, a) and c.get(0) == a.tobytes()


def test_a_fortran_order_array_is_refused_like_a_strided_one(tmp_path):
    f = np.arange(6, dtype=np.int32).reshape(2, 3).T
    with pytest.raises(TypeError, match="item 1"):
        sc.pack([(b"ok", 0), (f, 1)], tmp_path / "p.shc", progress=False)


@pytest.mark.parametrize("label,error", [(1.5, TypeError), ("3", TypeError), (1 << 63, ValueError)])
def test_labels_must_be_int64_integers(tmp_path, label, error):
    with pytest.raises(error, match="label"):
        _pack(tmp_path / "s.shc", [(b"x", label)])
    assert not (tmp_path / "s.shc").exists()


def test_a_shuffled_writer_that_cannot_write_its_header_leaves_nothing_behind(tmp_path):
    """The header block is written when a shuffled writer starts (before samples are staged).
    Under a file-size limit below it (RLIMIT_FSIZE, SIGXFSZ ignored: the write fails with EFBIG),
    the constructor's OSError names the temporary file and nothing stays: no temporary file in
    the directory, no descriptor open on it or on the staging file (before, both were left)."""
    import subprocess
    import sys
    import textwrap

    d = tmp_path / "out"
    d.mkdir()
    code = textwrap.dedent(f"""
        import errno, os, resource, signal
        import shadecache as sc
        d = {str(d)!r}
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
        try:
            sc.PackWriter(os.path.join(d, "s.shc"), shuffle=True)
        except OSError as e:
            assert e.errno == errno.EFBIG and "s.shc.tmp." in str(e), e
        else:
            raise SystemExit("a writer started past the file-size limit")
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{{fd}}")
            except OSError:
                continue
            if target.startswith(os.path.realpath(d)):
                fds.append(target)
        print("left", sorted(os.listdir(d)), "fds", fds)
    """)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=repo),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "left [] fds []", r.stdout
