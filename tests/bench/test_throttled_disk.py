"""bench/throttled_disk.py, the slow storage every I/O benchmark runs on: a throttled process's
direct reads are counted by the block device and held to the IOPS limit; the process that made the
disk is not throttled; everything made (mount, loop device, image, cgroup) is gone afterwards."""
import os
import subprocess
import sys
import time

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import throttled_disk  # noqa: E402

pytestmark = pytest.mark.skipif(throttled_disk.unavailable() is not None,
                                reason=f"throttled disk: {throttled_disk.unavailable()}")

READER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 4096)
t = time.monotonic()
for i in range(int(sys.argv[2])):
    os.preadv(fd, [buf], (i * 7919 % 4096) * 4096)
print(time.monotonic() - t)
"""


def test_direct_reads_are_counted_and_held_to_the_iops_limit():
    with throttled_disk.ThrottledDisk(64 << 20, read_iops=500, read_bps=200 << 20) as disk:
        made = (disk.image, disk.device, disk.mount, disk.cgroup)
        path = os.path.join(disk.mount, "data")
        with open(path, "wb") as f:
            f.write(os.urandom(16 << 20))
        disk.drop_caches()
        before = disk.counters()
        out = subprocess.run([sys.executable, "-c", READER, path, "300"], check=True,
                             capture_output=True, text=True, preexec_fn=disk.enter_in_child)
        seen = disk.counters() - before
        assert seen.requests >= 300 and seen.bytes >= 300 * 4096, seen
        # 300 reads at 500/s take at least ~0.6 s (the throttle is a floor: a loaded machine is slower)
        assert float(out.stdout) >= 0.45, out.stdout
        # the maker is outside the cgroup
        with open(f"/proc/{os.getpid()}/cgroup") as f:
            assert "shadecache-disk" not in f.read()
    image, device, mount, cgroup = made
    assert not os.path.exists(image) and not os.path.exists(mount) and not os.path.exists(cgroup)
    assert device not in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout


def test_a_disk_closed_while_a_file_on_it_is_open_lets_its_loop_device_go():
    """An open file keeps the file system busy, so a plain umount fails; the disk is then unmounted
    lazily and its loop device is released once the file is closed, not left attached."""
    disk = throttled_disk.ThrottledDisk(64 << 20)
    with disk:
        image, device, mount = disk.image, disk.device, disk.mount
        f = open(os.path.join(mount, "held"), "wb")
    try:
        assert not os.path.ismount(mount)
    finally:
        f.close()
    deadline = time.monotonic() + 5
    while True:
        attached = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
        if device + ":" not in attached or image not in attached:
            break
        assert time.monotonic() < deadline, attached
        time.sleep(0.1)
