"""A seconds-long run of bench/fidelity.py (one data set, one seed, the short schedule), so the
benchmark cannot rot: real store, real Cache, real sampler; the report's figures agree with the
runs, its PASS/FAIL with its figures, and the Markdown writer replaces exactly its own section."""
import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("sklearn")
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)
import fidelity  # noqa: E402


def test_fidelity_sweep_and_report(tmp_path, monkeypatch):
    monkeypatch.setitem(fidelity.SCHEDULES, "cosine", 2)    # keep the test short
    monkeypatch.setitem(fidelity.SCHEDULES, "short", 1)
    log = str(tmp_path / "runs.jsonl")
    common = ["--json", log, "--datasets", "tabular", "--seeds", "1"]
    assert fidelity.main(["run", *common, "--configs", "uniform", "--sizes", "0.1,0.2"]) == 0
    assert fidelity.main(["run", *common, "--configs", "default", "--sizes", "0.1"]) == 0
    runs = [json.loads(x) for x in open(log)]
    assert len(runs) == 2 * 2 + 2       # uniform: trained at 10% + a replay at 20%; default at 10%
    # resumable: a second call finds everything done
    assert fidelity.main(["run", *common, "--configs", "default", "--sizes", "0.1"]) == 0
    assert len(open(log).readlines()) == len(runs)
    for r in runs:
        assert 0.0 <= r["hit_ratio"] <= 1.0 and 0.0 < r["min_coverage"] <= 1.0
    trained = [r for r in runs if "test_acc" in r]
    assert {r["label"] for r in trained} == {"uniform", "default"}
    assert all(10.0 <= r["test_acc"] <= 100.0 for r in trained)   # chance is 10%
    md = tmp_path / "B.md"
    md.write_text("# B\n\n## Other\n\nkeep me\n")
    rc = fidelity.main(["report", "--json", log, "--png", str(tmp_path / "p.png"), "--md", str(md)])
    text = md.read_text()
    assert "keep me" in text and fidelity.SECTION in text
    res = fidelity.Results(runs)
    got = [ln for ln in text.splitlines() if ln.startswith("- PASS") or ln.startswith("- FAIL")]
    assert len(got) == 2 * (1 + 1)     # per schedule: accuracy and hit ratio at 10%
    for sch in fidelity.SCHEDULES:
        c = res.cell("tabular", sch, 0.1, "default")
        d = np.array([r["test_acc"] for r in trained if r["label"] == "default"
                      and r["schedule"] == sch]) - [r["test_acc"] for r in trained
                                                    if r["label"] == "uniform" and r["schedule"] == sch]
        assert c["delta"] == pytest.approx(d)
        line = [ln for ln in got if f"tabular {sch} 10%: mean" in ln][0]
        assert line.startswith("- PASS") == (d.mean() >= -0.3)
    assert rc == (0 if all(ln.startswith("- PASS") for ln in got) else 1)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    fidelity.main(["report", "--json", log, "--png", str(tmp_path / "p.png"), "--md", str(md)])
    assert md.read_text().count(fidelity.SECTION) == 1     # replaced, not appended
