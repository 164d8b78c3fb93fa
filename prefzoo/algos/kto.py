"""KTO: Kahneman-Tversky Optimisation on unpaired, labelled completions (Ethayarajh et al. 2024, arXiv 2402.01306).

KTO needs no pairs: each row is a prompt x, a completion y and a label, desirable or undesirable. With the
implicit reward and the reference point (sec. 4.1, eq. 8)

    r_theta(x, y) = log pi_theta(y|x) - log pi_ref(y|x)                (sums over the completion's tokens)
    z0            = KL(pi_theta(y'|x) || pi_ref(y'|x))
    v(x, y)       = lambda_D sigma(beta (r_theta(x, y) - z0))          y desirable
                    lambda_U sigma(beta (z0 - r_theta(x, y)))          y undesirable
    L_KTO         = E_{x,y ~ D}[ lambda_y - v(x, y) ]

(:func:`prefzoo.objective.kto_loss`). z0 is estimated "by matching inputs x' with unrelated outputs y' in a batch
of size m", z0 = max(0, (1/m) sum log pi_theta(y'|x') / pi_ref(y'|x')), and it is not backpropagated through.
Defaults: beta = 0.1, lambda_U = 1. With imbalanced classes (n_D desirable, n_U undesirable rows) the paper
recommends weights with lambda_D n_D / (lambda_U n_U) in [1, 4/3]. ``algo.desirable_weight`` unset (null, the
default) takes the lower end of that range from the training rows' class counts, lambda_D = lambda_U n_U / n_D
(1.0 on balanced data, as the paper's and TRL's default; 8.4 on the built-in arithmetic rows, 10.6% desirable),
and logs it. A set weight is kept; the run logs the class counts and warns, in one line, when its ratio is
outside the range (:meth:`KTO.check_data`). Departure: TRL's default is lambda_D = 1 whatever the balance; on
the built-in rows that gives a ratio of 0.12, and such runs collapse (docs/algorithms.md, KTO).

How the code does it, and departs:

* The mismatched pairs are a rotation of the optimizer step's rows: row i's prompt with row (i+1) mod B's
  completion (:func:`mismatched`), so no row is paired with itself for B >= 2 and the y' are exactly the step's y,
  paired with other x. B = 1 is refused before anything loads (``Declaration.min_batch_size = 2``, per process).
  TRL builds its mismatched pairs once, when it prepares the data set (each row with its neighbour's completion,
  in blocks of consecutive rows), so they are fixed for the run and a batch's y' need not be its y.
* z0 is ONE number per optimizer step: its (sum, count) over all the step's rows -- every micro-batch, every
  data-parallel process -- through the contract's ``step_statistics`` pass, made before the losses
  (:func:`prefzoo.training.step.step_statistics`), averaged, and only then clamped at 0. Gradient accumulation and
  data parallelism thus give the update of one big batch. (TRL estimates it per micro-batch, averaged over
  processes.) Under data parallelism the rotation runs over each process's own rows.
* The KL pass runs without gradients (z0 is detached in the paper too): one forward pass of the policy and one of
  the reference over the B mismatched rows, besides the loss's own.
* Paired preference data is split into unpaired rows (chosen: desirable, rejected: undesirable), as TRL does; the
  built-in task's rows are every sampled completion, labelled by the verifier (:mod:`prefzoo.data.unpaired`).

Metrics (TRL's names): ``rewards/chosen`` / ``rewards/rejected`` = mean beta r_theta of the step's desirable /
undesirable rows (0 at step 0), ``rewards/margins`` = their difference, ``logps/chosen|rejected`` (summed, nats),
``kl`` = the step's mean mismatched log-ratio BEFORE the clamp (z0 = max(0, kl)), ``count/desirable`` and
``count/undesirable`` (rows of the step). Held-out preference accuracy ranks a pair by beta r_theta of each side.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration, check_beta
from prefzoo.errors import ConfigError, PluginError
from prefzoo.objective import kto_loss, sequence_logps
from prefzoo.types import (NO_STEP, LossOutput, ObjectiveSettings, Policy, PreferenceBatch, SequenceBatch, StepContext,
                           UnpairedBatch)

log = logging.getLogger(__name__)

#: the paper's recommended range of lambda_D n_D / (lambda_U n_U) (sec. 4.1)
WEIGHT_RATIO_RANGE = (1.0, 4.0 / 3.0)


@dataclass
class KTOConfig(AlgoConfig):
    name: str = "kto"
    default_beta: float = 0.1  # the paper's and TRL's
    desirable_weight: Optional[float] = None  # lambda_D; None: lambda_U n_U / n_D from the training rows (check_data)
    undesirable_weight: float = 1.0  # lambda_U


def mismatched(batch: SequenceBatch) -> SequenceBatch:
    """Row i's prompt with row (i+1) mod B's completion: the pairs z0 is estimated on.

    Shape: (B, P) prompts and (B, T) completions -> the same shapes (the completions rotated by one row).
    """
    return SequenceBatch(batch.prompt_ids, batch.prompt_mask, batch.completion_ids.roll(-1, dims=0),
                         batch.completion_mask.roll(-1, dims=0))


def weight_ratio(desirable_weight: float, undesirable_weight: float, desirable: int, undesirable: int) -> float:
    """lambda_D n_D / (lambda_U n_U) (inf without undesirable rows)."""
    denominator = undesirable_weight * undesirable
    return desirable_weight * desirable / denominator if denominator else float("inf")


def balanced_desirable_weight(undesirable_weight: float, desirable: int, undesirable: int) -> float:
    """lambda_D = lambda_U n_U / n_D: the lower end of the paper's range (ratio 1); 1.0 without rows of both labels."""
    return undesirable_weight * undesirable / desirable if desirable and undesirable else 1.0


@register
class KTO(Algorithm):
    """KTO plugin: unpaired labelled rows, frozen reference, the Kahneman-Tversky value around z0."""

    config_class = KTOConfig

    @staticmethod
    def validate_settings(cfg: KTOConfig, objective: ObjectiveSettings) -> None:
        check_beta(objective, "KTO", "the paper and TRL use 0.1")
        for key in ("desirable_weight", "undesirable_weight"):
            value = getattr(cfg, key)
            if value is not None and not value > 0:
                raise ConfigError(f"algo.{key}={value} must be > 0 (the paper's lambda; leave algo.desirable_weight "
                                  "unset to balance the classes).")

    def __init__(self, cfg: KTOConfig, objective: ObjectiveSettings, sampling=None):
        super().__init__(cfg, objective, sampling)
        #: lambda_D in use: the set weight, else 1.0 until check_data balances it from the class counts
        self.desirable_weight = cfg.desirable_weight if cfg.desirable_weight is not None else 1.0

    def declare(self) -> Declaration:
        return Declaration(reference=True, aggregation="example_mean", data="unpaired", min_batch_size=2,
                           capabilities=frozenset({"implicit_rewards", "step_statistics"}),
                           progress_keys=("loss", "kl", "rewards/margins"))

    def check_data(self, stats: dict[str, int]) -> None:
        """Balance lambda_D from the class counts when unset; log them; warn (one line) when a set lambda_D gives
        lambda_D n_D / (lambda_U n_U) outside [1, 4/3]."""
        n_d, n_u = int(stats.get("desirable", 0)), int(stats.get("undesirable", 0))
        if self.cfg.desirable_weight is None:
            self.desirable_weight = balanced_desirable_weight(self.cfg.undesirable_weight, n_d, n_u)
        ratio = weight_ratio(self.desirable_weight, self.cfg.undesirable_weight, n_d, n_u)
        log.info("KTO training rows: %d desirable, %d undesirable; lambda_D = %.3g%s, lambda_U = %.3g; "
                 "lambda_D n_D / (lambda_U n_U) = %.3g", n_d, n_u, self.desirable_weight,
                 " (balanced: algo.desirable_weight unset)" if self.cfg.desirable_weight is None else "",
                 self.cfg.undesirable_weight, ratio)
        low, high = WEIGHT_RATIO_RANGE
        if not low <= ratio <= high:
            hint = (f"e.g. algo.desirable_weight in [{low * self.cfg.undesirable_weight * n_u / n_d:.3g}, "
                    f"{high * self.cfg.undesirable_weight * n_u / n_d:.3g}]" if n_d and n_u else
                    "give rows of both labels")
            log.warning("KTO: %d desirable and %d undesirable training rows give lambda_D n_D / (lambda_U n_U) = %.3g, "
                        "outside the paper's recommended [1, 4/3]; %s.", n_d, n_u, ratio, hint)

    @torch.no_grad()
    def step_statistics(self, policy: Policy, batch: UnpairedBatch, micro_batch_size: int
                        ) -> dict[str, tuple[float, float]]:
        """(sum, count) of log pi_theta(y'|x) - log pi_ref(y'|x) over the step's mismatched rows, as ``kl``."""
        if len(batch) == 0:
            return {"kl": (0.0, 0.0)}
        if len(batch) == 1:
            raise PluginError("KTO estimates z0 on mismatched rows of a step: one row would be paired with itself; "
                              "give each process at least 2 rows per step (trainer.batch_size).")
        total = 0.0
        for part in mismatched(batch).chunks(micro_batch_size):
            logps, _ = policy.logps(part)
            total += float((sequence_logps(logps, part.completion_mask)
                            - sequence_logps(policy.ref_logps(part), part.completion_mask)).sum())
        return {"kl": (total, float(len(batch)))}

    def log_ratios(self, policy: Policy, batch: SequenceBatch) -> tuple[Tensor, Tensor]:
        """Summed log pi_theta (with gradients) and r_theta = log pi_theta - log pi_ref of each row, Shape (B,) each."""
        logps, _ = policy.logps(batch)
        seq = sequence_logps(logps, batch.completion_mask)
        with torch.no_grad():
            ref = sequence_logps(policy.ref_logps(batch), batch.completion_mask)
        return seq, seq - ref

    def loss(self, policy: Policy, batch: UnpairedBatch, step: StepContext = NO_STEP) -> LossOutput:
        if step.statistics is None or "kl" not in step.statistics:
            raise PluginError("KTO's loss needs the step's z0: run it through prefzoo.training.step."
                              "accumulate_gradients (or optimisation_step), which makes the step_statistics pass first.")
        kl = float(step.statistics["kl"])
        seq, ratio = self.log_ratios(policy, batch)
        desirable = batch.labels.to(torch.bool)
        losses = kto_loss(ratio, desirable, max(0.0, kl), self.beta, self.desirable_weight,
                          self.cfg.undesirable_weight)
        with torch.no_grad():
            rewards = self.beta * ratio
            n_d, n_u = float(desirable.sum()), float((~desirable).sum())
            pairs = {"rewards/chosen": (float(rewards[desirable].sum()), n_d),
                     "rewards/rejected": (float(rewards[~desirable].sum()), n_u),
                     "logps/chosen": (float(seq[desirable].sum()), n_d),
                     "logps/rejected": (float(seq[~desirable].sum()), n_u),
                     "desirable_share": (n_d, float(len(batch)))}
        return LossOutput(losses, None, {"kl": kl}, token_metrics=pairs)

    def after_step(self, metrics: dict[str, float], num_samples: int) -> dict[str, float]:
        """The step's margin and class counts, from its means over all rows (``num_samples`` rows)."""
        share = metrics.get("desirable_share", 0.0)
        desirable = round(share * num_samples)
        return {"rewards/margins": metrics.get("rewards/chosen", 0.0) - metrics.get("rewards/rejected", 0.0),
                "count/desirable": float(desirable), "count/undesirable": float(num_samples - desirable)}

    @torch.no_grad()
    def implicit_rewards(self, policy: Policy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Held-out ranking: beta r_theta of chosen and of rejected, Shape (B,) each."""
        both = batch.stacked()
        _, ratio = self.log_ratios(policy, both)
        return self.beta * ratio[: len(batch)], self.beta * ratio[len(batch):]
