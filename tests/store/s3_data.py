"""Stores for the object-store tests: a local packed file and the same file as an object."""
import os
import sys
import uuid

import numpy as np

import shadecache as sc
from shadecache.store.object_client import ObjectClient

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
from seaweed import ACCESS_KEY, SECRET_KEY  # noqa: E402,F401  (the server's one identity)


def local_store(path, n=3000, low=100, high=6000, seed=0):
    """A packed store of n samples of random bytes (sizes in [low, high)), labels i % 7."""
    rng = np.random.default_rng(seed)
    with sc.PackWriter(path, meta={"classes": [f"c{k}" for k in range(7)]}) as w:
        for i in range(n):
            w.add(rng.bytes(int(rng.integers(low, high))), i % 7)
    return sc.PackedStore(path)


def upload(s3, path, key=None, **client_kw) -> str:
    """The file at `path` as an object of the server; its URL."""
    key = key or f"t-{uuid.uuid4().hex[:8]}.shc"
    ObjectClient(endpoint_url=s3.endpoint, **client_kw).upload_file(str(path), s3.bucket, key)
    return f"s3://{s3.bucket}/{key}"
