"""The fuzzers of tests/fuzz, short and seeded (seconds): each surface runs in child processes
under an address-space limit and must find nothing. The long run is
`SHADECACHE_FUZZ_INPUTS=1000000 python tests/fuzz run store` (BENCHMARKS.md, "Fuzzing").
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fuzz_harness  # noqa: E402

SHORT = {"store": 1500, "cache": 300, "cli": 150, "peer": 3000}


@pytest.mark.parametrize("surface", sorted(SHORT))
def test_fuzz_short(surface, tmp_path):
    n = int(os.environ.get("SHADECACHE_FUZZ_INPUTS", SHORT[surface]))
    res = fuzz_harness.run(surface, n, seed=2024, findings_dir=str(tmp_path / "findings"))
    assert res.inputs == n
    details = [open(p + ".txt").read().strip()[-400:] for _, p in res.findings[:3]]
    assert not res.findings, f"{len(res.findings)} findings, e.g. {details} " \
                             f"(replay: python tests/fuzz replay PATH)"


def test_the_harness_catches_crashes_hangs_and_findings(tmp_path, monkeypatch):
    """The machinery itself: a surface whose inputs crash (SIGSEGV), hang, raise an unlisted
    exception or allocate beyond the budget is caught, each input saved and replayable."""
    selftest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "selftest")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([selftest, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(selftest)
    res = fuzz_harness.run("planted", 8, seed=640, findings_dir=str(tmp_path))
    kinds = sorted(k for k, _ in res.findings)
    assert kinds == ["alloc", "crash", "hang", "unlisted"], kinds
    assert res.inputs == 8
    for _, path in res.findings:
        assert os.path.getsize(path) == 1
