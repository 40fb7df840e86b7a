"""`shadecache` as a user runs it: one error handler for every subcommand (cli.main)."""
import os
import subprocess
import sys

import shadecache as sc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUT_VERSION_OFFSET = 8   # csrc/cache/layout.h: u64 magic, then u32 layout_version


def cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "shadecache.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)


def test_a_segment_of_another_layout_version_is_one_line_not_a_traceback(cache_name):
    with sc.Cache.create(cache_name, num_samples=10, capacity_bytes=1 << 20) as c:
        c.put(1, b"abc")
        with open(f"/dev/shm/shadecache.{cache_name}", "r+b") as f:
            f.seek(LAYOUT_VERSION_OFFSET)
            f.write((999).to_bytes(4, "little"))
        for cmd in (["stats", cache_name], ["ls"]):
            res = cli(*cmd)
            assert "Traceback" not in res.stderr, res.stderr
        res = cli("stats", cache_name)
        assert res.returncode == 2, res
        assert "LayoutVersionError" in res.stderr and cache_name in res.stderr, res.stderr


def test_store_and_cache_errors_share_the_exit_status(tmp_path, cache_name):
    junk = tmp_path / "junk.shc"
    junk.write_bytes(b"not a store" * 100)
    store = cli("info", str(junk))
    cache = cli("stats", cache_name)   # no such cache
    assert store.returncode == cache.returncode == 2, (store, cache)
    assert store.stderr.startswith("shadecache info: StoreFormatError: "), store.stderr
    assert cache.stderr.startswith("shadecache stats: "), cache.stderr
    assert cache_name in cache.stderr
