"""Whether a cache's shared memory is mapped with huge pages, and whether this node can give them.

Why it matters: a cache larger than the CPU caches is read at random, so nearly every value a
`get` or a batch gather reads lies on a page whose address translation is not in the TLB; with
4 KiB pages that is a page walk per value, with 2 MiB pages the TLB covers 512 times as much.
`get`s and `CachedLoader` batches over such a cache are faster on them, and the numpy arrays they
are compared with already have them (numpy asks for huge pages for its large arrays):
docs/shared_memory.md, "Huge pages"; the runs in docs/benchmark_history.md, "Huge pages for the
segment".

The segment is a file on /dev/shm (tmpfs), and tmpfs gives huge pages only when the mount says so
(`huge=within_size` or `huge=always`) or when the node forces them on every tmpfs
(`/sys/kernel/mm/transparent_hugepage/shmem_enabled` = `force`); a `huge=never` mount (the default)
ignores `madvise(MADV_HUGEPAGE)`, so the engine cannot ask for them itself. The mount is the
node's administrator's to set: `mount -o remount,huge=within_size /dev/shm` (docs/shared_memory.md,
"Huge pages"). This module only reads: the mount option (/proc/self/mountinfo), the global
setting, and how much of a mapping is mapped by huge pages (/proc/self/smaps).
"""
import os
from typing import Optional

from ..shm import SHM_DIR   # shm.py names every place shadecache keeps files in
SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
# The tmpfs modes under which a file sized up front (ftruncate + posix_fallocate, as the segment is
# made) gets huge pages from the start. Under "advise" its preallocated pages start small; they
# become huge only when collapsed (khugepaged on a madvised mapping, or MADV_COLLAPSE), which the
# engine does not ask for today.
HUGE_MODES = ("always", "within_size", "force")


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def mount_option(mountinfo: Optional[str] = None, path: str = SHM_DIR,
                 device: Optional[str] = None) -> Optional[str]:
    """The `huge=` option of the file system that holds `path`: "never" when its mount has none,
    None when it is not found (or /proc is unreadable). `mountinfo` is the text of
    /proc/self/mountinfo (read when None); `device` the "major:minor" of that file system (taken
    from os.stat(path) when None). The mount is found by device, not by mount point: a mount
    point can be stacked or moved (mountinfo is ordered by mount id, not by what is visible),
    and /dev/shm can be a directory of another tmpfs or a symlink."""
    text = _read("/proc/self/mountinfo") if mountinfo is None else mountinfo
    if device is None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if text is None:
        return None
    for line in text.splitlines():
        # "<id> <parent> <major:minor> <root> <mount point> <options> [optional...] - <type> <source> <super options>"
        fields = line.split()
        if len(fields) < 7 or " - " not in line or fields[2] != device:
            continue
        # the super options are the last field (the source may be empty: "- tmpfs  rw,...")
        super_options = line.split(" - ", 1)[1].split()
        for opt in (super_options[-1].split(",") if len(super_options) >= 2 else []):
            if opt.startswith("huge="):
                return opt[len("huge="):]
        return "never"
    return None


def global_setting(shmem_enabled: Optional[str] = None) -> Optional[str]:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/shmem_enabled ("never",
    "force", "deny", ...), None when the kernel has no such file."""
    text = _read(SHMEM_ENABLED) if shmem_enabled is None else shmem_enabled
    if text is None:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def shm_mode(mountinfo: Optional[str] = None, shmem_enabled: Optional[str] = None,
             device: Optional[str] = None) -> str:
    """The huge-page mode that applies to new files on /dev/shm: the global setting when it
    overrides every mount ("force", "deny"), else the mount's `huge=` option ("never" if unknown)."""
    g = global_setting(shmem_enabled)
    if g in ("force", "deny"):
        return g
    return mount_option(mountinfo, device=device) or "never"


def gives_huge_pages(mode: str) -> bool:
    """Whether a segment created under `mode` gets huge pages."""
    return mode in HUGE_MODES


def describe(mode: Optional[str] = None) -> str:
    """One line for a benchmark's output: the mode and the page size new segments get."""
    mode = shm_mode() if mode is None else mode
    return (f"/dev/shm huge pages: `{mode}` (cache segments on "
            f"{'2 MiB' if gives_huge_pages(mode) else '4 KiB'} pages)")


def mapped_bytes(path: str, smaps: Optional[str] = None) -> tuple:
    """(bytes resident, bytes mapped by huge pages) of this process's mappings of file `path`,
    summed over /proc/self/smaps (`smaps` is its text, read when None). A file removed while
    mapped shows as "<path> (deleted)" there and counts too."""
    text = _read("/proc/self/smaps") if smaps is None else smaps
    rss = huge = 0
    inside = False
    for line in (text or "").splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:   # a mapping's first line
            name = head[5].strip() if len(head) == 6 else ""
            inside = name == path or name == path + " (deleted)"
        elif inside:
            key, _, value = line.partition(":")
            if key == "Rss":
                rss += int(value.split()[0]) * 1024
            elif key in ("ShmemPmdMapped", "FilePmdMapped"):
                huge += int(value.split()[0]) * 1024
    return rss, huge


def report(segment_path: str) -> dict:
    """What `Cache.huge_pages()` and `shadecache stats` show: the mode /dev/shm gives new
    segments (`shm_mode`), whether that means huge pages for them (`new_segments_huge`), and how
    much of this process's mapping of the segment file `segment_path` is resident now and how much
    of that is mapped by huge pages (the latter two are this cache's own: a cache made before a
    remount can differ from the mode, until khugepaged collapses it)."""
    mode = shm_mode()
    rss, huge = mapped_bytes(segment_path)
    return {"shm_mode": mode, "new_segments_huge": gives_huge_pages(mode),
            "resident_bytes": rss, "huge_mapped_bytes": huge}
