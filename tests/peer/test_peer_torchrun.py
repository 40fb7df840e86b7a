"""A real multi-node run under torchrun: two "nodes" of two processes each on loopback (gloo, CPU),
DDP with CachedDataset + ShadeSampler + Cluster.from_torch, one cache and one peer server per node."""
import glob
import json
import os
import signal
import shutil
import socket
import subprocess
import sys
import uuid

import pytest

import shadecache as sc
from shadecache.demo import synthetic
from shadecache.peer import new_secret

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_two_nodes(path, tmp_path, job, port, env):
    """Two torchrun nodes of two processes each on 127.0.0.1:port; (the processes, their output)."""
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                               "--nproc-per-node", "2", "--node-rank", str(k), "--master-addr", "127.0.0.1",
                               "--master-port", str(port), os.path.join(HERE, "peer_ddp_train.py"),
                               path, str(tmp_path), job, "2"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for k in range(2)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            # the whole session: torchrun's workers and their DataLoader workers hold the pipe too
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
        outs.append(out.decode(errors="replace"))
    return procs, outs


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="torchrun not installed")
def test_two_nodes_two_processes_each(tmp_path):
    path = str(tmp_path / "train.shc")
    sc.pack(synthetic.SyntheticImages(2048, seed=5, size=8), path, progress=False)
    job = uuid.uuid4().hex[:8]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", SHADECACHE_SECRET=new_secret())
    for _ in range(3):   # a port found free can be taken before torchrun binds it: try another
        procs, outs = _torchrun_two_nodes(path, tmp_path, job, _free_port(), env)
        if not any("EADDRINUSE" in o for o in outs):
            break
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    results = [json.load(open(f)) for f in sorted(glob.glob(str(tmp_path / "rank*.json")))]
    assert len(results) == 4
    assert sum(r["wrong"] for r in results) == 0
    assert {r["node"] for r in results} == {0, 1}
    # samples came across nodes, and from both nodes' servers
    assert sum(r["stats"]["tiers"]["peer"]["hits"] for r in results) > 0
    for node in (0, 1):
        assert sum(r["stats"]["tiers"]["peer"]["hits"] for r in results if r["node"] == node) > 0
