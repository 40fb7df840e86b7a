"""A seconds-long run of bench/cache_table.py with tiny sizes, so the benchmark code cannot rot.

Speed is not checked here (targets live in bench/); what is checked: every comparison runs against
the real Cache and real alternatives, produces finite figures whose PASS/FAIL agrees with them,
the Markdown writer replaces exactly its own section, the chart is a PNG, and nothing is left in
/dev/shm or the temporary directory.
"""
import glob
import math
import os
import sys
import tempfile

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import baselines  # noqa: E402
import cache_table as ct  # noqa: E402
from workload import ValueSet, access_order, run_interleaved  # noqa: E402


def _leftovers():
    # Only this process's: segment names carry the pid, and temporary directories are made in a
    # private folder (below), so a benchmark another job runs on this machine is not counted.
    pid = f"-{os.getpid()}-"
    shm = {p for p in glob.glob("/dev/shm/*")
           if "shadecache-bench" in os.path.basename(p) and pid in os.path.basename(p)}
    tmp = set(glob.glob(os.path.join(tempfile.gettempdir(), "shadecache-bench-*")))
    return shm | tmp


@pytest.fixture
def no_leaks(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("bench-tmp")))
    before = _leftovers()
    yield
    assert _leftovers() - before == set()


def _check_rows(rows):
    assert rows
    for r in rows:
        assert math.isfinite(r.cache_figure) and r.cache_figure > 0, r
        if r.kind == "ratio" and r.alternative_figure == r.alternative_figure:  # not a skipped line
            assert math.isfinite(r.ratio) and r.ratio > 0, r
        if r.target is not None:
            assert r.passed == (r.margin >= 1.0), r


def test_value_set_detects_wrong_bytes():
    vs = ValueSet(10, 64)
    vs.check_value(3, vs.value(3))
    with pytest.raises(AssertionError, match="id 3"):
        vs.check_value(3, vs.value(4))
    with pytest.raises(AssertionError, match="miss"):
        vs.check_value(3, None)
    assert vs.value(3) != vs.value(4) and len(vs.value(9)) == 64


def test_access_order_is_a_permutation_per_pass():
    ids = access_order(100, 250)
    assert sorted(ids[:100]) == list(range(100)) and sorted(ids[100:200]) == list(range(100))


def test_baselines_fill_verify_and_clean_up(no_leaks):
    vs = ValueSet(300, 3 * 1024)
    ids = access_order(vs.n, 300)
    with baselines.ShmDictStore(vs) as shm, baselines.LmdbStore(vs) as lm:
        shm.verify(ids)
        lm.verify(ids)
        lm.reopen(lock=True)
        lm.verify(ids[:10])
        keys = [baselines.lmdb_key(i) for i in ids]
        t = run_interleaved({
            "shm": lambda r: ct.timed(baselines.shm_dict_get_loop, shm.buf, shm.index, ids),
            "lmdb": lambda r: ct.timed(baselines.lmdb_get_loop, lm.env, keys),
            "copy": lambda r: ct.timed(baselines.plain_copy_loop, shm.buf,
                                       ct.random_offsets(len(shm.buf), 4096, 50), 4096),
        }, 2)
        assert all(v > 0 for v in t.values())
        lm.warm()
        assert lm.timed_gets(keys) > 0


def test_redis_baseline_or_clear_skip(no_leaks):
    with pytest.raises(baselines.RedisUnavailable, match="not on PATH"):
        baselines.RedisStore(ValueSet(4, 64), server="redis-server-that-does-not-exist")
    vs = ValueSet(200, 1024)
    try:
        store = baselines.RedisStore(vs)
    except baselines.RedisUnavailable as exc:
        pytest.skip(str(exc))
    with store:
        assert "Hiredis" in store.parser
        store.verify(list(range(vs.n)))
        pid = store.proc.pid
    assert store.proc is None and not os.path.exists(f"/proc/{pid}")  # stopped and reaped


def test_cache_table_tiny_run_writes_section_and_png(tmp_path, no_leaks):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nintro\n\n## Shared-memory cache\n\n_pending_\n\n"
                  "## Packed sample store\n\nkeep me\n")
    png = tmp_path / "img" / "cache_bench.png"
    rc = ct.main(["--tiny", "--md", str(md), "--png", str(png)])
    text = md.read_text()
    assert rc in (0, 1)
    assert "_pending_" not in text and "keep me" in text and text.startswith("# Benchmarks\n\nintro")
    section = text.split("## Shared-memory cache")[1].split("## Packed sample store")[0]
    assert "python bench/cache_table.py --tiny" in section
    for what in ("`get` 3 KB", "`get_many(64)` 3 KB", "`put` 3 KB", "`update_scores`"):
        assert what in section
    assert ("FAIL" in section) == (rc == 1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_comparison_returns_consistent_rows(no_leaks):
    cfg = ct.Config.tiny()
    for compare in ct.COMPARISONS:
        _check_rows(compare(cfg))


def test_write_section_rejects_a_file_without_the_section(tmp_path):
    md = tmp_path / "B.md"
    md.write_text("# nothing here\n")
    with pytest.raises(ValueError, match="no section"):
        ct.write_section(str(md), "x\n")


def test_pytest_benchmark_file_runs_tiny(no_leaks):
    import subprocess

    repo = os.path.dirname(BENCH)
    env = dict(os.environ, SHADECACHE_BENCH_TINY="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(BENCH, "bench_cache.py"), "--benchmark-only"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=240)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "failed" not in proc.stdout and "error" not in proc.stdout, tail


def test_efficiency_bench_tiny_rows(capsys):
    """bench/bench_efficiency.py's row and hit-ratio code on tiny caches: the figures it prints
    come from the bytes get returns and the file's blocks, and the row checks its own values."""
    import numpy as np

    import bench_efficiency as be

    r = be.measure_row("3 KB", np.full(600, 3000, np.int64), 1 << 20, True, phases=((1, 0), (1, 1)))
    assert 0.5 < r["values0"] <= 1.0 and 0.5 < r["values1"] <= 1.0, r
    assert 1.0 <= r["ram1"] <= 1.0 + (1 << 20) / r["cap"], r
    r = be.shifting_row(2 << 20, False)
    assert r["values0"] > 0.5, r
    be.hit_ratio(n=300, epochs=2)
    assert "hit ratio" in capsys.readouterr().out
