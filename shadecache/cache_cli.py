"""`shadecache ls | stats NAME | rm NAME | gc`: the caches on this node."""
import json
import sys

from .cache import Cache, creator_alive, gc, list_caches, remove


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def cmd_ls(args) -> int:
    rows = []
    for name in list_caches():
        try:
            with Cache.attach(name) as c:
                s = c.stats()
        except Exception as e:  # a half-made or foreign segment: show it, do not stop
            rows.append((name, "-", "-", "-", "-", f"unreadable: {e}"))
            continue
        alive = creator_alive(name)
        owner = f"{s['creator_pid']}" + ("" if alive else " (dead)")
        rows.append((name, s["policy"], f"{_fmt_bytes(s['bytes_used'])}/{_fmt_bytes(s['capacity_bytes'])}",
                     str(s["items"]), f"{s['hit_ratio']:.3f}", owner))
    header = ("NAME", "POLICY", "USED/CAPACITY", "ITEMS", "HIT RATIO", "OWNER PID")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(col.ljust(w) for col, w in zip(r, widths)).rstrip())
    return 0


def cmd_stats(args) -> int:
    with Cache.attach(args.name) as c:
        d = c.stats()
        from .order import board_for   # issue 10: the prefetcher's per-epoch counters, if any
        board = board_for(c)
        if board is not None:
            d["prefetch"] = {"prefetcher_pid": board.prefetcher_pid, **board.totals(),
                             "per_epoch": board.epoch_counters()}
        print(json.dumps(d, indent=2, sort_keys=True))
    return 0


def cmd_rm(args) -> int:
    rc = 0
    for name in args.names:
        if remove(name):
            print(f"removed {name}")
        else:
            print(f"shadecache: no cache named {name!r}", file=sys.stderr)
            rc = 1
    return rc


def cmd_gc(args) -> int:
    for name in gc():
        print(f"removed {name} (its creator is gone)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("ls", help="list the caches on this node")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("stats", help="print one cache's counters as JSON")
    p.add_argument("name")
    p.set_defaults(func=cmd_stats)
    p = sub.add_parser("rm", help="remove caches by name")
    p.add_argument("names", nargs="+")
    p.set_defaults(func=cmd_rm)
    p = sub.add_parser("gc", help="remove caches whose creating process is gone")
    p.set_defaults(func=cmd_gc)
