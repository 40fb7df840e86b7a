"""Every speed target of the shared-memory Cache, measured against its alternatives in one run.

    python bench/cache_table.py            # ~2-3 minutes; prints the table, writes BENCHMARKS.md
                                           # and docs/img/cache_bench.png

Each comparison builds its stores outside the timed region (values, keys, id orders and batches
are all prepared beforehand), times every contender round-robin `reps` times (figures are
medians, ratios medians of per-repetition ratios: workload.run_interleaved), then checks outside
the timed region that the cache returned the right bytes, missed nothing and is consistent
(`check()`). Every cache, shared-memory block,
server and temporary directory is removed in a `finally`, whatever fails.

Targets:
- get 3 KB:            >= 1.25x a tight loop over multiprocessing.shared_memory + a dict index
                       >= 2x    LMDB, one read transaction per get
- get_many(64) 3 KB:   >= 4x    Redis MGET x64 (hiredis parser, unix socket)
- get 100 KB:          >= 0.9x  the bandwidth of a plain 100 KB bytes copy from random offsets
                                of a shared-memory mapping
- put 3 KB into a full cache (every put evicts): >= 200k puts/s
- update_scores of 64 ids on a cache holding 1M items: <= 0.5 us per id
"""
import argparse
import contextlib
import dataclasses
import os
import platform
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import baselines  # noqa: E402
from workload import ValueSet, access_order, batches_of, random_offsets, run_interleaved, timed  # noqa: E402

SECTION = "## Shared-memory cache"
DEFAULT_MD = os.path.join(REPO, "BENCHMARKS.md")
DEFAULT_PNG = os.path.join(REPO, "docs", "img", "cache_bench.png")
KB = 1024


@dataclasses.dataclass
class Config:
    """Sizes of one run. The defaults are the published run; `Config.tiny()` is the smoke test."""
    working_set_bytes: int = 2 << 30     # per store; far beyond the L3 (32 MiB here)
    small: int = 3 * KB
    large: int = 100 * KB
    batch: int = 64
    reps: int = 21                       # short repetitions, many of them: see workload.Timings
    gets_per_rep: int = 25_000           # 3 KB gets (and ids fetched through get_many)
    large_gets_per_rep: int = 2_000      # 100 KB gets
    put_cache_bytes: int = 1 << 30       # the full cache that every timed put evicts from
    puts_per_rep: int = 25_000
    score_items: int = 1_000_000         # items cached while update_scores is timed
    score_value_size: int = 3 * KB
    score_calls_per_rep: int = 5_000
    capacity_slack: float = 1.5          # cache capacity / bytes of values it must hold in full
    capacity_extra: int = 16 << 20       # plus this much: whole slab pages for each size class
    policy: str = "importance"           # the policy the get/update_scores caches run under

    @classmethod
    def tiny(cls):
        return cls(working_set_bytes=4 << 20, large=32 * KB, reps=2, gets_per_rep=2_000,
                   large_gets_per_rep=200, put_cache_bytes=2 << 20, puts_per_rep=1_000,
                   score_items=5_000, score_value_size=64, score_calls_per_rep=200)


@dataclasses.dataclass
class Row:
    """One line of the table. `kind` is "ratio" (cache / alternative >= target), "min"
    (figure >= target) or "max" (figure <= target); `target` None marks an informational line."""
    comparison: str
    cache_figure: float
    unit: str
    alternative: str = ""
    alternative_figure: float = float("nan")
    kind: str = "ratio"
    target: float = None
    note: str = ""
    paired_ratio: float = None   # median of per-repetition ratios (workload.Timings.speedup)

    @property
    def ratio(self):
        if self.kind != "ratio":
            return float("nan")
        if self.paired_ratio is not None:
            return self.paired_ratio
        return self.cache_figure / self.alternative_figure

    @property
    def measured(self):
        """The number the target is compared with."""
        return self.ratio if self.kind == "ratio" else self.cache_figure

    @property
    def passed(self):
        if self.target is None:
            return None
        if self.kind == "max":
            return self.measured <= self.target
        return self.measured >= self.target

    @property
    def margin(self):
        """measured / target, inverted for "max" rows: >= 1 means the target holds."""
        if self.target is None:
            return float("nan")
        return self.target / self.measured if self.kind == "max" else self.measured / self.target


# --------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------
def fmt_figure(value, unit):
    if value != value:  # nan
        return "—"
    if unit == "GB/s":
        return f"{value / 1e9:.2f} GB/s"
    if unit == "us/id":
        return f"{value * 1e6:.3f} µs/id"
    if value >= 1e6:
        return f"{value / 1e6:.2f}M {unit}"
    return f"{value / 1e3:.0f}k {unit}"


def fmt_target(row):
    if row.target is None:
        return "(info)"
    if row.kind == "ratio":
        return f"≥ {row.target:g}×"
    if row.kind == "max":
        return f"≤ {fmt_figure(row.target, row.unit)}"
    return f"≥ {fmt_figure(row.target, row.unit)}"


def table_lines(rows):
    """The Markdown table, one line per row."""
    lines = ["| comparison | measured | alternative | alternative figure | ratio | target | result |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r.ratio:.2f}×" if r.kind == "ratio" else "—"
        result = {None: "—", True: "PASS", False: "**FAIL**"}[r.passed]
        alt = r.alternative + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.comparison} | {fmt_figure(r.cache_figure, r.unit)} | {alt or '—'} | "
                     f"{fmt_figure(r.alternative_figure, r.unit)} | {ratio} | {fmt_target(r)} | "
                     f"{result} |")
    return lines


# --------------------------------------------------------------------------------------------
# the cache side
# --------------------------------------------------------------------------------------------
def cache_get_loop(cache, ids):
    get = cache.get
    for i in ids:
        get(i)


def cache_view_loop(cache, ids):
    # A zero-copy view of each value, released at once: the cost of pinning and unpinning.
    view = cache.view
    for i in ids:
        view(i).release()


def cache_get_many_loop(cache, id_batches):
    get_many = cache.get_many
    for ids in id_batches:
        get_many(ids)


def cache_put_loop(cache, ids, values):
    put = cache.put
    for i, v in zip(ids, values):
        put(i, v)


def cache_put_scored_loop(cache, ids, values, scores):
    put = cache.put
    for i, v, s in zip(ids, values, scores):
        put(i, v, s)


def cache_update_scores_loop(cache, id_batches, score_batches):
    update = cache.update_scores
    for ids, scores in zip(id_batches, score_batches):
        update(ids, scores)


def _cache_name(tag):
    return f"shadecache-bench-{os.getpid()}-{tag}"


@contextlib.contextmanager
def open_cache(tag, num_samples, capacity_bytes, policy):
    """A fresh cache with the default max_item_bytes (as a user gets it), unlinked at exit
    whatever happened."""
    import shadecache as sc

    cache = sc.Cache.create(_cache_name(tag), num_samples=num_samples,
                            capacity_bytes=int(capacity_bytes), policy=policy)
    try:
        yield cache
    finally:
        try:
            cache.unlink()
        finally:
            cache.close()


def fill_cache(cache, values, ids=None, chunk=4096, scores=None):
    """put_many every value (or those of `ids`, with `scores[k]` for `ids[k]` when given);
    returns how many were admitted."""
    ids = list(range(values.n)) if ids is None else list(ids)
    admitted = 0
    with tqdm(total=len(ids) * values.size, desc=f"cache fill {values.size} B", unit="B",
              unit_scale=True, leave=False, mininterval=0.5) as bar:
        for lo in range(0, len(ids), chunk):
            part = ids[lo:lo + chunk]
            part_scores = None if scores is None else np.asarray(scores[lo:lo + chunk], dtype=np.float32)
            ok = cache.put_many(np.asarray(part, dtype=np.int64), [values.value(i) for i in part],
                                part_scores)
            admitted += int(np.count_nonzero(ok))
            bar.update(len(part) * values.size)
    return admitted


def _require_all_cached(cache, values):
    items = cache.stats()["items"]
    if items != values.n:
        raise RuntimeError(f"cache {cache.name} holds {items} of {values.n} values of {values.size} B "
                           f"after the fill; raise Config.capacity_slack")


def _verify_cache(cache, values, ids):
    for i in ids:
        values.check_value(i, cache.get(i))


# --------------------------------------------------------------------------------------------
# setups: everything a comparison times, built and verified outside the timed region
# (shared with bench_cache.py's pytest-benchmark fixtures)
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def small_setup(cfg, redis_server="redis-server"):
    """3 KB values in a cache, shm+dict, LMDB and (when available) Redis, plus per-repetition
    ids, batches and keys. `s.redis` is None and `s.redis_skip` says why when Redis is absent."""
    s = types.SimpleNamespace(cfg=cfg)
    s.values = ValueSet(cfg.working_set_bytes // cfg.small, cfg.small)
    ids = access_order(s.values.n, cfg.reps * cfg.gets_per_rep)
    s.ids = [ids[r * cfg.gets_per_rep:(r + 1) * cfg.gets_per_rep] for r in range(cfg.reps)]
    s.batches = [batches_of(rep_ids, cfg.batch) for rep_ids in s.ids]
    s.lmdb_keys = [[baselines.lmdb_key(i) for i in rep_ids] for rep_ids in s.ids]
    s.redis_keys = [[[baselines.redis_key(i) for i in b] for b in rep] for rep in s.batches]
    with contextlib.ExitStack() as stack:
        s.cache = stack.enter_context(open_cache("get-small", s.values.n,
                                                 s.values.total_bytes * cfg.capacity_slack + cfg.capacity_extra,
                                                 cfg.policy))
        fill_cache(s.cache, s.values)
        _require_all_cached(s.cache, s.values)
        s.shm = stack.enter_context(baselines.ShmDictStore(s.values))
        s.lmdb = stack.enter_context(baselines.LmdbStore(s.values, lock=False))
        s.lmdb.warm()
        # The plain copy: a bytes copy of one value's size from random offsets of the same mapping.
        s.offsets = [random_offsets(len(s.shm.buf), cfg.small, cfg.gets_per_rep, seed=20 + r)
                     for r in range(cfg.reps)]
        s.redis, s.redis_skip = None, ""
        try:
            s.redis = stack.enter_context(baselines.RedisStore(s.values, server=redis_server))
        except baselines.RedisUnavailable as exc:
            s.redis_skip = str(exc)
            print(f"SKIP Redis MGET comparison: {s.redis_skip}", file=sys.stderr)
        check_ids = s.ids[0][:1000]
        for store in (s.shm, s.lmdb, s.redis):
            if store is not None:
                store.verify(check_ids)
        _verify_cache(s.cache, s.values, check_ids)
        misses = s.cache.stats()["misses"]
        yield s
        if s.cache.stats()["misses"] != misses:
            raise RuntimeError("the cache missed during the get benchmark; its figures are void")
        s.cache.check()


@contextlib.contextmanager
def large_setup(cfg):
    """100 KB values in a cache and in shm+dict, ids per repetition, and random offsets into
    the shm mapping for the plain copy."""
    s = types.SimpleNamespace(cfg=cfg)
    s.values = ValueSet(cfg.working_set_bytes // cfg.large, cfg.large)
    ids = access_order(s.values.n, cfg.reps * cfg.large_gets_per_rep, seed=3)
    s.ids = [ids[r * cfg.large_gets_per_rep:(r + 1) * cfg.large_gets_per_rep] for r in range(cfg.reps)]
    with contextlib.ExitStack() as stack:
        s.cache = stack.enter_context(open_cache("get-large", s.values.n,
                                                 s.values.total_bytes * cfg.capacity_slack + cfg.capacity_extra,
                                                 cfg.policy))
        fill_cache(s.cache, s.values, chunk=256)
        _require_all_cached(s.cache, s.values)
        s.shm = stack.enter_context(baselines.ShmDictStore(s.values))
        s.offsets = [random_offsets(len(s.shm.buf), cfg.large, cfg.large_gets_per_rep, seed=10 + r)
                     for r in range(cfg.reps)]
        s.shm.verify(s.ids[0][:100])
        _verify_cache(s.cache, s.values, s.ids[0][:100])
        misses = s.cache.stats()["misses"]
        yield s
        if s.cache.stats()["misses"] != misses:
            raise RuntimeError("the cache missed during the 100 KB get benchmark; its figures are void")
        s.cache.check()


class FullCache:
    """A full cache of 3 KB values for timing puts that each evict one value.

    `prepare(n)` picks n uncached ids (with their values and, for `importance`, scores above
    every score cached so far, so each put is admitted and evicts the lowest); `verify(...)`
    checks afterwards that each put inserted and evicted once and stored the right bytes.
    """

    def __init__(self, cache, values, policy):
        self.cache, self.values, self.policy = cache, values, policy
        self.rng = np.random.default_rng(7)
        self.next_score = 1.0

    def prepare(self, n):
        uncached = np.flatnonzero(~self.cache.cached_mask())
        ids = self.rng.choice(uncached, size=min(n, len(uncached)), replace=False).tolist()
        vals = [self.values.value(i) for i in ids]
        if self.policy != "importance":
            return ids, vals, None
        scores = (self.next_score + np.arange(len(ids), dtype=np.float64)).tolist()
        self.next_score += len(ids)
        return ids, vals, scores

    def run(self, ids, vals, scores):
        """The timed loop (a plain put loop, or one passing each score)."""
        if scores is None:
            cache_put_loop(self.cache, ids, vals)
        else:
            cache_put_scored_loop(self.cache, ids, vals, scores)

    def verify(self, before, ids):
        after = self.cache.stats()
        evicted = after["evictions"] - before["evictions"]
        inserted = after["inserts"] - before["inserts"]
        if inserted != len(ids) or evicted < len(ids):
            raise RuntimeError(f"{self.policy}: {len(ids)} puts into a full cache made {inserted} "
                               f"inserts and {evicted} evictions; expected one of each per put")
        _verify_cache(self.cache, self.values, ids[-100:])


@contextlib.contextmanager
def full_cache_setup(cfg, policy):
    size = cfg.small
    fits = int(cfg.put_cache_bytes // size)
    values = ValueSet(2 * fits, size, seed=5)  # twice what fits: uncached ids never run out
    with open_cache(f"put-{policy}", values.n, cfg.put_cache_bytes, policy) as cache:
        overfill = fits + fits // 4
        # Under importance a cache counts as full for low scores while up to 1/8 of it is still
        # free; rising (negative) scores make every fill put admitted, so every slot gets used
        # and each timed put (scores from 1.0 up) really evicts.
        fill_cache(cache, values, ids=range(overfill),
                   scores=np.arange(-overfill, 0, dtype=np.float64) if policy == "importance" else None)
        if cache.stats()["items"] >= overfill:
            raise RuntimeError(f"cache of {cfg.put_cache_bytes} B is not full after "
                               f"{overfill} puts of {size} B")
        yield FullCache(cache, values, policy)
        cache.check()


def distinct_batches(rng, low, high, calls, batch):
    """`calls` (ids, scores) pairs: int64 ids in [low, high), distinct within each batch (cut
    from random permutations), and float32 scores in [0, 1)."""
    ids = []
    while len(ids) < calls:
        perm = rng.permutation(np.arange(low, high, dtype=np.int64))
        ids.extend(perm[k:k + batch] for k in range(0, len(perm) - batch + 1, batch))
    ids = ids[:calls]
    return ids, [rng.random(batch, dtype=np.float32) for _ in range(calls)]


@contextlib.contextmanager
def scores_setup(cfg):
    """A cache holding `score_items` items with num_samples twice that (half the ids are ghosts:
    scored, never cached) and, per repetition, update_scores batches of cached and of ghost ids.
    At exit: the last batch of each kind is in the score table and no item moved."""
    s = types.SimpleNamespace(cfg=cfg)
    values = ValueSet(cfg.score_items, cfg.score_value_size, seed=9)
    num_samples = 2 * cfg.score_items
    rng = np.random.default_rng(11)
    s.batches = {kind: [distinct_batches(rng, low, high, cfg.score_calls_per_rep, cfg.batch)
                        for _ in range(cfg.reps)]
                 for kind, (low, high) in (("cached", (0, cfg.score_items)),
                                           ("ghost", (cfg.score_items, num_samples)))}
    with open_cache("scores", num_samples, values.total_bytes * cfg.capacity_slack + cfg.capacity_extra,
                    "importance") as cache:
        s.cache = cache
        fill_cache(cache, values, chunk=16384)
        _require_all_cached(cache, values)
        yield s
        table = cache.scores()
        for kind, reps in s.batches.items():
            last_ids, last_scores = reps[-1][0][-1], reps[-1][1][-1]
            if not np.array_equal(table[last_ids], last_scores):
                raise RuntimeError(f"update_scores ({kind} ids) did not store the scores it was given")
        if cache.stats()["items"] != values.n:
            raise RuntimeError("update_scores changed which items are cached")
        cache.check()


# --------------------------------------------------------------------------------------------
# the comparisons: each returns table rows
# --------------------------------------------------------------------------------------------
def compare_small_gets(cfg, redis_server="redis-server"):
    """get / get_many of 3 KB values: cache vs shm+dict, LMDB (txn per get) and Redis MGET."""
    with small_setup(cfg, redis_server) as s:
        contenders = {
            "cache.get": lambda r: timed(cache_get_loop, s.cache, s.ids[r]),
            "shm+dict": lambda r: timed(baselines.shm_dict_get_loop, s.shm.buf, s.shm.index, s.ids[r]),
            "lmdb": lambda r: s.lmdb.timed_gets(s.lmdb_keys[r]),
            "cache.get_many": lambda r: timed(cache_get_many_loop, s.cache, s.batches[r]),
            "copy": lambda r: timed(baselines.plain_copy_loop, s.shm.buf, s.offsets[r], cfg.small),
            "cache.view": lambda r: timed(cache_view_loop, s.cache, s.ids[r]),
        }
        if s.redis is not None:
            contenders["redis"] = lambda r: timed(baselines.redis_mget_loop, s.redis.client,
                                                  s.redis_keys[r])
        t = run_interleaved(contenders, cfg.reps)
        # LMDB with its default reader-table locking; py-lmdb opens an environment once per
        # process, so this pass runs after the first, again side by side with cache.get.
        s.lmdb.reopen(lock=True)
        s.lmdb.verify(s.ids[0][:1000])
        t_locked = run_interleaved({
            "cache.get": lambda r: timed(cache_get_loop, s.cache, s.ids[r]),
            "lmdb": lambda r: s.lmdb.timed_gets(s.lmdb_keys[r]),
        }, cfg.reps)
    g = cfg.gets_per_rep
    n_batched = len(s.batches[0]) * cfg.batch
    size = f"{cfg.small // KB} KB"
    rows = [
        Row(f"`get` {size}", g / t["cache.get"], "gets/s",
            "`multiprocessing.shared_memory` + dict index, bytes copy", g / t["shm+dict"],
            target=1.25, paired_ratio=t.speedup("cache.get", "shm+dict")),
        Row(f"`get` {size}", g / t["cache.get"], "gets/s",
            "LMDB, one read txn per get + copy", g / t["lmdb"], target=2.0,
            note="readonly, lock=False", paired_ratio=t.speedup("cache.get", "lmdb")),
        Row(f"`get` {size}", g / t["cache.get"], "gets/s",
            f"plain {size} bytes copy from Python, random offsets of a shm mapping",
            g / t["copy"], paired_ratio=t.speedup("cache.get", "copy")),
        # The plain copy against LMDB: how much of the LMDB ratio is the copy itself. cache.get
        # can beat the copy (it requests every line of the value at once; a memoryview slice
        # leaves that to the hardware prefetcher), so this is a reference, not a ceiling.
        Row(f"plain {size} bytes copy from Python (memoryview slice + tobytes)", g / t["copy"],
            "gets/s", "LMDB, one read txn per get + copy", g / t["lmdb"], note="readonly, lock=False",
            paired_ratio=t.speedup("copy", "lmdb")),
        Row(f"`view` {size} + release (zero copy)", g / t["cache.view"], "gets/s",
            f"`get` {size}", g / t["cache.get"], paired_ratio=t.speedup("cache.view", "cache.get")),
        Row(f"`get` {size} (a second pass)", g / t_locked["cache.get"], "gets/s",
            "LMDB, one read txn per get + copy", g / t_locked["lmdb"],
            note="LMDB's default lock=True", paired_ratio=t_locked.speedup("cache.get", "lmdb")),
    ]
    if s.redis is not None:
        rows.append(Row(f"`get_many({cfg.batch})` {size}", n_batched / t["cache.get_many"], "gets/s",
                        f"Redis MGET×{cfg.batch}, hiredis, unix socket", n_batched / t["redis"],
                        target=4.0, paired_ratio=t.speedup("cache.get_many", "redis")))
    else:
        rows.append(Row(f"`get_many({cfg.batch})` {size}", n_batched / t["cache.get_many"], "gets/s",
                        f"Redis MGET×{cfg.batch}: skipped", note=s.redis_skip))
    return rows


def compare_large_gets(cfg):
    """get of 100 KB values vs a plain 100 KB bytes copy from random offsets of a shm mapping."""
    with large_setup(cfg) as s:
        t = run_interleaved({
            "cache.get": lambda r: timed(cache_get_loop, s.cache, s.ids[r]),
            "copy": lambda r: timed(baselines.plain_copy_loop, s.shm.buf, s.offsets[r], cfg.large),
            "shm+dict": lambda r: timed(baselines.shm_dict_get_loop, s.shm.buf, s.shm.index, s.ids[r]),
            "cache.view": lambda r: timed(cache_view_loop, s.cache, s.ids[r]),
        }, cfg.reps)
    nbytes = cfg.large_gets_per_rep * cfg.large
    size = f"{cfg.large // KB} KB"
    return [
        Row(f"`get` {size}", nbytes / t["cache.get"], "GB/s",
            f"plain {size} bytes copy, random offsets of a shm mapping", nbytes / t["copy"],
            target=0.9, paired_ratio=t.speedup("cache.get", "copy")),
        Row(f"`get` {size}", nbytes / t["cache.get"], "GB/s",
            "`multiprocessing.shared_memory` + dict index, bytes copy", nbytes / t["shm+dict"],
            paired_ratio=t.speedup("cache.get", "shm+dict")),
        Row(f"`view` {size} + release (zero copy: bytes made readable, not read)", nbytes / t["cache.view"], "GB/s",
            f"`get` {size}", nbytes / t["cache.get"], paired_ratio=t.speedup("cache.view", "cache.get")),
    ]


def measure_full_puts(cfg):
    """put of 3 KB values into a full cache, where every put evicts one value."""
    rows = []
    for policy in ("lru", "importance"):
        with full_cache_setup(cfg, policy) as full:
            def run(rep, full=full):
                ids, vals, scores = full.prepare(cfg.puts_per_rep)
                before = full.cache.stats()
                dt = timed(full.run, ids, vals, scores)
                full.verify(before, ids)
                return dt / len(ids)

            per_put = run_interleaved({"put": run}, cfg.reps)["put"]
        label = "LRU" if policy == "lru" else "importance, each score above all cached"
        rows.append(Row(f"`put` {cfg.small // KB} KB into a full cache, every put evicts ({label})",
                        1.0 / per_put, "puts/s", kind="min", target=200_000.0))
    return rows


def measure_update_scores(cfg):
    """update_scores of 64 ids per call on a cache holding score_items items."""
    with scores_setup(cfg) as s:
        t = run_interleaved({
            kind: (lambda r, kind=kind: timed(cache_update_scores_loop, s.cache, *s.batches[kind][r]))
            for kind in ("cached", "ghost")
        }, cfg.reps)
    per_id = {k: t[k] / (cfg.score_calls_per_rep * cfg.batch) for k in ("cached", "ghost")}
    items = f"{cfg.score_items / 1e6:g}M" if cfg.score_items >= 1e6 else f"{cfg.score_items}"
    return [
        Row(f"`update_scores` of {cfg.batch} cached ids, {items} items cached", per_id["cached"],
            "us/id", kind="max", target=0.5e-6),
        Row(f"`update_scores` of {cfg.batch} ghost ids (scored, not cached)", per_id["ghost"],
            "us/id", kind="max"),
    ]


COMPARISONS = (compare_small_gets, compare_large_gets, measure_full_puts, measure_update_scores)


def run_all(cfg, comparisons=COMPARISONS):
    rows = []
    for compare in comparisons:
        t0 = time.perf_counter()
        print(f"running {compare.__name__} ...", file=sys.stderr, flush=True)
        rows.extend(compare(cfg))
        print(f"  {compare.__name__} took {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


# --------------------------------------------------------------------------------------------
# outputs: BENCHMARKS.md section and the PNG
# --------------------------------------------------------------------------------------------
def _git_revision():
    """HEAD's short hash, with "+dirty" when the measured code (engine, Cache, harness) differs from it."""
    try:
        def git(*args):
            return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()

        rev = git("rev-parse", "--short", "HEAD") or "unknown"
        measured = ["csrc/cache", "csrc/common", "csrc/bindings/core_module.cc", "csrc/bindings/errors.cc",
                    "shadecache/cache",
                    "bench/cache_table.py", "bench/baselines.py", "bench/workload.py"]
        return rev + ("+dirty" if git("status", "--porcelain", "--", *measured) else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def pages_line():
    """Which pages the /dev/shm contenders (the cache, shared_memory) run on; LMDB's file is not
    on /dev/shm."""
    from shadecache.cache import huge_pages
    return huge_pages.describe() + "."


def section_text(rows, cfg, command, png_rel=None):
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    ws = (f"{cfg.working_set_bytes / (1 << 30):g} GiB" if cfg.working_set_bytes >= 1 << 30
          else f"{cfg.working_set_bytes / (1 << 20):g} MiB")
    lines = [
        f"Reproduce: `{command}` (commit {_git_revision()}, {when}, {os.cpu_count()} vCPUs, "
        f"Python {platform.python_version()}).",
        "",
        f"{cfg.reps} repetitions, every contender timed in turn within each repetition (order "
        f"rotating), in one process; figures are medians, ratios the median of the per-repetition "
        f"ratios. Working set {ws} of values per store (L3 here: 32 MiB); ids are a "
        f"random permutation prepared outside the timed region; every loop binds its method to a "
        f"local first and makes a bytes copy per value. The caches run the `{cfg.policy}` policy "
        f"unless stated. {pages_line()}",
        "",
        *table_lines(rows),
        "",
    ]
    failed = [r for r in rows if r.passed is False]
    lines.append("All targets hold." if not failed else
                 "Targets missed: " + "; ".join(f"{r.comparison} vs {r.alternative or 'target'}"
                                                  for r in failed) + ".")
    if png_rel:
        lines += ["", f"![measured ÷ target per comparison]({png_rel})"]
    return "\n".join(lines) + "\n"


def write_section(path, text, heading=SECTION):
    """Replace the body of `heading` in the Markdown file `path` (up to the next `## `)."""
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    start = doc.find(heading + "\n")
    if start < 0:
        raise ValueError(f"{path} has no section {heading!r}")
    body = start + len(heading) + 1
    nxt = doc.find("\n## ", body)
    end = len(doc) if nxt < 0 else nxt + 1
    new = doc[:body] + "\n" + text + ("\n" if nxt >= 0 else "") + doc[end:]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(new)
    os.replace(tmp, path)


def plot(rows, path):
    """Bars of measured ÷ target (>= 1: the target holds) for every row that has a target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.target is not None]
    labels = [f"{r.comparison}\nvs {r.alternative}" if r.alternative else r.comparison for r in rows]
    labels = ["\n".join(textwrap.wrap(lab.replace("`", ""), 48)) for lab in labels]
    margins = [r.margin for r in rows]
    colors = ["tab:green" if r.passed else "tab:red" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.8 * len(rows) + 1.6))
    y = np.arange(len(rows))[::-1]
    # Bars grow from 1 (the target) on a log axis: right of the line the target holds.
    ax.barh(y, [m - 1.0 for m in margins], left=1.0, color=colors)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xscale("log")
    lo, hi = min(margins + [1.0]), max(margins + [1.0])
    ax.set_xlim(lo / 1.5, hi * 5)
    for yi, r, m in zip(y, rows, margins):
        text = (f"{r.ratio:.2f}× (target {r.target:g}×)" if r.kind == "ratio"
                else f"{fmt_figure(r.measured, r.unit)} (target {fmt_target(r)})")
        ax.text(max(m, 1.0) * 1.05, yi, text, va="center", fontsize=8)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("measured ÷ target, log scale  (right of 1: the target holds)")
    ax.set_title("shadecache Cache vs alternatives, same run")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--working-set-gib", type=float, default=None,
                    help="bytes of values per store for the get comparisons (default 2)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per contender (default 21)")
    ap.add_argument("--tiny", action="store_true", help="seconds-long run with tiny sizes")
    ap.add_argument("--md", default=DEFAULT_MD, help="Markdown file whose shared-memory cache section is rewritten")
    ap.add_argument("--png", default=DEFAULT_PNG, help="where the bar chart goes")
    ap.add_argument("--no-write", action="store_true", help="print only; write neither file")
    args = ap.parse_args(argv)

    cfg = Config.tiny() if args.tiny else Config()
    if args.working_set_gib is not None:
        cfg.working_set_bytes = int(args.working_set_gib * (1 << 30))
    if args.reps is not None:
        cfg.reps = args.reps
    t0 = time.perf_counter()
    rows = run_all(cfg)
    print(pages_line())
    print("\n".join(table_lines(rows)))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if not args.no_write:
        plot(rows, args.png)
        png_rel = os.path.relpath(os.path.abspath(args.png), os.path.dirname(os.path.abspath(args.md)))
        command = " ".join(["python bench/cache_table.py", *(sys.argv[1:] if argv is None else argv)])
        write_section(args.md, section_text(rows, cfg, command, png_rel))
        print(f"wrote {args.md} and {args.png}")
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
