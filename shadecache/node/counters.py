"""Named counters that every process reading one node's data set adds to: the miss path's (node/miss_path.py).

The counters are one row of int64 in a multiprocessing.RawArray, which travels to fork and spawn
DataLoader workers alike when they are started (no lock object could be shared between a
fork-context parent and spawn-context workers). Every add is one atomic read-modify-write
(_io.atomic_add), so any number of processes and threads add to the same row and no add is lost;
a reader of the totals sees each field's value at some moment (fields are not read as one
snapshot).

Only multiprocessing can hand the row to another process (while it starts one). A plain pickle (a
checkpoint of the data set, a copy.deepcopy) carries the values as they were: the copy counts in a
row of its own from there.
"""
import multiprocessing as mp
import multiprocessing.context

import numpy as np

from .. import _io


class SharedCounters:
    """int64 counters by name, added to atomically from any process that holds this object."""

    def __init__(self, fields):
        self.fields = tuple(fields)
        self.index = {name: k for k, name in enumerate(self.fields)}
        self._raw = mp.RawArray("q", len(self.fields))
        self._view = None

    def _array(self) -> np.ndarray:
        if self._view is None:
            self._view = np.frombuffer(self._raw, dtype=np.int64)
        return self._view

    def add(self, **deltas) -> None:
        """Adds each value to the field of its name (zeros skip the call)."""
        a = self._array()
        index = self.index
        for name, v in deltas.items():
            if v:
                _io.atomic_add(a, index[name], int(v))

    def totals(self) -> dict:
        return dict(zip(self.fields, (int(v) for v in self._array())))

    def reset(self) -> None:
        """Zeroes every field (while nobody adds: an add racing it may survive the reset)."""
        self._array()[:] = 0

    def __getstate__(self):
        if multiprocessing.context.get_spawning_popen() is not None:   # a process being started
            return {"fields": self.fields, "index": self.index, "_raw": self._raw, "_view": None}
        return {"fields": self.fields, "index": self.index, "_values": list(self._array())}

    def __setstate__(self, state):
        values = state.pop("_values", None)
        self.__dict__.update(state)
        if values is not None:
            self._raw, self._view = mp.RawArray("q", values), None
