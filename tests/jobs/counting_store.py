"""A store of the tests' own (store/protocol.py): a packed store whose every read_many adds the
number of ids it read to a file (one 8-byte record per call, O_APPEND: atomic between processes),
so a test counts what every process of a node (its jobs, their workers, the prefetcher) read from
the store; with `delay_s`, each sample read takes that long (a store slower than training, as
shared storage is). The node's processes import this module to unpickle it, as a user's store
would be."""
import os
import struct
import time

import numpy as np

import shadecache as sc


class CountingStore:
    def __init__(self, path: str, count_file: str, delay_s: float = 0.0):
        self.path, self.count_file, self.delay_s = path, count_file, delay_s
        self._store = sc.PackedStore(path)
        self._fd = None
        self.labels, self.lengths = self._store.labels, self._store.lengths
        self.fingerprint = self._store.fingerprint

    def __len__(self):
        return len(self._store)

    def read_many(self, ids):
        values = self._store.read_many(ids)
        if self.delay_s:
            time.sleep(self.delay_s * len(values))
        if self._fd is None or self._fd[1] != os.getpid():
            self._fd = (os.open(self.count_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), os.getpid())
        os.write(self._fd[0], struct.pack("<q", len(values)))
        return values

    def close(self):
        self._store.close()

    def __reduce__(self):
        return (CountingStore, (self.path, self.count_file, self.delay_s))


def reads(count_file: str) -> int:
    """Samples read from the store so far, by every process."""
    if not os.path.exists(count_file):
        return 0
    with open(count_file, "rb") as f:
        return int(np.frombuffer(f.read(), dtype="<i8").sum())


def pack_random(path, n: int, size: int) -> str:
    """A packed store at `path` of `n` random values of `size` bytes (seed 0), labels i % 10."""
    rng = np.random.default_rng(0)
    sc.pack([(rng.bytes(size), i % 10) for i in range(n)], path, progress=False)
    return str(path)
