"""Exceptions raised by shadecache. The native modules raise these same classes
(csrc/bindings/errors.cc maps each engine error kind to one of them).

Built-in exceptions are used where Python users expect them: IndexError for a sample id out of
range, TypeError for a wrong type, ValueError for a bad argument, FileExistsError /
FileNotFoundError for cache names, OSError (with errno) for any other system failure.
"""


class ShadecacheError(Exception):
    """Base class of every shadecache-specific error."""


class CapacityError(ShadecacheError, MemoryError):
    """Not enough room: /dev/shm too small for the segment, or a disk full while packing."""


class ValueTooLargeError(ShadecacheError, ValueError):
    """A value is larger than the largest size class (or the whole cache) can ever hold."""


class ClosedError(ShadecacheError, ValueError):
    """A Cache or store was used after close()."""


class LayoutVersionError(ShadecacheError):
    """A shared-memory segment or file was written by an incompatible layout/format version."""


class FingerprintError(ShadecacheError, ValueError):
    """An existing cache holds the samples of another data set (or another version of it, or
    another number of samples) than the one asked for."""


class CorruptionError(ShadecacheError):
    """An internal invariant does not hold (raised by Cache.check())."""


class StoreFormatError(ShadecacheError):
    """A packed store file is malformed: bad magic, damaged directory, truncated data."""


class CorruptSampleError(CorruptionError):
    """A sample's bytes do not match the checksum in the sample directory."""

    def __init__(self, message, sample_id=None, offset=None):
        super().__init__(message)
        self.sample_id = sample_id
        self.offset = offset


class ObjectChangedError(StoreFormatError):
    """The object a store was opened on was replaced since (its ETag or version differs): a store
    never mixes the bytes of two versions of an object; reopen it to read the new one."""


class ObjectStoreError(ShadecacheError, OSError):
    """A request to the object store failed for good: refused (access denied, a bad request) or
    still failing after every retry. The message names the object, the request and the cause."""
