"""Beta sets the speed, not the shape -- "the KL penalty coefficient does not change the shape; it changes how fast
you travel along it" (note 004, "Over-optimisation, quantified"; Gao et al. 2023): the test of the claim as a number.

The same RL run at several KL coefficients beta traces gold reward against d = sqrt(KL(pi || pi_ref)). If beta only
sets the speed, the curves lie on one another at equal d and differ only where one run went further; early stopping
and the penalty are then substitutes. The runs' curves are compared with what chance alone gives, the spread of
curves of one beta run with different seeds.

Definitions (:func:`speed_shape_test`). A curve is one run's held-out evaluations during training (step 0, the
reference, included): points (d_t, g_t) with g the gold reward (``gold_sample_reward``), sorted by d, and g(d) their
linear interpolation (``np.interp``; within the measured range only). For the runs of one algorithm:

* the common range [d_lo, d_hi] = [max over the curves of their smallest d, min over them of their largest d],
  and a grid d_1..d_K of K equally spaced points in it (K = 25);
* the BETA SPREAD S_beta = sqrt( (1/K) sum_k Var_beta g_beta(d_k) ): at each grid point the sample variance
  (ddof 1) across the B betas of their curves (for a beta run with several seeds, its smallest seed's), averaged
  over the grid, square root (reward units);
* the SEED SPREAD S_seed = sqrt( (1/K) sum_k V_k ), V_k the pooled within-beta variance at d_k over the betas run
  with 2 or more seeds: sum_beta sum_s (g_{beta,s}(d_k) - mean_s g_{beta,s}(d_k))^2 / sum_beta (n_beta - 1);
* the RATIO rho = S_beta / S_seed. Under the claim (one shape, travelled at beta's speed) the betas' curves differ
  at equal d only as seeds do, rho ~ 1; a shape that changes with beta gives rho > 1. ``consistent`` is rho <=
  :data:`RATIO_LIMIT` (2): a rule of thumb, not a significance test -- with one pair of seeds the seed spread has
  one degree of freedom at each d (the grid points are not independent), so a single pair leaves rho's own
  uncertainty large; more seeds narrow it.

Each run should have its own seed (the recipe gives every beta a different one): runs that share a seed share
their first rollouts and their evaluation samples (the evaluator's random source is ``trainer.seed``), which makes
their curves closer than independent runs' and would bias rho down, toward the claim.

The speed: each run's d at its last evaluation per training step (``speed``, sqrt(nats) per step); the claim
expects it to fall as beta grows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from prefzoo.report.overoptimisation import rl_label
from prefzoo.report.runs import eval_history, is_best_of_n, is_number

__all__ = ["Curve", "rl_curves", "spread", "speed_shape_test", "RATIO_LIMIT", "GRID_POINTS"]

#: rho at or below this: the betas' curves differ no more than seeds' do (see the module docstring)
RATIO_LIMIT = 2.0
#: grid points over the common range of d
GRID_POINTS = 25


@dataclass
class Curve:
    """One RL run's gold reward against d: ``d`` and ``gold`` sorted by d; ``steps`` and ``d_by_step`` in step order."""

    label: str
    algo: str
    beta: float
    seed: int
    d: np.ndarray
    gold: np.ndarray
    steps: np.ndarray
    d_by_step: np.ndarray

    def __call__(self, grid) -> np.ndarray:
        """g(d) on ``grid`` by linear interpolation between the measured points."""
        return np.interp(grid, self.d, self.gold)

    @property
    def speed(self) -> float:
        """d at the last evaluation per training step (sqrt(nats) per step); nan without a step > 0."""
        last = int(self.steps[-1]) if len(self.steps) else 0
        return float(self.d_by_step[-1] / last) if last > 0 else float("nan")


def rl_curves(runs: list[dict]) -> list[Curve]:
    """The curve of every trained run with a gold reward and a KL in its evaluations (best-of-n and reward models
    left out), with its algorithm, beta and seed from ``summary.json``."""
    out = []
    for run in runs:
        s = run["summary"]
        if s.get("algo") == "rm" or is_best_of_n(run) or not is_number(s.get("beta")):
            continue
        pts = [(e.get("step") or 0, math.sqrt(max(e["kl_k1"], 0.0)), e["gold_sample_reward"]) for e in eval_history(run)
               if is_number(e.get("kl_k1")) and is_number(e.get("gold_sample_reward"))]
        if len(pts) < 2:
            continue
        pts.sort(key=lambda p: p[0])
        by_d = sorted(pts, key=lambda p: p[1])
        out.append(Curve(rl_label(run), str(s.get("algo")), float(s["beta"]), int(s.get("seed") or 0),
                         np.array([p[1] for p in by_d]), np.array([p[2] for p in by_d]),
                         np.array([p[0] for p in pts]), np.array([p[1] for p in pts])))
    return out


def spread(values: np.ndarray, groups: list[list[int]]) -> float:
    """sqrt of the grid-mean pooled sample variance: ``values`` (curves, K) on one grid; ``groups`` lists the rows
    of each group (rows of one group vary around their own mean); nan when no group has 2 rows."""
    ss, dof = np.zeros(values.shape[1]), 0
    for rows in groups:
        if len(rows) < 2:
            continue
        v = values[rows]
        ss += ((v - v.mean(axis=0)) ** 2).sum(axis=0)
        dof += len(rows) - 1
    return float(math.sqrt((ss / dof).mean())) if dof else float("nan")


def speed_shape_test(curves: list[Curve], grid_points: int = GRID_POINTS) -> list[dict]:
    """The test of the module docstring for each algorithm with 2 or more betas and a beta run with 2 or more seeds.

    Returns:
        one dict per such algorithm: ``algo``, ``betas`` (sorted), ``seeds`` (beta -> its seeds), ``d_lo``,
        ``d_hi``, ``d_max`` (the largest d any of its curves reached), ``beta_spread``, ``seed_spread``, ``ratio``,
        ``consistent`` (ratio <= :data:`RATIO_LIMIT`; None when the common range is empty), ``speeds`` (label ->
        speed), ``curves`` (the curves used) and ``reason`` (why no number, else None).
    """
    out = []
    for algo in sorted({c.algo for c in curves}):
        mine = sorted((c for c in curves if c.algo == algo), key=lambda c: (c.beta, c.seed))
        seeds: dict[float, list[int]] = {}
        for c in mine:
            seeds.setdefault(c.beta, []).append(c.seed)
        if len(seeds) < 2 or max(len(v) for v in seeds.values()) < 2:
            continue
        lo, hi = max(float(c.d.min()) for c in mine), min(float(c.d.max()) for c in mine)
        result = {"algo": algo, "betas": sorted(seeds), "seeds": seeds, "d_lo": lo, "d_hi": hi,
                  "d_max": max(float(c.d.max()) for c in mine), "beta_spread": float("nan"),
                  "seed_spread": float("nan"), "ratio": float("nan"), "consistent": None,
                  "speeds": {c.label: c.speed for c in mine}, "curves": mine, "reason": None}
        if not hi > lo:
            result["reason"] = (f"the curves share no range of d (the slowest reached d = {hi:.3g}, the largest "
                                f"smallest d is {lo:.3g})")
            out.append(result)
            continue
        grid = np.linspace(lo, hi, grid_points)
        values = np.stack([c(grid) for c in mine])
        first = {}
        for i, c in enumerate(mine):
            first.setdefault(c.beta, i)  # (sorted by seed: the smallest seed's row)
        by_beta = [[i for i, c in enumerate(mine) if c.beta == beta] for beta in seeds]
        s_beta, s_seed = spread(values, [list(first.values())]), spread(values, by_beta)
        ratio = (s_beta / s_seed if s_seed > 0 else (math.inf if s_beta > 0 else float("nan")))
        result.update(beta_spread=s_beta, seed_spread=s_seed, ratio=ratio,
                      consistent=bool(ratio <= RATIO_LIMIT) if not math.isnan(ratio) else None)
        out.append(result)
    return out
