"""The fuzz harness: one small module per input surface, run in child processes.

A surface is a module `fuzz_<name>.py` next to this one that defines

    BUDGET_MB            address space a child may use beyond what it maps after setup()
    TIMEOUT_S            seconds one input may take before it counts as a hang
    setup(workdir)       -> state: built once per child (caches, warm stores), before the limit
    generate(rng)        -> bytes: one input, a pure function of the random.Random it is given
    run(state, data)     runs one input; raises Finding for a wrong result (wrong bytes, a rejected
                         call that changed a value, an exception outside docs/errors.md)
    teardown(state)      optional

Inputs are bytes so that every surface saves and replays the same way: a failing input is written
to FINDINGS/<surface>-<kind>-<hash>.bin and `python tests/fuzz replay FILE` runs it again.

Process model (fork-server style): the parent starts one child per worker; the child runs setup(),
sets RLIMIT_AS to its size then plus BUDGET_MB (so an allocation the input does not justify fails
as MemoryError, which is a finding), then runs inputs `seed:i` for i in its range, writing one line
per input to the parent. The parent sees a hang (no line within TIMEOUT_S: it kills the child) or
a crash (the child died) and regenerates that input itself from `seed:i` to save it; the child
saves the findings it can see. Either way a fresh child continues after the input.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import random
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
SURFACES = ("store", "cache", "cli", "peer")


class Finding(Exception):
    """A result that is wrong (kind: wrong-bytes, changed, unlisted, alloc, disagree, ...)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def surface(name: str):
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    return importlib.import_module(f"fuzz_{name}")


def input_rng(seed: int, i: int) -> random.Random:
    return random.Random(f"{seed}:{i}")


def allowed(exc: BaseException, types, where: str) -> None:
    """Raises Finding unless `exc` is one of the documented `types` of entry point `where`.
    A MemoryError that is not listed is an allocation the input did not justify."""
    if isinstance(exc, tuple(types)):
        return
    kind = "alloc" if isinstance(exc, MemoryError) else "unlisted"
    raise Finding(kind, f"{where} raised {type(exc).__module__}.{type(exc).__name__}: {exc}")


def save(findings_dir: str, name: str, kind: str, data: bytes, message: str) -> str:
    os.makedirs(findings_dir, exist_ok=True)
    h = hashlib.sha1(data).hexdigest()[:12]
    path = os.path.join(findings_dir, f"{name}-{kind}-{h}.bin")
    with open(path, "wb") as f:
        f.write(data)
    with open(path + ".txt", "w") as f:
        f.write(message + "\n")
    return path


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def limit_address_space(budget_mb: int) -> None:
    lim = _vm_bytes() + (budget_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))


# ---- the child ---------------------------------------------------------------------------------

def worker_main(name: str, seed: int, start: int, stop: int, findings_dir: str) -> int:
    """Runs inputs [start, stop); one line per input on stdout: "<i> ok" or "<i> F <kind> <path>"."""
    mod = surface(name)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # what the code under test prints does not reach the protocol
    workdir = tempfile.mkdtemp(prefix=f"fuzz-{name}-")
    try:
        state = mod.setup(workdir)
        limit_address_space(mod.BUDGET_MB)
        for i in range(start, stop):
            data = b""
            try:
                data = mod.generate(input_rng(seed, i))
                mod.run(state, data)
                out.write(f"{i} ok\n")
            except Finding as f:
                path = save(findings_dir, name, f.kind, data, str(f))
                out.write(f"{i} F {f.kind} {path}\n")
            except BaseException as e:  # the harness itself must not die on the code under test
                path = save(findings_dir, name, "harness", data, traceback.format_exc())
                out.write(f"{i} F harness {path} {type(e).__name__}\n")
        if hasattr(mod, "teardown"):
            mod.teardown(state)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


# ---- the parent --------------------------------------------------------------------------------

class Result:
    def __init__(self):
        self.inputs = 0
        self.findings = []  # (kind, path)
        self.restarts = 0
        self.seconds = 0.0

    def count(self, kind):
        return sum(1 for k, _ in self.findings if k == kind)


def _spawn(name, seed, start, stop, findings_dir, nice):
    cmd = [sys.executable, os.path.abspath(__file__), "_worker", name, str(seed), str(start),
           str(stop), findings_dir]
    if nice:
        cmd = ["nice", "-n", str(nice)] + cmd
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=os.environ)


def run(name: str, inputs: int, seed: int = 0, findings_dir: str | None = None,
        workers: int = 1, nice: int = 0, progress: bool = False) -> Result:
    """Runs `inputs` inputs of surface `name` in `workers` children; returns the tally."""
    from tqdm import tqdm

    mod = surface(name)
    findings_dir = findings_dir or os.environ.get("SHADECACHE_FUZZ_OUT",
                                                  os.path.join(HERE, "findings"))
    res = Result()
    t0 = time.monotonic()
    per = -(-inputs // workers)
    # one slot per worker: [proc, next input expected, stop, last progress time, pending bytes]
    slots = []
    for w in range(workers):
        a, b = w * per, min(inputs, (w + 1) * per)
        if a < b:
            slots.append([_spawn(name, seed, a, b, findings_dir, nice), a, b, time.monotonic(), b""])
    # a child may spend its first seconds in setup(); the hang clock starts after that
    setup_grace = 60.0
    bar = tqdm(total=inputs, unit="input", desc=f"fuzz {name}", disable=not progress,
               mininterval=1.0)
    started = {id(s): False for s in slots}
    while slots:
        fds = {s[0].stdout.fileno(): s for s in slots}
        ready, _, _ = select.select(list(fds), [], [], 1.0)
        now = time.monotonic()
        for fd in ready:
            s = fds[fd]
            chunk = os.read(fd, 65536)
            if chunk:
                s[4] += chunk
                *lines, s[4] = s[4].split(b"\n")
                for line in lines:
                    parts = line.decode().split()
                    i = int(parts[0])
                    if parts[1] == "F":
                        res.findings.append((parts[2], parts[3]))
                    s[1] = i + 1
                    res.inputs += 1
                    bar.update(1)
                s[3] = now
                started[id(s)] = True
                continue
            # EOF: the child ended; a crash unless it finished its range with status 0
            rc = s[0].wait()
            if s[1] < s[2]:
                data = mod.generate(input_rng(seed, s[1]))
                why = f"child exited with {rc} (signal {-rc})" if rc < 0 else f"child exited {rc}"
                res.findings.append(("crash", save(findings_dir, name, "crash", data,
                                                   f"crash at input {seed}:{s[1]}: {why}")))
                res.inputs += 1
                bar.update(1)
                _restart(s, name, seed, findings_dir, nice, res, started)
            elif rc != 0:  # died after its last input: teardown, or the interpreter's exit
                data = mod.generate(input_rng(seed, s[2] - 1))
                res.findings.append(("crash", save(findings_dir, name, "crash", data,
                                                   f"child exited with {rc} after its last input "
                                                   f"{seed}:{s[2] - 1}")))
                slots.remove(s)
            else:
                slots.remove(s)
        for s in list(slots):
            limit = mod.TIMEOUT_S + (0 if started[id(s)] else setup_grace)
            if s in slots and s[0].poll() is None and now - s[3] > limit:
                os.kill(s[0].pid, signal.SIGKILL)
                s[0].wait()
                data = mod.generate(input_rng(seed, s[1]))
                res.findings.append(("hang", save(findings_dir, name, "hang", data,
                                                  f"hang at input {seed}:{s[1]}: no answer in "
                                                  f"{limit:.0f} s")))
                res.inputs += 1
                bar.update(1)
                _restart(s, name, seed, findings_dir, nice, res, started)
    bar.close()
    res.seconds = time.monotonic() - t0
    return res


def _restart(s, name, seed, findings_dir, nice, res, started):
    s[0].stdout.close()
    s[1] += 1
    res.restarts += 1
    if s[1] < s[2]:
        s[0] = _spawn(name, seed, s[1], s[2], findings_dir, nice)
        s[3] = time.monotonic()
        s[4] = b""
        started[id(s)] = False
    else:
        s[0] = subprocess.Popen(["true"], stdout=subprocess.PIPE)  # an empty child: EOF at once
        s[1] = s[2]


def replay(path: str) -> int:
    """Runs one saved input in this process (under the same address-space limit) and reports."""
    base = os.path.basename(path)
    name = base.split("-", 1)[0]
    mod = surface(name)
    with open(path, "rb") as f:
        data = f.read()
    workdir = tempfile.mkdtemp(prefix=f"fuzz-replay-{name}-")
    try:
        state = mod.setup(workdir)
        limit_address_space(mod.BUDGET_MB)
        mod.run(state, data)
        print(f"{base}: passes now")
        return 0
    except Finding as f:
        print(f"{base}: still fails: {f}")
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "_worker":
    # Through the imported module, not __main__: surfaces raise fuzz_harness.Finding, and a
    # second copy of this file as __main__ would have a Finding class of its own.
    sys.path.insert(0, HERE)
    import fuzz_harness

    sys.exit(fuzz_harness.worker_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                      int(sys.argv[5]), sys.argv[6]))
