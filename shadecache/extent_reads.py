"""The tier chain's reads under the extent plan, in one process: extent mates and their stage.

Under the extent plan (read_plan.py) a miss is read with its whole extent. What the store reads
besides the ids asked for are the extent's mates: the chain offers them to the cache with the
asked ones, and what the cache refuses waits in this process's stage (first in, first out, within
its room) until the sampler's order asks for it, so that a full cache that admits by score does
not make a mate be read again when its turn comes. A copying tier (the SSD tier) is asked only for
the extents the node holds whole, with its other samples of them, so an extent comes back from the
tier in one read and the store is not asked for it at all.

The pass: in the sampler's process the chain knows which ids the sampler's current pass over its
order still asks for (begin_pass, then each read's asked ids): only those are worth reading as
mates (not another rank's share, nor a sample asked already), and a new pass drops what the last
one staged. In any other process (a DataLoader worker, the prefetcher, the peer server) nobody
tells it, and every id counts as due.

One ExtentReads per process and chain (TierChain.extents), used by one caller at a time (the miss
path's lock, shadecache/node/miss_path.py, serialises them).
"""
from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

STAGE_EXTENTS = 32            # the stage's room: the sampler's default window twice
STAGE_MAX_BYTES = 256 << 20


class MateStage:
    """Extent mates the cache refused, kept until their turn (first in, first out, within
    `capacity` bytes). Each value keeps the index of the tier that read it (Read.source)."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._d = OrderedDict()   # id -> (value, source)
        self._bytes = 0

    def put(self, ids, values, sources) -> None:
        for i, v, src in zip(ids, values, sources):
            if i in self._d or v is None:
                continue
            self._d[i] = (v, src)
            self._bytes += len(v)
        while self._bytes > self.capacity and self._d:
            _, (v, _) = self._d.popitem(last=False)
            self._bytes -= len(v)

    def take(self, ids) -> list:
        """The staged (value, source) of each id (None where there is none), removed."""
        out = []
        for i in ids:
            got = self._d.pop(i, None)
            if got is not None:
                self._bytes -= len(got[0])
            out.append(got)
        return out

    def mask(self, ids: np.ndarray) -> np.ndarray:
        """Bool mask: which of `ids` are staged."""
        d = self._d
        return np.fromiter((i in d for i in ids.tolist()), dtype=bool, count=ids.size)

    def clear(self) -> None:
        self._d.clear()
        self._bytes = 0

    @property
    def room(self) -> int:
        """Bytes the stage takes before it drops its oldest values."""
        return max(0, self.capacity - self._bytes)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, i) -> bool:
        return i in self._d


class ExtentReads:
    """The extent plan's state in one process (module docstring): the stage and the pass."""

    def __init__(self, layout, lengths):
        self.layout = layout
        self.lengths = lengths
        self.stage = MateStage(min(STAGE_MAX_BYTES, STAGE_EXTENTS * layout.extent_bytes))
        self.pid = os.getpid()
        self._due = None          # bool per id: the current pass asks for it and has not yet

    def begin_pass(self, order=None) -> None:
        """The sampler starts a pass over its order in this process (a new epoch, the same epoch
        again, a resume): what the last pass staged is not due in this one's windows, and would
        hold the stage's room. order: the ids the pass will ask for (None: every id)."""
        self.stage.clear()
        if order is None:
            self._due = np.ones(len(self.layout), dtype=bool)
        else:
            self._due = np.zeros(len(self.layout), dtype=bool)
            self._due[np.asarray(order, dtype=np.int64)] = True

    def asked(self, ids) -> None:
        """The chain was asked for `ids` in this pass: not due as mates any more (a sample asked
        again in its window is read with its extent's samples still due, not the whole extent)."""
        if self._due is not None:
            self._due[np.asarray(ids, dtype=np.int64)] = False

    def due(self, ids) -> np.ndarray:
        """Bool mask: which of `ids` the current pass still asks for (all before a pass began)."""
        ids = np.asarray(ids, dtype=np.int64)
        return np.ones(ids.size, dtype=bool) if self._due is None else self._due[ids]

    def mates(self, ids, cached, keeps, on_way=None) -> np.ndarray:
        """The mates to read with `ids`: those this node would keep (keeps(ids) -> mask) and its
        cache does not hold (cached: bool per id, or None), not on their way from the node's
        prefetcher (on_way(ids) -> mask, or None: a reader asks for those when their turn comes,
        and a read of them here would be a second), not staged, still due in this pass, and no
        more than the stage has room for. A stage that overflows drops mates still due,
        whose reads bring more mates, which push out more; the rest of an extent cut off here is
        read when its samples are asked for. (The mates' lengths only: a cast of the whole array
        is a copy of the data set's.)"""
        mates = self.layout.mates(ids)
        if mates.size and cached is not None:
            mates = mates[~cached[mates]]
        if mates.size:
            mates = mates[keeps(mates)]
        if mates.size and on_way is not None:
            mates = mates[~np.asarray(on_way(mates), dtype=bool)]
        if mates.size and len(self.stage):
            mates = mates[~self.stage.mask(mates)]
        if mates.size:
            mates = mates[self.due(mates)]
            fits = np.cumsum(np.asarray(self.lengths)[mates], dtype=np.int64) <= self.stage.room
            mates = mates[fits]
        return mates

    def take_staged(self, r) -> None:
        """Fills the positions of Read `r` no tier had yet from the stage (with the source that
        read them), marking them r.staged."""
        rest = r.missing()
        if not len(self.stage) or not rest.size:
            return
        staged = np.zeros(r.ids.size, dtype=bool)
        for k, got in zip(rest.tolist(), self.stage.take(r.ids[rest].tolist())):
            if got is not None:
                r.values[k] = got[0]
                r.source[k] = got[1]
                staged[k] = True
        r.staged = staged

    def whole(self, r, tier, pending: np.ndarray, cached):
        """Which of the `pending` positions of `r` to ask of a copying tier, and which of its other
        samples to read with them: only the positions whose store extent the node holds whole
        (each of its samples cached, held by this tier, or staged), with the tier's other samples
        of those extents that are neither cached nor staged; the rest are left to the store, whose
        read of their extents brings them anyway (a read of this tier for them would be one more
        read and save the shared storage nothing)."""
        holds = getattr(tier, "holds", None)
        none = np.empty(0, np.int64)
        if holds is None or not pending.size:
            return pending, none
        ids = r.ids[pending]
        members = self.layout.widen(ids)                  # disk order: grouped by extent
        ext = self.layout.extent_of[members]
        held = np.asarray(holds(members), dtype=bool)
        other = np.zeros(members.size, dtype=bool) if cached is None else cached[members].copy()
        if len(self.stage):
            other |= self.stage.mask(members)
        starts = np.flatnonzero(np.concatenate([[True], ext[1:] != ext[:-1]]))
        whole = ext[starts][np.logical_and.reduceat(held | other, starts)]
        if not whole.size:
            return pending[:0], none
        in_whole = np.isin(ext, whole)
        mates = members[in_whole & held & ~other & ~np.isin(members, r.ids)]
        return pending[np.isin(self.layout.extent_of[ids], whole)], mates

    def in_disk_order(self, r, positions: np.ndarray) -> np.ndarray:
        """`positions` of `r` in disk order when the read brought mates (else as they are): a
        cache that fills up then holds whole extents and at most one in part, and a copying tier
        lays an extent's samples in neighbouring slots."""
        if positions.size and r.ids.size > r.asked:
            return positions[np.argsort(self.layout.position[r.ids[positions]], kind="stable")]
        return positions

    def stage_refused(self, r, admitted: np.ndarray, have: np.ndarray) -> None:
        """The mates of `r` the cache refused wait in the stage for their turn."""
        if r.ids.size > r.asked:
            refused = np.flatnonzero(~admitted[r.asked:] & have[r.asked:]) + r.asked
            if refused.size:
                self.stage.put(r.ids[refused].tolist(), [r.values[k] for k in refused.tolist()],
                               r.source[refused].tolist())
