"""Fuzz surface: the `shadecache` command's arguments (pack, verify, info, ls, stats, rm).

Input: a program of bytes choosing argv words from pools: subcommands, options, and paths to an
honest store, damaged stores from the store surface, a FIFO, a folder tree, an empty folder, a
directory where a file is expected, /dev/null, missing paths, odd names. `gc` and `demo` are left
out (gc may remove other jobs' crashed caches on a shared machine; demo trains a model), and `rm`
only ever names this child's own caches or names that cannot exist.

Oracle: shadecache.cli.main returns an exit status or argparse exits (SystemExit); any other
exception escaping it (a traceback for the user) is a finding, as is a wait past TIMEOUT_S.
"""
from __future__ import annotations

import contextlib
import io
import os
import uuid

BUDGET_MB = 512
TIMEOUT_S = 60.0
CALLS_PER_INPUT = 1


def setup(workdir):
    import glob

    import shadecache as sc
    from fuzz_store import CORPUS, generate
    from fuzz_harness import input_rng

    p = lambda *a: os.path.join(workdir, *a)  # noqa: E731
    os.makedirs(p("tree", "a", "sub"))
    os.makedirs(p("tree", "b"))
    os.makedirs(p("empty"))
    for i in range(5):
        with open(p("tree", "a" if i % 2 else "b", f"{i}.bin"), "wb") as f:
            f.write(bytes([i]) * (i * 1000))
    with open(p("tree", "a", "sub", "deep.bin"), "wb") as f:
        f.write(b"deep")
    os.mkfifo(p("fifo.shc"))
    honest = []  # copies: `pack` may be asked to write over any path of the pool
    for src in sorted(glob.glob(os.path.join(CORPUS, "*.shc"))):
        honest.append(p(os.path.basename(src)))
        with open(src, "rb") as f, open(honest[-1], "wb") as g:
            g.write(f.read())
    damaged = []
    for i in range(6):
        d = generate(input_rng(99, i))[1:]
        damaged.append(p(f"damaged{i}.shc"))
        with open(damaged[-1], "wb") as f:
            f.write(d)
    cache = f"fuzzcli-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    c = sc.Cache.create(cache, num_samples=8, capacity_bytes=1 << 20, policy="lru")
    paths = honest + damaged + [p("fifo.shc"), p("tree"), p("empty"), p("tree", "a", "1.bin"),
                                "/dev/null", "/dev/zero", p("missing.shc"), p("out.shc"),
                                p("tree", "out.shc"), "", "-", p("x" * 300), p("é\udcff.shc")]
    names = [cache, cache + "-missing", "a/b", "", "x" * 300, "-v", "fuzzcli\0x"]
    return {"cache": c, "paths": paths, "names": names, "workdir": workdir}


def teardown(state):
    state["cache"].close()
    try:
        state["cache"].unlink()
    except FileNotFoundError:
        pass


def generate(rng) -> bytes:
    return bytes(rng.randrange(256) for _ in range(8))


OPTS = ["--backend", "auto", "pread", "io_uring", "spdk", "-q", "--quiet", "--help", "--bogus",
        "--backend=pread", "-h", "--", "0"]
COMMANDS = ["pack", "verify", "info", "ls", "stats", "rm", "verify", "info", "pack", "stats",
            "--version", "", "nonsense"]


def argv_of(state, data: bytes) -> list:
    at = iter(data)
    nxt = lambda: next(at, 0)  # noqa: E731
    cmd = COMMANDS[nxt() % len(COMMANDS)]
    argv = [cmd] if cmd else []
    for _ in range(nxt() % 4):
        k = nxt() % 3
        if cmd in ("stats", "rm") and k != 2:
            argv.append(state["names"][nxt() % len(state["names"])])
        elif k != 2:
            argv.append(state["paths"][nxt() % len(state["paths"])])
        else:
            argv.append(OPTS[nxt() % len(OPTS)])
    if cmd == "rm":  # only our own cache, or a name that cannot exist
        argv = [a for a in argv if a.startswith("-") or a.startswith("fuzzcli-")
                or a in ("", "x" * 300)]
        argv = ["rm"] + argv
    return argv


def run(state, data: bytes) -> None:
    from shadecache import cli
    from fuzz_harness import Finding

    argv = argv_of(state, data)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    except SystemExit as e:  # argparse's usage errors and --help
        if e.code not in (0, 2, None) and not isinstance(e.code, str):
            raise Finding("exit", f"shadecache {argv!r} exited {e.code!r}")
        return
    except BaseException as e:
        kind = "alloc" if isinstance(e, MemoryError) else "traceback"
        raise Finding(kind, f"shadecache {argv!r} raised {type(e).__name__}: {e}")
    if not isinstance(rc, int) or rc not in (0, 1, 2):
        raise Finding("exit", f"shadecache {argv!r} returned {rc!r}")
    if "Traceback" in err.getvalue():
        raise Finding("traceback", f"shadecache {argv!r} printed a traceback")
