"""A surface with planted defects, for the harness's own test (tests/fuzz/test_fuzz_short.py):
input byte 1 crashes, 2 hangs, 3 raises an exception outside the list, 4 allocates 1 GiB."""
import ctypes
import time

BUDGET_MB = 64
TIMEOUT_S = 2.0


def setup(workdir):
    return None


def generate(rng):
    return bytes([rng.randrange(5)])  # seed 640, inputs 0-7: 0 2 3 4 0 1 0 0


def run(state, data):
    from fuzz_harness import allowed

    b = data[0]
    try:
        if b == 1:
            ctypes.string_at(0)  # SIGSEGV
        elif b == 2:
            time.sleep(3600)
        elif b == 3:
            raise RuntimeError("planted")
        elif b == 4:
            bytearray(1 << 30)
    except Exception as e:
        allowed(e, (ValueError,), "planted")
