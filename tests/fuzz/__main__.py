"""python tests/fuzz run SURFACE [--inputs N] [--seed S] [--workers W] [--nice K]
python tests/fuzz replay FINDINGS/<surface>-<kind>-<hash>.bin
python tests/fuzz corpus            (rewrites the store seed corpus with the real PackWriter)

SURFACE: store | cache | cli (see fuzz_harness.py for what a surface is). --inputs defaults to
$SHADECACHE_FUZZ_INPUTS, else 1000. Prints the tally; exits 1 when anything was found.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fuzz_harness  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tests/fuzz", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("surface", choices=fuzz_harness.SURFACES)
    r.add_argument("--inputs", type=int,
                   default=int(os.environ.get("SHADECACHE_FUZZ_INPUTS", "1000")))
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--workers", type=int, default=1)
    r.add_argument("--nice", type=int, default=0)
    r.add_argument("--out", default=None, help="folder for failing inputs")
    rp = sub.add_parser("replay")
    rp.add_argument("path")
    sub.add_parser("corpus")
    a = p.parse_args(argv)
    if a.cmd == "replay":
        return fuzz_harness.replay(a.path)
    if a.cmd == "corpus":
        fuzz_harness.surface("store").write_corpus()
        return 0
    res = fuzz_harness.run(a.surface, a.inputs, a.seed, a.out, a.workers, a.nice, progress=True)
    calls = getattr(fuzz_harness.surface(a.surface), "CALLS_PER_INPUT", None)
    kinds = sorted({k for k, _ in res.findings})
    print(f"surface {a.surface}: {res.inputs} inputs in {res.seconds:.0f} s "
          f"({res.inputs / max(res.seconds, 1e-9):.0f}/s), seed {a.seed}, {a.workers} worker(s), "
          f"{res.restarts} child restarts")
    if calls:
        print(f"  about {calls} calls per input")
    print("  findings: " + (", ".join(f"{k} {res.count(k)}" for k in kinds) or "none"))
    for k, path in res.findings[:20]:
        print(f"  {k}: {path}")
    return 1 if res.findings else 0


if __name__ == "__main__":
    sys.exit(main())
