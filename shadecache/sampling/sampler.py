"""ShadeSampler: SHADE's importance sampling with cache-aware ordering, as a stock torch Sampler.

Each epoch the whole order is drawn up front, in four steps:

1. draw   `total` ids WITH replacement, each with probability p_i proportional to its importance
          score tempered toward uniform (p = (1 - temper)/N + temper * score/sum), or a plain
          permutation when importance=False or temper=0 (the uniform baseline); the same global
          draw on every rank, because every rank holds the same merged scores and the same seed;
2. floor  (guardrail, on by default) every sample not drawn in the last `coverage_epochs - 1`
          epochs and absent from the draw replaces a duplicate slot of it, so every sample is
          trained at least once every `coverage_epochs` epochs; step 4 never substitutes away the
          one occurrence of a sample that is due;
3. share  rank r keeps positions r, r + world, r + 2*world, ... of the global draw;
4. PADS   against one snapshot of the cache's cached set: each cached id of the share may replace
          up to `rep_factor` misses (a fractional factor is rounded at random), and all cached ids
          together at most `substitute` * (the share's length) of them; then cached ids go first and
          misses after, each group shuffled.

No scores, no repeats: until update() has given scores, step 4 is skipped and the epoch is a plain
permutation (a loop that never calls update() compares loaders, not samplers).

Repeats come from two budgets. The accuracy budget, `substitute` (step 4): `rep_factor` is the
number of EXTRA copies each cached draw may take in place of a miss (0: ordering only, 1: a cached
sample drawn once is trained up to twice while one miss fewer is read), and `substitute` caps the
substitutions at a fraction of the epoch, so the distinct samples trained per epoch stay >= 1 -
substitute of the draw whatever the cache size. The stall budget, `stall_budget` (stalls=True):
while the epoch runs, a miss that the store, at its measured speed, cannot deliver by the time its
batch is assembled is deferred later in the epoch while the prefetcher reads it, or, when no later
position hides it, replaced by a cached sample chosen by importance, in at most `stall_budget` of
the epoch's positions (shadecache/sampling/stalls.py). On a store faster than training it does
nothing. The counts of both, per epoch: `repeats_history`, CachedDataset.stats()["per_epoch"],
`shadecache stats`.

Unbiased weights: `weights(idx)` gives each sample of a batch the weight 1 / (N * p_i * f_i), where
N * p_i is its expected number of draws relative to a uniform epoch and f_i the factor by which
substitution changes it (1 + substituted/cached for a cached id, 1 - substituted/misses for a
miss). Multiplying each per-sample loss by its weight makes the epoch's expected gradient the
uniform epoch's; the expected mean weight over an epoch is 1, so the learning rate means the same.

Scores: `update(idx, losses)` takes the ids the DataLoader returned WITH the batch (CachedDataset
yields (sample, target, index)), so each rank weight goes to the sample whose loss produced it, and
pushes the new scores to the cache's shared score table (eviction and admission use them). SHADE's
public sampler instead kept the raw draw and wrote each batch's weights to the positions of that
draw taken before its PADS reordering, so the scores landed on other samples. At `end_epoch` the
epoch's observations, coverage and losses are summed across ranks (torch.distributed, any
backend that reduces CPU tensors, e.g. gloo) and folded into the scores.
"""
import math
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from .extents import arrange
from .follow import REBEND, follow, horizon
from .importance import ImportanceTable
from .stalls import StallPlanner, StallView
from ..lookahead.publish import board_of, publish_ahead, published_iter, rewrite_published


def _dist_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _as_numpy(x, dtype):
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False)


def _check_options(n, rep_factor, temper, substitute, stall_budget, stall_speeds,
                   coverage_epochs, draw) -> None:
    """ValueError naming the first of ShadeSampler's options that is out of its range."""
    if n < 1:
        raise ValueError(f"ShadeSampler needs at least one sample, got {n}")
    if rep_factor < 0 or not math.isfinite(rep_factor):
        raise ValueError(f"rep_factor must be a finite number >= 0, got {rep_factor}")
    if not 0.0 <= temper <= 1.0:
        raise ValueError(f"temper must be in [0, 1], got {temper}")
    if substitute is not None and not 0.0 <= substitute <= 1.0:
        raise ValueError(f"substitute must be None or in [0, 1], got {substitute}")
    if not 0.0 <= stall_budget <= 1.0:
        raise ValueError(f"stall_budget must be in [0, 1], got {stall_budget}")
    if stall_speeds is not None and (len(stall_speeds) != 2 or not all(
            math.isfinite(v) and v > 0 for v in map(float, stall_speeds))):
        raise ValueError(f"stall_speeds must be None or (step_s, miss_s), two positive "
                         f"seconds, got {stall_speeds!r}")
    if coverage_epochs is not None and coverage_epochs < 0:
        raise ValueError(f"coverage_epochs must be >= 0 or None, got {coverage_epochs}")
    if draw not in ("systematic", "multinomial"):
        raise ValueError(f"draw must be 'systematic' or 'multinomial', got {draw!r}")


class ShadeSampler(Sampler):
    """Importance + cache-aware sampler (see the module docstring for the algorithm).

    data_source      a sized data set (or an int N)
    cache            a shadecache.Cache whose cached set orders the epoch and whose score table
                     receives the scores; None for importance sampling without a cache
    batch_size       the training batch size (sets the prior score of unseen samples)
    rep_factor       extra copies a cached draw may take in place of a miss (>= 0)
    importance       False: a seeded permutation per epoch (uniform baseline, no replacement)
    pads             order cached ids first (ignored without a cache)
    coverage_epochs  K: every sample is drawn at least once every K epochs; 0/None disables
    temper           in [0, 1]: 1 draws by the scores (SHADE), 0 uniformly (a permutation), between
                     a mix of the two
    substitute       the accuracy budget: fraction of this rank's epoch that substitution may
                     take at most (None: no cap beyond rep_factor)
    stalls           watch for stalls: defer or repeat misses the store cannot deliver in time
                     (needs a CachedDataset as data_source, whose counters time the store; not
                     under the extent order, whose reads are whole extents)
    stall_budget     the stall budget: fraction of this rank's epoch that stall repeats may take
                     at most (0: deferrals only)
    stall_speeds     None: measure the step time and the store's per-sample wait; (step_s,
                     miss_s): take these (a store whose latency is known; tests)
    epoch_size       samples per epoch over all ranks (default N)
    smoothing        the floor of the loss-trend blend (see ImportanceTable)
    num_replicas/rank  default: from torch.distributed when initialized, else 1/0
    board            the order board to publish on when the data source is no node's data set
                     (default: the node's, sc.Node; without a node, the board of `cache`)

    The order follows the node's read plan (read_plan.py; sc.Node(read_plan=...)): under the
    samples plan the sequence is a shuffle of the draw; under the extent plan the draw is arranged
    as a shuffle of the store's extents, samples shuffled within each window of the plan's window
    of extents (sampling/extents.py; with pads and a cache, the cached samples still go first,
    the misses follow in extent order; the cache is given one score per extent, so it keeps whole
    ones). The draw itself (which ids, how often) is the same under both. The plan is saved in
    state_dict, and a state saved under another plan is refused.
    """

    def __init__(self, data_source, cache=None, batch_size: int = 64, rep_factor: float = 1.0,
                 seed: int = 0, importance: bool = True, pads: bool = False,
                 coverage_epochs=2, epoch_size=None, smoothing: float = 0.5,
                 draw: str = "systematic", temper: float = 0.0, substitute=0.0,
                 stalls: bool = True, stall_budget: float = 0.3, stall_speeds=None,
                 num_replicas=None, rank=None, board=None):
        n = data_source if isinstance(data_source, (int, np.integer)) else len(data_source)
        _check_options(n, rep_factor, temper, substitute, stall_budget, stall_speeds,
                       coverage_epochs, draw)
        world, r = _dist_world()
        self.num_replicas = int(num_replicas if num_replicas is not None else world)
        self.rank = int(rank if rank is not None else r)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in 0..{self.num_replicas - 1}")
        self.n = int(n)
        self.node = getattr(data_source, "node", None)
        self.cache, self._board = self._node_parts(cache, board)
        cache = self.cache
        if cache is not None and cache.num_samples != self.n:
            raise ValueError(f"cache {cache.name!r} holds {cache.num_samples} sample ids, the data "
                             f"set has {self.n}")
        self.batch_size = int(batch_size)
        self.rep_factor = float(rep_factor)
        self.seed = int(seed)
        self.draw = draw
        self.importance = bool(importance)
        self.temper = float(temper)
        self.substitute = None if substitute is None else float(substitute)
        self.pads = bool(pads)
        self.stalls = bool(stalls)
        self.stall_budget = float(stall_budget)
        self.coverage_epochs = int(coverage_epochs or 0)
        size = self.n if epoch_size is None else int(epoch_size)
        if size < 1:
            raise ValueError(f"epoch_size must be at least 1, got {epoch_size!r}")
        self.num_samples = math.ceil(size / self.num_replicas)     # this rank's share
        self.total_size = self.num_samples * self.num_replicas
        plan = None if self.node is None else self.node.read_plan
        self.read_plan = plan
        self.extents = plan.layout if plan is not None and plan.extents else None
        self.extent_window = plan.window if plan is not None else 1
        self.table = ImportanceTable(self.n, self.batch_size, smoothing)
        self.last_drawn = np.full(self.n, -1, dtype=np.int64)   # last epoch each id was trained
        self.coverage_history = []                              # distinct ids trained / N, per epoch
        self.epoch = 0
        self._order = None          # this rank's order for self.epoch, once drawn
        self._ahead = None          # while self._order was drawn only for the order
        #                             board and nothing used it yet: the previous draw's stats
        self._forced = None         # ids the coverage floor added this epoch (global)
        self._weights = None        # per-id unbiased weight for self.epoch's order (see weights())
        self._consumed = 0          # samples reported through update() this epoch
        self._start = 0             # where the next __iter__ starts (set by load_state_dict)
        self._loss_sum = 0.0
        self._loss_cnt = 0
        self.last_epoch_stats = {}
        self.repeats_history = []   # per epoch: accuracy_repeats, stall_deferrals, stall_repeats
        self.follow_history = []    # per epoch: samples of its batches traded to follow the node
        self._follow_due = (-1, 0)  # (epoch, position) of the next bend (follow.REBEND)
        self._stall_plan = False
        self._prefetcher_looked = 0.0   # when _jobs_upkeep last looked for the node's prefetcher
        self._restart_gap = 0.5         # seconds between its looks: doubled after each restart,
        self._restarted_at = -1e9       # ... and back to 0.5 once a restarted one lived 60 s
        self._scores_on = None          # the board whose job table holds this sampler's scores
        self._source = data_source if hasattr(data_source, "loader_totals") else None
        self._planner = (StallPlanner(self.batch_size, self.stall_budget, stall_speeds)
                         if self.stalls else None)
        self._planner_epoch = None  # the epoch the planner's state belongs to
        self._view = None
        self._counted_epoch = None  # the epoch whose accuracy repeats were counted
        self._scored = False        # update() has given scores (has_scores)
        self._warned_unmerged = False
        self._push_scores(np.arange(self.n, dtype=np.int64), self.table.scores)

    def _node_parts(self, cache, board):
        """(cache, board) of this sampler: its data set's node's (cache= and board= must then be
        left out or be the node's), else those given; a cache without a node publishes on that
        cache's board."""
        if self.node is not None:
            if cache is not None and cache is not self.node.cache:
                raise ValueError("ShadeSampler: the data set's node has its own cache; leave cache= out")
            if board is not None:
                raise ValueError("ShadeSampler: the data set's node has its own order board; leave "
                                 "board= out")
            return self.node.cache, None
        if board is None and cache is not None:   # this process's job on the cache's board
            from ..lookahead.board import BoardLink
            board = BoardLink(cache.name, num_samples=cache.num_samples)
        return cache, board

    @property
    def board(self):
        """The order board this sampler publishes on: its node's (looked for when used: another
        process may make it later), or the one it was given; None without either."""
        if self.node is not None:
            return self.node.board
        return self._board.get() if hasattr(self._board, "get") else self._board

    @property
    def order_kind(self) -> str:
        """"extents" when the order follows the node's extent plan, else "uniform"."""
        return "uniform" if self.extents is None else "extents"

    @classmethod
    def defaults(cls) -> dict:
        """The constructor's default options: what `ShadeSampler(data)` does (benchmarks and the
        demo report them from here, so they cannot drift from the code)."""
        import inspect
        return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}

    # ---- the epoch's order -------------------------------------------------------------------
    def __len__(self):
        return self.num_samples

    def set_epoch(self, epoch: int):
        epoch = int(epoch)
        if epoch != self.epoch and self._loss_cnt and not self._warned_unmerged:
            self._warned_unmerged = True
            warnings.warn(f"ShadeSampler.set_epoch({epoch}) without end_epoch(): the losses given to update() "
                          f"in epoch {self.epoch} are not folded into the scores (nor merged across ranks), "
                          "so the draw keeps the scores of the last end_epoch; call sampler.end_epoch() "
                          "at the end of every epoch", RuntimeWarning, stacklevel=2)
        if epoch != self.epoch:
            self.epoch = epoch
            self._order = None
            self._planner_epoch = None   # a new order: the planner starts over on it
            self._ahead = None
            self._weights = None
            self._consumed = 0
            self._start = 0
        publish_ahead(self, self._draw_ahead)   # a board's prefetcher starts now

    def _rng(self, stream: int):
        # one independent stream per (seed, epoch, purpose); rank only where it must differ
        return np.random.default_rng([self.seed, self.epoch, stream])

    def draw_probabilities(self):
        """Each id's probability per draw this epoch (float64, sums to 1), or None when the epoch
        is a permutation (importance=False or temper=0)."""
        if not self.importance or self.temper == 0.0:
            return None
        # The scores as folded at the last end_epoch (identical on every rank after its merge), not
        # the live ones: those move with this rank's own losses, and ranks drawing from different
        # weights would overlap and drop samples.
        w = self.table.base
        p = w / w.sum()
        if self.temper != 1.0:
            p = (1.0 - self.temper) / self.n + self.temper * p
        return p

    def global_draw(self):
        """The epoch's draw over all ranks after the coverage floor: (ids, forced ids)."""
        rng = self._rng(0)
        p = self.draw_probabilities()
        if p is None:
            reps = math.ceil(self.total_size / self.n)
            g = np.concatenate([rng.permutation(self.n) for _ in range(reps)])[:self.total_size]
            return g.astype(np.int64), np.empty(0, dtype=np.int64)
        if self.draw == "multinomial":
            g = rng.choice(self.n, size=self.total_size, replace=True, p=p).astype(np.int64)
        else:
            # systematic: one uniform offset, total_size evenly spaced points over the cumulative
            # weights. Sample i is drawn floor or ceil of total_size * p_i times (the same
            # expectation as multinomial draws), so far fewer samples are left out by chance.
            cum = np.cumsum(p)
            cum[-1] = 1.0
            points = (rng.random() + np.arange(self.total_size)) / self.total_size
            g = rng.permutation(np.searchsorted(cum, points, side="right")).astype(np.int64)
        forced = np.empty(0, dtype=np.int64)
        if self.coverage_epochs > 0:
            in_draw = np.zeros(self.n, dtype=bool)
            in_draw[g] = True
            overdue = np.flatnonzero((self.last_drawn <= self.epoch - self.coverage_epochs)
                                     & ~in_draw)
            if overdue.size:
                # duplicate slots: every occurrence of an id after its first one
                order = np.argsort(g, kind="stable")
                gs = g[order]
                dup_slots = order[np.r_[False, gs[1:] == gs[:-1]]]
                take = min(overdue.size, dup_slots.size)
                if take < overdue.size:  # epoch_size < N: keep the most overdue ones
                    overdue = overdue[np.argsort(self.last_drawn[overdue], kind="stable")[:take]]
                slots = rng.choice(dup_slots, size=take, replace=False)
                forced = rng.permutation(overdue)
                g[slots] = forced
        return g, forced

    def _draw_share(self):
        g, forced = self.global_draw()
        if self.extents is not None:   # the same arrangement on every rank (one rng stream)
            g = arrange(g, self.extents, self.extent_window, self._rng(7))
        share = g[self.rank::self.num_replicas].copy()
        rng = self._rng(1 + self.rank)
        stats = {"substituted": 0, "planned_hits": 0}
        cached = None
        # no scores, no repeats: until update() has given scores the epoch is a plain permutation.
        # The draw's own order is kept wherever nothing has to move (it is random already), so
        # that a configuration differs from uniform sampling only by what it changes.
        if self.cache is None or not (self.pads or self.rep_factor > 0) or not self.has_scores():
            order = share
        else:
            cached = np.asarray(self.cache.cached_mask(), dtype=bool)
            hit = cached[share]
            miss_at = np.flatnonzero(~hit)
            stats["cached_draws"] = int(hit.sum())
            stats["missed_draws"] = int(miss_at.size)
            copies = np.empty(0, dtype=np.int64)
            dropped = np.empty(0, dtype=np.int64)
            if self.rep_factor > 0 and stats["cached_draws"] and miss_at.size:
                misses = share[miss_at]
                # the floor: one occurrence of every id due this epoch (not drawn in the last K-1
                # epochs; the floor added those absent from the raw draw) must stay
                protected = np.zeros(misses.size, dtype=bool)
                if self.coverage_epochs > 0:
                    due = self.last_drawn[misses] <= self.epoch - self.coverage_epochs
                    _, first = np.unique(misses, return_index=True)
                    protected[first] = due[first]
                free = np.flatnonzero(~protected)
                want = self.rep_factor * stats["cached_draws"]
                want = int(math.floor(want) + (rng.random() < want - math.floor(want)))
                if self.substitute is not None:   # the budget: a fraction of the epoch, no more
                    want = min(want, int(self.substitute * share.size))
                k = min(want, free.size)
                if k:
                    dropped = np.sort(miss_at[rng.choice(free, size=k, replace=False)])
                    copies = np.tile(rng.permutation(share[hit]), math.ceil(self.rep_factor))[:k]
                    stats["substituted"] = int(k)
            stats["planned_hits"] = stats["cached_draws"] + int(copies.size)
            if self.pads:   # cached first (in the draw's order, then the copies), then misses
                keep = np.ones(share.size, dtype=bool)
                keep[dropped] = False
                order = np.concatenate([share[hit], copies, share[~hit & keep]])
            else:           # each copy takes the place of the miss it replaces
                order = share.copy()
                order[dropped] = copies
        self._weights = self._unbiased_weights(cached, stats)
        return order.astype(np.int64), forced, stats

    def _unbiased_weights(self, cached, stats) -> np.ndarray:
        """1 / (N * p_i * f_i) for every id (see the module docstring). The factor f_i is the
        expected one over this epoch's substitution: k of the cached draws' copies replace k of
        the missed draws, each draw of a class equally likely to be copied or dropped (the floor's
        protected draws make the true factor of a due miss slightly higher; left out on purpose,
        the weight stays bounded)."""
        p = self.draw_probabilities()
        q = np.ones(self.n, dtype=np.float64) if p is None else self.n * p
        k = stats.get("substituted", 0)
        if k and cached is not None:
            f_hit = 1.0 + k / stats["cached_draws"]
            f_miss = max(1.0 - k / stats["missed_draws"], 0.05)
            q = q * np.where(cached, f_hit, f_miss)
        return (1.0 / q).astype(np.float32)

    def weights(self, idx):
        """The unbiased importance weight of each sample id in `idx` for this epoch's order, as a
        float32 torch tensor when idx is a tensor (same device), else a numpy array. Multiply it
        into the per-sample losses: `(losses * sampler.weights(idx)).mean()`. All ones for a
        uniform epoch without substitution (the defaults: nothing to correct).

        Unbiased (each sample's count x weight averages one uniform epoch's) with the accuracy
        budget and wherever every draw is random: the coverage floor's forced draws and a
        substitution that takes every miss are not random, so with temper=1 and the floor on,
        low-score samples average ~1.1, and with substitute=None and rep_factor large enough to
        replace every miss, misses average ~0.5 (tests/sampling/test_sampler_ranks.py measures a
        10% budget). The stall budget's repeats are not corrected: they depend on the store's
        speed, which the weights of the epoch, fixed when it is drawn, cannot know."""
        ids = self.table.check_ids(_as_numpy(idx, np.int64).reshape(-1))
        self.order()
        w = self._weights[ids]
        if isinstance(idx, torch.Tensor):
            return torch.from_numpy(w).to(idx.device).reshape(idx.shape)
        return w

    def _draw_uses_history(self) -> bool:
        """Whether the next epoch's draw depends on the scores or the coverage record that
        end_epoch folds (so every rank must fold the same ones)."""
        return self.temper > 0 and (self.importance or self.coverage_epochs > 0)

    def order(self) -> np.ndarray:
        """This rank's order for the current epoch (drawn on first use, then fixed)."""
        if self._order is None:
            self._order, self._forced, self.last_epoch_stats = self._draw_share()
        elif self._ahead is not None:   # drawn for the board: used from now on
            self._ahead, self.last_epoch_stats = None, self._ahead
        return self._order

    def _draw_ahead(self) -> np.ndarray:
        """The order publish_ahead puts on the board, the very order order() returns
        later. Until __iter__, order() or weights() uses it, the sampler behaves as if it were
        not drawn, as without a board: end_epoch does not count it as trained, state_dict does
        not save it, last_epoch_stats keeps the previous draw's."""
        if self._order is None:
            before = self.last_epoch_stats
            self._order, self._forced, self._ahead = self._draw_share()
            self.last_epoch_stats = before
        return self._order

    def next_epoch_order(self):
        """This rank's order for the next epoch when it is fixed already, else None. It is fixed
        when the draw is uniform (importance=False or temper=0) and the cache does not reorder
        it (pads=False and no accuracy budget, or no cache): the seed and the epoch number alone
        decide it (the stall budget may still bend it while it runs; the board then shows that).
        The order board then shows the next epoch's first samples behind this one's, so the
        prefetcher reads across the epoch boundary instead of waiting for end_epoch.
        Drawing it changes nothing in the sampler."""
        if self.draw_probabilities() is not None or (
                self.cache is not None and (self.pads or self._substitutes())):
            return None
        saved = self.epoch, self._weights
        self.epoch += 1
        try:
            order, _, _ = self._draw_share()   # the very draw order() makes in that epoch
        finally:
            self.epoch, self._weights = saved
        return order

    def _substitutes(self) -> bool:
        """Whether the accuracy budget can replace misses at all."""
        return self.rep_factor > 0 and (self.substitute is None or self.substitute > 0)

    def __iter__(self):
        order = self.order()
        start, self._start = self._start, 0
        if start == 0:
            self._consumed = 0
        plan = None
        # Not under the extent order: a miss there is read with its whole extent, which the
        # pass's other samples of that extent share, so a repeat in place of one sample does not
        # save its read: measured, epochs with the budget there ran slower than without it and
        # did not reliably read less (docs/importance.md, "The stall budget", "Not under the
        # extent order").
        self._stall_plan = (self._planner is not None and self.cache is not None
                            and self._source is not None and self.extents is None)
        if self._stall_plan:
            # Once per order drawn (set_epoch to another epoch and end_epoch drop the order and
            # the planner's claim to it): a second pass over the same order (a pass stopped
            # early and started over) takes it as planned, repeats written in included;
            # restarting the planner there counted its budget from zero again over an order that
            # already held that epoch's repeats, and left out every miss of the epoch, far past
            # its budget (tests/sampling/test_stalls.py,
            # test_a_second_pass_over_the_same_epoch_takes_its_order_as_planned)
            if self._planner_epoch != self.epoch:
                self._planner.start_epoch(self._rng(2 + self.num_replicas + self.rank))
                self._planner_epoch = self.epoch
        if self._stall_plan or self.cache is not None:   # and with a board, the jobs' upkeep
            plan = self._plan_batch
        if self.node is not None:   # the chain's record of what this pass asks for starts anew
            self.node.chain.begin_pass(order[start:])
        if self._counted_epoch != self.epoch:   # once per epoch, when its order is first used
            self._counted_epoch = self.epoch
            self._note(accuracy_repeats=self.last_epoch_stats.get("substituted", 0))
        return published_iter(self, order, start, plan)   # publishes to the order board

    # ---- the stall budget ----------------------------------------------------------------------
    def _plan_batch(self, k: int) -> None:
        """Before the batch at position k is taken: with other jobs on the board, the batch
        follows the node (sampling/follow.py); the stall budget may defer or repeat misses from k
        on (shadecache/sampling/stalls.py); the board shows the changed entries."""
        board = board_of(self)
        if board is not None:
            self._jobs_upkeep(board)
            if self.extents is None and len(board.all_jobs.registered()) > 1:
                self._follow(board, k)
        if not self._stall_plan:
            return
        p = self._planner
        if self._view is None:
            self._view = StallView(self, self._source)
        self._view.refresh()
        before = (p.deferrals, p.repeats)
        changed = p.plan(self._order, k, self._view)
        if changed.size:
            rewrite_published(self, self._order, changed, lo=max(0, k - self.batch_size))
        if (p.deferrals, p.repeats) != before:
            self._note(stall_deferrals=p.deferrals - before[0],
                       stall_repeats=p.repeats - before[1])

    def _jobs_upkeep(self, board) -> None:
        """Per batch, cheap: a dead job's board freed (at most every half second), the cache's
        scores merged again when jobs came or went, and, with other jobs on the cache, the
        node's prefetcher started again should the one that ran die (it outlives the job that
        started it: lookahead/prefetcher.py); alone, a job starts it at its publishes, and
        again within half a second should it die (killed, not stopped); one that keeps dying is
        started again after 1, 2, 4 ... 60 s."""
        if self._scores_on != board.identity:   # a board this sampler has not written to yet
            self._scores_on = board.identity
            self._push_scores(np.arange(self.n, dtype=np.int64), self.table.scores)
        freed = board.all_jobs.free_dead()
        board.merge.jobs_changed(self.cache)
        shared = freed or len(board.all_jobs.registered()) > 1
        now = time.monotonic()
        if self.node is not None and now - self._prefetcher_looked >= self._restart_gap:
            self._prefetcher_looked = now
            if board.control.prefetcher_died():
                # a start blocks this batch until the new process registers: one that keeps
                # dying (the OOM killer, a full /dev/shm) is started again ever more rarely
                self.node.start_reading_ahead()
                self._restart_gap = min(2.0 * self._restart_gap, 60.0)
                self._restarted_at = now
            else:
                if now - self._restarted_at >= 60.0:
                    self._restart_gap = 0.5
                if shared:
                    self.node.start_reading_ahead()   # nothing when one runs (a /proc look)

    def _follow(self, board, k: int) -> None:
        """The order from k takes what the node holds or reads first, over the prefetcher's reach
        (sampling/follow.py), bent again each time 1/REBEND of that reach has been taken."""
        window = max(self.batch_size, board.control.reach)
        due_epoch, due_k = self._follow_due
        if due_epoch == self.epoch and k < due_k:
            return
        self._follow_due = (self.epoch, k + max(self.batch_size, window // REBEND))
        on_way = board.flags.on_way(slice(None))   # the flags first: a read landing in between
        cached = np.asarray(self.cache.cached_mask(), dtype=bool)   # is seen cached
        changed, moves = follow(self._order, k, window, cached, on_way, horizon=horizon(window))
        if not changed.size:
            return
        ahead = None if self._planner is None else self._planner.ahead
        if ahead is not None and ahead.size == self._order.size:
            for places, sources in moves:     # the stall planner's marks go with their samples
                ahead.move(places, sources)
        rewrite_published(self, self._order, changed, lo=max(0, k - self.batch_size))
        while len(self.follow_history) <= self.epoch:
            self.follow_history.append(0)
        self.follow_history[self.epoch] += int(changed.size)

    def _note(self, **counts) -> None:
        """This epoch's repeats and deferrals: the sampler's history, the data set's per-epoch
        record (CachedDataset.note_epoch) and the order board's sampler row (node-wide)."""
        while len(self.repeats_history) <= self.epoch:
            self.repeats_history.append({"accuracy_repeats": 0, "stall_deferrals": 0,
                                         "stall_repeats": 0})
        row = self.repeats_history[self.epoch]
        for k, v in counts.items():
            row[k] += int(v)
        if self._source is not None and hasattr(self._source, "note_epoch"):
            self._source.note_epoch(self.epoch, **counts)   # zeros too: the epoch has a row
        if any(counts.values()):
            board = board_of(self)
            if board is not None:
                board.counters.count_sampler(self.epoch, **counts)

    def has_scores(self) -> bool:
        """Whether scores exist: update() has given some (this rank's since the last end_epoch,
        or any rank's folded at one). Until then the epoch is a plain permutation: no cached-first
        reordering and no repeats of either budget (a loop that never calls update() compares
        loaders, not samplers)."""
        if not self._scored:
            t = self.table
            self._scored = bool(t.obs_cnt.any()) or bool((t.base != t.prior).any())
        return self._scored

    # ---- scores ------------------------------------------------------------------------------
    def update(self, idx, losses):
        """Give each per-sample loss of one minibatch to the sample id that produced it.

        idx: the index tensor the DataLoader returned with the batch; losses: per-sample losses
        (reduction="none"), same length. Returns the updated ids and their new scores.
        """
        ids = _as_numpy(idx, np.int64).reshape(-1)
        lo = _as_numpy(losses, np.float64).reshape(-1)
        if ids.size != lo.size:
            raise ValueError(f"update: {ids.size} sample ids but {lo.size} losses")
        touched, scores = self.table.update(ids, lo)
        if self.extents is None:
            # Under the extent order the cache keeps the extent scores of the last end_epoch for
            # the whole epoch: a partly trained extent's mean moves as its samples are, and live
            # means evicted extents whose samples were still due (each read again), while the
            # cold epoch's ties (every mean at the prior) keep a full cache from admitting
            # anything new. With the prefetcher, live means made the cold epoch read the data
            # several times over (docs/benchmark_history.md, "The tiers keep whole extents").
            self._push_scores(touched, scores)
        self._consumed += int(ids.size)
        self._loss_sum += float(lo.sum())
        self._loss_cnt += int(lo.size)
        return touched, scores

    def _push_scores(self, ids, scores):
        """The scores of `ids` into the cache's table: through the job's own table and the merge
        over the jobs on the board (lookahead/job_scores.py), or straight without a board."""
        if self.cache is None or not ids.size:
            return
        if self.extents is not None:
            # the tiers keep whole extents: one score per extent, from the scores the last
            # end_epoch folded (table.base: merged over the ranks, fixed for the epoch; at init
            # and right after end_epoch they are table.scores, and a resume mid-epoch gives the
            # same ones, not this rank's unmerged losses of the epoch)
            ids, scores = self.extents.shared_scores(ids, self.table.base,
                                                     np.asarray(self.cache.cached_mask(), bool))
        board = board_of(self)
        if board is None:
            self.cache.update_scores(ids, np.asarray(scores, dtype=np.float32))
            return
        if board.scores.batch != self.batch_size:
            board.scores.set_batch(self.batch_size)
        board.merge.scores(self.cache, ids, np.asarray(scores, dtype=np.float32))

    @property
    def scores(self) -> np.ndarray:
        return self.table.scores

    def end_epoch(self, mean_loss=None):
        """Close the epoch: merge observations, coverage and loss across ranks, fold them into the
        scores, record coverage, and move to the next epoch. mean_loss defaults to the mean of the
        losses passed to update() (over all ranks)."""
        # coverage counts what this epoch's order held (drawn = scheduled for training)
        trained = np.zeros(self.n, dtype=np.float64)
        if self._order is not None and self._ahead is None:   # not an order nobody used
            trained[self._order] = 1.0
        obs_sum, obs_cnt = self.table.observations()
        loss = np.array([self._loss_sum, self._loss_cnt,
                         float(mean_loss) if mean_loss is not None else 0.0], dtype=np.float64)
        world, _ = _dist_world()
        if self.num_replicas > 1 and world != self.num_replicas and self._draw_uses_history():
            # Each rank would fold only its own losses and coverage: from the next epoch on the
            # ranks draw from different weights, their shares overlap and samples are dropped.
            raise RuntimeError(
                f"ShadeSampler(num_replicas={self.num_replicas}) must merge the ranks' losses at "
                f"end_epoch, but torch.distributed is "
                + ("not initialized" if world == 1 else f"running with world size {world}")
                + "; initialize the process group, or use temper=0, whose draw does not depend "
                  "on the scores")
        if world > 1:
            # views share memory with the numpy arrays, so all_reduce updates them in place
            for arr in (obs_sum, obs_cnt, trained, loss):
                dist.all_reduce(torch.from_numpy(arr), op=dist.ReduceOp.SUM)
            if mean_loss is not None:
                mean_loss = loss[2] / world
        if mean_loss is None and loss[1] > 0:
            mean_loss = loss[0] / loss[1]
        self.last_drawn[trained > 0] = self.epoch
        self.coverage_history.append(float((trained > 0).sum()) / self.n)
        self.table.end_epoch(mean_loss)
        self._push_scores(np.arange(self.n, dtype=np.int64), self.table.scores)
        self._loss_sum, self._loss_cnt = 0.0, 0
        self.epoch += 1
        self._order = None
        self._planner_epoch = None
        self._ahead = None
        self._weights = None
        self._consumed = 0
        self._start = 0
        # With an order board, the next epoch's order is drawn and published now (its
        # draw uses the scores just folded and the cache as it is), so the prefetcher reads its
        # first batches before the loader asks for them; without a board it is drawn at __iter__
        publish_ahead(self, self._draw_ahead)

    # ---- coverage ----------------------------------------------------------------------------
    def coverage(self) -> dict:
        """Coverage so far: distinct samples trained per epoch (fraction of N), the lowest over
        epochs, and how many samples were not trained within the last K epochs (K =
        coverage_epochs, or 1 when the floor is off)."""
        k = self.coverage_epochs or 1
        h = self.coverage_history
        stale = int((self.last_drawn <= self.epoch - 1 - k).sum()) if h else 0
        return {"per_epoch": list(h), "last": h[-1] if h else None,
                "min": min(h) if h else None, "window_epochs": k,
                "not_seen_in_window": stale}

    # ---- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume mid-epoch with the same order and scores."""
        if self._ahead is not None:   # drawn only for the board: saved as not drawn (redrawn)
            return {**self._state(), "order": None, "forced": None, "weights": None}
        return self._state()

    def _state(self) -> dict:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch,
                "table": self.table.state_dict(), "last_drawn": self.last_drawn.copy(),
                "coverage_history": list(self.coverage_history),
                "order": None if self._order is None else self._order.copy(),
                "forced": None if self._forced is None else self._forced.copy(),
                "weights": None if self._weights is None else self._weights.copy(),
                "consumed": self._consumed, "loss_sum": self._loss_sum,
                "loss_cnt": self._loss_cnt, "rank": self.rank,
                "num_replicas": self.num_replicas,
                "repeats_history": [dict(r) for r in self.repeats_history],
                "stalls": (None if self._planner is None or self._planner_epoch != self.epoch
                           else self._planner.state()),
                "read_plan": None if self.read_plan is None else self.read_plan.state()}

    def load_state_dict(self, state: dict):
        if int(state["n"]) != self.n:
            raise ValueError(f"sampler state is for {state['n']} samples, this data set has {self.n}")
        if (int(state["rank"]), int(state["num_replicas"])) != (self.rank, self.num_replicas):
            raise ValueError(f"sampler state is for rank {state['rank']} of {state['num_replicas']}, "
                             f"this is rank {self.rank} of {self.num_replicas}")
        saved = state.get("read_plan")
        if saved is not None and self.read_plan is not None and not self.read_plan.same_as(saved):
            how = ('read_plan="samples"' if saved.get("kind") != "extents" else
                   f"read_plan=sc.ReadPlan.of_extents(store, extent_bytes={saved.get('extent_bytes')}, "
                   f"window={saved.get('window')})")
            raise ValueError(f"the sampler state was drawn under the read plan {saved}, this node reads "
                             f"by {self.read_plan.state()}: compose the node with {how} to resume the "
                             "same order")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.table.load_state_dict(state["table"])
        self.last_drawn = np.asarray(state["last_drawn"], dtype=np.int64).copy()
        self.coverage_history = list(state["coverage_history"])
        self._order = None if state["order"] is None else np.asarray(state["order"], np.int64).copy()
        self._ahead = None
        self._forced = None if state["forced"] is None else np.asarray(state["forced"], np.int64)
        w = state.get("weights")   # absent in states saved before weights() existed: redrawn
        self._weights = None if w is None else np.asarray(w, dtype=np.float32).copy()
        if self._order is not None and self._weights is None:
            self._weights = self._unbiased_weights(None, {})
        self._consumed = int(state["consumed"])
        self._start = self._consumed if self._order is not None else 0
        self._loss_sum = float(state["loss_sum"])
        self._loss_cnt = int(state["loss_cnt"])
        self.repeats_history = [dict(r) for r in state.get("repeats_history", [])]
        self._scored = False
        self._planner_epoch = None
        if self._planner is not None and state.get("stalls") is not None and self._order is not None:
            self._planner.load(state["stalls"], self._rng(2 + self.num_replicas + self.rank))
            self._planner_epoch = self.epoch
        self._push_scores(np.arange(self.n, dtype=np.int64), self.table.scores)
