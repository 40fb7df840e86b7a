"""The fuzz harness, the shared pread pool and store hardening: reproducers.

Each test fails on 0ce1b4d (main after the merge). Crashes, hangs and heap corruption are
run in a child process so that the suite reports them as failures instead of dying.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import shadecache as sc
from shadecache.store import probe_backend

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUZZ = os.path.join(REPO, "tests", "fuzz")


def run_py(code, timeout=60, env=None):
    e = dict(os.environ, PYTHONPATH=REPO)
    e.update(env or {})
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as t:
        pytest.fail(f"hung for {timeout} s: {t.stdout!r}")


def make_store(path, n, size, seed=0):
    with sc.PackWriter(path, meta={}) as w:
        for i in range(n):
            w.add(bytes([(i + seed) % 256]) * (size + i), i)
    return str(path)


@pytest.fixture
def big_store(tmp_path):
    return make_store(tmp_path / "big.shc", 2000, 16000)


# ---- store close() racing a read of the same store ---------------------------------------------

@pytest.mark.parametrize("backend", ["pread", "io_uring"])
def test_close_while_another_thread_reads_is_an_error_not_a_crash(big_store, backend):
    """close() now frees the backend (the ring, the share of the pool) while a read of the same
    store is still inside it: io_uring segfaults, pread hangs (the last close joins the pool the
    reader is waiting on). It used to be an OSError (EBADF)."""
    if backend == "io_uring" and probe_backend("io_uring")[0] != "io_uring":
        pytest.skip("no io_uring here")
    r = run_py(f"""
        import threading, time, shadecache as sc
        for attempt in range(3):
            s = sc.PackedStore({big_store!r}, backend={backend!r})
            s.read(0)
            got = []
            def reader():
                try:
                    for _ in range(40):
                        s.read_many(list(range(2000)))
                    got.append("done")
                except (sc.ClosedError, OSError) as e:
                    got.append(type(e).__name__)
            t = threading.Thread(target=reader); t.start()
            time.sleep(0.03)
            s.close()
            t.join()
            print(attempt, got, flush=True)
        print("ok")
        """, timeout=90)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stdout, r.stderr[-500:])


# ---- the shared pool serialises every pread read of the process --------------------------------

_SLOW_PREAD = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>
static ssize_t (*real)(int, void*, size_t, off_t);
static ssize_t slow(int fd, void* b, size_t n, off_t off) {
  if (!real) real = (ssize_t (*)(int, void*, size_t, off_t))dlsym(RTLD_NEXT, "pread64");
  if (off >= 4096 && getenv("SLOW_ON")) usleep(50000);
  return real(fd, b, n, off);
}
ssize_t pread64(int fd, void* b, size_t n, off_t off) { return slow(fd, b, n, off); }
ssize_t pread(int fd, void* b, size_t n, off_t off) { return slow(fd, b, n, off); }
"""


@pytest.fixture
def slow_pread(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the pread shim")
    src, so = tmp_path / "slow.c", tmp_path / "slow.so"
    src.write_text(_SLOW_PREAD)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(so), str(src), "-ldl"], check=True)
    return str(so)


def test_pread_reads_of_two_stores_in_two_threads_overlap(tmp_path, slow_pread):
    """Every pread read of the process goes through one pool whose run() holds job_mu_ for the
    whole batch: two stores read from two threads (or the lanes of a ReadStream, or the prefetcher's
    read_many threads) take turns. With each pread taking 50 ms, 2 x 10 reads take ~1.0 s
    instead of ~0.5 s (on cfcfd78, per-store threads: 0.62 s)."""
    p = make_store(tmp_path / "s.shc", 16, 100)
    r = run_py(f"""
        import os, threading, time, shadecache as sc
        A = sc.PackedStore({p!r}, backend="pread", queue_depth=1)
        B = sc.PackedStore({p!r}, backend="pread", queue_depth=1)
        A.read(0); B.read(0)
        os.environ["SLOW_ON"] = "1"
        def go(s):
            for k in range(10): s.read(k)
        t0 = time.monotonic()
        th = [threading.Thread(target=go, args=(s,)) for s in (A, B)]
        [t.start() for t in th]; [t.join() for t in th]
        print(time.monotonic() - t0)
        """, env={"LD_PRELOAD": slow_pread})
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) < 0.8, f"two threads took {float(r.stdout):.2f} s: serialised"


# ---- FolderStore.close() ------------------------------------------------------------------------

def test_folder_store_close_leaves_no_pool_threads(tmp_path):
    """FolderStore.close() is NativeStore's no-op: a pread FolderStore keeps the pool (15 threads
    here) and keeps reading after close()."""
    (tmp_path / "c").mkdir()
    for i in range(4):
        (tmp_path / "c" / f"{i}.bin").write_bytes(b"x" * 10)
    p = make_store(tmp_path / "s.shc", 4, 10)
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    s = sc.PackedStore(p, backend="pread")
    s.read_many([0, 1, 2, 3])
    s.close()
    base = threads()
    f = sc.FolderStore(tmp_path, backend="pread")
    assert f.read_many([0, 1, 2, 3]) == [b"x" * 10] * 4
    f.close()
    assert threads() == base
    with pytest.raises(sc.ClosedError):
        f.read(0)


# ---- ReadStream (csrc/io/read_stream.cc) ----------------------------------------------------------

def test_stream_reads_the_file_the_store_opened(tmp_path):
    """ReadStream reopens the store by path (plain open, no inode check): after a re-pack was
    renamed over the path it reads the new file at the old directory's offsets (wrong bytes
    with verify=False, a false CorruptSampleError with it), where read_many reads the file
    that was opened and validated."""
    from shadecache import _io
    p = make_store(tmp_path / "a.shc", 8, 5000, seed=0)
    q = make_store(tmp_path / "b.shc", 8, 5000, seed=100)
    s = sc.PackedStore(p, backend="pread", verify=False)
    os.replace(q, p)
    want = s.read_many([3])
    st = _io.ReadStream(s._r, "pread", 8, 2)
    try:
        st.submit(s._r, [3])
        assert st.take() == want
    finally:
        st.close()
        s.close()


def test_stream_on_a_path_now_a_fifo_does_not_hang(tmp_path):
    """The same reopen blocks forever when a FIFO now sits at the path (defect 1, again)."""
    p = make_store(tmp_path / "a.shc", 4, 100)
    r = run_py(f"""
        import os, shadecache as sc
        from shadecache import _io
        s = sc.PackedStore({p!r}, backend="pread")
        os.unlink({p!r}); os.mkfifo({p!r})
        st = _io.ReadStream(s._r, "pread", 8, 2)
        st.submit(s._r, [1]); assert st.take()[0] == bytes([1]) * 101
        print("ok")
        """, timeout=20)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-500:]


@pytest.mark.parametrize("backend", ["pread", "io_uring"])
def test_stream_close_while_take_waits_does_not_free_bytes_in_flight(big_store, backend):
    """take() waiting in one thread, close() in another: take() wakes with 'closed', and the
    binding pops and frees the batch's bytes objects while a lane is still reading into them
    (close() joins the lanes only afterwards): glibc aborts 'corrupted size vs. prev_size'."""
    if backend == "io_uring" and probe_backend("io_uring")[0] != "io_uring":
        pytest.skip("no io_uring here")
    r = run_py(f"""
        import gc, threading, time, shadecache as sc
        from shadecache import _io
        s = sc.PackedStore({big_store!r}, backend={backend!r}, direct=True)
        st = _io.ReadStream(s._r, {backend!r}, 2, 2, "spread")  # one read in flight per lane: slow batches
        for k in range(4):
            st.submit(s._r, list(range(k * 500, k * 500 + 500)))
        def taker():
            try:
                while True: st.take()
            except sc.ClosedError:
                pass
        t = threading.Thread(target=taker); t.start()
        time.sleep(0.02)
        st.close()
        t.join()
        junk = [bytes(16000) for _ in range(4000)]; del junk; gc.collect()
        print("ok")
        """)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stderr[-500:])


def test_stream_dropped_in_a_forked_child_does_not_abort(tmp_path):
    """ReadStream::close() returns early in a forked child (right: the lanes are not there), and
    then ~ReadStream destroys joinable std::threads: std::terminate, SIGABRT."""
    p = make_store(tmp_path / "a.shc", 4, 100)
    r = run_py(f"""
        import gc, os, shadecache as sc
        from shadecache import _io
        s = sc.PackedStore({p!r}, backend="pread")
        st = _io.ReadStream(s._r, "pread", 8, 2)
        pid = os.fork()
        if pid == 0:
            del st; gc.collect()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child status", status)
        st.close()
        """)
    assert r.returncode == 0 and "child status 0" in r.stdout, (r.stdout, r.stderr[-300:])


def test_stream_lanes_that_cannot_start_are_an_oserror(tmp_path):
    """ReadStream's constructor starts its lanes with emplace_back(std::thread): when one cannot
    start, the constructor throws with the earlier lanes running and joinable: std::terminate."""
    p = make_store(tmp_path / "a.shc", 4, 100)
    r = run_py(f"""
        import resource, shadecache as sc
        from shadecache import _io
        s = sc.PackedStore({p!r}, backend="pread")
        vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1])
        lim = vm * 1024 + (40 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        try:
            st = _io.ReadStream(s._r, "pread", 32, 16)
            st.close()
            print("started")
        except OSError as e:
            print("oserror:", e)
        """)
    assert r.returncode == 0 and ("oserror" in r.stdout or "started" in r.stdout), \
        (r.returncode, r.stderr[-300:])


# ---- ids given as a list ---------------------------------------------------------------------

def test_a_list_changed_by_an_ids_index_is_not_read_after_free(tmp_path):
    """integer_ids walks PySequence_Fast_ITEMS of a list while as_id() runs __index__, which
    may change the list: the next items are read from freed memory ('got object', a type that
    was never in the list, or a segfault; run in a child). Taken as the list was when the call
    began, ids 10**6.. are out of range."""
    p = make_store(tmp_path / "a.shc", 4, 100)
    r = run_py(f"""
        import shadecache as sc
        s = sc.PackedStore({p!r}, backend="pread")
        class Evil:
            def __index__(self):
                ids.clear()
                [object() for _ in range(1000)]
                return 0
        ids = [Evil()] + [10**6 + k for k in range(1000)]
        try:
            s.read_many(ids)
        except IndexError:
            print("ok")
        """)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stdout, r.stderr[-300:])


# ---- paths -----------------------------------------------------------------------------------

def test_a_path_with_a_nul_byte_is_refused_not_cut(tmp_path):
    """os.fsencode keeps a NUL; the native side's c_str() stops at it, so PackWriter('x.shc\\0')
    writes x.shc and FolderStore reads another file than the one named. Python's open() says
    ValueError('embedded null byte')."""
    (tmp_path / "a").write_bytes(b"AAA")
    with pytest.raises(ValueError):
        sc.FolderStore(files=[(str(tmp_path / "a") + "\0/etc/passwd", 0)]).read(0)
    with pytest.raises(ValueError):
        with sc.PackWriter(str(tmp_path / "x.shc") + "\0.tmp") as w:
            w.add(b"abc", 0)
    assert not (tmp_path / "x.shc").exists()


def test_cli_prints_a_non_utf8_path_with_a_strict_stdout(tmp_path):
    """Paths need not be UTF-8 (docs/errors.md), but info/verify print them to stdout, which is
    errors='strict' in any UTF-8 locale but C.UTF-8 (PYTHONIOENCODING=utf-8 stands for
    en_US.UTF-8 here): a valid store exits 2 'UnicodeEncodeError'. The CLI fuzzer cannot see
    this: it captures stdout in a StringIO, which takes surrogates."""
    p = os.fsdecode(os.fsencode(str(tmp_path)) + b"/g\xff.shc")
    make_store(p, 4, 100)
    for cmd in ("info", "verify"):
        r = subprocess.run([sys.executable, "-m", "shadecache.cli", cmd, p], capture_output=True,
                           env=dict(os.environ, PYTHONPATH=REPO, PYTHONIOENCODING="utf-8"))
        assert r.returncode == 0, (cmd, r.stderr[-300:])


# ---- the fuzzers' oracles ----------------------------------------------------------------------

def test_harness_reports_a_child_that_dies_after_its_last_input(tmp_path, monkeypatch):
    """fuzz_harness.run() counts a crash only when the child dies before its last input; a
    SIGSEGV in teardown or at interpreter exit (a store's destructor, the pool's join) is
    silently dropped."""
    mod = tmp_path / "fuzz_exitcrash.py"
    mod.write_text(textwrap.dedent("""
        import ctypes
        BUDGET_MB = 64
        TIMEOUT_S = 5.0
        def setup(workdir): return None
        def generate(rng): return b"\\0"
        def run(state, data): pass
        def teardown(state): ctypes.string_at(0)
        """))
    monkeypatch.syspath_prepend(FUZZ)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), REPO]))
    import fuzz_harness
    res = fuzz_harness.run("exitcrash", 3, seed=1, findings_dir=str(tmp_path / "out"))
    assert [k for k, _ in res.findings] == ["crash"], res.findings


def test_store_oracle_fails_when_valid_metadata_is_refused(tmp_path, monkeypatch):
    """fuzz_store.run() accepts StoreFormatError from meta/classes whatever the metadata is, so
    a store that refused every valid metadata object would pass 1,000,000 inputs."""
    monkeypatch.syspath_prepend(FUZZ)
    import fuzz_harness
    import fuzz_store

    def refuse(self):
        raise sc.StoreFormatError("refused")

    state = fuzz_store.setup(str(tmp_path))
    monkeypatch.setattr(sc.PackedStore, "meta", property(refuse))
    found = 0
    for i in range(100):
        try:
            fuzz_store.run(state, fuzz_store.generate(fuzz_harness.input_rng(7, i)))
        except fuzz_harness.Finding:
            found += 1
    state["anchor"].close()
    assert found > 0
