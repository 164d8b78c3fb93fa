"""KTO's Kahneman-Tversky value of a completion, relative to a reference point (Ethayarajh et al. 2024).

With the implicit reward r = log pi(y|x) - log pi_ref(y|x) (summed over the completion) and a reference point
z0 (KTO: an estimate of KL(pi || pi_ref), held fixed), the value of a labelled completion is (sec. 4.1, eq. 8)

    v(x, y) = lambda_D sigma(beta (r - z0))    y desirable
              lambda_U sigma(beta (z0 - r))    y undesirable

and the loss of the row is lambda_y - v(x, y) (lambda_y = lambda_D or lambda_U): 0 at best, lambda_y at worst,
lambda_y / 2 where r = z0. sigma saturates both ways, so a row far on its good side has no gradient left, and
neither has one far on its bad side (the paper's "ignores noisy examples").
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import ObjectiveError

__all__ = ["kto_loss"]


def kto_loss(log_ratio: Tensor, desirable: Tensor, z0: float | Tensor, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> Tensor:
    """lambda_y - v(x, y) of each row (the module docstring), with gradients through ``log_ratio`` only.

    Shape: log_ratio (B,) float (summed log pi - log pi_ref per row, nats), desirable (B,) bool -> (B,).
    z0: the reference point in nats (a float or a 0-d tensor; it is detached here).

    Units: log_ratio and z0 in nats per sequence; beta in 1/nats; the loss is dimensionless (in units of the
    weights lambda_D / lambda_U), in [0, max(lambda_D, lambda_U)].

    Raises:
        ObjectiveError: shapes differ, ``desirable`` is not bool, or beta or a weight is not > 0.

    Source: Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", sec. 4.1 (eq. 8).
    """
    if log_ratio.ndim != 1 or desirable.shape != log_ratio.shape:
        raise ObjectiveError(f"kto_loss: log_ratio {tuple(log_ratio.shape)} and desirable {tuple(desirable.shape)} "
                             "must both be (B,)")
    if desirable.dtype != torch.bool:
        raise ObjectiveError(f"kto_loss: desirable must be a bool tensor, got {desirable.dtype}")
    if not (beta > 0 and desirable_weight > 0 and undesirable_weight > 0):
        raise ObjectiveError(f"kto_loss: beta={beta}, desirable_weight={desirable_weight} and undesirable_weight="
                             f"{undesirable_weight} must all be > 0")
    z0 = torch.as_tensor(z0, dtype=log_ratio.dtype, device=log_ratio.device).detach()
    gain = beta * (log_ratio - z0)  # > 0: the completion beats the reference point
    sign = torch.where(desirable, 1.0, -1.0).to(log_ratio.dtype)
    weight = torch.where(desirable, desirable_weight, undesirable_weight).to(log_ratio.dtype)
    return weight * (1.0 - torch.sigmoid(sign * gain))
