"""bench/bench_store.py runs end to end at tiny sizes and prints its table (a smoke test: the
figures of a run this small mean nothing; BENCHMARKS.md has the real run)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_store_quick(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_store.py"), "--quick",
                          "--no-fio", "--dir", str(tmp_path / "b"),
                          "--json", str(tmp_path / "r.json")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "FolderStore warm cache" in out.stdout and "4 KB warm cache" in out.stdout
    assert not os.path.exists(tmp_path / "b")  # the benchmark removes its files
    with open(tmp_path / "r.json") as f:
        res = json.load(f)
    assert res["4k_vs_pread_warm"]["ours"] > 0 and res["folder_warm"]["loop"] > 0
