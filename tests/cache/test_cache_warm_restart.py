"""Warm restart, with real processes: a job creates a persisted cache,
trains, is SIGKILLed; a new job attaches and its first epoch hits as the old job's last did; the
scores survived; a store of another data set is refused; check() passes; `shadecache ls` shows
the cache and `gc` keeps it unless asked."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import shadecache as sc
from shadecache import _core

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
N = 600


def _store(path, salt):
    with sc.PackWriter(path) as w:
        for i in range(N):
            w.add(bytes([(i + salt) % 251]) + os.urandom(0) + b"s" * (1500 + (i % 7) * 100), i % 3)
    return sc.PackedStore(path)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, HERE, env.get("PYTHONPATH", "")])
    return env


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "shadecache.cli", *args], capture_output=True, text=True,
                          env=_env(), timeout=60)


def test_persisted_cache_survives_a_killed_job(tmp_path, cache_name):
    store = _store(str(tmp_path / "a.shc"), 0)
    other = _store(str(tmp_path / "b.shc"), 1)
    assert store.fingerprint != other.fingerprint
    out1, out2 = str(tmp_path / "job1.json"), str(tmp_path / "job2.json")
    job = subprocess.Popen([sys.executable, os.path.join(HERE, "warm_job.py"), store.path, cache_name, out1, "2",
                            "--wait"], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert job.stdout.readline().strip() == "READY"
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=30)
    first = json.load(open(out1))
    assert first["warm_items"] == 0 and first["hit_ratio"][0] < 0.1  # it started cold
    end_ratio = first["hit_ratio"][-1]
    assert end_ratio > 0.3

    # the creator is dead, the segment stays; gc leaves a persisted cache alone
    assert cache_name in sc.cache.list_caches()
    assert cache_name not in sc.cache.gc()
    ls = _cli("ls")
    assert ls.returncode == 0
    line = next(l for l in ls.stdout.splitlines() if l.startswith(cache_name))
    assert "persisted" in line and "last attach" in ls.stdout.splitlines()[0].lower()

    # a new job attaches and is warm from its first epoch
    rc = subprocess.run([sys.executable, os.path.join(HERE, "warm_job.py"), store.path, cache_name, out2, "1"],
                        env=_env(), timeout=120)
    assert rc.returncode == 0
    second = json.load(open(out2))
    assert second["warm_items"] > 0
    assert second["hit_ratio"][0] == pytest.approx(end_ratio, abs=0.02)
    # the scores the killed job set are there before the new job sets any
    ids = np.arange(N)
    assert np.allclose(second["scores_before"], ((ids * 7919) % 1000 / 1000.0).astype(np.float32))

    # another data set (another store) is refused, with a clear error, and changes nothing
    with pytest.raises(sc.FingerprintError, match="another data set"):
        sc.Cache.for_store(cache_name, other, 1 << 20, persist=True)
    with sc.Cache.attach(cache_name, fingerprint=store.fingerprint) as c:
        assert c.persist and c.fingerprint == store.fingerprint
        c.check()
        assert c.stats()["items"] == second["warm_items"] or c.stats()["items"] > 0

    # gc --keep-for: kept while recently attached; --persisted removes it
    assert _cli("gc", "--keep-for", "3600").returncode == 0
    assert cache_name in sc.cache.list_caches()
    r = _cli("gc", "--persisted")
    assert r.returncode == 0 and cache_name in r.stdout
    assert cache_name not in sc.cache.list_caches()


def test_keep_for_removes_a_persisted_cache_not_attached_for_long(cache_name):
    code = (f"import shadecache as sc; sc.Cache.create({cache_name!r}, 10, 1 << 20, persist=True, "
            f"fingerprint='f1')")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), timeout=60)
    assert cache_name in sc.cache.list_caches()  # outlived its creator
    info = sc.cache.describe(cache_name)
    assert info["persist"] and info["fingerprint"] == "f1"
    assert cache_name not in sc.cache.gc(keep_for=3600)
    assert cache_name in sc.cache.gc(keep_for=0)


def test_create_or_attach_refuses_another_size(cache_name):
    with sc.Cache.create(cache_name, 10, 1 << 20, fingerprint="f") as c:
        with pytest.raises(sc.FingerprintError, match="holds 10 sample ids, not 11"):
            sc.Cache.create_or_attach(cache_name, 11, 1 << 20, fingerprint="f")
        with pytest.raises(sc.FingerprintError, match="not g"):
            sc.Cache.create_or_attach(cache_name, 10, 1 << 20, fingerprint="g")
        with pytest.raises(TypeError, match="fingerprint must be a str"):
            sc.Cache.attach(cache_name, fingerprint=3)
        d = sc.Cache.create_or_attach(cache_name, 10, 1 << 20, fingerprint="f")
        assert d.fingerprint == "f" and not d.persist
        d.close()
        c.put(1, b"x")
    assert _core.CacheCore.list().count(cache_name) == 0  # a cache that does not persist goes with its creator
