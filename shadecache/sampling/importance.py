"""Per-sample importance as SHADE (USENIX FAST 2023) defines it, in numpy (no torch here).

Two pieces:

- `rank_weights(losses)`: inside ONE minibatch, samples are ranked by loss and the sample of rank r
  (r = 0 for the lowest loss, B-1 for the highest) gets the weight log(r + 10). Ranks, not raw
  losses, make the weights comparable across minibatches and epochs whatever the loss scale.
- `ImportanceTable`: the score of every sample of the data set (SHADE's "ghost cache": cached or
  not). Each observation is given to the exact sample id that produced the loss. Across epochs the
  scores are smoothed by a loss-trend term (see `ImportanceTable`).

Contract for callers: ids are dense sample ids 0..N-1 (numpy int64 or anything np.asarray turns
into integers); losses are per-sample, finite, in the same order as the ids.
"""
import math

import numpy as np

from ..ids import check_ids

RANK_OFFSET = 10.0  # SHADE's constant: weight = log(rank + 10)


def rank_weights(losses) -> np.ndarray:
    """SHADE's rank-based weight of each sample of one minibatch, in the input order.

    The highest loss gets rank B-1 and the highest weight log(B - 1 + 10); the lowest loss gets rank
    0 and log(10). Tied losses share the mean of the ranks they span, so two samples with the same
    loss always get the same weight whatever their position in the batch.
    """
    x = np.asarray(losses, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"rank_weights: losses must be one-dimensional, got shape {x.shape}")
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:
        raise ValueError(f"rank_weights: loss at position {int(bad[0])} is {x[bad[0]]!r}, "
                         "not a finite number")
    b = x.size
    if b == 0:
        return np.empty(0, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    xs = x[order]
    # group equal losses: start of each run of equal values in the sorted order
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], b]
    mean_rank = (starts + ends - 1) / 2.0                       # mean of ranks start..end-1
    ranks = np.empty(b, dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return np.log(ranks + RANK_OFFSET)


def prior_score(batch_size: int) -> float:
    """Score of a sample never observed: the mean weight of a minibatch of `batch_size`, so an
    unseen sample is neither favoured nor starved against seen ones."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return float(np.mean(np.log(np.arange(batch_size) + RANK_OFFSET)))


class ImportanceTable:
    """Scores of all N samples, updated per minibatch, smoothed across epochs.

    Within epoch e every observed sample i has

        score[i] = (1 - a_e) * base[i] + a_e * mean of the rank weights i received in epoch e

    where base is the score table frozen at the start of the epoch (so a sample seen twice in one
    epoch is averaged, not double-counted) and a sample not observed keeps base[i]. The blend a_e is
    the loss-trend term: with L the mean training loss of an epoch,

        a_0 = 1   (nothing to smooth against but the prior)
        a_1 = smoothing   (no trend yet)
        a_e = clip(smoothing + |L_{e-1} - L_{e-2}| / L_{e-2}, smoothing, 1)

    While the loss still moves fast, last epoch's ranks say little about the model now, so new
    observations dominate; once the loss flattens, ranks are averaged over epochs, which damps the
    noise of ranking inside small minibatches.

    Observations of one epoch are kept as (sum, count) per sample so that several training
    processes can add theirs up (`observations()`) before `end_epoch` folds them into base.
    """

    def __init__(self, num_samples: int, batch_size: int = 64, smoothing: float = 0.5):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.smoothing = float(smoothing)
        self.prior = prior_score(batch_size)
        self.base = np.full(self.num_samples, self.prior, dtype=np.float64)
        self.scores = self.base.copy()
        self.obs_sum = np.zeros(self.num_samples, dtype=np.float64)
        self.obs_cnt = np.zeros(self.num_samples, dtype=np.float64)
        self.alpha = 1.0
        self.epoch = 0
        self.loss_history: list = []

    # ---- within an epoch ---------------------------------------------------------------------
    def check_ids(self, ids) -> np.ndarray:
        """ids as a 1-D int64 array in 0..num_samples-1 (shadecache/ids.py: the one rule)."""
        return check_ids(ids, self.num_samples)

    def observe(self, ids, weights):
        """Record one weight per id; returns (unique ids touched, their new scores)."""
        ids = self.check_ids(ids)
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != ids.shape:
            raise ValueError(f"{ids.size} ids but {w.size} weights")
        np.add.at(self.obs_sum, ids, w)
        np.add.at(self.obs_cnt, ids, 1.0)
        touched = np.unique(ids)
        self._refresh(touched)
        return touched, self.scores[touched]

    def update(self, ids, losses):
        """One minibatch: rank its losses, give each weight to the id that produced the loss."""
        ids = self.check_ids(ids)
        losses = np.asarray(losses, dtype=np.float64)
        if losses.shape != ids.shape:
            raise ValueError(f"{ids.size} sample ids but {losses.size} losses")
        return self.observe(ids, rank_weights(losses))

    def _refresh(self, ids):
        seen = ids[self.obs_cnt[ids] > 0]
        mean_w = self.obs_sum[seen] / self.obs_cnt[seen]
        self.scores[seen] = (1.0 - self.alpha) * self.base[seen] + self.alpha * mean_w

    def observations(self):
        """The epoch's (sum, count) arrays, to be summed across processes IN PLACE before
        end_epoch (torch.distributed.all_reduce on views of them)."""
        return self.obs_sum, self.obs_cnt

    # ---- epoch boundary ----------------------------------------------------------------------
    def end_epoch(self, mean_loss=None):
        """Fold this epoch's observations into base and set the next epoch's blend from the trend."""
        self._refresh(np.flatnonzero(self.obs_cnt > 0))
        self.base = self.scores.copy()
        self.obs_sum[:] = 0.0
        self.obs_cnt[:] = 0.0
        if mean_loss is not None:
            mean_loss = float(mean_loss)
            if not math.isfinite(mean_loss):
                raise ValueError(f"mean_loss must be finite, got {mean_loss!r}")
            self.loss_history.append(mean_loss)
        self.alpha = self.next_alpha()
        self.epoch += 1

    def next_alpha(self) -> float:
        h = self.loss_history
        if len(h) < 2 or h[-2] <= 0.0:
            # no epoch ended with a loss: nothing but the prior to keep; one: no trend yet
            return self.smoothing if h else 1.0
        trend = abs(h[-1] - h[-2]) / h[-2]
        return float(min(1.0, max(self.smoothing, self.smoothing + trend)))

    # ---- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"num_samples": self.num_samples, "batch_size": self.batch_size,
                "smoothing": self.smoothing, "base": self.base.copy(),
                "scores": self.scores.copy(), "obs_sum": self.obs_sum.copy(),
                "obs_cnt": self.obs_cnt.copy(), "alpha": self.alpha, "epoch": self.epoch,
                "loss_history": list(self.loss_history)}

    def load_state_dict(self, state: dict):
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(f"state is for {state['num_samples']} samples, this table has "
                             f"{self.num_samples}")
        self.batch_size = int(state["batch_size"])
        self.smoothing = float(state["smoothing"])
        self.prior = prior_score(self.batch_size)
        for k in ("base", "scores", "obs_sum", "obs_cnt"):
            v = np.asarray(state[k], dtype=np.float64)
            if v.shape != (self.num_samples,):
                raise ValueError(f"state[{k!r}] has shape {v.shape}, expected ({self.num_samples},)")
            setattr(self, k, v.copy())
        self.alpha = float(state["alpha"])
        self.epoch = int(state["epoch"])
        self.loss_history = [float(x) for x in state["loss_history"]]
