"""Huge pages for the segment: what /dev/shm's mount gives, and what a cache's mapping got.

The parsers are tested on the texts the kernel writes; the whole path on a real mapping, in a
private mount namespace whose /dev/shm is a tmpfs mounted with huge=within_size (as
docs/shared_memory.md tells an administrator to mount it), and on this machine's own /dev/shm.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import shadecache as sc
from shadecache.cache import huge_pages

REPO = pathlib.Path(__file__).parents[2]

MOUNTINFO = """\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
28 22 0:25 / /dev/shm rw,relatime shared:4 - tmpfs tmpfs rw,size=24684092k
40 22 0:30 / /mnt/x rw - tmpfs tmpfs rw,huge=always
"""


def test_mount_option_finds_the_mount_by_device_not_by_mount_point():
    assert huge_pages.mount_option(MOUNTINFO, device="0:25") == "never"
    assert huge_pages.mount_option(MOUNTINFO, device="0:30") == "always"
    assert huge_pages.mount_option(MOUNTINFO, device="9:99") is None
    assert huge_pages.mount_option("garbage\n\n1 2 3\n", device="0:25") is None
    # a huge mount stacked on /dev/shm but listed first (mountinfo follows mount ids, not the
    # stacking): the device of the visible file system decides, whatever the order of the lines
    stacked = ("41 28 0:31 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=1048576k,huge=within_size\n"
               + MOUNTINFO)
    assert huge_pages.mount_option(stacked, device="0:31") == "within_size"
    assert huge_pages.mount_option(stacked, device="0:25") == "never"
    # an empty source leaves two spaces before the super options
    empty = "50 22 0:40 / /mnt/y rw - tmpfs  rw,size=8192k,huge=always\n"
    assert huge_pages.mount_option(empty, device="0:40") == "always"


def test_mount_option_of_this_nodes_dev_shm_is_read_from_its_own_device():
    st = os.stat("/dev/shm")
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    with open("/proc/self/mountinfo") as f:
        line = next(l for l in f if l.split()[2] == dev)
    assert huge_pages.mount_option() == huge_pages.mount_option(line)
    assert huge_pages.mount_option() in ("never", "always", "within_size", "advise")


def test_the_global_setting_overrides_the_mount_only_when_it_forces_or_denies():
    within = MOUNTINFO.replace("size=24684092k", "size=24684092k,huge=within_size")
    assert huge_pages.global_setting("always within_size advise [never] deny force\n") == "never"
    assert huge_pages.shm_mode(within, "always within_size advise [never] deny force", "0:25") == "within_size"
    assert huge_pages.shm_mode(MOUNTINFO, "always within_size advise never deny [force]", "0:25") == "force"
    assert huge_pages.shm_mode(within, "always within_size advise never [deny] force", "0:25") == "deny"
    assert huge_pages.shm_mode(MOUNTINFO, "", "0:25") == "never"
    assert [m for m in ("never", "advise", "within_size", "always", "force", "deny")
            if huge_pages.gives_huge_pages(m)] == ["within_size", "always", "force"]


def test_mapped_bytes_sums_the_mappings_of_one_file_deleted_or_not():
    smaps = """\
7f0000000000-7f0000400000 rw-s 00000000 00:1b 11                         /dev/shm/shadecache.a
Size:               4096 kB
Rss:                4096 kB
ShmemPmdMapped:     2048 kB
FilePmdMapped:         0 kB
VmFlags: rd wr sh mr mw me ms sd
7f0000400000-7f0000600000 rw-s 00000000 00:1b 12                         /dev/shm/shadecache.ab
Rss:                2048 kB
ShmemPmdMapped:     2048 kB
7f0000600000-7f0000800000 rw-s 00000000 00:1b 11                         /dev/shm/shadecache.a (deleted)
Rss:                 100 kB
ShmemPmdMapped:        0 kB
7f0000800000-7f0000900000 rw-p 00000000 00:00 0
Rss:                 512 kB
"""
    assert huge_pages.mapped_bytes("/dev/shm/shadecache.a", smaps) == (4196 * 1024, 2048 * 1024)
    assert huge_pages.mapped_bytes("/dev/shm/shadecache.zz", smaps) == (0, 0)


def _fill(cache, n=2000, size=3072):
    v = np.arange(size, dtype=np.uint8)
    for i in range(n):
        assert cache.put(i, v)
    assert bytes(cache.get(n - 1)) == v.tobytes()


def test_a_cache_on_this_node_reports_what_its_mapping_got(cache_name):
    with sc.Cache.create(cache_name, num_samples=4096, capacity_bytes=16 << 20) as c:
        _fill(c)
        r = c.huge_pages()
    assert r["shm_mode"] == huge_pages.shm_mode()
    assert r["new_segments_huge"] == huge_pages.gives_huge_pages(r["shm_mode"])
    assert r["resident_bytes"] >= 2000 * 3072, r
    if not r["new_segments_huge"]:
        assert r["huge_mapped_bytes"] == 0, r
    with pytest.raises(sc.ClosedError):
        c.huge_pages()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) to mount a tmpfs")
def test_a_cache_on_a_huge_tmpfs_is_mapped_with_huge_pages(cache_name):
    """The mount an administrator is told to use (huge=within_size): the segment's resident
    pages are huge-page mapped, values round-trip, and the report says so."""
    script = f"""
import numpy as np, shadecache as sc
with sc.Cache.create("{cache_name}", num_samples=4096, capacity_bytes=16 << 20) as c:
    v = np.arange(3072, dtype=np.uint8)
    for i in range(2000):
        assert c.put(i, v)
    assert all(bytes(c.get(i)) == v.tobytes() for i in range(2000))
    r = c.huge_pages()
print(r)
assert r["shm_mode"] == "within_size" and r["new_segments_huge"], r
assert r["huge_mapped_bytes"] >= 2 << 20 and r["huge_mapped_bytes"] >= r["resident_bytes"] // 2, r
print("ok")
"""
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f"mount -t tmpfs -o size=64m,huge=within_size tmpfs /dev/shm && {sys.executable} -c '{script}'"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO))
    if res.returncode != 0 and ("Operation not permitted" in res.stderr or "bad option" in res.stderr):
        pytest.skip("cannot mount a huge-page tmpfs here: " + res.stderr.strip())
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok" in res.stdout
