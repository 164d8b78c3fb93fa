"""The pairwise family, composed once: DPO's loss on pairs (offline DPO and Online DPO) and the two-sided forward pass
(DPO, Online DPO, SimPO, ORPO, SFT).

* :func:`forward_pairs`: the summed log-probs and lengths of both sides of B pairs from ONE forward pass of the
  policy over the 2B rows (:class:`PairLogps`), with the reference's summed log-probs when asked (precomputed on
  the batch, or one no-grad pass).
* :class:`PairwiseConfig`, :func:`check_pairwise_settings`: the loss-type settings and their checks
  (``loss_type`` one link of :data:`prefzoo.objective.PAIRWISE_LOSSES` or a weighted list, ``loss_weights``,
  ``label_smoothing``, ``ipo_average_log_ratio``, ``discopop_tau``; beta > 0).
* :class:`DirectPreference`: the family's body (not a plugin: no name, never registered) that DPO and Online DPO
  derive from. It holds DPO's loss on a batch of pairs: the log-ratios log(pi/pi_ref) of each side (summed, or
  averaged over the tokens for IPO), the implicit rewards beta f'(pi/pi_ref) of the objective's divergence, the
  scores each link reads, the weighted sum of the loss types, bco_pair's running reward shift, the metrics, and
  the held-out implicit rewards. DPO adds its declaration (offline pairs, the reference precomputable); Online DPO
  its declaration, its rollout and its judge, so every loss type DPO has, Online DPO has.

Pair weights (``PreferenceBatch.weights``, Online DPO's ties at 0): each link is computed on the pairs of positive
weight only, then weighted; a pair of weight 0 has loss 0 and no gradient, and takes no part in the links that
sort the batch (``aot``, ``aot_unpaired``). The pair metrics are over the pairs of positive weight.

The log-probs are taken at temperature 1 for offline pairs, and at the rollout's temperature for an online plugin's
own samples (the policy that is trained is the one that sampled).

Metrics (TRL's names and meanings): ``rewards/chosen`` / ``rewards/rejected`` = beta * log(pi/pi_ref) of the
chosen / rejected completion (0 at step 0; averaged log-ratios under IPO alone), ``rewards/margins`` and
``rewards/accuracies`` from the margin m the loss sees; with a divergence other than reverse KL also
``implicit_rewards/chosen|rejected`` = beta f'(pi/pi_ref); ``logps/chosen|rejected`` (summed, nats),
``log_ratio/chosen|rejected`` (nats; as the loss sees them); with several loss types ``loss/<type>`` (each
component before its weight); with ``bco_pair`` ``bco/reward_shift`` (the delta this step used) and
``bco/batch_reward`` (this step's mean implicit reward of chosen and rejected, over every pair); online also ``kl``
(KL(pi || pi_ref) per sequence, k1 from the summed log-probs, over both sides, nats) and ``entropy`` (nats per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from prefzoo.algos.base import AlgoConfig, Algorithm, check_beta
from prefzoo.errors import ConfigError
from prefzoo.objective import (PAIRWISE_LOSSES, PairScores, get_divergence, implicit_reward, masked_sum, pairwise_loss,
                               sequence_logps)
from prefzoo.types import NO_STEP, LossOutput, ObjectiveSettings, Policy, PreferenceBatch, StepContext

__all__ = ["PairLogps", "forward_pairs", "PairwiseConfig", "RENAMED_LOSS_TYPES", "loss_types", "check_loss_types",
           "check_pairwise_settings", "DirectPreference"]


# ------------------------------------------------------------------------------------- the two-sided forward pass
@dataclass
class PairLogps:
    """Both sides of B pairs, from one forward pass over the 2B rows (chosen rows first). Shapes (B,) unless said.

    Attributes:
        chosen_logps / rejected_logps: summed log pi over each completion's counted tokens (nats).
        chosen_length / rejected_length: counted tokens (at least 1, so a mean never divides by 0), float.
        ref_chosen_logps / ref_rejected_logps: summed log pi_ref, or None (reference-free plugins).
        entropy: Shape (2B, T), the policy's per-token entropy when asked for, else None.
        mask: Shape (2B, T) bool, the completion mask of the stacked rows.
    """

    chosen_logps: Tensor
    rejected_logps: Tensor
    chosen_length: Tensor
    rejected_length: Tensor
    ref_chosen_logps: Tensor | None = None
    ref_rejected_logps: Tensor | None = None
    entropy: Tensor | None = None
    mask: Tensor | None = None

    @property
    def chosen_mean(self) -> Tensor:
        """(1/|y_w|) log pi(y_w | x): the length-normalised log-prob of the chosen (nats per token)."""
        return self.chosen_logps / self.chosen_length

    @property
    def rejected_mean(self) -> Tensor:
        return self.rejected_logps / self.rejected_length


def reference_pairs(policy: Policy, batch: PreferenceBatch, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Summed reference log-probs (B,) of chosen and rejected: the batch's precomputed ones, or one no-grad pass."""
    if batch.ref_chosen_logps is not None:
        return batch.ref_chosen_logps, batch.ref_rejected_logps
    both = batch.stacked()
    seq = sequence_logps(policy.ref_logps(both, temperature), both.completion_mask)
    return seq[: len(batch)], seq[len(batch):]


def forward_pairs(policy: Policy, batch: PreferenceBatch, temperature: float = 1.0, reference: bool = False,
                  with_entropy: bool = False) -> PairLogps:
    """One forward pass of the policy over the 2B rows of ``batch`` (and the reference's summed log-probs when
    ``reference``: :func:`reference_pairs`, taken first), at ``temperature``. Shapes in :class:`PairLogps`."""
    ref = reference_pairs(policy, batch, temperature) if reference else (None, None)
    both = batch.stacked()
    logps, entropy = policy.logps(both, temperature, with_entropy=with_entropy)
    seq = sequence_logps(logps, both.completion_mask)
    lengths = both.completion_mask.sum(-1).clamp(min=1).to(seq.dtype)
    b = len(batch)
    return PairLogps(seq[:b], seq[b:], lengths[:b], lengths[b:], ref[0], ref[1], entropy, both.completion_mask)


# --------------------------------------------------------------------------------------------- the loss types
@dataclass
class PairwiseConfig(AlgoConfig):
    """The loss-type settings of DPO and Online DPO (their configs derive from this one).

    Attributes:
        loss_type: a link of :data:`prefzoo.objective.PAIRWISE_LOSSES`, or a list of them (a weighted sum).
        loss_weights: one weight per loss type (None: 1.0 each).
        label_smoothing: cDPO/rDPO/AOT: probability that a label is flipped, in [0, 0.5); exo_pair: EXO's eps > 0.
        ipo_average_log_ratio: ipo: each side's log-ratio averaged over its tokens (false: summed, Azar et al. eq. 17).
        discopop_tau: discopop: the temperature of its logistic/exponential blend (the paper's 0.05).
    """

    loss_type: Any = "sigmoid"
    loss_weights: Optional[list[float]] = None
    label_smoothing: float = 0.0
    ipo_average_log_ratio: bool = True
    discopop_tau: float = 0.05


#: old names of loss types -> the message that names the current one
RENAMED_LOSS_TYPES = {"aot_pair": "aot_pair was TRL 0.x's name for AOT on unpaired data: use algo.loss_type=aot_unpaired "
                                  "(algo.loss_type=aot is AOT on pairs)."}


def loss_types(cfg: PairwiseConfig) -> tuple[str, ...]:
    """``algo.loss_type`` as a tuple of names (one name, or the list of a weighted sum)."""
    return (cfg.loss_type,) if isinstance(cfg.loss_type, str) else tuple(cfg.loss_type)


def check_loss_types(cfg: PairwiseConfig) -> None:
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


def check_pairwise_settings(cfg: PairwiseConfig, objective: ObjectiveSettings, who: str) -> None:
    """The checks of :class:`PairwiseConfig` and beta > 0 (``who``: the plugin's name in the message).

    Raises:
        ConfigError: the first bad value, naming its key, the valid range and the usual value.
    """
    check_loss_types(cfg)
    if not 0 <= cfg.label_smoothing < 0.5:
        raise ConfigError(f"algo.label_smoothing={cfg.label_smoothing} must be in [0, 0.5).")
    if "exo_pair" in loss_types(cfg) and cfg.label_smoothing == 0:
        raise ConfigError("algo.loss_type=exo_pair needs algo.label_smoothing > 0 (EXO's eps enters as log eps); "
                          "EXO's authors use algo.label_smoothing=1e-3.")
    if not cfg.discopop_tau > 0:
        raise ConfigError(f"algo.discopop_tau={cfg.discopop_tau} must be > 0 (DiscoPOP's temperature; the paper's "
                          "0.05).")
    check_beta(objective, who, "beta scales the implicit reward; beta=0 has no optimum")


def _on_rows(scores: PairScores, kept: Tensor | None, link) -> Tensor:
    """``link(scores)`` (B,), computed on the pairs ``kept`` only (0 elsewhere, with no gradient) when given."""
    if kept is None or bool(kept.all()):
        return link(scores)
    if not bool(kept.any()):
        return scores.margin * 0.0  # a micro-batch of weight-0 pairs: zero loss, zero gradient, still a graph
    return torch.zeros_like(scores.margin).masked_scatter(kept, link(scores.select(kept)))


# ------------------------------------------------------------------------------------------------ the family body
class DirectPreference(Algorithm):
    """DPO's loss on a batch of pairs (see the module docstring); the body of DPO and Online DPO, not a plugin.

    A member gives its config (deriving from :class:`PairwiseConfig`), ``validate_settings`` (calling
    :func:`check_pairwise_settings`) and ``declare``; an online member also ``make_experience``, which returns a
    :class:`~prefzoo.types.PreferenceBatch` whose reference log-probs are set.
    """

    def __init__(self, cfg: PairwiseConfig, objective: ObjectiveSettings, sampling=None):
        super().__init__(cfg, objective, sampling)
        self.divergence = get_divergence(objective.divergence, alpha=objective.alpha)
        self.loss_types = loss_types(cfg)
        self.loss_weights = tuple(float(x) for x in cfg.loss_weights) if cfg.loss_weights is not None \
            else (1.0,) * len(self.loss_types)
        self.bco_shift = {"mean": 0.0, "rows": 0}  # bco_pair's running mean reward (DPO's module docstring)

    @property
    def temperature(self) -> float:
        """The temperature of the log-probs: the rollout's for an online member's own samples, else 1."""
        return self.sampling.temperature if self.declaration.online else 1.0

    @property
    def averages_log_ratio(self) -> bool:
        """The metrics' (and held-out rewards') view: averaged log-ratios under IPO alone, summed otherwise."""
        return self.loss_types == ("ipo",) and self.cfg.ipo_average_log_ratio

    def reference_logps(self, policy: Policy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Summed reference log-probs (B,) of chosen and rejected (precomputed if the batch carries them)."""
        return reference_pairs(policy, batch, self.temperature)

    def sides(self, policy: Policy, batch: PreferenceBatch, with_entropy: bool = False) -> PairLogps:
        """Both sides of the pairs, policy and reference, from one forward pass of the policy over the 2B rows."""
        return forward_pairs(policy, batch, self.temperature, reference=True, with_entropy=with_entropy)

    @staticmethod
    def ratios(sides: PairLogps, averaged: bool) -> tuple[Tensor, Tensor]:
        """log(pi/pi_ref) of chosen and rejected (B,) each: summed over the completion tokens, or averaged."""
        chosen = sides.chosen_logps - sides.ref_chosen_logps
        rejected = sides.rejected_logps - sides.ref_rejected_logps
        if averaged:
            return chosen / sides.chosen_length, rejected / sides.rejected_length
        return chosen, rejected

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

    def scores(self, sides: PairLogps, averaged: bool) -> PairScores:
        """What the links read (:class:`~prefzoo.objective.PairScores`), float64: each side's score
        s = beta (f'(pi/pi_ref) - f'(1)) -- the implicit reward, 0 at the reference (beta log(pi/pi_ref) under
        reverse KL, what the anchored links of APO, NCA, BCO and SPPO expect) -- in the summed or averaged view;
        beta times the policy's and the reference's log-prob margins (aot); the chosen's mean NLL (sft)."""
        chosen, rejected = self.rewards(*self.ratios(sides, averaged))
        at_reference = self.reward_at_reference()
        chosen, rejected = chosen - at_reference, rejected - at_reference
        return PairScores.from_sides(
            chosen, rejected,
            policy_margin=self.beta * (sides.chosen_logps - sides.rejected_logps).double(),
            reference_margin=self.beta * (sides.ref_chosen_logps - sides.ref_rejected_logps).double(),
            chosen_nll=-sides.chosen_mean.double())

    def loss(self, policy: Policy, batch: PreferenceBatch, step: StepContext = NO_STEP) -> LossOutput:
        online = self.declaration.online
        sides = self.sides(policy, batch, with_entropy=online)
        kept = None if batch.weights is None else batch.weights > 0
        views: dict[bool, PairScores] = {}

        def view(averaged: bool) -> PairScores:
            if averaged not in views:
                views[averaged] = self.scores(sides, averaged)
            return views[averaged]

        parts = {}
        for loss_type in self.loss_types:
            link = lambda s, t=loss_type: pairwise_loss(  # noqa: E731
                s, t, self.beta, self.cfg.label_smoothing, discopop_tau=self.cfg.discopop_tau,
                reward_shift=self.bco_shift["mean"])
            averaged = loss_type == "sigmoid_norm" or (loss_type == "ipo" and self.cfg.ipo_average_log_ratio)
            parts[loss_type] = _on_rows(view(averaged), kept, link)
        losses = sum(w * parts[t] for t, w in zip(self.loss_types, self.loss_weights)).float()
        if batch.weights is not None:
            losses = losses * batch.weights
        with torch.no_grad():
            tokens = self.pair_metrics(sides, view(self.averages_log_ratio), parts, kept)
            metrics = {}
            if "bco_pair" in parts:
                summed = view(False)
                metrics["bco/batch_reward"] = ((summed.chosen + summed.rejected) / 2).mean().item()
                metrics["bco/reward_shift"] = self.bco_shift["mean"]
            if online:
                kl = torch.cat([sides.chosen_logps - sides.ref_chosen_logps, sides.rejected_logps - sides.ref_rejected_logps])
                tokens["kl"] = (float(kl.sum()), float(len(kl)))
                tokens["entropy"] = (float(masked_sum(sides.entropy, sides.mask)), float(sides.mask.sum()))
        return LossOutput(losses, None, metrics, tokens)

    def pair_metrics(self, sides: PairLogps, s: PairScores, parts: dict[str, Tensor], kept: Tensor | None
                     ) -> dict[str, tuple[float, float]]:
        """The pair metrics (module docstring) as (sum, count) over the pairs ``kept`` (all when None)."""
        kept = torch.ones_like(sides.chosen_logps, dtype=torch.bool) if kept is None else kept
        n = float(kept.sum())
        total = lambda x: (float(x.double()[kept].sum()), n)  # noqa: E731
        chosen_ratio, rejected_ratio = self.ratios(sides, self.averages_log_ratio)
        out = {"rewards/chosen": total(self.beta * chosen_ratio), "rewards/rejected": total(self.beta * rejected_ratio),
               "rewards/margins": total(s.margin), "rewards/accuracies": total(s.margin > 0),
               "logps/chosen": total(sides.chosen_logps), "logps/rejected": total(sides.rejected_logps),
               "log_ratio/chosen": total(chosen_ratio), "log_ratio/rejected": total(rejected_ratio)}
        if self.objective.divergence != "reverse_kl":  # the link's value beta f'(u), as f-DPO defines it
            out["implicit_rewards/chosen"] = total(s.chosen + self.reward_at_reference())
            out["implicit_rewards/rejected"] = total(s.rejected + self.reward_at_reference())
        if len(parts) > 1:
            out.update({f"loss/{t}": total(part) for t, part in parts.items()})
        return out

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
        """Held-out ranking: the implicit rewards of chosen and rejected, Shape (B,) each (the metrics' view)."""
        sides = forward_pairs(policy, batch, self.temperature, reference=True)
        return self.rewards(*self.ratios(sides, self.averages_log_ratio))
