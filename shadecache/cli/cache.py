"""`shadecache ls | stats NAME | rm NAME | gc`: the caches on this node."""
import json
import sys
import time

from ..cache import Cache, creator_alive, describe, gc, list_caches, remove
from .. import status as tier_status


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def cmd_ls(args) -> int:
    rows = []
    for name in list_caches():
        try:
            s = describe(name)
        except Exception as e:  # a half-made or foreign segment: show it, do not stop
            rows.append((name, "-", "-", "-", "-", f"unreadable: {e}", "-", "-"))
            continue
        alive = creator_alive(name)
        owner = f"{s['creator_pid']}" + ("" if alive else " (dead)")
        kept = "persisted" if s["persist"] else "-"
        last = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["last_attach"]))
        rows.append((name, s["policy"], f"{_fmt_bytes(s['bytes_used'])}/{_fmt_bytes(s['capacity_bytes'])}",
                     str(s["items"]), f"{s['hit_ratio']:.3f}", owner, kept, last))
    header = ("NAME", "POLICY", "USED/CAPACITY", "ITEMS", "HIT RATIO", "OWNER PID", "KEPT", "LAST ATTACH")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(col.ljust(w) for col, w in zip(r, widths)).rstrip())
    for name in list_caches():   # the tiers below each cache, as its peer server publishes them
        t = tier_status.read(name)
        if t is None:
            continue
        print(f"{name}: peer server {t.get('address')} (pid {t.get('pid')}{', gone' if t['stale'] else ''})")
        ssd = t.get("ssd")
        if ssd:
            print(f"  ssd tier {ssd['path']}: {ssd['items']} items, "
                  f"{_fmt_bytes(ssd['bytes_used'])}/{_fmt_bytes(ssd['capacity_bytes'])}"
                  + (f", disabled: {ssd['disabled']}" if ssd.get("disabled") else ""))
        peers = t.get("peers") or []
        print(f"  peers: {', '.join(peers) if peers else '(none told)'}")
    return 0


def cmd_stats(args) -> int:
    with Cache.attach(args.name) as c:
        d = c.stats()
        d["huge_pages"] = c.huge_pages()
        from ..lookahead.board import OrderBoard   # the prefetcher's per-epoch counters, if any
        try:
            board = OrderBoard.attach(c.name)      # an observer: it joins no job
        except (FileNotFoundError, ValueError):
            board = None
        if board is not None:
            try:
                d["prefetch"] = {"prefetcher_pid": board.control.prefetcher_pid, **board.counters.totals(),
                                 "per_epoch": board.counters.epoch_counters()}
                d["score_merge"] = board.score_merge
                d["jobs"] = job_rows(board)
            finally:
                board.close()
        pf = tier_status.read(c.name, tier_status.PREFETCHER)
        if pf is not None:
            d.setdefault("prefetch", {})["status"] = pf
        print(json.dumps(d, indent=2, sort_keys=True))
        if d.get("jobs"):
            print(jobs_table(d["jobs"]), file=sys.stderr)
    return 0


def job_rows(board) -> list:
    """One row per job registered on the cache's board: who, whether it lives, and its totals
    (samples, hits, reads from the store, stalls: the seconds its loaders waited on misses, the
    stall budget's deferrals and repeats)."""
    rows = []
    views = {v.slot: v for v in board.all_jobs.views()}
    for j in board.jobs.describe():
        v = views.get(j["slot"])
        t = v.counters.job_totals() if v is not None else {}
        samples = t.get("samples", 0)
        rows.append({**j, **t, "hit_ratio": t.get("hits", 0) / samples if samples else 0.0,
                     "wait_s": t.get("wait_ns", 0) / 1e9})
    return rows


def jobs_table(rows) -> str:
    """The jobs as a table for people (stats prints it on stderr, the JSON on stdout)."""
    head = ("JOB", "PID", "LIVE", "SAMPLES", "HIT RATIO", "STORE READS", "STORE BYTES", "WAIT S",
            "DEFERRED", "REPEATED")
    lines = [head] + [(r["name"], str(r["pid"]), "yes" if r["live"] else "no", str(r.get("samples", 0)),
                       f"{r['hit_ratio']:.3f}", str(r.get("store_reads", 0)),
                       _fmt_bytes(r.get("store_bytes", 0)), f"{r['wait_s']:.2f}",
                       str(r.get("stall_deferrals", 0)), str(r.get("stall_repeats", 0)))
                      for r in rows]
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in lines)


def cmd_rm(args) -> int:
    """Removes every name it can; one it cannot (missing, another user's) is reported and the
    rest are still removed. 1 when any name was not removed."""
    rc = 0
    for name in args.names:
        try:
            gone = remove(name)
        except OSError as e:   # another user's segment: PermissionError naming its owner
            print(f"shadecache rm {name}: {e}", file=sys.stderr)
            rc = 1
            continue
        if gone:
            print(f"removed {name}")
        else:
            print(f"shadecache: no cache named {name!r}", file=sys.stderr)
            rc = 1
    return rc


def cmd_gc(args) -> int:
    keep_for = None if args.keep_for is None else _parse_age(args.keep_for)
    for name in gc(persisted=args.persisted, keep_for=keep_for):
        print(f"removed {name} (its creator or writer is gone)")
    return 0


def _parse_age(text: str) -> float:
    """'90', '90s', '30m', '12h', '7d' -> seconds; ValueError naming the text otherwise."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        if t and t[-1] in units:
            return float(t[:-1]) * units[t[-1]]
        return float(t)
    except ValueError:
        raise ValueError(f"--keep-for {text!r}: give an age such as 3600, 30m, 12h or 7d") from None


def register(sub) -> None:
    p = sub.add_parser("ls", help="list the caches on this node")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("stats", help="print one cache's counters as JSON")
    p.add_argument("name")
    p.set_defaults(func=cmd_stats)
    p = sub.add_parser("rm", help="remove caches by name")
    p.add_argument("names", nargs="+")
    p.set_defaults(func=cmd_rm)
    p = sub.add_parser("gc", help="remove caches whose creating process is gone (persisted ones only "
                                  "with --persisted, or once not attached for --keep-for)")
    p.add_argument("--persisted", action="store_true", help="also remove persisted caches")
    p.add_argument("--keep-for", metavar="AGE", default=None,
                   help="also remove persisted caches not attached for longer than AGE (3600, 30m, 12h, 7d)")
    p.set_defaults(func=cmd_gc)
