"""The `shadecache` command. Each area registers its own subcommands:

  cache.register   ls, stats, rm, gc      (shadecache/cli/cache.py)
  store.register   pack, verify, info     (shadecache/cli/store.py)
  demo.register    demo                   (shadecache/cli/demo.py)
  peer.register    serve, secret          (shadecache/cli/peer.py)

Only the area of the command being run is imported (`shadecache ls` must not pay for importing
torch); `--help` imports them all. An area that fails to import (torch missing for `demo`) does not
take the others down.
"""
import argparse
import importlib
import sys

_COMMANDS = {
    "ls": ".cache", "stats": ".cache", "rm": ".cache", "gc": ".cache",
    "pack": ".store", "verify": ".store", "info": ".store",
    "demo": ".demo",
    "serve": ".peer", "secret": ".peer",
}


def build_parser(areas) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shadecache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for area in areas:
        try:
            mod = importlib.import_module(area, __package__)
        except ImportError as e:  # an optional extra (torch) may be absent
            for cmd in [c for c, a in _COMMANDS.items() if a == area]:
                p = sub.add_parser(cmd, help=f"unavailable: {e}")
                p.set_defaults(func=lambda args, m=str(e): sys.exit(f"shadecache: {m}"))
            continue
        mod.register(sub)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Paths need not be UTF-8: print them back as the bytes they are, whatever the locale's
    # stdout error handler is (strict outside C.UTF-8).
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="surrogateescape")
    first = next((a for a in argv if not a.startswith("-")), None)
    area = _COMMANDS.get(first)
    areas = [area] if area else list(dict.fromkeys(_COMMANDS.values()))
    args = build_parser(areas).parse_args(argv)
    from ..errors import ShadecacheError

    # The one error handler of every subcommand: the user's mistakes and damaged inputs (a missing
    # file, a malformed store, a segment of another layout version) end with one line naming the
    # error, exit status 2 as for a bad command line; 1 stays "ran, and found a problem"
    # (verify's corrupt samples, rm of an unknown name).
    try:
        rc = args.func(args)
    except (ShadecacheError, OSError, ValueError) as e:
        print(f"shadecache {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
