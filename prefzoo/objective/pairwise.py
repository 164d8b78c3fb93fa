"""Pairwise preference losses on a margin: the links shared by DPO, SimPO and the reward model.

Every pairwise method of the zoo scores the two completions of a pair, forms a margin
m = s(y_w) - s(y_l) (an implicit reward difference for DPO, a length-normalised one minus a target
margin for SimPO, a reward-model difference for Bradley-Terry reward modelling), and turns it into a
loss with one of these links (a table of small functions, :data:`PAIRWISE_LOSSES`):

    sigmoid   -(1 - eps) log sigma(m) - eps log sigma(-m)       Bradley-Terry negative log-likelihood
              (eps = label_smoothing: conservative DPO, Mitchell 2023; eps = 0: Rafailov et al. 2023,
              eq. 7; Ouyang et al. 2022, eq. 1)
    ipo       (m / beta - 1 / (2 beta))^2                        Azar et al. 2023, eq. 17: the log-ratio
              difference h = m / beta is regressed to 1 / (2 tau), tau = beta
    hinge     max(0, 1 - m)                                      SLiC, Zhao et al. 2023

Shapes: margin (B,) -> loss (B,), B = pairs. Units: nats (sigmoid), squared nats (ipo), margin units (hinge).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .errors import check_choice, check_number, check_tensor

__all__ = ["PAIRWISE_LOSSES", "pairwise_loss", "bradley_terry_loss"]


def _sigmoid(margin: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    if not label_smoothing:  # (0 * logsigmoid(-margin) would be NaN for an infinite margin)
        return -F.logsigmoid(margin)
    return -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)


def _ipo(margin: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return (margin / beta - 1 / (2 * beta)) ** 2


def _hinge(margin: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return torch.relu(1 - margin)


#: name -> ``f(margin, beta, label_smoothing) -> per-pair loss``
PAIRWISE_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": _sigmoid, "ipo": _ipo, "hinge": _hinge}


def pairwise_loss(margin: torch.Tensor, loss_type: str = "sigmoid", beta: float = 1.0,
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-pair loss from the margin between the chosen and the rejected completion's scores.

    Args:
        margin: Shape (B,), s(chosen) - s(rejected) (for DPO: beta * the log-ratio difference, nats).
        loss_type: a key of :data:`PAIRWISE_LOSSES` (formulas in the module docstring).
        beta: the divergence coefficient; used by ``ipo`` only (its target 1/(2 beta)), must be > 0 there.
        label_smoothing: eps of conservative DPO, in [0, 0.5); ``sigmoid`` only.

    Returns:
        Shape (B,) losses, in the margin's dtype.

    Shape: margin (B,) -> (B,); B = pairs.
    Units: nats (sigmoid), squared nats (ipo), margin units (hinge).

    Raises:
        ObjectiveError: unknown loss type (valid ones listed); margin not a tensor; beta <= 0 for ipo;
            label_smoothing outside [0, 0.5).

    Source: Bradley & Terry 1952; Rafailov et al. 2023, eq. 7; Mitchell 2023 (cDPO); Azar et al. 2023, eq. 17
    (IPO); Zhao et al. 2023 (SLiC hinge).
    """
    check_tensor("margin", margin)
    check_choice("loss_type", loss_type, tuple(PAIRWISE_LOSSES))
    label_smoothing = check_number("label_smoothing", label_smoothing, low=0.0, high=0.5, strict_high=True)
    if loss_type == "ipo":
        beta = check_number("beta", beta, low=0.0, strict_low=True, hint="IPO's target margin is 1/(2 beta)")
    return PAIRWISE_LOSSES[loss_type](margin, beta, label_smoothing)


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the preference under Bradley-Terry: -log sigma(r_w - r_l), computed stably.

    Shape: chosen_rewards (B,), rejected_rewards (B,) -> (B,); B = pairs.
    Units: nats.

    Raises:
        ObjectiveError: the shapes differ.

    Source: Bradley & Terry 1952; Ouyang et al. 2022, eq. 1.
    """
    from .errors import check_same_shape

    check_same_shape("chosen_rewards", chosen_rewards, "rejected_rewards", rejected_rewards)
    return pairwise_loss(chosen_rewards - rejected_rewards, "sigmoid")
