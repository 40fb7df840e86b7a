"""A pack killed with SIGKILL at any point leaves nothing that opens as a valid store, and an
older store at the destination stays intact. Real subprocesses, real SIGKILLs."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import shadecache as sc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, SIZE = 3000, 20000  # ~70 MB of padded samples: packing takes a few seconds

PACKER = textwrap.dedent("""
    import sys, time, shadecache as sc

    class Slow:
        # a map-style data set that yields (bytes, label) slowly enough to be killed mid-pack
        def __len__(self):
            return {n}
        def __getitem__(self, i):
            time.sleep(0.0005)
            return bytes([i % 251]) * {size}, i

    sc.pack(Slow(), sys.argv[1], progress=False)
    print("DONE", flush=True)
""").format(n=N, size=SIZE)


def packed_bytes_expected():
    return N * (-(-SIZE // 4096) * 4096)


def run_and_kill(dst, fraction):
    """Starts a pack, SIGKILLs it once its temporary file holds `fraction` of the data
    (fraction > 1: after the pack finished writing samples, during close)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-c", PACKER, str(dst)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    target = fraction * packed_bytes_expected()
    deadline = time.time() + 60
    killed_at = None
    while time.time() < deadline and proc.poll() is None:
        tmps = [f for f in os.listdir(dst.parent) if ".tmp." in f]
        if tmps:
            size = os.path.getsize(dst.parent / tmps[0]) if os.path.exists(dst.parent / tmps[0]) else 0
            if size >= target:
                proc.send_signal(signal.SIGKILL)
                killed_at = size
                break
        time.sleep(0.002)
    proc.wait(timeout=30)
    return proc.returncode, killed_at


def assert_nothing_valid(folder, allowed=None):
    """Every file in `folder` fails to open as a store, except `allowed` (path, first byte)."""
    for name in os.listdir(folder):
        p = folder / name
        if allowed and p == allowed[0]:
            s = sc.PackedStore(p)
            assert s.read(0) == allowed[1] and len(s) == 1
            continue
        with pytest.raises(sc.StoreFormatError):
            sc.PackedStore(p)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.95])
def test_sigkill_mid_pack_leaves_no_valid_store(tmp_path, fraction):
    dst = tmp_path / "train.shc"
    rc, killed_at = run_and_kill(dst, fraction)
    assert rc == -signal.SIGKILL and killed_at is not None, "the pack ended before the kill"
    assert not dst.exists()
    leftovers = os.listdir(tmp_path)
    assert len(leftovers) == 1 and ".shc.tmp." in leftovers[0]  # what .gitignore/gc can match
    assert_nothing_valid(tmp_path)


def test_sigkill_mid_pack_keeps_the_old_store(tmp_path):
    dst = tmp_path / "train.shc"
    sc.pack([(b"old store", 3)], dst, progress=False)
    rc, killed_at = run_and_kill(dst, 0.5)
    assert rc == -signal.SIGKILL and killed_at is not None
    assert_nothing_valid(tmp_path, allowed=(dst, b"old store"))


def test_unkilled_pack_completes(tmp_path):
    """The same packer, left alone, produces a valid store (so the kills above are meaningful)."""
    dst = tmp_path / "train.shc"
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", PACKER, str(dst)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "DONE" in out.stdout, out.stderr
    s = sc.PackedStore(dst)
    assert len(s) == N and s.read(1000) == bytes([1000 % 251]) * SIZE and s.label(1000) == 1000
    assert os.listdir(tmp_path) == ["train.shc"]
