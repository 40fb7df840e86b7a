"""A world-writable working directory holding planted modules, and a job run in it: the tests of
the interpreters the package starts (the peer server, the prefetcher) show, with a real job in a
real process, that those interpreters import none of them (shadecache/process.py)."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_among_planted_modules(tmp_path, modules, job: str):
    """Runs the Python code `job` as a script of its own folder (tmp_path/job: its folder, not the
    working directory, is first on its import path; shadecache comes from this checkout, not
    $PYTHONPATH) in the working directory tmp_path/evil: mode 0777 and holding, for each name of
    `modules`, a module that records its name and raises ImportError. Returns (the finished
    process, the names of the planted modules that ran)."""
    evil = tmp_path / "evil"
    evil.mkdir()
    os.chmod(evil, 0o777)
    marker = tmp_path / "planted-module-ran"
    for name in modules:
        (evil / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n"
                                         "raise ImportError('planted')\n")
    script = tmp_path / "job" / "job.py"
    script.parent.mkdir()
    script.write_text(f"import sys\nsys.path.insert(1, {ROOT!r})\n" + textwrap.dedent(job))
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, str(script)], cwd=str(evil), env=env, capture_output=True, text=True,
                         timeout=120)
    return out, marker.read_text().split() if marker.exists() else []
