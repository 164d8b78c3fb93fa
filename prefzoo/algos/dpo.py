"""Direct Preference Optimisation (Rafailov et al. 2023) and its f-divergence family (Wang et al. 2024).

The KL-regularised objective's optimum pi* = pi_ref exp(r/beta) / Z rearranges to
r(x, y) = beta log(pi*(y|x) / pi_ref(y|x)) + beta log Z(x); substituting it into the Bradley-Terry model
of preferences cancels Z and leaves a classification loss on log-ratios (Rafailov et al. 2023, eq. 7):

    margin = beta log(pi(y_w)/pi_ref(y_w)) - beta log(pi(y_l)/pi_ref(y_l))
    loss   = -log sigmoid(margin)

With a general f-divergence the implicit reward becomes beta f'(pi/pi_ref) (Wang et al. 2024, Thm. 1);
:func:`prefzoo.objective.implicit_reward` supplies it, so ``objective=forward_kl|js|alpha`` changes only
the link, and reverse KL gives exactly the loss above. ``algo.loss_type`` picks the link on the pair's scores
s = beta f'(pi/pi_ref) (the table, its equations and sources: :mod:`prefzoo.objective.pairwise`):

* ``sigmoid``  -(1-eps) log sigma(m) - eps log sigma(-m)  (eps = label_smoothing: conservative DPO,
  Mitchell 2023; eps = 0 is eq. 7 of Rafailov et al.);
* ``ipo``      (m / beta - 1 / (2 beta))^2  (Azar et al. 2023, eq. 17: the log-ratio difference is
  regressed to 1/(2 tau), tau = beta). Each side's log-ratio is AVERAGED over its completion tokens first
  (``ipo_average_log_ratio=true``, the default, as the IPO authors' code and TRL do): the target margin
  1/(2 beta) then does not depend on the completions' lengths. ``false`` keeps eq. 17 on summed log-ratios;
* ``hinge``    max(0, 1 - m)  (SLiC, Zhao et al. 2023, with the log-ratio scaled by beta);
* ``robust`` (rDPO: label_smoothing is the flip rate), ``exo_pair`` (label_smoothing is EXO's eps > 0),
  ``discopop`` (``discopop_tau``) on the margin; ``nca_pair``, ``sppo_hard``, ``apo_zero``, ``apo_down``,
  ``bco_pair`` and ``aot_unpaired`` on each side's score s = beta (f'(pi/pi_ref) - f'(1)), 0 at the reference
  (beta log(pi/pi_ref) under reverse KL, as TRL; for the other divergences TRL 1.16 subtracts other constants);
  ``aot`` on the sorted policy and reference log-prob margins (sorted within each micro-batch: its loss depends
  on ``trainer.micro_batch_size``, as TRL's on the per-device batch); ``sft``: the chosen's mean NLL;
* a list, ``loss_type=[sigmoid,sft]`` with ``loss_weights=[1.0,0.5]``: the weighted sum (weights default 1).
  Each component reads its own view: IPO the averaged log-ratios, the others the summed ones.

``bco_pair``'s reward shift delta is the running mean of the implicit rewards of both sides over every row of
every PREVIOUS step (row-weighted, from the step's logged ``bco/batch_reward``, so it is the same whatever the
micro-batch size or the number of processes); it is 0 at the first step, where the policy is the reference and
every reward is 0. (The BCO paper and TRL 0.x update it with each batch before using it: one step of lag here.)
It lives in the plugin's ``state_dict``, so a resumed run continues with the same delta.

Chosen and rejected go through the policy in one concatenated forward pass. Reference log-probs are
computed per batch under no_grad, or once before training (``precompute_ref_logps``: the capability
``precomputed_reference``).

Metrics (TRL's names and meanings): ``rewards/chosen`` / ``rewards/rejected`` = beta * log(pi/pi_ref) of the
chosen / rejected completion (0 at step 0; averaged log-ratios under IPO), ``rewards/margins`` and
``rewards/accuracies`` from the margin m the loss sees; with a divergence other than reverse KL also
``implicit_rewards/chosen|rejected`` = beta f'(pi/pi_ref), the f-DPO link's reward; ``logps/chosen|rejected``
(summed, nats), ``log_ratio/chosen|rejected`` (nats; as the loss sees them: summed, or averaged under IPO alone);
with several loss types ``loss/<type>`` (each component before its weight); with ``bco_pair``
``bco/reward_shift`` (the delta this step used) and ``bco/batch_reward`` (this step's mean implicit reward of
chosen and rejected).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration
from prefzoo.errors import ConfigError
from prefzoo.objective import (PAIRWISE_LOSSES, PairScores, get_divergence, implicit_reward, pairwise_loss,
                               sequence_logps)
from prefzoo.types import LossOutput, ObjectiveSettings, Policy, PreferenceBatch


@dataclass
class DPOConfig(AlgoConfig):
    name: str = "dpo"
    loss_type: Any = "sigmoid"  # a link of prefzoo.objective.PAIRWISE_LOSSES, or a list of them (a weighted sum)
    loss_weights: Optional[list[float]] = None  # one weight per loss_type (None: 1.0 each)
    label_smoothing: float = 0.0  # cDPO/rDPO/AOT: probability that a label is flipped, in [0, 0.5); exo_pair: eps > 0
    ipo_average_log_ratio: bool = True  # ipo: each side's log-ratio averaged over its tokens (false: summed, eq. 17)
    discopop_tau: float = 0.05  # discopop: the temperature of its logistic/exponential blend (the paper's 0.05)
    precompute_ref_logps: bool = False


#: old names of loss types -> the message that names the current one
RENAMED_LOSS_TYPES = {"aot_pair": "aot_pair was TRL 0.x's name for AOT on unpaired data: use algo.loss_type=aot_unpaired "
                                  "(algo.loss_type=aot is AOT on pairs)."}


def loss_types(cfg: DPOConfig) -> tuple[str, ...]:
    """``algo.loss_type`` as a tuple of names (one name, or the list of a weighted sum)."""
    return (cfg.loss_type,) if isinstance(cfg.loss_type, str) else tuple(cfg.loss_type)


def check_loss_types(cfg: DPOConfig) -> None:
    """Raise ``ConfigError`` unless ``algo.loss_type`` / ``algo.loss_weights`` name valid, distinct links and weights."""
    valid = ", ".join(PAIRWISE_LOSSES)
    given = cfg.loss_type
    if isinstance(given, str):
        if given in RENAMED_LOSS_TYPES:
            raise ConfigError(f"algo.loss_type={given}: {RENAMED_LOSS_TYPES[given]}")
        if given not in PAIRWISE_LOSSES:
            raise ConfigError(f"algo.loss_type={given!r} is unknown; choose one of {valid}.")
    else:
        names = list(given) if isinstance(given, (list, tuple)) else None
        if names is None:
            raise ConfigError(f"algo.loss_type={given!r}: give a loss type or a list of them, e.g. "
                              "algo.loss_type=[sigmoid,sft].")
        if not names:
            raise ConfigError("algo.loss_type=[] is empty; give a loss type, or a list, e.g. algo.loss_type=[sigmoid,sft].")
        for name in names:
            if name in RENAMED_LOSS_TYPES:
                raise ConfigError(f"algo.loss_type={names!r}: {RENAMED_LOSS_TYPES[name]}")
            if name not in PAIRWISE_LOSSES:
                raise ConfigError(f"algo.loss_type={names!r}: {name!r} is unknown; choose from {valid}.")
            if names.count(name) > 1:
                raise ConfigError(f"algo.loss_type={names!r} lists {name!r} twice; give each loss type once (and "
                                  "weigh it with algo.loss_weights).")
    types = loss_types(cfg)
    w = cfg.loss_weights
    if w is not None:
        w = list(w)
        if len(w) != len(types):
            raise ConfigError(f"algo.loss_weights has {len(w)} entries but algo.loss_type has {len(types)} "
                              f"({', '.join(types)}); give one weight per loss type.")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in w):
            raise ConfigError(f"algo.loss_weights={w}: weights must be finite and >= 0.")
        if not any(x > 0 for x in w):
            raise ConfigError(f"algo.loss_weights={w}: at least one weight must be > 0.")


@register
class DPO(Algorithm):
    """DPO plugin: offline pairs, frozen reference, loss on the implicit-reward margin."""

    name = "dpo"
    config_class = DPOConfig

    def __init__(self, cfg: DPOConfig, objective: ObjectiveSettings, sampling=None):
        super().__init__(cfg, objective, sampling)
        self.divergence = get_divergence(objective.divergence, alpha=objective.alpha)
        self.loss_types = loss_types(cfg)
        self.loss_weights = tuple(float(x) for x in cfg.loss_weights) if cfg.loss_weights is not None \
            else (1.0,) * len(self.loss_types)
        self.bco_shift = {"mean": 0.0, "rows": 0}  # bco_pair's running mean reward (module docstring)

    @staticmethod
    def validate_settings(cfg: DPOConfig, objective: ObjectiveSettings) -> None:
        check_loss_types(cfg)
        if not 0 <= cfg.label_smoothing < 0.5:
            raise ConfigError(f"algo.label_smoothing={cfg.label_smoothing} must be in [0, 0.5).")
        if "exo_pair" in loss_types(cfg) and cfg.label_smoothing == 0:
            raise ConfigError("algo.loss_type=exo_pair needs algo.label_smoothing > 0 (EXO's eps enters as log eps); "
                              "EXO's authors use algo.label_smoothing=1e-3.")
        if not cfg.discopop_tau > 0:
            raise ConfigError(f"algo.discopop_tau={cfg.discopop_tau} must be > 0 (DiscoPOP's temperature; the paper's "
                              "0.05).")
        if not objective.beta > 0:
            raise ConfigError(f"objective.beta={objective.beta}: DPO needs beta > 0 (beta scales the implicit reward; "
                              "beta=0 has no optimum).")

    def declare(self) -> Declaration:
        return Declaration(reference=True, aggregation="example_mean",
                           capabilities=frozenset({"implicit_rewards", "precomputed_reference"}),
                           precompute_reference=self.cfg.precompute_ref_logps,
                           progress_keys=("loss", "rewards/accuracies", "rewards/margins"))

    @property
    def averages_log_ratio(self) -> bool:
        """The metrics' (and held-out rewards') view: averaged log-ratios under IPO alone, summed otherwise."""
        return self.loss_types == ("ipo",) and self.cfg.ipo_average_log_ratio

    def reference_logps(self, policy: Policy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Summed reference log-probs (B,) of chosen and rejected (precomputed if the batch carries them)."""
        if batch.ref_chosen_logps is not None:
            return batch.ref_chosen_logps, batch.ref_rejected_logps
        both = batch.stacked()
        seq = sequence_logps(policy.ref_logps(both), both.completion_mask)
        return seq[: len(batch)], seq[len(batch):]

    def sides(self, policy: Policy, batch: PreferenceBatch) -> dict[str, Tensor]:
        """Summed log-probs of policy and reference and the completion lengths of both sides, (B,) each: one
        forward pass of the policy over the 2B rows."""
        ref_chosen, ref_rejected = self.reference_logps(policy, batch)
        both = batch.stacked()
        logps, _ = policy.logps(both)
        seq = sequence_logps(logps, both.completion_mask)
        lengths = both.completion_mask.sum(-1).clamp(min=1).to(seq.dtype)
        b = len(batch)
        return {"chosen_logps": seq[:b], "rejected_logps": seq[b:], "ref_chosen_logps": ref_chosen,
                "ref_rejected_logps": ref_rejected, "chosen_length": lengths[:b], "rejected_length": lengths[b:]}

    @staticmethod
    def ratios(sides: dict[str, Tensor], averaged: bool) -> tuple[Tensor, Tensor]:
        """log(pi/pi_ref) of chosen and rejected (B,) each: summed over the completion tokens, or averaged."""
        chosen = sides["chosen_logps"] - sides["ref_chosen_logps"]
        rejected = sides["rejected_logps"] - sides["ref_rejected_logps"]
        if averaged:
            return chosen / sides["chosen_length"], rejected / sides["rejected_length"]
        return chosen, rejected

    def log_ratios(self, policy: Policy, batch: PreferenceBatch) -> dict[str, Tensor]:
        """Sequence log-probs of both sides (one forward pass over the 2B rows) and their log-ratios
        log(pi/pi_ref) (B,) each: summed over the completion tokens, or averaged under IPO."""
        sides = self.sides(policy, batch)
        chosen, rejected = self.ratios(sides, self.averages_log_ratio)
        return {"chosen_logps": sides["chosen_logps"], "rejected_logps": sides["rejected_logps"], "chosen": chosen,
                "rejected": rejected}

    def rewards(self, chosen_ratio: Tensor, rejected_ratio: Tensor) -> tuple[Tensor, Tensor]:
        """Implicit rewards beta f'(pi/pi_ref) of chosen and rejected, Shape (B,) each, float64.

        In float64 because the links of forward KL (-1/u = -exp(-log_ratio)) and alpha overflow float32 once a
        sequence log-ratio falls below about -88 nats (a rejected answer DPO has pushed down): the loss and
        its gradient would then be NaN. (float64 overflows below -709 nats.)
        """
        return (implicit_reward(chosen_ratio.double(), self.beta, self.divergence),
                implicit_reward(rejected_ratio.double(), self.beta, self.divergence))

    def reward_at_reference(self) -> float:
        """beta f'(1): the implicit reward of a completion whose probability is its reference one (beta under
        reverse KL, -beta under forward KL)."""
        return float(implicit_reward(torch.zeros((), dtype=torch.float64), self.beta, self.divergence))

    def scores(self, sides: dict[str, Tensor], averaged: bool) -> PairScores:
        """What the links read (:class:`~prefzoo.objective.PairScores`), float64: each side's score
        s = beta (f'(pi/pi_ref) - f'(1)) -- the implicit reward, 0 at the reference (beta log(pi/pi_ref) under
        reverse KL, what the anchored links of APO, NCA, BCO and SPPO expect) -- in the summed or averaged view;
        beta times the policy's and the reference's log-prob margins (aot); the chosen's mean NLL (sft)."""
        chosen, rejected = self.rewards(*self.ratios(sides, averaged))
        at_reference = self.reward_at_reference()
        chosen, rejected = chosen - at_reference, rejected - at_reference
        return PairScores.from_sides(
            chosen, rejected,
            policy_margin=self.beta * (sides["chosen_logps"] - sides["rejected_logps"]).double(),
            reference_margin=self.beta * (sides["ref_chosen_logps"] - sides["ref_rejected_logps"]).double(),
            chosen_nll=-(sides["chosen_logps"] / sides["chosen_length"]).double())

    def loss(self, policy: Policy, batch: PreferenceBatch) -> LossOutput:
        sides = self.sides(policy, batch)
        views: dict[bool, PairScores] = {}

        def view(averaged: bool) -> PairScores:
            if averaged not in views:
                views[averaged] = self.scores(sides, averaged)
            return views[averaged]

        parts = {}
        for loss_type in self.loss_types:
            s = view(loss_type == "ipo" and self.cfg.ipo_average_log_ratio)
            parts[loss_type] = pairwise_loss(s, loss_type, self.beta, self.cfg.label_smoothing,
                                             discopop_tau=self.cfg.discopop_tau, reward_shift=self.bco_shift["mean"])
        losses = sum(w * parts[t] for t, w in zip(self.loss_types, self.loss_weights)).float()
        with torch.no_grad():
            chosen_ratio, rejected_ratio = self.ratios(sides, self.averages_log_ratio)
            s = view(self.averages_log_ratio)
            metrics = {
                "rewards/chosen": (self.beta * chosen_ratio).mean().item(),
                "rewards/rejected": (self.beta * rejected_ratio).mean().item(),
                "rewards/margins": s.margin.mean().item(), "rewards/accuracies": (s.margin > 0).float().mean().item(),
                "logps/chosen": sides["chosen_logps"].mean().item(), "logps/rejected": sides["rejected_logps"].mean().item(),
                "log_ratio/chosen": chosen_ratio.mean().item(), "log_ratio/rejected": rejected_ratio.mean().item(),
            }
            if self.objective.divergence != "reverse_kl":  # the link's value beta f'(u), as f-DPO defines it
                metrics["implicit_rewards/chosen"] = (s.chosen + self.reward_at_reference()).mean().item()
                metrics["implicit_rewards/rejected"] = (s.rejected + self.reward_at_reference()).mean().item()
            if len(parts) > 1:
                metrics.update({f"loss/{t}": part.mean().item() for t, part in parts.items()})
            if "bco_pair" in parts:
                summed = view(False)
                metrics["bco/batch_reward"] = ((summed.chosen + summed.rejected) / 2).mean().item()
                metrics["bco/reward_shift"] = self.bco_shift["mean"]
        return LossOutput(losses, None, metrics)

    def after_step(self, metrics: dict[str, float], num_samples: int) -> dict[str, float]:
        """bco_pair: fold the step's mean reward (``bco/batch_reward``, over its ``num_samples`` rows) into the
        running mean that the next steps subtract."""
        if "bco_pair" in self.loss_types and "bco/batch_reward" in metrics:
            rows = self.bco_shift["rows"] + int(num_samples)
            mean = self.bco_shift["mean"]
            self.bco_shift = {"mean": mean + (float(metrics["bco/batch_reward"]) - mean) * num_samples / rows,
                              "rows": rows}
        return {}

    def state_dict(self) -> dict:
        state = super().state_dict()
        if "bco_pair" in self.loss_types:
            state["bco_reward_shift"] = dict(self.bco_shift)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "bco_pair" in self.loss_types:  # (checkpoints written before bco_pair have none: start from 0)
            self.bco_shift = dict(state.get("bco_reward_shift", {"mean": 0.0, "rows": 0}))

    @torch.no_grad()
    def implicit_rewards(self, policy: Policy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Held-out ranking: the implicit rewards of chosen and rejected, Shape (B,) each."""
        r = self.log_ratios(policy, batch)
        return self.rewards(r["chosen"], r["rejected"])
