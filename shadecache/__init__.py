"""shadecache: an importance-aware, node-wide shared-memory sample cache for PyTorch training.

Names are loaded on first use, so `import shadecache` neither builds a dependency on torch nor
loads a native module the caller does not need.
"""
import importlib

from ._version import __version__  # noqa: F401  (the package version, re-exported)
from .errors import (  # noqa: F401
    CapacityError,
    ClosedError,
    CorruptionError,
    CorruptSampleError,
    FingerprintError,
    LayoutVersionError,
    ObjectChangedError,
    ObjectStoreError,
    ShadecacheError,
    StoreFormatError,
    ValueTooLargeError,
)

# public name -> module that defines it
_LAZY = {
    "Cache": ".cache",
    "POLICIES": ".cache",
    "PackWriter": ".store.writer",
    "PackedStore": ".store.packed",
    "FolderStore": ".store.folder",
    "S3Store": ".store.s3",
    "pack": ".store.writer",
    "rank_weights": ".sampling.importance",
    "ImportanceTable": ".sampling.importance",
    "ShadeSampler": ".sampling.sampler",
    "CachedDataset": ".loader.dataset",
    "CachedLoader": ".loader.loader",
    "RaggedBatch": ".loader.batches",
    "Cluster": ".peer",
    "PeerServer": ".peer",
    "SSDTier": ".ssd",
    "OrderBoard": ".lookahead.board",
    "belady_hits": ".lookahead.belady",
    "Prefetcher": ".lookahead.prefetcher",
    "Node": ".node",
    "Admission": ".admission",
    "ReadThrough": ".admission",
    "ReadPlan": ".read_plan",
}

# the package's rooms, reached as attributes (`sc.cache.gc()`) without an import of their own
_ROOMS = ("cache", "cli", "demo", "loader", "lookahead", "node", "peer", "sampling", "ssd", "store")

__all__ = sorted(list(_LAZY) + ["__version__", "CapacityError", "ClosedError", "CorruptionError", "FingerprintError",
                                "CorruptSampleError", "LayoutVersionError", "ObjectChangedError",
                                "ObjectStoreError", "ShadecacheError",
                                "StoreFormatError", "ValueTooLargeError"])


def __getattr__(name):
    if name in _ROOMS:   # importing a subpackage sets it on this module too
        return importlib.import_module("." + name, __name__)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'shadecache' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
