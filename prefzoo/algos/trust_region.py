"""The surrogates a member with PPO's per-token clip can use instead (``algo.policy_loss``: GRPO, RLOO, REINFORCE++,
the teacher's log-ratio reward): their settings, their checks, and the table that picks the per-token loss
(:func:`trust_region_token_loss`); :class:`TokenLoss` is what a member's ``token_loss`` returns."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import Tensor

from prefzoo.algos.online_settings import OnlineConfig
from prefzoo.errors import ConfigError
from prefzoo.objective import TRUST_REGION_LOSSES, clipped_surrogate_loss, dppo_loss, dro_loss, masked_sum, sapo_loss
from prefzoo.types import Experience

__all__ = ["DPPO_DELTA", "TrustRegionConfig", "check_trust_region", "trust_region_token_loss", "TokenLoss"]

log = logging.getLogger(__name__)


@dataclass
class TokenLoss:
    """What a member's ``token_loss`` returns.

    Attributes:
        per_token: Shape (B, T), the loss of each loss token (0 elsewhere), with gradients.
        clipped: Shape (B, T) bool, the tokens where the clip was active (``clip_fraction``).
        metrics: extra per-row metrics (e.g. GSPO's ``sequence_clip_fraction``).
        tokens: extra per-token (sum, count) metrics; a name here replaces the shared one (GSPO's ``ratio_mean``).
    """

    per_token: Tensor
    clipped: Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, tuple[float, float]] = field(default_factory=dict)


#: ``algo.dppo_delta``'s default per divergence: the DPPO paper's recipe (verl's example: TV 0.15, binary KL 0.05)
DPPO_DELTA = {"dppo_tv": 0.15, "dppo_kl": 0.05}


@dataclass
class TrustRegionConfig(OnlineConfig):
    """The family's config with the settings of the surrogates a member with PPO's per-token clip can use instead
    (``algo.policy_loss``: GRPO, RLOO, REINFORCE++, ``algo=teacher_reward``), :func:`trust_region_token_loss`. A
    subclass of :class:`~prefzoo.algos.online_settings.OnlineConfig`, so a member that also has GRPO's advantages is an
    ordinary diamond, ``GRPOConfig(GroupRelativeConfig, TrustRegionConfig)``: the shared fields come first in the saved
    config (``name`` first), and the left base's defaults win, as Python's attribute lookup would have it.

    Attributes:
        dppo_delta: DPPO's divergence threshold (both signs); None: :data:`DPPO_DELTA` of the chosen divergence.
        dppo_ratio_cap: DPPO's truncation of the (detached) ratio that weighs a kept token.
        sapo_temperature_pos / sapo_temperature_neg: SAPO's gate temperatures for A > 0 / A < 0.
        dro_beta: DRO's quadratic penalty on log pi - log pi_old (not ``objective.beta``, the KL to pi_ref).
    """

    dppo_delta: float | None = None
    dppo_ratio_cap: float = 1e4
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    dro_beta: float = 0.05


def check_trust_region(cfg, losses: tuple[str, ...]) -> None:
    """``algo.policy_loss`` one of ``losses`` (the member's own and :data:`prefzoo.objective.TRUST_REGION_LOSSES`), and
    the chosen surrogate's settings in range. ``clip`` is refused with the spelling prefzoo uses (``clipped``).

    Raises:
        ConfigError: naming the key and its valid values.
    """
    name = cfg.policy_loss
    if not name.startswith("dppo") and (cfg.dppo_delta is not None
                                         or cfg.dppo_ratio_cap != TrustRegionConfig.dppo_ratio_cap):
        log.warning("algo.dppo_delta / algo.dppo_ratio_cap are DPPO's (algo.policy_loss=dppo_tv|dppo_kl), and "
                    "algo.policy_loss=%s: they are ignored; drop them.", name)
    if name == "clip":
        raise ConfigError("algo.policy_loss=clip: prefzoo spells PPO's ratio clip 'clipped' (as RLOO's and TRL's "
                          "names for it); write algo.policy_loss=clipped.")
    if name not in losses:
        raise ConfigError(f"algo.policy_loss={name!r}; choose one of {', '.join(losses)}.")
    if name.startswith("dppo") and ((cfg.dppo_delta is not None and not cfg.dppo_delta > 0) or not cfg.dppo_ratio_cap > 0):
        raise ConfigError(f"algo.dppo_delta={cfg.dppo_delta} and algo.dppo_ratio_cap={cfg.dppo_ratio_cap} must be > 0 "
                          f"(null: {DPPO_DELTA[name]}, the paper's for {name}).")
    if name == "sapo" and not (cfg.sapo_temperature_pos > 0 and cfg.sapo_temperature_neg > 0):
        raise ConfigError(f"algo.sapo_temperature_pos={cfg.sapo_temperature_pos} and algo.sapo_temperature_neg="
                          f"{cfg.sapo_temperature_neg} must be > 0 (the paper's: 1.0 and 1.05).")
    if name == "dro" and not cfg.dro_beta >= 0:
        raise ConfigError(f"algo.dro_beta={cfg.dro_beta} must be >= 0 (Tinker's example: 0.05).")


def trust_region_token_loss(cfg, logps: Tensor, old_logps: Tensor, batch: Experience) -> TokenLoss:
    """The per-token loss ``cfg.policy_loss`` names: ``clipped`` (PPO's clip, :func:`prefzoo.objective.clipped_surrogate_loss`
    with ``clip_eps_low`` / ``clip_eps_high``) or one of :data:`prefzoo.objective.TRUST_REGION_LOSSES`: ``dppo_tv`` /
    ``dppo_kl`` (:func:`prefzoo.objective.dppo_loss`; ``clip_fraction`` = the tokens its mask dropped), ``sapo``
    (:func:`prefzoo.objective.sapo_loss`; ``clip_fraction`` = tokens whose gate weight fell below 1/2, and
    ``gate_weight_mean``), ``dro`` (:func:`prefzoo.objective.dro_loss`; ``clip_fraction`` = tokens past the point where
    the penalty outweighs the advantage). All equal REINFORCE's gradient on a rollout's first pass (ratio 1), so with
    one optimizer step per rollout they differ from ``clipped`` only in the loss's logged value; they part from it on
    the later mini-batches and epochs. Shapes: (B, T)."""
    mask, a, name = batch.loss_mask, batch.advantages, cfg.policy_loss
    if name == "clipped":
        return TokenLoss(*clipped_surrogate_loss(logps, old_logps, a, mask, cfg.clip_eps_low, cfg.clip_eps_high))
    if name in ("dppo_tv", "dppo_kl"):
        delta = DPPO_DELTA[name] if cfg.dppo_delta is None else cfg.dppo_delta
        return TokenLoss(*dppo_loss(logps, old_logps, a, mask, name[5:], delta, delta, cfg.dppo_ratio_cap))
    if name == "sapo":
        per_token, weight, low = sapo_loss(logps, old_logps, a, mask, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        return TokenLoss(per_token, low, tokens={"gate_weight_mean": (float(masked_sum(weight, mask)), float(mask.sum()))})
    if name == "dro":
        return TokenLoss(*dro_loss(logps, old_logps, a, mask, cfg.dro_beta))
    raise ConfigError(f"algo.policy_loss={name!r}; choose clipped or one of {', '.join(TRUST_REGION_LOSSES)}.")
