"""`shadecache pack | verify | info`: the packed store from the command line."""
from __future__ import annotations

import os
import sys


def _pack(args) -> int:
    from ..store.writer import pack

    from ..store.object_client import ObjectClient, is_object_url, parse_url

    client = ObjectClient() if is_object_url(args.dst) or is_object_url(args.src) else None
    n = pack(args.src, args.dst, progress=not args.quiet, backend=args.backend,
             shuffle=not args.no_shuffle, seed=args.seed, client=client)
    size = (client.head(*parse_url(args.dst))["size"] if is_object_url(args.dst)
            else os.path.getsize(args.dst))
    print(f"packed {n} samples into {args.dst} ({size / 2**20:.1f} MiB)")
    return 0


def _verify(args) -> int:
    from ..store.packed import PackedStore

    store = PackedStore(args.path, backend=args.backend, verify=True)
    bad = store.verify(progress=not args.quiet)
    if not bad:
        print(f"OK: {len(store)} samples in {args.path}, every checksum matches")
        return 0
    for i in bad[:20]:
        print(f"corrupt: sample {i} at file offset {store.offset(i)} ({store.lengths[i]} bytes)",
              file=sys.stderr)
    if len(bad) > 20:
        print(f"... and {len(bad) - 20} more", file=sys.stderr)
    print(f"FAILED: {len(bad)} of {len(store)} samples in {args.path} are corrupt", file=sys.stderr)
    return 1


def _info(args) -> int:
    import numpy as np

    from ..store import FolderStore, PackedStore, probe_backend

    if os.path.isdir(args.path):
        store = FolderStore(args.path, backend=args.backend)
        print(f"folder         {args.path}")
        print(f"samples        {len(store)}")
        print(f"classes        {len(store.classes)}")
    else:
        store = PackedStore(args.path, backend=args.backend)
        lengths = store.lengths.astype(np.int64)
        print(f"store          {args.path}")
        if getattr(store, "etag", None):
            print(f"object         ETag {store.etag} at {store.client.endpoint}")
        print(f"format version {store.version}")
        print(f"placement      {store.placement}" +
              (f" (seed {store.placement_seed})" if store.placement == "shuffled" else ""))
        print(f"file size      {store.file_bytes} bytes ({store.file_bytes / 2**20:.1f} MiB)")
        print(f"samples        {len(store)}")
        if len(store):
            print(f"sample bytes   total {int(lengths.sum())}, min {int(lengths.min())}, "
                  f"mean {lengths.mean():.0f}, max {int(lengths.max())}")
        classes = store.classes
        if classes:
            print(f"classes        {len(classes)}")
    labels = store.labels
    if len(labels):
        uniq, counts = np.unique(labels, return_counts=True)
        shown = ", ".join(f"{int(u)}:{int(c)}" for u, c in list(zip(uniq, counts))[:10])
        more = f", ... ({len(uniq)} distinct)" if len(uniq) > 10 else ""
        print(f"labels         {shown}{more}")
    name, reason = probe_backend(args.backend)
    print(f"I/O backend    {name}" + (f" (io_uring unavailable: {reason})" if reason else ""))
    return 0


def register(subparsers) -> None:
    backends = ("auto", "io_uring", "pread")
    p = subparsers.add_parser("pack", help="pack an image folder (or convert an older store) "
                                           "into one store file")
    p.add_argument("src", help="folder in ImageFolder layout (SRC/<class>/<file>), or a store "
                               "file to convert (format version 1) or repack")
    p.add_argument("dst", help="store file to write (replaced atomically), or an object URL "
                               "s3://bucket/key (one multipart upload: all or nothing)")
    p.add_argument("--backend", choices=backends, default="auto")
    p.add_argument("--no-shuffle", action="store_true",
                   help="lay samples out in id order (default: a seeded shuffle, so that "
                        "neighbours on disk are unrelated samples)")
    p.add_argument("--seed", type=int, default=0, help="seed of the placement shuffle")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_pack)

    p = subparsers.add_parser("verify", help="check every sample's checksum in a store")
    p.add_argument("path", help="a store file, or an object URL s3://bucket/key")
    p.add_argument("--backend", choices=backends, default="auto")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_verify)

    p = subparsers.add_parser("info", help="describe a store (or folder) and the I/O backend")
    p.add_argument("path", help="a store file, a folder, or an object URL s3://bucket/key")
    p.add_argument("--backend", choices=backends, default="auto")
    p.set_defaults(func=_info)
