"""What the peer tests share: the job's secret in the environment, a small packed store, a cache
that holds all of it."""
import numpy as np
import pytest

import shadecache as sc


def secret_in_env(secret: str):
    """An autouse fixture for a test module: `secret` is the job's secret, given the way a launcher
    gives it (in the environment: children inherit it)."""
    @pytest.fixture(autouse=True)
    def _secret_in_env(monkeypatch):
        monkeypatch.setenv("SHADECACHE_SECRET", secret)
        monkeypatch.delenv("SHADECACHE_SECRET_FILE", raising=False)
    return _secret_in_env


def pack_store(path, n=64, size=(1, 3000), seed=5, labels=1):
    """A packed store of `n` random samples of `size` bytes (an int, or a [low, high) range),
    labels i % `labels`."""
    rng = np.random.default_rng(seed)
    with sc.PackWriter(str(path)) as w:
        for i in range(n):
            k = size if isinstance(size, int) else int(rng.integers(*size))
            w.add(rng.integers(0, 256, k, dtype=np.uint8).tobytes(), i % labels)
    return sc.PackedStore(str(path))


def full_cache(cache_factory, store):
    """A cache of `store`'s data set holding every one of its samples."""
    c = cache_factory(len(store), 8 << 20, "lru", max_item_bytes=4096, fingerprint=store.fingerprint)
    c.put_many(np.arange(len(store)), store.read_many(list(range(len(store)))))
    assert c.stats()["items"] == len(store)
    return c
