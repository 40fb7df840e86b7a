"""`shadecache ls | stats | rm | gc` against real segments and a really killed creator."""
import json
import os
import signal
import subprocess
import sys

import shadecache as sc
from shadecache import _core
from shadecache.cache import huge_pages

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "shadecache.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_ls_stats_rm(cache_name):
    with sc.Cache.create(cache_name, num_samples=10, capacity_bytes=1 << 20, policy="lru") as c:
        c.put(1, b"abc")
        c.get(1)
        c.get(2)
        res = cli("ls")
        assert res.returncode == 0, res.stderr
        line = next(l for l in res.stdout.splitlines() if l.startswith(cache_name))
        assert "lru" in line and "0.500" in line and str(os.getpid()) in line
        res = cli("stats", cache_name)
        stats = json.loads(res.stdout)
        assert stats["items"] == 1 and stats["hits"] == 1 and stats["misses"] == 1
        # the CLI's own mapping of the segment (resident: at least the header it read)
        assert stats["huge_pages"]["shm_mode"] == huge_pages.shm_mode()
        assert stats["huge_pages"]["resident_bytes"] > 0
        res = cli("rm", cache_name)
        assert res.returncode == 0 and f"removed {cache_name}" in res.stdout
        assert cache_name not in _core.CacheCore.list()
        assert c.get(1) == b"abc", "a removed name stays usable by processes that have it mapped"
    res = cli("rm", cache_name)
    assert res.returncode == 1 and "no cache named" in res.stderr
    res = cli("stats", cache_name)
    assert res.returncode != 0 and "no cache named" in res.stderr


def test_gc_removes_segments_of_killed_creators(cache_name):
    code = ("import shadecache as sc, time, sys; "
            f"c = sc.Cache.create({cache_name!r}, num_samples=10, capacity_bytes=1 << 20); "
            "c.put(0, b'x'); print('ready', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "ready"
    live = sc.Cache.attach(cache_name)  # a live attacher does not keep gc away: the creator decides
    res = cli("gc")
    assert cache_name in _core.CacheCore.list(), "gc must not remove the cache of a live creator"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert cache_name in _core.CacheCore.list(), "SIGKILL leaves the segment behind"
    res = cli("gc")
    assert res.returncode == 0 and f"removed {cache_name}" in res.stdout
    assert cache_name not in _core.CacheCore.list()
    assert live.get(0) == b"x"
    live.close()


def test_creator_exit_removes_its_segment(cache_name):
    code = (f"import shadecache as sc; c = sc.Cache.create({cache_name!r}, num_samples=10, "
            "capacity_bytes=1 << 20); c.put(0, b'x')")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
    assert cache_name not in _core.CacheCore.list()
