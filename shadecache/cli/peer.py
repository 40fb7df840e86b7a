"""`shadecache serve NAME`: serve the node cache NAME to the other nodes, in the foreground.
`shadecache secret`: print (or write to a new 0600 file) a fresh secret for the peer layer.

The secret comes from $SHADECACHE_SECRET or the 0600 file named by $SHADECACHE_SECRET_FILE (or
--secret-file), never the command line itself, where `ps` shows it to every user; every address
needs one, loopback included. --store makes the server read its own samples through from the
shared store on a miss (so the cluster reads each sample once); without it, --cache-only says
that serving what the cache holds is meant. --ssd serves an SSD tier too.
"""
import os
import signal
import threading


def cmd_serve(args) -> int:
    from ..cache import Cache
    from ..node import Node
    from ..peer import secret
    from ..peer.server import PeerService

    key = secret.resolve(secret.read_file(args.secret_file) if args.secret_file else None)
    if not args.store and not args.cache_only:
        raise ValueError("serve needs --store PATH (the server reads through the samples this node is home to, "
                         "so that the cluster reads each sample once), or --cache-only to serve only what the "
                         "cache holds")
    cache = Cache.attach(args.name)
    store = ssd = None
    if args.store:
        from ..store.packed import PackedStore
        store = PackedStore(args.store)
    if args.ssd:
        from ..ssd.tier import SSDTier
        ssd = SSDTier(args.ssd, capacity_bytes=args.ssd_bytes, cache=cache)
    node = Node(store, cache, ssd=ssd, read_ahead=False)
    service = PeerService(node, args.host, args.port, key)
    print(f"serving cache {args.name!r} on {service.address} (Ctrl-C to stop)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    service.start()
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    joined = service.close()
    print(f"served {service.counters}", flush=True)
    if not joined:   # a connection thread still inside a native call: leave without finalizing under it
        os._exit(0)
    return 0


def cmd_secret(args) -> int:
    from ..peer import secret

    value = secret.new_secret()
    if args.out:
        secret.write_file(args.out, value)
        print(f"wrote a new secret to {args.out} (mode 0600); give every node that file and set "
              f"SHADECACHE_SECRET_FILE={args.out}")
    else:
        print(value)
    return 0


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a node cache to the other nodes (peer server)")
    p.add_argument("name", help="the cache to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=7070)
    p.add_argument("--store", help="packed store to read this node's own samples through from on a miss")
    p.add_argument("--cache-only", action="store_true", help="serve only what the cache holds (no --store)")
    p.add_argument("--secret-file", help="a 0600 file holding the secret (default: $SHADECACHE_SECRET, "
                                         "then $SHADECACHE_SECRET_FILE)")
    p.add_argument("--ssd", help="SSD tier directory to serve (and fill)")
    p.add_argument("--ssd-bytes", type=int, default=0, help="SSD tier budget in bytes")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("secret", help="print a fresh secret for the peer layer (32 random bytes, hex)")
    p.add_argument("--out", help="write it to this new file, mode 0600, instead of printing it")
    p.set_defaults(func=cmd_secret)
