"""`shadecache pack | verify | info` run as real subprocesses."""
import os
import subprocess
import sys

import numpy as np

import shadecache as sc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The real entry point (shadecache.cli.main, as the `shadecache` script runs it), with the package
# of this checkout on the path.
DRIVER = """
import sys
from shadecache.cli import main
sys.exit(main(sys.argv[1:]))
"""


def cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-c", DRIVER, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_pack_verify_info(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "src"
    for c in ("x", "y"):
        (root / c).mkdir(parents=True)
        for j in range(30):
            (root / c / f"{j}.bin").write_bytes(rng.bytes(int(rng.integers(0, 9000))))
    dst = tmp_path / "out.shc"
    out = cli("pack", root, dst)
    assert out.returncode == 0, out.stderr
    assert "packed 60 samples" in out.stdout
    assert "60/60" in out.stderr  # the tqdm progress bar

    out = cli("verify", dst)
    assert out.returncode == 0 and "OK: 60 samples" in out.stdout, out.stderr

    out = cli("info", dst)
    assert out.returncode == 0, out.stderr
    info = dict(line.split(None, 1) if " " in line else (line, "") for line in
                (ln.replace("format version", "format_version").replace("I/O backend", "backend")
                 .replace("sample bytes", "sample_bytes").replace("file size", "file_size")
                 for ln in out.stdout.splitlines()))
    assert info["format_version"].strip() == "2"
    assert info["placement"].strip() == "shuffled (seed 0)"
    assert info["samples"].strip() == "60"
    assert info["classes"].strip() == "2"
    assert info["labels"].strip() == "0:30, 1:30"
    assert info["backend"].split()[0] == sc.PackedStore(dst).backend

    # a flipped byte: verify names the sample and its offset, exits 1
    s = sc.PackedStore(dst)
    victim = int(np.argmax(s.lengths))
    with open(dst, "r+b") as f:
        f.seek(s.offset(victim) + 7)
        b = f.read(1)
        f.seek(s.offset(victim) + 7)
        f.write(bytes([b[0] ^ 1]))
    out = cli("verify", dst)
    assert out.returncode == 1
    assert f"corrupt: sample {victim} at file offset {s.offset(victim)}" in out.stderr
    assert "FAILED: 1 of 60" in out.stderr


def test_cli_bad_input_is_one_clear_line(tmp_path):
    (tmp_path / "empty").mkdir()
    out = cli("pack", tmp_path / "empty", tmp_path / "e.shc")
    assert out.returncode == 2 and "no samples found under" in out.stderr
    assert "Traceback" not in out.stderr
    junk = tmp_path / "junk"
    junk.write_bytes(b"\0" * 10)
    out = cli("info", junk)
    assert out.returncode == 2 and "StoreFormatError" in out.stderr and str(junk) in out.stderr
    out = cli("verify", tmp_path / "absent.shc")
    assert out.returncode == 2 and "FileNotFoundError" in out.stderr


def test_cli_converts_a_version_one_store(tmp_path):
    from store_layout import write_version_one

    old, new = tmp_path / "old.shc", tmp_path / "new.shc"
    data = [bytes([i]) * (300 + i) for i in range(20)]
    write_version_one(old, data, [i % 3 for i in range(20)], meta={"classes": ["a", "b", "c"]})
    out = cli("info", old)
    assert out.returncode == 2 and "format version 1" in out.stderr
    assert f"shadecache pack {old}" in out.stderr and "Traceback" not in out.stderr
    out = cli("pack", old, new, "--seed", "5")
    assert out.returncode == 0 and "packed 20 samples" in out.stdout, out.stderr
    with sc.PackedStore(new) as s:
        assert s.read_many(range(20)) == data and s.placement_seed == 5
    out = cli("pack", old, tmp_path / "plain.shc", "--no-shuffle")
    assert out.returncode == 0, out.stderr
    with sc.PackedStore(tmp_path / "plain.shc") as s:
        assert s.placement == "as written" and s.disk_order().tolist() == list(range(20))
