"""The two I/O backends, the fallback from io_uring to the pread pool, and fork/spawn safety.

Refusal of io_uring is simulated with SHADECACHE_IOURING_DISABLE=1, which makes the ring's
creation fail with EPERM exactly where a seccomp filter would (csrc/io/uring_backend.cc).
"""
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import shadecache as sc
from shadecache import _io

HAVE_URING = _io.built_with_uring() and _io.probe_backend("io_uring", 8)[0] == "io_uring"
needs_uring = pytest.mark.skipif(not HAVE_URING, reason="io_uring unavailable on this machine")
# The simulated refusal acts inside the io_uring backend, which a build without liburing lacks
# (there the fallback is taken for that reason instead, and the other tests cover it).
needs_uring_build = pytest.mark.skipif(not _io.built_with_uring(), reason="built without liburing")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def store_file(tmp_path_factory):
    rng = np.random.default_rng(3)
    data = [rng.bytes(int(n)) for n in rng.integers(0, 30000, 400)]
    path = tmp_path_factory.mktemp("b") / "b.shc"
    sc.pack([(d, i % 10) for i, d in enumerate(data)], path, progress=False)
    return path, data


@needs_uring
def test_auto_uses_io_uring_when_allowed(store_file):
    path, data = store_file
    s = sc.PackedStore(path)
    assert s.backend == "io_uring" and s.fallback_reason == ""


@needs_uring_build
def test_simulated_refusal_falls_back_and_says_so_once(store_file, tmp_path):
    path, data = store_file
    code = textwrap.dedent(f"""
        import warnings, shadecache as sc
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as w:
            stores = [sc.PackedStore({str(path)!r}) for _ in range(3)]
            f = sc.FolderStore(files=[({str(path)!r}, 0)])
        print("BACKENDS", [s.backend for s in stores] + [f.backend])
        print("WARNINGS", len(w))
        print("MESSAGE", w[0].message if w else "")
        print("READ", stores[0].read(5) == open({str(path)!r}, "rb").read()[stores[0].offset(5):]
              [:len(stores[0].read(5))])
        try:
            sc.PackedStore({str(path)!r}, backend="io_uring")
        except OSError as e:
            print("FORCED", e.errno)
    """)
    env = dict(os.environ, SHADECACHE_IOURING_DISABLE="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["BACKENDS"] == "['pread', 'pread', 'pread', 'pread']"
    assert lines["WARNINGS"] == "1"  # said once, not once per store
    assert "Operation not permitted" in lines["MESSAGE"] and "pread" in lines["MESSAGE"]
    assert lines["READ"] == "True"
    assert lines["FORCED"] == "1"  # EPERM: asking for io_uring explicitly is an error


@needs_uring_build
def test_simulated_refusal_in_process(store_file, monkeypatch):
    path, data = store_file
    monkeypatch.setenv("SHADECACHE_IOURING_DISABLE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = sc.PackedStore(path, backend="auto", queue_depth=8)
    assert s.backend == "pread" and "SHADECACHE_IOURING_DISABLE" in s.fallback_reason
    ids = np.random.default_rng(0).integers(0, len(data), 1000)
    assert s.read_many(ids) == [data[i] for i in ids]
    with pytest.raises(OSError) as ei:
        sc.PackedStore(path, backend="io_uring")
    assert ei.value.errno == 1 and "io_uring" in str(ei.value)


@pytest.mark.parametrize("backend", ["pread"] + (["io_uring"] if HAVE_URING else []))
@pytest.mark.parametrize("qd", [1, 3, 64])
def test_backends_agree_at_any_queue_depth(store_file, backend, qd):
    path, data = store_file
    ids = np.random.default_rng(qd).integers(0, len(data), 700)
    for direct in (False, True):
        s = sc.PackedStore(path, backend=backend, direct=direct, queue_depth=qd)
        assert s.read_many(ids) == [data[i] for i in ids]


def test_read_many_releases_the_gil(store_file):
    """Python threads make progress while read_many waits: a counter thread keeps counting."""
    import threading

    path, data = store_file
    s = sc.PackedStore(path, direct=True, queue_depth=4)
    ids = np.tile(np.arange(len(data)), 20)
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        before = ticks
        s.read_many(ids)  # one native call of 8000 reads
        during = ticks - before
    finally:
        stop.set()
        t.join()
    assert during > 100


def test_concurrent_threads_share_one_store(store_file):
    from concurrent.futures import ThreadPoolExecutor

    path, data = store_file
    s = sc.PackedStore(path, queue_depth=16)
    rng = np.random.default_rng(9)
    batches = [rng.integers(0, len(data), 300) for _ in range(16)]
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(s.read_many, batches))
    for ids, got in zip(batches, results):
        assert got == [data[i] for i in ids]
    # short-lived threads one after another (thread ids get reused), and the opener again: the
    # opener's ring is bound to it (SINGLE_ISSUER), every other thread must be sent elsewhere
    import threading

    for ids in batches[:6]:
        out = []
        t = threading.Thread(target=lambda: out.append(s.read_many(ids)))
        t.start()
        t.join()
        assert out == [[data[i] for i in ids]]
    assert s.read_many(batches[0]) == [data[i] for i in batches[0]]


@pytest.mark.parametrize("backend", ["pread"] + (["io_uring"] if HAVE_URING else []))
def test_fork_child_builds_its_own_backend(store_file, backend):
    path, data = store_file
    s = sc.PackedStore(path, backend=backend, direct=True, queue_depth=8)
    assert s.read_many([1, 2]) == [data[1], data[2]]  # ring/pool exists in the parent
    parent_owner = s._r.backend_pid
    assert parent_owner == os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        ok = 0
        try:
            ids = list(range(len(data)))
            ok = (s.read_many(ids) == data and s._r.backend_pid == os.getpid()
                  and s.backend == backend)
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)
    # the parent's ring was not disturbed by the child
    assert s._r.backend_pid == os.getpid()
    assert s.read_many(range(len(data))) == data


class Probe:
    """A data set that reports which process and which backend served each sample."""

    def __init__(self, store):
        self.store = store

    def __len__(self):
        return len(self.store)

    def __getitem__(self, i):
        data, label = self.store[i]
        return data, label, os.getpid(), self.store._r.backend_pid, self.store.backend


def keep(batch):
    return batch


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_dataloader_workers(store_file, ctx):
    torch = pytest.importorskip("torch")
    path, data = store_file
    s = sc.PackedStore(path, direct=True, queue_depth=16)
    s.read(0)  # the parent has its ring before the workers are forked
    loader = torch.utils.data.DataLoader(Probe(s), batch_size=16, num_workers=2,
                                         multiprocessing_context=ctx, collate_fn=keep,
                                         shuffle=True)
    seen = []
    pids = set()
    for batch in loader:
        for b, label, pid, owner, backend in batch:
            assert pid == owner != os.getpid()  # each worker read through its own ring/pool
            assert backend == s.backend
            pids.add(pid)
            seen.append((b, label))
    assert len(pids) == 2
    assert sorted(seen) == \
        sorted((d, i % 10) for i, d in enumerate(data))
