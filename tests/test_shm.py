"""The node's files in /dev/shm (shadecache/shm.py): an owner that exits removes its own file and
never a successor's under the same name, and gc removes what killed owners leave and nothing a
live process still owns. Real processes: a child creates, exits or is SIGKILLed, the test looks."""
import os
import signal
import subprocess
import sys
import uuid

import pytest

import shadecache as sc
from shadecache import shm
from shadecache.cache import gc
from shadecache.lookahead.board import OrderBoard

# A child that makes a cache (and, with "board", its order board), says "ready", and exits when
# its stdin gives a line (or is killed meanwhile).
_OWNER = r"""
import sys
import shadecache as sc
from shadecache.lookahead.board import OrderBoard
name, what, persist = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if what in ("cache", "both"):
    c = sc.Cache.create(name, num_samples=10, capacity_bytes=1 << 20, persist=persist)
if what in ("board", "both"):
    b = OrderBoard.create(name, 10)
print("ready", flush=True)
if sys.stdin.readline() == "unlink\n":   # the job's own clean-up, by the handle it holds
    try:
        c.unlink()
    except FileNotFoundError:
        pass
"""


@pytest.fixture
def name():
    n = f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    sc.Cache.remove(n)
    try:
        os.unlink(shm.board_path(n))
    except FileNotFoundError:
        pass


def _owner(name, what, persist=False):
    p = subprocess.Popen([sys.executable, "-c", _OWNER, name, what, "1" if persist else "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"ready\n"
    return p


def _exit(p, line=b"go\n"):
    p.stdin.write(line)
    p.stdin.close()
    assert p.wait(timeout=30) == 0


def test_an_owner_that_exits_leaves_a_cache_made_again_under_its_name(name):
    p = _owner(name, "cache")
    assert sc.Cache.remove(name)       # `shadecache rm` while its creator runs
    with sc.Cache.create(name, num_samples=10, capacity_bytes=1 << 20) as mine:
        assert mine.put(3, b"mine")
        _exit(p)                       # the first creator exits: its cache is long gone
        assert name in sc.Cache.list()
        other = sc.Cache.attach(name)  # a worker of this job attaches by name
        assert other.get(3) == b"mine"
        other.close()
    assert name not in sc.Cache.list()   # and this owner still removes its own at the end


def test_unlink_by_an_old_handle_leaves_a_cache_made_again_under_its_name(name):
    p = _owner(name, "cache")
    old = sc.Cache.attach(name)
    assert sc.Cache.remove(name)
    with sc.Cache.create(name, num_samples=10, capacity_bytes=1 << 20) as mine:
        assert mine.put(3, b"mine")
        with pytest.raises(FileNotFoundError, match="another cache"):
            old.unlink()               # this process's handle on the first job's segment
        old.close()
        _exit(p, b"unlink\n")         # the first job's own handle, in its process
        assert name in sc.Cache.list()
        other = sc.Cache.attach(name)
        assert other.get(3) == b"mine"
        other.close()


def test_an_owner_that_exits_leaves_a_board_made_again_under_its_name(name):
    p = _owner(name, "board")
    OrderBoard.attach(name).unlink()   # its creator's board is gone, another job makes one
    with OrderBoard.create(name, 10) as mine:
        mine.orders.publish(0, 0, [1, 2, 3])
        _exit(p)
        assert os.path.exists(shm.board_path(name))
        assert OrderBoard.attach(name).orders.published(0).tolist() == [1, 2, 3]
    assert not os.path.exists(shm.board_path(name))


def test_gc_keeps_the_board_of_a_live_creator_whose_cache_is_not_there(name):
    """A board made before its cache (or while gc lists the caches) is a live job's."""
    p = _owner(name, "board")
    try:
        gc()
        assert os.path.exists(shm.board_path(name))
    finally:
        _exit(p)
    assert not os.path.exists(shm.board_path(name))


def test_gc_removes_the_board_of_a_killed_creator_beside_its_persisted_cache(name):
    """A killed job's board would block the restarted job's OrderBoard.create (FileExistsError)
    for as long as the persisted cache it was made for is kept."""
    p = _owner(name, "both", persist=True)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    removed = gc()
    assert name not in removed and name in sc.Cache.list()      # persisted: kept
    assert shm.BOARD_PREFIX + name in removed
    OrderBoard.create(name, 10).__exit__(None, None, None)      # the restarted job's board
