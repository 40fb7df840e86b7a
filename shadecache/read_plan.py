"""The read plan: how a node reads its misses, given to the node once, the same in every process.

Two plans:

  samples   each miss is read alone (neighbours on disk merged within the store's gap, in any
            batch): the sampler's order is a shuffle of its draw;
  extents   each miss is read with its whole extent (a run of neighbours on disk, about
            `extent_bytes` long), and the sampler arranges its draw so that the samples of a few
            extents are asked for together (sampling/extents.py's arrange): a store whose device
            pays more for a request than for its bytes then reads bandwidth, not requests.

A plan is immutable and picklable: the node hands it to its tier chain in every process (data set,
loader, DataLoader workers, prefetcher, peer server), and the sampler draws its order under it. The
order is a function of the seed, the scores, the cache at set_epoch and the plan, so the plan is
printed when it is chosen, saved in the sampler's state_dict, and can be given (`read_plan=` of
sc.Node: "samples", "extents", a ReadPlan, or "auto").

"auto" chooses from the store's device profile (what a request costs against a byte, measured at
open or given): extents where the mean sample is under a quarter of what the device transfers in
the time of one request (PackedStore.iops_bound), else samples. A measurement varies between
processes, and with it the choice and the extent size, so that two runs with one seed would draw
two orders: a choice made from a measurement is kept on the node (node_files:
$XDG_CACHE_HOME/shadecache/read_plans, else ~/.cache/..., this user's, 0700/0600) and reused for
PLAN_TTL_S; every rank of a process group takes rank 0's (one broadcast).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from . import node_files
from .ids import check_ids

DEFAULT_WINDOW = 16          # extents whose samples the sampler shuffles together
MIN_EXTENT_BYTES = 64 << 10
MAX_EXTENT_BYTES = 8 << 20
REQUESTS_PER_EXTENT = 16     # an extent is this many gaps long: a request costs <= 1/16 of its bytes
PLAN_TTL_S = 7 * 86400       # a chosen plan is reused this long on a node, then measured again
SAMPLES, EXTENTS = "samples", "extents"


class ExtentLayout:
    """Which extent each sample id lies in: consecutive runs of about `extent_bytes` bytes of the
    store's disk order (a sample belongs to the extent its first byte falls in). Immutable."""

    def __init__(self, disk_order, lengths, extent_bytes: int):
        disk_order = np.asarray(disk_order, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        n = lengths.size
        if disk_order.size != n or (n and not np.array_equal(np.sort(disk_order), np.arange(n))):
            raise ValueError("disk_order must be a permutation of the ids 0..N-1 "
                             f"(N = {n}, the number of lengths)")
        if int(extent_bytes) < 1:
            raise ValueError(f"extent_bytes must be >= 1, not {extent_bytes!r}")
        self.extent_bytes = int(extent_bytes)
        starts = np.cumsum(lengths[disk_order]) - lengths[disk_order]
        self.extent_of = np.empty(n, dtype=np.int64)
        self.extent_of[disk_order] = starts // self.extent_bytes
        self.extents = int(self.extent_of.max()) + 1 if n else 0
        # the members of extent e are by_extent[first[e]:first[e + 1]] (disk order is extent order)
        self.by_extent = disk_order
        self.position = np.empty(n, dtype=np.int64)   # each id's place in the disk order
        self.position[disk_order] = np.arange(n, dtype=np.int64)
        self.first = np.searchsorted(self.extent_of[disk_order], np.arange(self.extents + 1))
        for a in (self.extent_of, self.by_extent, self.position, self.first):
            a.setflags(write=False)

    def widen(self, ids) -> np.ndarray:
        """Every id of the extents that `ids` touch (distinct, in disk order): what one read of
        those extents brings."""
        ext = np.unique(self.extent_of[check_ids(ids, self.extent_of.size)])
        if ext.size == 0:
            return np.empty(0, dtype=np.int64)
        lo, hi = self.first[ext], self.first[ext + 1]
        counts = hi - lo
        starts = np.repeat(lo - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        return self.by_extent[starts + np.arange(int(counts.sum()))]

    def mates(self, ids) -> np.ndarray:
        """The ids a read of the extents of `ids` brings besides them."""
        wide = self.widen(ids)
        return wide[~np.isin(wide, np.asarray(ids, dtype=np.int64))]

    def shared_scores(self, ids, scores, cached=None) -> tuple:
        """(members, their scores): every id of the extents that `ids` touch, each with the mean
        of `scores` (one per id of the data set) over its extent. Under the extent plan a miss
        reads its whole extent, so a cached sample saves a read only while all of its extent is
        held: the cache and the SSD tier are given one score per extent (its samples' mean), and
        keep, evict and admit whole extents by it.

        cached (a bool per id, the cache's content): the extents it holds whole score one
        standard deviation of the extents' means higher, so that another extent takes the place
        of one held only where it scores clearly higher. An extent is a random handful of
        samples, and the means of most extents differ by less than their noise: swapping them on
        every difference read an extent for each swap."""
        members = self.widen(ids)
        if members.size == 0:
            return members, np.empty(0, dtype=np.float64)
        # by bincount: an extent index a sample larger than extent_bytes skipped has no members
        counts = np.bincount(self.extent_of, minlength=self.extents)
        means = (np.bincount(self.extent_of, weights=np.asarray(scores, dtype=np.float64),
                             minlength=self.extents) / np.maximum(counts, 1))
        if cached is not None and self.extents > 1:
            some = counts > 0
            held = some & (np.bincount(self.extent_of, weights=np.asarray(cached, dtype=np.float64),
                                       minlength=self.extents) == counts)
            means = means + float(np.std(means[some])) * held
        return members, means[self.extent_of[members]]

    def __len__(self) -> int:
        return self.extent_of.size


class ReadPlan:
    """How misses are read (module docstring): kind "samples" or "extents"; for extents, the
    layout of the store, its extent size and the window of extents the sampler shuffles
    together. `reason` says where the choice came from (printed by describe())."""

    def __init__(self, kind: str, layout: ExtentLayout | None = None, window: int = DEFAULT_WINDOW,
                 reason: str = "given"):
        if kind not in (SAMPLES, EXTENTS):
            raise ValueError(f"a read plan is {SAMPLES!r} or {EXTENTS!r}, not {kind!r}")
        if (kind == EXTENTS) != (layout is not None):
            raise ValueError("an extents plan needs its ExtentLayout, a samples plan has none")
        if isinstance(window, bool) or int(window) < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.kind, self.layout, self.window, self.reason = kind, layout, int(window), str(reason)

    @property
    def extents(self) -> bool:
        return self.kind == EXTENTS

    @property
    def extent_bytes(self) -> int:
        return 0 if self.layout is None else self.layout.extent_bytes

    @classmethod
    def samples(cls, reason: str = "given") -> "ReadPlan":
        return cls(SAMPLES, reason=reason)

    @classmethod
    def of_extents(cls, store, extent_bytes: int | None = None, window: int = DEFAULT_WINDOW,
                   reason: str = "given") -> "ReadPlan":
        """The extent plan of a packed store (disk_order and lengths), extents of `extent_bytes`
        (default: extent_bytes_for(store))."""
        if not hasattr(store, "disk_order"):
            raise ValueError(f"the extent plan needs a packed store (its disk order); "
                             f"{type(store).__name__} has none")
        size = extent_bytes_for(store) if extent_bytes is None else int(extent_bytes)
        return cls(EXTENTS, ExtentLayout(store.disk_order(), store.lengths, size), window, reason)

    def state(self) -> dict:
        """What a checkpoint keeps of the plan (the sampler's state_dict)."""
        return {"kind": self.kind, "extent_bytes": self.extent_bytes, "window": self.window}

    def same_as(self, state: dict) -> bool:
        return state == self.state()

    def describe(self) -> str:
        if not self.extents:
            return f"read plan: samples ({self.reason})"
        return (f"read plan: extents of {self.extent_bytes >> 10} KiB, {self.layout.extents} of them, "
                f"window {self.window} ({self.reason}; for the node's sampler, whose order it "
                f"arranges: with a sampler of your own, read_plan='samples')")

    def __repr__(self) -> str:
        return f"<ReadPlan {self.describe()}>"


def extent_bytes_for(store) -> int:
    """An extent long enough that its request costs the device at most 1/16 of its transfer:
    16 x the store's gap threshold (bandwidth / IOPS), rounded to a power of two (so that two
    measurements of one device agree), within [64 KiB, 8 MiB]."""
    gap = int(getattr(store, "gap_bytes", 0) or 0)
    want = max(MIN_EXTENT_BYTES, REQUESTS_PER_EXTENT * gap)
    return int(min(MAX_EXTENT_BYTES, 1 << int(round(np.log2(want)))))


def choose(store, given="auto", window: int = DEFAULT_WINDOW, remember: bool = True) -> ReadPlan:
    """The node's plan: a ReadPlan as it is; "samples"; "extents" or "auto" as this node chose
    them for the store before (within PLAN_TTL_S), else as chosen now from the store's device
    profile ("auto": extents where the store is IOPS-bound; "extents": the extent size of the
    device), and then remembered when measured. Under torch.distributed rank 0 chooses (and
    alone remembers) and every rank takes its kind and extent size (the ranks' shares are
    positions of one arranged sequence)."""
    if isinstance(given, ReadPlan):
        return given
    if given not in ("auto", SAMPLES, EXTENTS):
        raise ValueError(f"read_plan must be 'auto', {SAMPLES!r}, {EXTENTS!r} or a ReadPlan, "
                         f"not {given!r}")
    if given == SAMPLES:
        return ReadPlan.samples()
    if not hasattr(store, "disk_order") or not hasattr(store, "iops_bound"):
        if given == EXTENTS:
            return ReadPlan.of_extents(store)   # raises, naming what the store lacks
        return ReadPlan.samples("auto: the store has no disk order")
    kind, size, reason = _agreed(lambda: _measured_choice(store, given, remember))
    if kind == SAMPLES:
        return ReadPlan.samples(reason)
    return ReadPlan.of_extents(store, size, window, reason)


def _measured_choice(store, given: str, remember: bool):
    """(kind, extent_bytes, reason) of "auto" or "extents" for a store with a disk order: the
    remembered one, else chosen from the device profile (and remembered when measured)."""
    # what a process measured varies, what was given does not: only a measured choice is kept
    measured = str((getattr(store, "device", None) or {}).get("source", "")).startswith("measured")
    remember = remember and measured
    kind, size, reason = _remembered(store) if remember else (None, None, None)
    if kind is not None and (given == "auto" or kind == EXTENTS):
        return kind, size, reason
    kind = EXTENTS if given == EXTENTS or store.iops_bound else SAMPLES
    size = extent_bytes_for(store) if kind == EXTENTS else 0
    reason = f"{given}: {_device_words(store)}"
    if remember:
        _remember(store, kind, size)
    return kind, size, reason


def _device_words(store) -> str:
    dev = getattr(store, "device", None) or {}
    iops, bw = dev.get("iops"), dev.get("bandwidth")
    lengths = getattr(store, "lengths", None)
    mean = float(np.mean(lengths)) if lengths is not None and len(lengths) else 0.0
    if not iops or not bw:
        return f"device {dev.get('source', 'not measured')}, mean sample {mean / 1024:.1f} KiB"
    return (f"device {iops:,.0f} reads/s, {bw / 1e6:,.0f} MB/s ({dev.get('source', '')}), "
            f"mean sample {mean / 1024:.1f} KiB")


def _plans_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shadecache", "read_plans")


def _plan_file(store) -> str | None:
    """The file name of a store's remembered plan: its data set (fingerprint) on its device (the
    same data on another disk is measured on its own)."""
    fp = getattr(store, "fingerprint", None)
    if not fp:
        return None
    try:
        device = os.stat(store.path).st_dev
    except (AttributeError, OSError, TypeError):
        device = 0
    return "".join(c if c.isalnum() else "_" for c in str(fp))[:64] + f"-{device}.json"


def _remembered(store):
    """(kind, extent_bytes, reason) this node chose for the store within PLAN_TTL_S, or Nones.
    Only a file of this user's own directory is read (node_files: nobody else plants a plan)."""
    name = _plan_file(store)
    if name is None:
        return None, None, None
    try:
        dir_fd = node_files.own_directory(_plans_dir(), "read plan directory")
        try:
            fd = node_files.open_file(name, os.O_RDONLY, "read plan file", dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        with open(fd, "r", encoding="utf-8") as f:
            got = json.load(f)
        kind, size, at = got["kind"], int(got["extent_bytes"]), float(got["chosen_unix"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, None, None
    if kind not in (SAMPLES, EXTENTS) or not 0 <= time.time() - at < PLAN_TTL_S:
        return None, None, None
    if kind == EXTENTS and not (MIN_EXTENT_BYTES <= size <= MAX_EXTENT_BYTES
                                and size & (size - 1) == 0):
        return None, None, None   # not a size this module writes: measured again
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(at))
    return kind, size, (f"auto: chosen on this node at {when} ({got.get('why', '')}); "
                        f"read_plan='{SAMPLES}' or '{EXTENTS}' overrides it")


def _remember(store, kind: str, size: int) -> None:
    name = _plan_file(store)
    if name is None:
        return
    data = json.dumps({"kind": kind, "extent_bytes": size, "chosen_unix": time.time(),
                       "why": _device_words(store)}).encode()
    try:
        dir_fd = node_files.own_directory(_plans_dir(), "read plan directory")
        try:
            node_files.replace(_plans_dir(), name, data, "read plan file", dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass   # an unwritable home: the plan is chosen again by the next process


def _agreed(choose_here):
    """choose_here()'s (kind, extent_bytes, reason) in this process, or under torch.distributed
    rank 0's on every rank (the others do not choose: one measurement, one remembered plan)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return choose_here()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return choose_here()
    box = [choose_here() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return tuple(box[0])
