"""The node-local disk tier between the peers and the store.

  tier.py     SSDTier: checked batched reads, writes behind the read path, eviction by score
  layout.py   the on-disk layout: slot files per size class and the index journal
"""
from .tier import SSDTier  # noqa: F401

__all__ = ["SSDTier"]
