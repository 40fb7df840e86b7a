"""Home nodes: which node owns (caches and serves) each sample id.

Rendezvous (highest random weight) hashing: id i belongs to the live node n with the largest
weight h(i, n). When a node leaves, only the ids it owned move (each to its second-best node);
every other id keeps its home. Nodes are identified by node rank, so every process of a job,
on every node, computes the same homes without talking to anyone.
"""
import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on uint64 that spreads every input bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def weights(ids: np.ndarray, node: int) -> np.ndarray:
    """h(id, node) for every id (uint64)."""
    with np.errstate(over="ignore"):
        seed = _mix(np.asarray([node + 1], dtype=np.uint64) * _GOLDEN)[0]
        return _mix(np.asarray(ids, dtype=np.int64).astype(np.uint64) ^ seed)


def home_of(ids, nodes, alive=None) -> np.ndarray:
    """The home node rank of every id among `nodes` (node ranks), restricted to those with
    alive[k] true when a mask is given. ValueError when no node is alive."""
    nodes = list(nodes)
    if alive is not None:
        nodes = [n for n, a in zip(nodes, alive) if a]
    if not nodes:
        raise ValueError("home_of: no live node")
    ids = np.asarray(ids, dtype=np.int64)
    if len(nodes) == 1:
        return np.full(ids.shape, nodes[0], dtype=np.int64)
    w = np.stack([weights(ids, n) for n in nodes])
    return np.asarray(nodes, dtype=np.int64)[np.argmax(w, axis=0)]
