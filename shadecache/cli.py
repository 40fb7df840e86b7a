"""The `shadecache` command. Each area registers its own subcommands:

  cache_cli.register   ls, stats, rm, gc      (shadecache/cache_cli.py)
  store_cli.register   pack, verify, info     (shadecache/store_cli.py)
  demo.register        demo                   (shadecache/demo.py)

A module that fails to import (say torch is missing for `demo`) does not take the others down.
"""
import argparse
import importlib
import sys

_AREAS = (".cache_cli", ".store_cli", ".demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shadecache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for area in _AREAS:
        try:
            mod = importlib.import_module(area, __package__)
        except ImportError as e:  # an optional extra (torch) may be absent
            missing = str(e)
            p = sub.add_parser(area.strip(".").split("_")[0], help=f"unavailable: {missing}")
            p.set_defaults(func=lambda args, m=missing: sys.exit(f"shadecache: {m}"))
            continue
        mod.register(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
