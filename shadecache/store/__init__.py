"""The stores that cache misses are read from, and the writer of the packed format.

  protocol.py  what the tier chain asks of a store (and of every tier): write a new store to it
  packed.py    PackedStore (one packed file, docs/store_format.md) and its PackedStream
  packed_views.py  what every reader of the packed format answers from its directory
  s3.py        S3Store: the packed format in an object, read with ranged GETs (docs/object_store.md)
  object_client.py  requests to S3: botocore, retries and their counters, the multipart upload
  node_slots.py     the node-wide bound on requests in flight (byte locks the kernel releases)
  folder.py    FolderStore (one file per sample, an ImageFolder tree)
  reader.py    what the two share over their native reader (csrc/io: io_uring, or the pread pool)
  writer.py    PackWriter and pack(): write a packed store
  legacy.py    reads a store of format version 1, for `shadecache pack OLD NEW` to convert
"""
from .folder import FolderStore, scan_image_folder  # noqa: F401
from .packed import FORMAT_VERSION, PackedStore  # noqa: F401
from .reader import probe_backend  # noqa: F401
from .s3 import S3Store  # noqa: F401
from .writer import PackWriter, pack  # noqa: F401

__all__ = ["FORMAT_VERSION", "FolderStore", "PackWriter", "PackedStore", "S3Store", "pack",
           "probe_backend", "scan_image_folder"]
