"""FolderStore: the store interface over one file per sample, batched open/read/close."""
import os
import pickle

import numpy as np
import pytest

import shadecache as sc
from shadecache import _io

BACKENDS = ["pread"]
if _io.built_with_uring() and _io.probe_backend("io_uring", 8)[0] == "io_uring":
    BACKENDS.append("io_uring")


@pytest.fixture
def tree(tmp_path):
    """root/<class>/<file> with sizes from 0 bytes to 1 MB; returns (root, [(bytes, label)])."""
    rng = np.random.default_rng(5)
    root = tmp_path / "imgs"
    expected = []
    for label, cls in enumerate(["ant", "bee", "cow"]):
        (root / cls).mkdir(parents=True)
        for j in range(40):
            size = [0, 1, 4096, 1 << 20][j] if j < 4 else int(rng.integers(1, 50000))
            d = rng.bytes(size)
            (root / cls / f"{j:03d}.jpg").write_bytes(d)
            expected.append((d, label))
    return root, expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qd", [1, 8, 64])
def test_folder_round_trip(tree, backend, qd):
    root, expected = tree
    s = sc.FolderStore(root, backend=backend, queue_depth=qd)
    assert s.backend == backend and len(s) == len(expected)
    assert s.classes == ["ant", "bee", "cow"]
    ids = np.random.default_rng(qd).integers(0, len(s), 500)  # > queue depth, with repeats
    assert s.read_many(ids) == [expected[i][0] for i in ids]
    assert [s.read(i) for i in range(len(s))] == [d for d, _ in expected]
    assert s.labels.tolist() == [lab for _, lab in expected]
    assert s[41] == expected[41]
    assert s.path(0).endswith(os.path.join("ant", "000.jpg"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_folder_bad_input(tree, backend):
    root, expected = tree
    s = sc.FolderStore(root, backend=backend)
    with pytest.raises(IndexError, match="sample id 120 out of range"):
        s.read_many([0, 120])
    with pytest.raises(IndexError):
        s.read(-1)
    victim = s.path(45)
    os.remove(victim)  # a file that disappeared after the scan
    with pytest.raises(FileNotFoundError) as ei:
        s.read_many([1, 2, 45, 3])
    assert "sample 45" in str(ei.value) and victim in str(ei.value)
    assert s.read_many([1, 2]) == [expected[1][0], expected[2][0]]  # still usable
    # the batch drained: no descriptor leaked by the failed batch
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(FileNotFoundError):
            s.read_many(list(range(40, 60)))
    assert len(os.listdir("/proc/self/fd")) == fds


def test_folder_empty_and_missing(tmp_path):
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(ValueError, match="no samples found under"):
        sc.FolderStore(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        sc.FolderStore(tmp_path / "absent")
    with pytest.raises(ValueError):
        sc.FolderStore(files=[])


def test_folder_from_files_and_pickle(tree):
    root, expected = tree
    s = sc.FolderStore(root, queue_depth=5)
    t = pickle.loads(pickle.dumps(s))
    assert t.read_many(range(len(t))) == [d for d, _ in expected] and t.queue_depth == 5
    f = sc.FolderStore(files=[(s.path(3), 9), (s.path(50), 8)])
    assert f.read_many([1, 0]) == [expected[50][0], expected[3][0]]
    assert f.labels.tolist() == [9, 8]
    g = pickle.loads(pickle.dumps(f))
    assert g.read_many([0, 1]) == f.read_many([0, 1]) and g.labels.tolist() == [9, 8]


def test_folder_and_pack_agree(tree, tmp_path):
    root, expected = tree
    sc.pack(root, tmp_path / "p.shc", progress=False)
    p = sc.PackedStore(tmp_path / "p.shc")
    f = sc.FolderStore(root)
    ids = list(range(len(f)))
    assert p.read_many(ids) == f.read_many(ids)
    assert p.labels.tolist() == f.labels.tolist() and p.classes == f.classes


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_file_too_large_to_hold_fails_alone(tmp_path, backend):
    """One sparse 15 TB file in the folder: its read fails with CapacityError naming it, no
    descriptor leaks, and later batches (on the same ring) read the other files correctly (an
    allocation failure used to escape the completion loop and leave the ring's completions
    unconsumed, breaking every later batch)."""
    root = tmp_path / "f" / "a"
    root.mkdir(parents=True)
    for j in range(6):
        (root / f"f{j}").write_bytes(b"file%d" % j)
    with open(root / "f3", "r+b") as f:
        f.truncate(15 << 40)
    s = sc.FolderStore(tmp_path / "f", backend=backend, queue_depth=8)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(sc.CapacityError, match="sample 3: read .*f3"):
        s.read_many([0, 1, 2, 3, 4, 5])
    for ids in ([0, 1, 2, 4, 5], [5, 4, 2, 1, 0]):
        assert s.read_many(ids) == [b"file%d" % i for i in ids]
    assert len(os.listdir("/proc/self/fd")) == fds
