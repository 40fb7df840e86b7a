"""The node cache: one shared-memory copy of the cached samples for every process of a node.

  handle.py      Cache: create / attach a named segment; the readers and writers of the engine
                 (csrc/cache)
  node.py        the caches of this node: list, describe, remove, gc
  huge_pages.py  whether a cache's memory is on huge pages (read from /proc)
"""
from .handle import DEFAULT_MAX_ITEM_BYTES, POLICIES, Cache  # noqa: F401
from .node import creator_alive, describe, gc, list_caches, remove  # noqa: F401

__all__ = ["Cache", "DEFAULT_MAX_ITEM_BYTES", "POLICIES", "creator_alive", "describe", "gc",
           "list_caches", "remove"]
