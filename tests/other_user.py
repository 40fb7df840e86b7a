"""Two real users for the tests of the node's files: run a function as another uid in a real
process, and give a uid a private temporary directory.

The interpreter lives under /root (mode 0700 here), so another user cannot exec it: the process is
forked from the test process, with what it needs already imported, and drops to the other user
(supplementary groups, gid, then uid) before it calls the function. Its result (or the exception
it raised) comes back pickled through a pipe. Only root can become another user, so the tests that
use this skip unless they run as root.

ATTACKER is uid 65534 (nobody). VICTIM is a second ordinary uid (no account needed): root passes
every permission check, so where a permission should bite, the victim must not be root.
"""
import importlib
import os
import pickle
import select
import shutil
import signal
import tempfile
import time

import pytest

ATTACKER = 65534
VICTIM = 65533

needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="needs root: the test becomes two other users (setuid) to play an attacker and a victim")

# Imported before forking: the other user cannot read the interpreter's library under /root.
for _m in ("json", "secrets", "warnings", "numpy", "shadecache", "shadecache.cache.handle", "shadecache.cache.node", "shadecache.shm", "shadecache.lookahead.publish",
           "shadecache.lookahead.board", "shadecache.status", "shadecache.ssd.tier", "shadecache.ssd.layout",
           "shadecache.lookahead.prefetcher", "shadecache.node_files", "shadecache.cli.cache"):
    try:
        importlib.import_module(_m)
    except ImportError:   # a module this version does not have
        pass


class RaisedAs(Exception):
    """The function raised something that does not pickle: its type name and message."""


def run_as(uid: int, fn, *args, timeout: float = 60.0):
    """fn(*args) in a forked process running as `uid` (and gid `uid`, no supplementary groups);
    returns its result, or raises the exception it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                out = ("ok", fn(*args))
            except BaseException as e:   # noqa: BLE001 - every outcome goes back to the test
                out = ("raised", e)
            try:
                data = pickle.dumps(out)
            except Exception:
                data = pickle.dumps(("raised", RaisedAs(f"{type(out[1]).__name__}: {out[1]}")))
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise TimeoutError(f"the process running as uid {uid} did not finish in {timeout} s")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    if not chunks:
        raise RuntimeError(f"the process running as uid {uid} ended without a result (status {status})")
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "raised":
        raise value
    return value


class PrivateDir:
    """A fresh directory under /tmp owned by `uid`, mode 0700; removed (as root) by cleanup()."""

    def __init__(self, uid: int, prefix: str = "shadecache-test-"):
        self.path = tempfile.mkdtemp(prefix=prefix)
        os.chown(self.path, uid, uid)
        os.chmod(self.path, 0o700)

    def cleanup(self):
        shutil.rmtree(self.path, ignore_errors=True)


def unlink_quietly(path: str) -> None:
    """Removes `path` as root whoever owns it (test cleanup of what the other user made)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
