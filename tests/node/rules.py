"""An admission rule of a test's own (sc.Admission): the node's processes (the prefetcher, the
peer server) import this module to unpickle it, as a user's rule would be imported."""
import numpy as np

import shadecache as sc


class EvenIdsOnly(sc.Admission):
    """Nothing with an odd id enters the cache; the engine's policy decides the rest."""

    def allows(self, ids):
        return np.asarray(ids) % 2 == 0
