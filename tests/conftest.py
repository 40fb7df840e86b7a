import os
import uuid

import pytest

from shadecache import _core

pytest_plugins = ["s3_fixtures"]   # the S3 server and the fault proxy (tests/s3_fixtures.py)


def _creator(name):
    info = _core.CacheCore.read_creator(name)
    return info[0] if info else None


def _segments():
    return set(_core.CacheCore.list())


@pytest.fixture(scope="session", autouse=True)
def own_read_plans(tmp_path_factory):
    """The read plans a node chooses from a measurement are remembered under $XDG_CACHE_HOME
    (shadecache/read_plan.py): the suite's go to a directory of its own, not the user's home, and
    the processes the tests start (prefetchers, peer servers, ranks) inherit it."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg"))
    yield


@pytest.fixture(scope="session", autouse=True)
def no_leaked_segments():
    """Every test leaves /dev/shm as it found it (after `gc` of killed creators)."""
    before = _segments()
    before_files = set(os.listdir("/dev/shm"))
    yield
    from shadecache.cache import gc

    gc()
    from shadecache.cache import creator_alive

    # Segments of other live processes on this machine (another test run) are not ours, nor are
    # segments whose header this build cannot read (another version's run, mid-create) unless they
    # carry this run's pid in their name, as every test's names do.
    mine = f"-{os.getpid()}-"

    def ours(n):
        creator = _creator(n)
        if creator == os.getpid() or mine in n:
            return True
        # None: the segment went meanwhile (another run removed its own between the two looks)
        return creator is not None and creator_alive(n) is False

    leaked = {n for n in _segments() - before if ours(n)}
    assert not leaked, f"tests left shared-memory segments behind: {sorted(leaked)}"
    # and the node's other files (shm.py names them): boards and status files of this run's caches
    # (a board this process made goes at its exit, after this look)
    from shadecache import shm

    def left(e):
        boards = (shm.BOARD_PREFIX, shm.JOB_PREFIX)
        creator = shm.board_creator(os.path.join(shm.SHM_DIR, e)) if e.startswith(boards) else None
        return mine in e and (creator is None or creator[0] != os.getpid())

    others = {e for e in os.listdir(shm.SHM_DIR)
              if e.startswith((shm.BOARD_PREFIX, shm.JOB_PREFIX, shm.STATUS_PREFIX,
                               shm.PREFETCH_STATUS_PREFIX))
              and left(e)} - before_files
    assert not others, f"tests left files in {shm.SHM_DIR} behind: {sorted(others)}"


@pytest.fixture
def cache_name(request):
    """A unique cache name; the segment is removed after the test even if the test failed."""
    name = f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        _core.CacheCore.unlink(name)
    except OSError:
        pass


@pytest.fixture
def cache_factory():
    """make(n, capacity=1 MiB, policy="lru", **create_kwargs) -> a Cache under a unique name;
    every cache made is closed and removed after the test."""
    import shadecache as sc

    made = []

    def make(n, capacity=1 << 20, policy="lru", **kw):
        c = sc.Cache.create(f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}", num_samples=n,
                            capacity_bytes=capacity, policy=policy, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
        c.unlink()


# What bench/throttled_disk.py's disk delivers: a request costs the time of ~70 KB of transfer.
CLOUD_DEVICE = {"iops": 3000, "bandwidth": 200 << 20}


@pytest.fixture
def cloud_store(tmp_path):
    """3,000 samples of 2-4 KB (labels i % 10), shuffled on disk, opened with the cloud disk's
    device figures: an IOPS-bound store (its samples cost far more in requests than in bytes)."""
    import numpy as np

    import shadecache as sc

    rng = np.random.default_rng(0)
    p = tmp_path / "cloud.shc"
    with sc.PackWriter(p, seed=9) as w:
        for i in range(3000):
            w.add(rng.bytes(int(rng.integers(2000, 4000))), i % 10)
    with sc.PackedStore(p, device=CLOUD_DEVICE) as s:
        yield s
