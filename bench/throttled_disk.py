"""Storage shaped like a cloud network disk, for benchmarks: an ext4 file system on a loop device
whose reads are throttled by the cgroup v1 blkio controller (IOPS and bandwidth), plus what a
benchmark needs around it: dropping the page cache, setting read-ahead, and reading the bytes and
requests the block device itself saw (not our own accounting).

Needs root, a kernel with loop devices and the cgroup v1 blkio hierarchy at /sys/fs/cgroup/blkio
(device-mapper and cgroup v2 io are not needed). `unavailable()` says why it cannot run, or None.

    with ThrottledDisk(2 << 30, read_iops=3000, read_bps=200 << 20) as disk:
        path = os.path.join(disk.mount, "train.shc")      # write the data set here
        disk.drop_caches()
        before = disk.counters()
        proc = subprocess.Popen([...], preexec_fn=disk.enter_in_child)   # reads are throttled
        ...
        read = disk.counters() - before                   # DiskCounters(bytes, requests)

Only processes placed in the cgroup are throttled (children inherit it): the process that writes
the data set stays outside, so building the set is fast. `python bench/throttled_disk.py` measures
the limits with fio when it is installed (random 4 KiB and sequential 1 MiB reads).
"""
import argparse
import collections
import os
import shutil
import subprocess
import tempfile
import time
import uuid

BLKIO = "/sys/fs/cgroup/blkio"

DiskCounters = collections.namedtuple("DiskCounters", "bytes requests")
DiskCounters.__sub__ = lambda a, b: DiskCounters(a.bytes - b.bytes, a.requests - b.requests)


def unavailable():
    """Why a throttled disk cannot be made here (a sentence), or None when it can."""
    if os.geteuid() != 0:
        return "needs root (losetup, mount and the blkio cgroup)"
    if not os.path.exists(os.path.join(BLKIO, "blkio.throttle.read_iops_device")):
        return f"no cgroup v1 blkio throttling at {BLKIO}"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def drop_caches():
    """Write back and drop the page cache, dentries and inodes (every epoch starts cold)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class ThrottledDisk:
    """An ext4 loop device of `size_bytes` throttled to `read_iops` reads/s and `read_bps`
    bytes/s for the processes placed in its cgroup. A context manager: everything it made (mount,
    loop device, image file, cgroup) is removed on exit, also after an exception."""

    def __init__(self, size_bytes, read_iops=3000, read_bps=200 << 20, image_dir="/var/tmp",
                 read_ahead_kb=None):
        why = unavailable()
        if why:
            raise RuntimeError(f"a throttled disk cannot be made: {why}")
        self.size_bytes = int(size_bytes)
        self.read_iops, self.read_bps = int(read_iops), int(read_bps)
        self.image_dir, self.read_ahead_kb = image_dir, read_ahead_kb
        self.image = self.device = self.mount = self.cgroup = None

    # ---- setup and teardown --------------------------------------------------------------------

    def __enter__(self):
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _make(self):
        tag = uuid.uuid4().hex[:8]
        fd, self.image = tempfile.mkstemp(prefix="shadecache-disk-", suffix=".img", dir=self.image_dir)
        os.ftruncate(fd, self.size_bytes)
        os.close(fd)
        self.device = subprocess.run(["losetup", "--find", "--show", self.image], check=True,
                                     capture_output=True, text=True).stdout.strip()
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                        self.device], check=True, capture_output=True)
        self.mount = tempfile.mkdtemp(prefix="shadecache-disk-")
        subprocess.run(["mount", self.device, self.mount], check=True, capture_output=True)
        with open(f"/sys/block/{self.name}/dev") as f:
            self.major_minor = f.read().strip()
        self.cgroup = os.path.join(BLKIO, f"shadecache-disk-{tag}")
        os.mkdir(self.cgroup)
        self._write(self.cgroup, "blkio.throttle.read_iops_device", f"{self.major_minor} {self.read_iops}")
        self._write(self.cgroup, "blkio.throttle.read_bps_device", f"{self.major_minor} {self.read_bps}")
        if self.read_ahead_kb is not None:
            self.set_read_ahead(self.read_ahead_kb)

    def close(self):
        """Undo what _make did, in reverse; each step tolerates the previous one not having run."""
        if self.cgroup and os.path.isdir(self.cgroup):
            # A cgroup with members cannot be removed (EBUSY): move them back to the root group
            # first. A member still exiting (a child killed just before) leaves it busy for a
            # moment, so the removal is tried again for up to two seconds.
            deadline = time.monotonic() + 2.0
            while True:
                for pid in self._members():
                    try:
                        self._write(BLKIO, "cgroup.procs", str(pid))
                    except OSError:
                        pass
                try:
                    os.rmdir(self.cgroup)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
        if self.mount and os.path.ismount(self.mount):
            if subprocess.run(["umount", self.mount], capture_output=True).returncode != 0:
                # busy (a file on it still open, e.g. by a process being killed): detach it now and
                # let the kernel finish when the last user goes, or the loop device stays attached
                subprocess.run(["umount", "--lazy", self.mount], capture_output=True)
        if self.mount and os.path.isdir(self.mount):
            try:
                os.rmdir(self.mount)
            except OSError:
                pass
        if self.device:
            subprocess.run(["losetup", "-d", self.device], capture_output=True)
        if self.image and os.path.exists(self.image):
            os.unlink(self.image)
        self.cgroup = self.mount = self.device = self.image = None

    # ---- use -----------------------------------------------------------------------------------

    @property
    def name(self):
        """The block device's kernel name, e.g. loop3."""
        return os.path.basename(self.device)

    def enter(self, pid=None):
        """Place process `pid` (default: this one) in the throttled cgroup; its children inherit it."""
        self._write(self.cgroup, "cgroup.procs", str(pid or os.getpid()))

    def enter_in_child(self):
        """For subprocess.Popen(preexec_fn=...): the child is throttled, the parent is not."""
        self.enter(os.getpid())

    def leave(self, pid=None):
        """Move process `pid` (default: this one) back to the root blkio group (unthrottled)."""
        self._write(BLKIO, "cgroup.procs", str(pid or os.getpid()))

    def set_read_ahead(self, kb):
        """Kernel read-ahead of the device in KiB (0: the kernel reads only what was asked)."""
        self._write(f"/sys/block/{self.name}/queue", "read_ahead_kb", str(int(kb)))

    def drop_caches(self):
        drop_caches()

    def counters(self):
        """Bytes and read requests the device has completed (/sys/block/<dev>/stat: reads
        completed, sectors read of 512 bytes), what the throttled storage really served."""
        with open(f"/sys/block/{self.name}/stat") as f:
            fields = f.read().split()
        return DiskCounters(bytes=int(fields[2]) * 512, requests=int(fields[0]))

    def describe(self):
        return (f"ext4 on {self.device} ({self.size_bytes >> 20} MiB), reads throttled by cgroup v1 "
                f"blkio to {self.read_iops} IOPS and {self.read_bps / (1 << 20):.0f} MiB/s")

    def _members(self):
        try:
            with open(os.path.join(self.cgroup, "cgroup.procs")) as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    @staticmethod
    def _write(directory, name, text):
        with open(os.path.join(directory, name), "w") as f:
            f.write(text + "\n")


def _fio_limits(disk):
    """Random 4 KiB and sequential 1 MiB direct reads through the throttle, as fio measures them."""
    path = os.path.join(disk.mount, "fio.dat")
    subprocess.run(["fio", "--name=fill", f"--filename={path}", "--rw=write", "--bs=1M", "--size=256M",
                    "--direct=1"], check=True, capture_output=True)
    out = {}
    for label, rw, bs in (("random 4 KiB", "randread", "4k"), ("sequential 1 MiB", "read", "1M")):
        res = subprocess.run(["fio", "--name=limit", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
                              "--size=256M", "--direct=1", "--ioengine=io_uring", "--iodepth=32",
                              "--runtime=4", "--time_based", "--output-format=terse"],
                             check=True, capture_output=True, text=True, preexec_fn=disk.enter_in_child)
        f = res.stdout.strip().split(";")
        out[label] = (float(f[7]), float(f[6]) * 1024 / (1 << 20))   # read IOPS, read KiB/s -> MiB/s
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iops", type=int, default=3000)
    ap.add_argument("--mib-per-s", type=int, default=200)
    args = ap.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"cannot run: {why}")
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (scripts/install_system_deps.sh installs it)")
    with ThrottledDisk(1 << 30, args.iops, args.mib_per_s << 20) as disk:
        print(disk.describe())
        for label, (iops, mib) in _fio_limits(disk).items():
            print(f"  {label:18s} {iops:10,.0f} IOPS {mib:8.1f} MiB/s")


if __name__ == "__main__":
    main()
