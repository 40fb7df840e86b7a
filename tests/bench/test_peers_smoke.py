"""bench/peers.py, short: the quick data set of small samples on a real throttled disk, shadecache
(and the alternatives where this environment has them), two epochs; the table and its JSON come
out, every configuration is reported, and what the device served is counted."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))

import throttled_disk  # noqa: E402

pytestmark = pytest.mark.skipif(throttled_disk.unavailable() is not None,
                                reason=f"throttled disk: {throttled_disk.unavailable()}")


def test_peers_quick(tmp_path):
    out = tmp_path / "peers.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "peers.py"), "--quick",
                        "--datasets", "3k", "--epochs", "2", "--out", str(out), "--timeout", "240"],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "| data | system |" in r.stdout and "acceptance" in r.stdout
    res = json.loads(out.read_text())
    ours = res["datasets"]["3k"]["systems"]["shadecache"]
    assert ours["failed"] is None
    assert [e["epoch"] for e in ours["epochs"]] == [0, 1]
    assert all(e["samples"] == 6000 for e in ours["epochs"])
    cfg = ours["config"]
    assert cfg["sampler"]["order"] == "extents" and cfg["iops_bound"]
    # the throttle's rates, given (its bursts fool a probe at open: bench/peers.py --probe)
    assert cfg["device"]["source"].startswith("given") and cfg["device"]["iops"] == 3000
    # the cold epoch reads the data once, in requests of whole extents
    cold = ours["epochs"][0]
    assert 0.9 <= cold["bytes"] / 18_000_000 <= 1.1
    assert cold["requests"] < 6000 / 10
