"""A seconds-long run of bench/fidelity.py (one data set with a small test set, two seeds, epochs
cut short), so the benchmark cannot rot: real store, real Cache, real CachedLoader and sampler; the
sweep resumes from its log; the report's paired statistics agree with the runs, its PASS/FAIL with
its figures, and the Markdown writer replaces exactly its own section; the slow-store mode runs on
a real throttled disk where this machine has one."""
import functools
import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("sklearn")
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)
import fidelity  # noqa: E402
import fidelity_datasets  # noqa: E402
import throttled_disk  # noqa: E402


@pytest.fixture
def short(monkeypatch):
    monkeypatch.setitem(fidelity.SCHEDULES, "cosine", 2)
    monkeypatch.setitem(fidelity.SCHEDULES, "constant", 1)
    monkeypatch.setitem(fidelity_datasets.DATASETS, "tabular",
                        functools.partial(fidelity_datasets.tabular, test_n=4000))


def test_fidelity_sweep_and_report(tmp_path, short):
    log = str(tmp_path / "runs.jsonl")
    common = ["--json", log, "--datasets", "tabular", "--seeds", "2"]
    assert fidelity.main(["run", *common, "--configs", "uniform,defaults"]) == 0
    runs = [json.loads(x) for x in open(log)]
    assert len(runs) == 2 * 2 * 2          # seeds x schedules x configurations
    assert fidelity.main(["run", *common, "--configs", "uniform,defaults"]) == 0   # resumed
    assert len(open(log).readlines()) == len(runs)
    for r in runs:
        assert 0.0 <= r["hit_ratio"] <= 1.0 and 10.0 <= r["test_acc"] <= 100.0
        assert r["stall_repeats"] == 0            # a store in tmpfs keeps up
        assert len(r["epoch_s"]) == fidelity.SCHEDULES[r["schedule"]]
    md = tmp_path / "B.md"
    md.write_text("# B\n\n## Other\n\nkeep me\n\n## Sampling fidelity\n\nold\n\n## After\n\nme too\n")
    rc = fidelity.main(["report", "--json", log, "--png", str(tmp_path / "p.png"), "--md", str(md),
                        "--datasets", "tabular"])
    text = md.read_text()
    assert "keep me" in text and "me too" in text and "\nold\n" not in text
    assert text.count(fidelity.SECTION + "\n") == 1
    res = fidelity.Results(runs)
    for sch in fidelity.SCHEDULES:
        d = [res.by[("tabular", sch, "defaults")][s]["test_acc"]
             - res.by[("tabular", sch, "uniform")][s]["test_acc"] for s in (0, 1)]
        c = res.cell("tabular", sch, "defaults")
        assert c["mean"] == pytest.approx(np.mean(d))
        assert c["se"] == pytest.approx(np.std(d, ddof=1) / np.sqrt(2))
        if c["se"] > 0:
            assert c["t"] == pytest.approx(c["mean"] / c["se"])
        line = [ln for ln in text.splitlines() if f"tabular {sch}: mean Δ" in ln][0]
        assert line.startswith("- PASS") == (c["mean"] >= -0.2 and c["t"] >= -2.0)
        seeds = [ln for ln in text.splitlines() if f"tabular {sch}: at least 12" in ln][0]
        assert seeds.startswith("- FAIL")        # two seeds are not twelve
    assert rc == 1
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(throttled_disk.unavailable() is not None,
                    reason=f"throttled disk: {throttled_disk.unavailable()}")
def test_slow_store_mode(tmp_path, short):
    log = str(tmp_path / "slow.jsonl")
    assert fidelity.main(["slow", "--json", log, "--datasets", "tabular", "--seeds", "1",
                          "--configs", "uniform,defaults"]) == 0
    runs = {(r["label"], r["store"]): r for r in map(json.loads, open(log))}
    assert set(runs) == {("uniform", "fast"), ("uniform", "slow"), ("defaults", "slow")}
    slow = runs[("uniform", "slow")]
    # the device itself served the misses: at least one request per sample read from the store
    assert slow["device_requests"] >= slow["bytes_read"] // 4096 > 0
    assert len(slow["acc"]) == fidelity.SCHEDULES["cosine"]    # accuracy after every epoch
    cells = fidelity.slow_cells(list(runs.values()))
    c = cells[("tabular", "defaults")]
    assert c["default"] and c["seeds"] == 1
    assert c["wall_ratio"][0] == pytest.approx(runs[("defaults", "slow")]["wall_s"] / slow["wall_s"])
    assert fidelity.main(["slow-report", "--json", log]) in (0, 1)
