"""Pairwise preference losses: the links shared by DPO, SimPO, ORPO and the reward model.

Every pairwise method of the zoo scores the two completions of a pair, s_w = s(y_w) and s_l = s(y_l) (DPO: the
implicit rewards beta f'(pi/pi_ref), beta log(pi/pi_ref) under reverse KL; SimPO: beta/|y| log pi, with a target
margin; a reward model's scalar heads), and turns them into a per-pair loss with one of these links (a table of
small functions, :data:`PAIRWISE_LOSSES`). Most read only the margin m = s_w - s_l; the anchored ones read each
side, sorted ones the whole batch: they take a :class:`PairScores`. eps = ``label_smoothing``, tau =
``discopop_tau``, delta = ``reward_shift``; scores in score units (beta x nats for DPO), rho = s / beta.

=============  ===================================================================  ==================================
link           per-pair loss                                                        source
=============  ===================================================================  ==================================
sigmoid        -(1 - eps) log sigma(m) - eps log sigma(-m)                          Rafailov et al. 2023, eq. 7
                                                                                    (eps: cDPO, Mitchell 2023);
                                                                                    Ouyang et al. 2022, eq. 1
sigmoid_norm   sigmoid's link on the length-averaged scores (the caller averages    TRL 1.16 (loss_type
               each side's log-ratio over its tokens: m = beta (rho_w/|y_w| -       "sigmoid_norm")
               rho_l/|y_l|))
ipo            (m / beta - 1 / (2 beta))^2                                          Azar et al. 2023, eq. 17
hinge          max(0, 1 - m)                                                        SLiC, Zhao et al. 2023
robust         ((1 - eps) L(m) - eps L(-m)) / (1 - 2 eps),  L(m) = -log sigma(m)    rDPO, Chowdhury et al. 2024,
                                                                                    the de-biased loss (Sec. 3)
exo_pair       sigma(m) [log sigma(m) - log(1 - eps)]                               EXO, Ji et al. 2024, eq. 16
                 + sigma(-m) [log sigma(-m) - log eps]   (eps > 0)                  (K = 2)
nca_pair       -log sigma(s_w) - 1/2 log sigma(-s_w) - 1/2 log sigma(-s_l)          NCA, Chen et al. 2024 (K = 2)
sppo_hard      (rho_w - 1/(2 beta))^2 + (rho_l + 1/(2 beta))^2                      SPPO, Wu et al. 2024, eq. 4.7
                                                                                    with P(y_w wins) = 1, P(y_l) = 0
apo_zero       1 - sigma(s_w) + sigma(s_l)                                          APO, D'Oosterlinck et al. 2024,
                                                                                    eq. 7
apo_down       sigma(s_w) + 1 - sigma(s_w - s_l)                                    idem, eq. 8
bco_pair       -log sigma(s_w - delta) - log sigma(-(s_l - delta))                  BCO, Jung et al. 2024 (delta:
                                                                                    the running mean reward)
discopop       (1 - sigma(m / tau)) log(1 + e^-m) + sigma(m / tau) e^-m             DiscoPOP (LRML), Chris Lu et
                                                                                    al. 2024, eq. 5
aot            -(1 - eps) log sigma(d_i) - eps log sigma(-d_i),                     AOT paired, Melnyk et al. 2024
               d = sort(policy margins) - sort(reference margins) over the batch
aot_unpaired   the same with d = sort(s_w) - sort(s_l) over the batch               AOT unpaired, idem
sft            the chosen completion's mean negative log-likelihood                 NLL on chosen (TRL's ``sft``)
=============  ===================================================================  ==================================

Equation numbers: EXO 16, SPPO 4.7, APO 7/8 and DiscoPOP 5 are the ones TRL's code cites; ORPO's 6-7
(:mod:`prefzoo.objective.odds`) the paper's. rDPO, NCA, BCO and AOT are cited by section and name only: no copy
of those papers was at hand to check an equation number (the formulas are the ones their authors' losses and
TRL implement).

How this departs from TRL 1.16 (its DPOTrainer, read not run): the formulas are TRL's; ``exo_pair`` refuses eps = 0
(log 0) instead of taking eps = 1e-3 silently; ``bco_pair`` keeps the BCO paper's reward shift delta (TRL 1.16
dropped it: delta = 0 there); ``discopop`` computes sigma(m/tau) e^-m as exp(log sigma(m/tau) - m), finite for
any margin; ``sft`` takes each chosen completion's token mean (TRL: the token mean over the whole batch's chosen
tokens; equal when the completions have one length). TRL 0.x named ``aot_unpaired`` ``aot_pair``.

The sorted links (``aot``, ``aot_unpaired``) pair the i-th smallest policy margin with the i-th smallest reference
margin of the batch they are given: their value depends on which pairs share a batch (as TRL's, per device).

Shapes: every score (B,) -> loss (B,), B = pairs. Units: nats (the log sigmoid links), squared score units (ipo,
sppo_hard), probability units (apo_*), margin units (hinge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .errors import ObjectiveError, check_choice, check_number, check_same_shape, check_tensor

__all__ = ["PAIRWISE_LOSSES", "PairScores", "pairwise_loss", "bradley_terry_loss"]


@dataclass(frozen=True)
class PairScores:
    """What the pairwise links read of B preference pairs.

    Attributes:
        margin: s(y_w) - s(y_l), plus any offset the method adds (SimPO's -gamma).
        chosen / rejected: s(y_w) and s(y_l) separately; None when only the margin is known (the links that
            read a side then refuse).
        policy_margin / reference_margin: beta (log pi(y_w) - log pi(y_l)) and beta (log pi_ref(y_w) -
            log pi_ref(y_l)), which ``aot`` sorts separately; None otherwise.
        chosen_nll: the chosen completion's mean negative log-likelihood (``sft``); None otherwise.

    Shape: every field (B,), B = pairs.
    Units: score units (DPO: beta x nats); ``chosen_nll`` nats per token.

    Raises:
        ObjectiveError: (:meth:`from_sides`) a field that is not a tensor of the margin's shape.

    Source: the scores of Rafailov et al. 2023, eq. 7 (s = beta log pi/pi_ref); the per-side links of the table
    in the module docstring.
    """

    margin: torch.Tensor
    chosen: torch.Tensor | None = None
    rejected: torch.Tensor | None = None
    policy_margin: torch.Tensor | None = None
    reference_margin: torch.Tensor | None = None
    chosen_nll: torch.Tensor | None = None

    @classmethod
    def from_sides(cls, chosen: torch.Tensor, rejected: torch.Tensor, **extra: torch.Tensor | None) -> "PairScores":
        """Scores from each side's score (margin = chosen - rejected) and the optional fields in ``extra``."""
        check_same_shape("chosen", chosen, "rejected", rejected)
        for name, t in extra.items():
            if t is not None:
                check_same_shape("chosen", chosen, name, t)
        return cls(chosen - rejected, chosen, rejected, **extra)

    def select(self, rows: torch.Tensor) -> "PairScores":
        """The pairs ``rows`` (a bool mask or long indices, Shape (B,) or (K,)) of every field that is set."""
        return PairScores(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                             for f in fields(self)})


class _Params(NamedTuple):
    beta: float
    eps: float  # label_smoothing
    tau: float  # discopop_tau
    delta: float  # reward_shift


def _smoothed(m: torch.Tensor, eps: float) -> torch.Tensor:
    if not eps:  # (0 * logsigmoid(-m) would be NaN for an infinite margin)
        return -F.logsigmoid(m)
    return -(1 - eps) * F.logsigmoid(m) - eps * F.logsigmoid(-m)


def _sigmoid(s: PairScores, p: _Params) -> torch.Tensor:
    return _smoothed(s.margin, p.eps)


def _ipo(s: PairScores, p: _Params) -> torch.Tensor:
    return (s.margin / p.beta - 1 / (2 * p.beta)) ** 2


def _hinge(s: PairScores, p: _Params) -> torch.Tensor:
    return torch.relu(1 - s.margin)


def _robust(s: PairScores, p: _Params) -> torch.Tensor:
    if not p.eps:
        return -F.logsigmoid(s.margin)
    return (-(1 - p.eps) * F.logsigmoid(s.margin) + p.eps * F.logsigmoid(-s.margin)) / (1 - 2 * p.eps)


def _exo_pair(s: PairScores, p: _Params) -> torch.Tensor:
    m = s.margin
    return (torch.sigmoid(m) * (F.logsigmoid(m) - math.log1p(-p.eps))
            + torch.sigmoid(-m) * (F.logsigmoid(-m) - math.log(p.eps)))


def _nca_pair(s: PairScores, p: _Params) -> torch.Tensor:
    return -F.logsigmoid(s.chosen) - 0.5 * F.logsigmoid(-s.chosen) - 0.5 * F.logsigmoid(-s.rejected)


def _sppo_hard(s: PairScores, p: _Params) -> torch.Tensor:
    return ((s.chosen - 0.5) / p.beta) ** 2 + ((s.rejected + 0.5) / p.beta) ** 2


def _apo_zero(s: PairScores, p: _Params) -> torch.Tensor:
    return 1 - torch.sigmoid(s.chosen) + torch.sigmoid(s.rejected)


def _apo_down(s: PairScores, p: _Params) -> torch.Tensor:
    return torch.sigmoid(s.chosen) + 1 - torch.sigmoid(s.chosen - s.rejected)


def _bco_pair(s: PairScores, p: _Params) -> torch.Tensor:
    return -F.logsigmoid(s.chosen - p.delta) - F.logsigmoid(-(s.rejected - p.delta))


def _discopop(s: PairScores, p: _Params) -> torch.Tensor:
    m = s.margin
    mix = torch.sigmoid(m / p.tau)
    return (1 - mix) * F.softplus(-m) + torch.exp(F.logsigmoid(m / p.tau) - m)


def _sorted_gap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.sort(a, dim=0).values - torch.sort(b, dim=0).values


def _aot(s: PairScores, p: _Params) -> torch.Tensor:
    return _smoothed(_sorted_gap(s.policy_margin, s.reference_margin), p.eps)


def _aot_unpaired(s: PairScores, p: _Params) -> torch.Tensor:
    return _smoothed(_sorted_gap(s.chosen, s.rejected), p.eps)


def _sft(s: PairScores, p: _Params) -> torch.Tensor:
    return s.chosen_nll


#: name -> ``f(scores, params) -> per-pair loss`` (formulas and sources in the module docstring)
PAIRWISE_LOSSES: dict[str, Callable[[PairScores, _Params], torch.Tensor]] = {
    "sigmoid": _sigmoid, "ipo": _ipo, "hinge": _hinge, "robust": _robust, "exo_pair": _exo_pair,
    "nca_pair": _nca_pair, "sppo_hard": _sppo_hard, "apo_zero": _apo_zero, "apo_down": _apo_down,
    "bco_pair": _bco_pair, "discopop": _discopop, "aot": _aot, "aot_unpaired": _aot_unpaired, "sft": _sft,
    "sigmoid_norm": _sigmoid}

#: the :class:`PairScores` fields each link reads besides the margin
READS: dict[str, tuple[str, ...]] = {
    "nca_pair": ("chosen", "rejected"), "sppo_hard": ("chosen", "rejected"), "apo_zero": ("chosen", "rejected"),
    "apo_down": ("chosen", "rejected"), "bco_pair": ("chosen", "rejected"),
    "aot": ("policy_margin", "reference_margin"), "aot_unpaired": ("chosen", "rejected"), "sft": ("chosen_nll",)}


def pairwise_loss(scores: PairScores | torch.Tensor, loss_type: str = "sigmoid", beta: float = 1.0,
                  label_smoothing: float = 0.0, *, discopop_tau: float = 0.05,
                  reward_shift: float = 0.0) -> torch.Tensor:
    """Per-pair loss of one link of :data:`PAIRWISE_LOSSES` (formulas in the module docstring).

    Args:
        scores: the pairs' :class:`PairScores`, or a bare margin tensor s(chosen) - s(rejected) (enough for the
            margin links: sigmoid, ipo, hinge, robust, exo_pair, discopop).
        loss_type: a key of :data:`PAIRWISE_LOSSES`.
        beta: the divergence coefficient; read by ``ipo`` and ``sppo_hard`` (rho = s / beta), must be > 0 there.
        label_smoothing: eps in [0, 0.5): conservative DPO (``sigmoid``), the flip rate of ``robust``, the
            smoothing of ``aot``/``aot_unpaired``, and EXO's eps (``exo_pair``: must be > 0).
        discopop_tau: DiscoPOP's temperature tau > 0 (the paper's 0.05).
        reward_shift: BCO's delta (score units), subtracted from both sides' scores.

    Returns:
        Shape (B,) losses, in the scores' dtype.

    Shape: scores (B,) each -> (B,); B = pairs.
    Units: nats (log sigmoid links), squared score units (ipo, sppo_hard), probabilities (apo_*), margin
    units (hinge).

    Raises:
        ObjectiveError: unknown loss type (valid ones listed); scores not a tensor / PairScores, or a link
            that reads a side (or the batch's reference margins, or the chosen NLL) given only a margin;
            beta <= 0 for ipo/sppo_hard; label_smoothing outside [0, 0.5), or 0 for exo_pair; tau <= 0.

    Source: Bradley & Terry 1952; Rafailov et al. 2023, eq. 7; Mitchell 2023 (cDPO); Azar et al. 2023, eq. 17
    (IPO); Zhao et al. 2023 (SLiC hinge); the table of the module docstring for the others.
    """
    if not isinstance(scores, PairScores):
        check_tensor("scores", scores)
        scores = PairScores(scores)
    check_choice("loss_type", loss_type, tuple(PAIRWISE_LOSSES))
    missing = [f for f in READS.get(loss_type, ()) if getattr(scores, f) is None]
    if missing:
        raise ObjectiveError(f"loss_type {loss_type!r} reads the {' and '.join(missing)} of each pair, not only the "
                             "margin: pass a PairScores with them (PairScores.from_sides(chosen, rejected, ...))")
    for f in fields(scores):
        value = getattr(scores, f.name)
        if f.name != "margin" and value is not None:
            check_same_shape("margin", scores.margin, f.name, value)
    eps = check_number("label_smoothing", label_smoothing, low=0.0, high=0.5, strict_high=True)
    if loss_type == "exo_pair" and eps == 0:
        raise ObjectiveError("exo_pair needs label_smoothing > 0 (EXO's eps: log eps enters the loss); "
                             "EXO's authors use 1e-3")
    if loss_type in ("ipo", "sppo_hard"):
        beta = check_number("beta", beta, low=0.0, strict_low=True,
                            hint=f"{loss_type}'s target margin is 1/(2 beta)")
    tau = check_number("discopop_tau", discopop_tau, low=0.0, strict_low=True)
    delta = check_number("reward_shift", reward_shift)
    return PAIRWISE_LOSSES[loss_type](scores, _Params(beta, eps, tau, delta))


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the preference under Bradley-Terry: -log sigma(r_w - r_l), computed stably.

    Shape: chosen_rewards (B,), rejected_rewards (B,) -> (B,); B = pairs.
    Units: nats.

    Raises:
        ObjectiveError: the shapes differ.

    Source: Bradley & Terry 1952; Ouyang et al. 2022, eq. 1.
    """
    check_same_shape("chosen_rewards", chosen_rewards, "rejected_rewards", rejected_rewards)
    return pairwise_loss(chosen_rewards - rejected_rewards, "sigmoid")
