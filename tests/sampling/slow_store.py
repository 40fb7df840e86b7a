"""A store slower than training, for the stall budget's tests: a PackedStore whose every batched
read also takes `per_sample_s` per sample (storage bound by its requests per second, as a network
file system or a throttled cloud disk is). Picklable by path, so a prefetcher process opens it too
(its module must be importable there: the tests put this folder on PYTHONPATH)."""
import time

import shadecache as sc


class SlowStore:
    def __init__(self, path: str, per_sample_s: float):
        self.path, self.per_sample_s = path, float(per_sample_s)
        self.store = sc.PackedStore(path)
        self.labels, self.lengths = self.store.labels, self.store.lengths

    def __len__(self):
        return len(self.store)

    def label(self, i):
        return self.store.label(i)

    def read_many(self, ids):
        out = self.store.read_many(ids)
        time.sleep(self.per_sample_s * len(out))
        return out

    def __reduce__(self):
        return SlowStore, (self.path, self.per_sample_s)
