"""The home peer as a tier of the chain (shadecache/tiers.py, protocol: shadecache/store/protocol.py).

A Cluster serves an id from the node that is its home; HomePeerTier answers the tier protocol for
it: serves(ids) says which ids another node is home to (the chain asks the cluster for no others,
and, unless told to keep remote ids, a node keeps only the ids it is home to), read_many(ids)
fetches them (None for an id whose home failed or does not hold it: the next tier reads it). It
keeps no copies (no put_many) and knows no lengths; closing the chain's view of it leaves the
Cluster to its owner.
"""
import numpy as np


class HomePeerTier:
    lengths = None
    fingerprint = None

    def __init__(self, cluster):
        self.cluster = cluster

    def serves(self, ids) -> np.ndarray:
        """Bool mask: the ids whose home is another node (none on a one-node cluster)."""
        c = self.cluster
        ids = np.asarray(ids, dtype=np.int64)
        if c.num_nodes <= 1:
            return np.zeros(ids.size, dtype=bool)
        return c.home_of(ids) != c.node

    def read_many(self, ids) -> list:
        return self.cluster.fetch(ids)

    def close(self) -> None:
        """Nothing: the Cluster belongs to whoever made it."""
