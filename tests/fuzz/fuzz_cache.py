"""Fuzz surface: the cache API's arguments, under all four policies.

Input: a program of bytes; each call takes one byte for the policy (one cache of each policy lives
in the child), one for the entry point and one per argument, an index into the pools below (good
arguments, edge values and wrong types). Any byte string is a program.

Oracle: every exception is one docs/errors.md lists for that entry point; a call that raised
changed no cached value of the ids it named; a value read back is the last value put for that id
(or a miss: eviction is allowed); a put that says True is readable at once; check() holds after
every program.
"""
from __future__ import annotations

import os
import uuid

import numpy as np

import shadecache as sc

BUDGET_MB = 256
TIMEOUT_S = 20.0
N = 64
CALLS = 24
CALLS_PER_INPUT = CALLS
POLICIES = ("importance", "lru", "fifo", "static")

IDS = [0, 1, 2, 3, 5, 7, 31, N - 1, N, -1, 2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30,
       np.int64(4), np.uint64(6), np.int8(-1), np.uint64(2**63), True, 1.5, 2.0, "3", None, b"3",
       [3], np.float64(3)]
_big = np.frombuffer(bytes(range(256)) * 64, np.uint8)
VALUES = [b"", b"a", b"value", bytes(range(256)) * 16, bytearray(b"ba"), memoryview(b"mv"),
          _big[:1000], _big[::2], np.arange(6, dtype=np.int32), np.array([object()]),
          b"z" * (64 << 10), b"y" * ((64 << 10) + 1), b"x" * (1 << 20), "str", None, 5,
          np.zeros((2, 3), np.uint8), memoryview(bytes(100))[::3]]
SCORES = [None, 0.0, 0.5, 1.0, -1.0, 1e30, 1e300, float("nan"), float("inf"), -float("inf"), 3,
          10**400, True, np.float32(2.5), np.float64(-3), "0.5", 1 + 2j, [0.5], b"1"]
ID_ARRAYS = [[], [0, 1, 2], [N - 1, 0], [0, N], [-1], [2**63], [1.5], ["1"], [None], [True, False],
             np.array([1, 2], np.int64), np.array([1, 2], np.uint8), np.array([3.0]),
             np.array([[1, 2]]), np.array([2**63], np.uint64), np.arange(64)[::2],
             np.array([b"1"]), (4, 5), [[1], [2]], 7, "12", None]
VALUE_LISTS = [[], [b"a", b"b", b"c"], [b"x"], [b"a", "s", b"c"], [None], b"ab", (b"t", b"u"),
               [b"v" * 1000] * 2, [b"w" * (1 << 20)], 5, None, [bytearray(3), memoryview(b"q")]]
SCORE_ARRAYS = [None, [1.0, 2.0, 3.0], [1.0], [float("nan")], [1e300], np.ones(3, np.float32),
                np.ones(3, np.int64), ["1", "2", "3"], [[1.0]], 5, "abc", [None, None, None],
                np.array([1 + 1j] * 3), [10**400] * 3, np.arange(64, dtype=np.float64)[::2]]
BUFS = [bytearray(0), bytearray(4), bytearray(1 << 12), bytearray(70 << 10), b"ro",
        memoryview(bytearray(16))[::2], np.zeros(5000, np.uint8), np.zeros((64, 64), np.uint8)[:, 0],
        None, "s"]

# entry point -> the exception types docs/errors.md lists for it
ERR_ID = (TypeError, IndexError, sc.ClosedError)
ALLOWED = {
    "get": ERR_ID, "contains": ERR_ID, "remove": ERR_ID, "view": ERR_ID + (sc.CapacityError,),
    "get_into": ERR_ID + (ValueError,),
    "put": ERR_ID + (ValueError,),  # ValueTooLargeError and non-finite scores are ValueErrors
    "get_many": ERR_ID + (ValueError,),
    "put_many": ERR_ID + (ValueError,),
    "update_scores": ERR_ID + (ValueError,),
}
OPS = list(ALLOWED)


class Program:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def pick(self, pool):
        b = self.data[self.at] if self.at < len(self.data) else 0
        self.at += 1
        return pool[b % len(pool)]


def generate(rng) -> bytes:
    return bytes(rng.randrange(256) for _ in range(CALLS * 5))


def setup(workdir):
    tag = uuid.uuid4().hex[:8]
    caches = [sc.Cache.create(f"fuzz-{os.getpid()}-{tag}-{p}", num_samples=N,
                              capacity_bytes=1 << 20, policy=p, max_item_bytes=64 << 10)
              for p in POLICIES]
    return {"caches": caches, "shadow": [dict() for _ in POLICIES]}


def teardown(state):
    for c in state["caches"]:
        c.close()
        c.unlink()


def _plain_id(x):
    """The sample id `x` names when it is a valid one, else None."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        return None if not isinstance(x, bool) else int(x)
    return int(x) if 0 <= int(x) < N else None


def _ids_named(x):
    try:
        arr = list(x) if isinstance(x, (list, tuple, np.ndarray)) else []
    except TypeError:
        return []
    return [i for i in (_plain_id(a) for a in arr) if i is not None]


def run(state, data: bytes) -> None:
    from fuzz_harness import Finding, allowed

    prog = Program(data)
    for _ in range(CALLS):
        k = prog.pick(range(len(POLICIES)))
        c, shadow = state["caches"][k], state["shadow"][k]
        op = prog.pick(OPS)
        args, named = _args(op, prog)
        before = {i: c.get(i) for i in named}
        try:
            out = getattr(c, op)(*args)
        except Exception as e:
            allowed(e, ALLOWED[op], f"{POLICIES[k]} {op}{_show(args)}")
            for i in named:
                if c.get(i) != before[i]:
                    raise Finding("changed", f"{POLICIES[k]} {op}{_show(args)} raised {e!r} "
                                             f"but changed sample {i}")
            continue
        _account(op, args, out, c, shadow, POLICIES[k])
    for k, c in enumerate(state["caches"]):
        try:
            c.check()
        except sc.CorruptionError as e:
            raise Finding("corrupt", f"{POLICIES[k]}: check() after the program: {e}")
        for i, v in state["shadow"][k].items():
            got = c.get(i)
            if got is not None and got != v:
                raise Finding("wrong-bytes", f"{POLICIES[k]}: sample {i} holds other bytes")


def _args(op, prog):
    if op in ("get", "contains", "remove", "view"):
        x = prog.pick(IDS)
        return (x,), [i for i in [_plain_id(x)] if i is not None]
    if op == "get_into":
        x = prog.pick(IDS)
        buf = prog.pick(BUFS)
        if isinstance(buf, bytearray):
            buf = bytearray(len(buf))
        return (x, buf), [i for i in [_plain_id(x)] if i is not None]
    if op == "put":
        x = prog.pick(IDS)
        return (x, prog.pick(VALUES), prog.pick(SCORES)), [i for i in [_plain_id(x)] if i is not None]
    if op == "get_many":
        ids = prog.pick(ID_ARRAYS)
        return (ids,), _ids_named(ids)
    if op == "put_many":
        ids = prog.pick(ID_ARRAYS)
        return (ids, prog.pick(VALUE_LISTS), prog.pick(SCORE_ARRAYS)), _ids_named(ids)
    ids = prog.pick(ID_ARRAYS)
    return (ids, prog.pick(SCORE_ARRAYS)), _ids_named(ids)


def _bytes_of(v):
    return bytes(memoryview(v).cast("B")) if not isinstance(v, bytes) else v


def _account(op, args, out, c, shadow, policy):
    """Checks a call that returned against the shadow and records what it stored."""
    from fuzz_harness import Finding

    if op == "put":
        i = _plain_id(args[0])
        if i is None:
            raise Finding("unchecked", f"{policy} put{_show(args)} returned {out!r} for a bad id")
        if out:
            shadow[i] = _bytes_of(args[1])
            if c.get(i) != shadow[i]:
                raise Finding("wrong-bytes", f"{policy} put({i}) said True but get differs")
    elif op == "put_many":
        for i, v, ok in zip(list(args[0]), list(args[1]), list(out)):
            if ok:
                shadow[int(i)] = _bytes_of(v)
    elif op == "get":
        i = _plain_id(args[0])
        if out is not None and (i is None or out != shadow.get(i)):
            raise Finding("wrong-bytes", f"{policy} get({args[0]!r}) returned other bytes")
    elif op == "get_many":
        for i, v in zip(list(args[0]), out):
            if v is not None and v != shadow.get(int(i)):
                raise Finding("wrong-bytes", f"{policy} get_many: sample {i} returned other bytes")
    elif op == "get_into":
        i = _plain_id(args[0])
        if out >= 0 and bytes(memoryview(args[1]).cast("B")[:out]) != shadow.get(i):
            raise Finding("wrong-bytes", f"{policy} get_into({i}) wrote other bytes")
    elif op == "view" and out is not None:
        with out as v:
            if bytes(v) != shadow.get(_plain_id(args[0])):
                raise Finding("wrong-bytes", f"{policy} view({args[0]!r}) shows other bytes")
    elif op == "remove" and out:
        shadow.pop(_plain_id(args[0]), None)


def _show(args):
    def s(a):
        r = repr(a) if not isinstance(a, (bytes, bytearray, np.ndarray, memoryview)) else \
            f"<{type(a).__name__} {getattr(a, 'dtype', '')} len {len(a) if hasattr(a, '__len__') else '?'}>"
        return r[:60]
    return "(" + ", ".join(s(a) for a in args) + ")"
