"""What the tier chain asks of a store, and of every tier between the node cache and the store.

The store (the shared storage where every sample is) and the tiers closer to the node (the home
peer, the SSD tier) answer the same batched call, so that one chain (shadecache/tiers.py) reads a
miss through any of them, and a new store is one file that implements this:

    read_many(ids) -> list     the bytes of each id, in order, in one batched call (one value
                               per id: bytes, or any bytes-like object, whose bytes the chain
                               hands on as bytes); a tier gives None for an id it does not hold
                               (a store holds every id: the chain refuses a None, another
                               number of values or a value that is not bytes-like). Every
                               value handed out was checked against the checksum recorded with
                               it (a packed store's directory crc32c, the SSD tier's index, the
                               crc32c a peer sends with the value): a tier turns a damaged value
                               into a miss, a store raises sc.CorruptSampleError naming the id.
    lengths                    the byte length of every sample (an integer array), or None when
                               the tier cannot say without reading
    fingerprint                the identity of the data set (str), or None: a cache, an SSD tier
                               or a restarted job bound to one data set refuses another's
    close()                    releases files, rings, connections (a second close does nothing)

A store adds:

    len(store)                 the number of samples: ids are 0..len-1
    labels                     the label of every sample (an integer array), or label(i)

Optional, used when present:

    serves(ids) -> bool mask   the ids the tier can hold at all: the home peer serves only the
                               ids whose home is another node. The chain asks it for no others,
                               and a node keeps (in its cache and SSD tier) only the ids no such
                               tier serves, unless told to keep remote ones too.
    put_many(ids, values)      the tier keeps copies, written behind the read path: the chain
                               hands it what was read from below it and the cache refused.
    holds(ids) -> bool mask    which ids a copying tier holds now, without reading them (the
                               prefetcher leaves those to the loader: no shared-storage read).
    stream(queue_depth, lanes) a store whose reads can stay in flight across batches: an object
                               with submit(ids), take() -> the oldest batch's values, close()
                               (a PackedStore's ReadStream); the prefetcher's pipeline uses it.

Everything is duck-typed: Tier and Store below are typing.Protocol classes for readers and type
checkers; check_store() is what CachedDataset and the Prefetcher call to refuse, with a message
that names what is missing, an object that cannot serve as a store.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

import numpy as np


class Tier(Protocol):
    """A tier below the node cache (the home peer, the SSD tier): see the module docstring."""

    lengths: Optional[np.ndarray]
    fingerprint: Optional[str]

    def read_many(self, ids: Sequence[int]) -> list: ...

    def close(self) -> None: ...


class Store(Tier, Protocol):
    """The last tier: it holds every id 0..len-1 and knows their labels."""

    labels: np.ndarray

    def __len__(self) -> int: ...


def check_store(store, what: str = "store") -> None:
    """TypeError naming what `store` lacks to serve as a store: len(), read_many(ids), and labels
    (an array) or label(i)."""
    missing = []
    if not callable(getattr(store, "read_many", None)):
        missing.append("read_many(ids)")
    if not callable(getattr(type(store), "__len__", None)):
        missing.append("len()")
    if getattr(store, "labels", None) is None and not callable(getattr(store, "label", None)):
        missing.append("labels or label(i)")
    if missing:
        raise TypeError(f"{what} {type(store).__name__} lacks {', '.join(missing)} "
                        "(shadecache/store/protocol.py says what a store answers)")


def lengths_of(tier) -> Optional[np.ndarray]:
    """The tier's `lengths` as an int64 array, or None when it has none."""
    lengths = getattr(tier, "lengths", None)
    return None if lengths is None else np.asarray(lengths, dtype=np.int64)
