"""The stores that cache misses are read from, and the writer of the packed format.

  packed.py   PackedStore (one packed file, docs/store_format.md) and FolderStore (one file per
              sample), both read in batches through csrc/io (io_uring, or the pread pool)
  writer.py   PackWriter and pack(): write a packed store
"""
from .packed import FORMAT_VERSION, FolderStore, PackedStore, probe_backend, scan_image_folder  # noqa: F401
from .writer import PackWriter, pack  # noqa: F401

__all__ = ["FORMAT_VERSION", "FolderStore", "PackWriter", "PackedStore", "pack", "probe_backend",
           "scan_image_folder"]
