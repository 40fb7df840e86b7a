"""The data set a peer connection is about, as the handshake carries it: (fingerprint, num_samples).

The fingerprint is 32 bytes: a store's `fingerprint` (64 hex digits: sha256 of its header,
directory and metadata) as those bytes, another fingerprint string (a cache's `fingerprint=`) as
its sha256, none as 32 zero bytes (a data set then named by its sample count alone). Both sides
send theirs in the clear HELLO and mix it into the session keys, so a node never takes samples
of another data set (or another version of it) from a peer: the handshake refuses with
FingerprintError naming both.
"""
import hashlib

from ..errors import FingerprintError

UNNAMED = bytes(32)


def fingerprint_bytes(fingerprint) -> bytes:
    if not fingerprint:
        return UNNAMED
    if not isinstance(fingerprint, str):
        raise TypeError(f"fingerprint must be a str, got {type(fingerprint).__name__}")
    if len(fingerprint) == 64:
        try:
            return bytes.fromhex(fingerprint)
        except ValueError:
            pass
    return hashlib.sha256(fingerprint.encode("utf-8")).digest()


def identity_of(dataset) -> tuple:
    """(fingerprint bytes, num_samples) of `dataset`: a store (its `fingerprint`, when it has one,
    and its length), a Cache (its `fingerprint` and num_samples), or a (fingerprint, num_samples)
    pair (fingerprint: str or None)."""
    if isinstance(dataset, tuple):
        if len(dataset) != 2:
            raise ValueError(f"a data set identity is (fingerprint, num_samples), got {dataset!r}")
        fp, n = dataset
        if isinstance(fp, (bytes, bytearray)) and len(fp) == 32:
            fp = bytes(fp).hex()
    elif hasattr(dataset, "num_samples") and hasattr(dataset, "fingerprint"):   # a Cache
        fp, n = dataset.fingerprint, dataset.num_samples
    else:                                                                       # a store
        fp, n = getattr(dataset, "fingerprint", None), len(dataset)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n < 1 << 63:
        raise ValueError(f"num_samples must be a positive int, got {n!r}")
    return fingerprint_bytes(fp), int(n)


def of_server(cache, store=None) -> tuple:
    """The identity a server of `cache` (reading through `store`) announces: the store's when
    given (the cache must not name another data set or hold another number of samples), else the
    cache's."""
    mine = identity_of(cache)
    if store is None:
        return mine
    theirs = identity_of(store)
    if theirs[1] != mine[1] or (mine[0] != UNNAMED and theirs[0] != UNNAMED and mine[0] != theirs[0]):
        raise FingerprintError(f"cache {cache.name!r} holds {describe(mine)}, but the store to read through "
                               f"holds {describe(theirs)}")
    return theirs if theirs[0] != UNNAMED else mine


def describe(identity) -> str:
    fp, n = identity
    return f"an unnamed data set of {n} samples" if fp == UNNAMED else f"data set {fp.hex()} ({n} samples)"
