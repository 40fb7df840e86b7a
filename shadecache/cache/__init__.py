"""The node cache: one shared-memory copy of the cached samples for every process of a node.

  handle.py      Cache: create / attach a named segment; the readers and writers of the engine
                 (csrc/cache) and the node's segments (list, remove, gc)
  huge_pages.py  whether a cache's memory is on huge pages (read from /proc)
"""
from .handle import (  # noqa: F401  (the names `shadecache.cache.X` has always given)
    DEFAULT_MAX_ITEM_BYTES,
    POLICIES,
    Cache,
    creator_alive,
    describe,
    gc,
    list_caches,
    remove,
)

__all__ = ["Cache", "DEFAULT_MAX_ITEM_BYTES", "POLICIES", "creator_alive", "describe", "gc",
           "list_caches", "remove"]
