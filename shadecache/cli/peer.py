"""`shadecache serve NAME`: serve the node cache NAME to the other nodes, in the foreground.

The secret comes from $SHADECACHE_SECRET (never the command line, where `ps` shows it); without
one only loopback may be bound. --store makes the server read its own samples through from the
shared store on a miss (so the cluster reads each sample once); --ssd serves an SSD tier too.
"""
import os
import signal
import threading


def cmd_serve(args) -> int:
    from ..cache import Cache
    from ..peer.server import PeerService

    cache = Cache.attach(args.name)
    store = ssd = None
    if args.store:
        from ..store.packed import PackedStore
        store = PackedStore(args.store)
    if args.ssd:
        from ..ssd.tier import SSDTier
        ssd = SSDTier(args.ssd, capacity_bytes=args.ssd_bytes, cache=cache)
    service = PeerService(cache, args.host, args.port, os.environ.get("SHADECACHE_SECRET"), ssd, store)
    print(f"serving cache {args.name!r} on {service.address} (Ctrl-C to stop)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    threading.Thread(target=service.serve_forever, daemon=True).start()
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    service.close()
    print(f"served {service.counters}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a node cache to the other nodes (peer server)")
    p.add_argument("name", help="the cache to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (non-loopback needs $SHADECACHE_SECRET)")
    p.add_argument("--port", type=int, default=7070)
    p.add_argument("--store", help="packed store to read this node's own samples through from on a miss")
    p.add_argument("--ssd", help="SSD tier directory to serve (and fill)")
    p.add_argument("--ssd-bytes", type=int, default=0, help="SSD tier budget in bytes")
    p.set_defaults(func=cmd_serve)
