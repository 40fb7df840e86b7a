"""Each job's own scores, and the cache's score table as their merge.

A job's sampler writes its scores (SHADE's, sampling/importance.py) into its own table, in its
job's board file (JobScores); no job writes another's. The cache's score table, by which the
engine evicts and admits (csrc/cache/policies/importance.cc: a full cache admits a value whose
score beats the lowest cached one, and evicts that one), holds their merge over the live jobs,
by the node's rule (sc.Node(score_merge=...), kept in the order board's header):

  uses   sum over the live jobs that still read the sample in their current epoch of
         (1 + its rank-normalised score in that job): a sample two jobs still need outranks one
         that one job needs, and one that every job has read this epoch (0) goes first; among
         samples as many jobs need, the more important goes last;
  max    the largest rank-normalised score over the live jobs;
  sum    the sum of the live jobs' rank-normalised scores;
  last   no merge: each job writes its own scores over the table (what a cache did before it knew
         of jobs; kept for comparison, docs/jobs.md).

Rank-normalised: SHADE's score of a sample is a blend of log(rank + 10) over the ranks it got
inside its minibatches, so its range depends on the batch size B; (score - log 10) /
(log(B + 9) - log 10) maps the job's range to [0, 1] (its mean rank as a fraction of the batch),
which makes jobs of different batch sizes comparable. docs/jobs.md has the measurements that
chose the default.

With one live job the table holds its own scores as written (any rule): a job alone evicts and
admits exactly as before jobs. The merge is written under the registry lock (jobs.py), so that two
jobs that change one sample at once cannot leave a merge made of a view older than both.
"""
from __future__ import annotations

import math

import numpy as np

from .board_layout import H_SCORE_BATCH, SCORE_MERGES

RANK_OFFSET = 10.0      # SHADE's constant (sampling/importance.py): weight = log(rank + 10)
RULES = tuple(SCORE_MERGES)
DEFAULT_RULE = "uses"


def check_rule(rule) -> str:
    """The rule's name; ValueError naming the choices for anything else."""
    if rule not in SCORE_MERGES:
        raise ValueError(f"score_merge must be one of {sorted(SCORE_MERGES)}, got {rule!r}")
    return rule


def rule_name(number: int) -> str:
    for name, k in SCORE_MERGES.items():
        if k == number:
            return name
    return DEFAULT_RULE   # 0: a board made without one


class JobScores:
    """The score table of one job (float32 per sample in its board file) and the batch size its
    scores were ranked in (header word H_SCORE_BATCH; 0 until its sampler says)."""

    def __init__(self, table: np.ndarray, header: np.ndarray):
        self._table, self._header = table, header

    def close(self) -> None:
        self._table = self._header = None

    def write(self, ids, scores) -> None:
        """Sets the job's scores of `ids` (aligned 4-byte stores: a reader sees each old or new)."""
        self._table[np.asarray(ids, dtype=np.int64)] = np.asarray(scores, dtype=np.float32)

    def read(self, ids) -> np.ndarray:
        return self._table[np.asarray(ids, dtype=np.int64)]

    def set_batch(self, batch_size: int) -> None:
        self._header[H_SCORE_BATCH // 8] = int(batch_size)

    @property
    def batch(self) -> int:
        return int(self._header[H_SCORE_BATCH // 8])

    def normalised(self, ids) -> np.ndarray:
        """The job's scores of `ids` mapped to [0, 1] by its rank range (module docstring); the
        scores as they are while no batch size is known."""
        s = self.read(ids).astype(np.float64)
        b = self.batch
        if b < 2:
            return s
        lo, hi = math.log(RANK_OFFSET), math.log(b - 1 + RANK_OFFSET)
        return np.clip((s - lo) / (hi - lo), 0.0, 1.0)


def merge(rule: str, jobs: list, ids: np.ndarray) -> np.ndarray:
    """The cache's scores of `ids` under `rule` over `jobs` (each with .scores: JobScores and
    .orders: Orders, the live jobs' views; two or more), as float32."""
    if rule == "uses":
        key = np.zeros(ids.size, dtype=np.float64)
        for j in jobs:
            key += j.orders.pending(ids) * (1.0 + j.scores.normalised(ids))
    elif rule == "max":
        key = np.max([j.scores.normalised(ids) for j in jobs], axis=0)
    elif rule == "sum":
        key = np.sum([j.scores.normalised(ids) for j in jobs], axis=0)
    else:
        raise ValueError(f"rule {rule!r} merges nothing")
    return key.astype(np.float32)


class ScoreMerge:
    """Writes one job's scores and the merge into the cache (module docstring). all_jobs: the
    AllJobs of the job's board (all_jobs.py); own: the job's own view in it."""

    def __init__(self, all_jobs, own, rule: str):
        self.all_jobs, self.own, self.rule = all_jobs, own, rule
        self._pushed = None     # the jobs (slot, generation) the last full merge was made over

    def scores(self, cache, ids, scores) -> None:
        """The job's new scores of `ids`: into its table, and the cache's scores of those ids."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.own.scores.write(ids, scores)
        self._push(cache, ids, written=True)

    def uses(self, cache, ids) -> None:
        """What the job still reads changed for `ids` (taken, or a new epoch published): under
        the "uses" rule, with another job live, their merge again."""
        if self.rule == "uses" and len(self.all_jobs.registered()) > 1:
            self._push(cache, np.asarray(ids, dtype=np.int64).reshape(-1), written=False)

    def jobs_changed(self, cache) -> bool:
        """When a job joined or left since the last full merge: all of the cache's scores merged
        again (over the jobs there are now); returns whether it did."""
        now = self.all_jobs.registered()
        if now == self._pushed:
            return False
        self._push(cache, np.arange(cache.num_samples, dtype=np.int64), written=True)
        self._pushed = now
        return True

    def _push(self, cache, ids: np.ndarray, written: bool) -> None:
        if not ids.size:
            return
        if len(self.all_jobs.registered()) < 2 or self.rule == "last":
            # alone: no other job's merge to race with, no lock (a job that registers meanwhile
            # merges everything again at its next batch, and so does this one: jobs_changed)
            if written:
                cache.update_scores(ids, self.own.scores.read(ids))
            return
        try:
            with self.all_jobs.locked():
                jobs = self.all_jobs.views()
                if len(jobs) < 2 or self.rule == "last":
                    if written:   # alone (or "last"): the job's own scores, as written
                        cache.update_scores(ids, self.own.scores.read(ids))
                    return
                cache.update_scores(ids, merge(self.rule, jobs, ids))
        except FileNotFoundError:
            # The node's file was removed or made again under this live job (by hand): there is
            # no registry to merge under. The job's own scores, as a job alone writes them, and
            # the sampler finds the board there now at its next look (BoardLink.get: this one is
            # no longer current); a crash mid-epoch would be worse than one unmerged write.
            if written:
                cache.update_scores(ids, self.own.scores.read(ids))
