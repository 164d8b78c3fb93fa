"""The surrogates a member with PPO's per-token clip can use instead (``algo.policy_loss``: GRPO, RLOO, REINFORCE++,
the teacher's log-ratio reward): their settings, their checks, and the table that picks the per-token loss
(:func:`trust_region_token_loss`); :class:`TokenLoss` is what a member's ``token_loss`` returns."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import Tensor

from prefzoo.algos.online_settings import OnlineConfig
from prefzoo.errors import ConfigError
from prefzoo.objective import (TRUST_REGION_LOSSES, clipped_surrogate_loss, dppo_loss, dro_loss, masked_sum, sapo_loss,
                               vespo_loss)
from prefzoo.types import Experience

log = logging.getLogger(__name__)

__all__ = ["DPPO_DELTA", "TrustRegionConfig", "check_trust_region", "trust_region_token_loss", "takes_is_weights",
           "TokenLoss"]



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
        clip_delta: ``policy_loss=clipped``'s two-sided clip (INTELLECT-2's delta, TRL 1.16's ``delta``): the unclipped
            branch's ratio capped at delta, which bounds the loss of a negative-advantage token; None: PPO's clip.
            Must exceed 1 + ``clip_eps_high`` (the report's recommendation; INTELLECT-2 used 4).
        dppo_delta: DPPO's divergence threshold (both signs); None: :data:`DPPO_DELTA` of the chosen divergence.
        dppo_delta_low / dppo_delta_high: DPPO's threshold for A < 0 / A > 0 alone (verl's ``clip_ratio_low`` /
            ``clip_ratio_high`` under its ``dppo_*`` loss modes); None: ``dppo_delta``'s.
        dppo_ratio_cap: DPPO's truncation of the (detached) ratio that weighs a kept token.
        sapo_temperature_pos / sapo_temperature_neg: SAPO's gate temperatures for A > 0 / A < 0.
        dro_beta: DRO's quadratic penalty on log pi - log pi_old (not ``objective.beta``, the KL to pi_ref).
        vespo_k_pos / vespo_lambda_pos / vespo_k_neg / vespo_lambda_neg: VESPO's kernel w^k e^{lambda (1 - w)} for
            A >= 0 / A < 0 (the paper's and TRL's 2, 3 / 3, 2).
    """

    clip_delta: float | None = None
    dppo_delta: float | None = None
    dppo_delta_low: float | None = None
    dppo_delta_high: float | None = None
    dppo_ratio_cap: float = 1e4
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    dro_beta: float = 0.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


#: the settings of each surrogate: set away from their defaults with another ``algo.policy_loss`` they are ignored
SETTINGS_OF = {"clipped": ("clip_delta",),
               "dppo": ("dppo_delta", "dppo_delta_low", "dppo_delta_high", "dppo_ratio_cap"),
               "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"), "dro": ("dro_beta",),
               "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}


def check_trust_region(cfg, losses: tuple[str, ...]) -> None:
    """``algo.policy_loss`` one of ``losses`` (the member's own and :data:`prefzoo.objective.TRUST_REGION_LOSSES`), and
    the chosen surrogate's settings in range; another surrogate's settings moved from their defaults are ignored, with
    a warning. ``clip`` is refused with the spelling prefzoo uses (``clipped``).

    Raises:
        ConfigError: naming the key and its valid values.
    """
    name = cfg.policy_loss
    if name == "clip":
        raise ConfigError("algo.policy_loss=clip: prefzoo spells PPO's ratio clip 'clipped' (as RLOO's and TRL's "
                          "names for it); write algo.policy_loss=clipped.")
    if name not in losses:
        raise ConfigError(f"algo.policy_loss={name!r}; choose one of {', '.join(losses)}.")
    family = "dppo" if name.startswith("dppo") else name
    for owner, keys in SETTINGS_OF.items():
        moved = [f"algo.{k}={getattr(cfg, k)}" for k in keys
                 if owner != family and getattr(cfg, k) != getattr(TrustRegionConfig, k)]
        if moved:
            log.warning("%s: %s's setting%s, and algo.policy_loss=%s: ignored; drop %s or set algo.policy_loss=%s.",
                        ", ".join(moved), owner, "" if len(moved) == 1 else "s", name,
                        "it" if len(moved) == 1 else "them", "dppo_tv|dppo_kl" if owner == "dppo" else owner)
    if name == "clipped" and cfg.clip_delta is not None and not cfg.clip_delta > 1 + cfg.clip_eps_high:
        raise ConfigError(f"algo.clip_delta={cfg.clip_delta} must exceed 1 + algo.clip_eps_high = "
                          f"{1 + cfg.clip_eps_high:g} (the cap of the unclipped ratio for A < 0; INTELLECT-2 used 4), "
                          "or be null (PPO's clip).")
    if family == "dppo":
        deltas = {k: getattr(cfg, k) for k in ("dppo_delta", "dppo_delta_low", "dppo_delta_high")}
        bad = [f"algo.{k}={v}" for k, v in deltas.items() if v is not None and not v > 0]
        if bad or not cfg.dppo_ratio_cap > 0:
            raise ConfigError(f"{', '.join(bad) or f'algo.dppo_ratio_cap={cfg.dppo_ratio_cap}'} must be > 0 (null: "
                              f"{DPPO_DELTA[name]}, the paper's for {name}).")
    if name == "sapo" and not (cfg.sapo_temperature_pos > 0 and cfg.sapo_temperature_neg > 0):
        raise ConfigError(f"algo.sapo_temperature_pos={cfg.sapo_temperature_pos} and algo.sapo_temperature_neg="
                          f"{cfg.sapo_temperature_neg} must be > 0 (the paper's: 1.0 and 1.05).")
    if name == "dro" and not cfg.dro_beta >= 0:
        raise ConfigError(f"algo.dro_beta={cfg.dro_beta} must be >= 0 (Tinker's example: 0.05).")
    if name == "vespo" and not (cfg.vespo_k_pos >= 0 and cfg.vespo_k_neg >= 0 and cfg.vespo_lambda_pos > 0
                                and cfg.vespo_lambda_neg > 0):
        raise ConfigError(f"algo.vespo_k_pos={cfg.vespo_k_pos}, algo.vespo_k_neg={cfg.vespo_k_neg} must be >= 0 and "
                          f"algo.vespo_lambda_pos={cfg.vespo_lambda_pos}, algo.vespo_lambda_neg={cfg.vespo_lambda_neg} "
                          "> 0 (the paper's: k 2 / 3, lambda 3 / 2).")


def dppo_deltas(cfg) -> tuple[float, float]:
    """DPPO's (delta_low, delta_high): each side's own key, else ``algo.dppo_delta``, else :data:`DPPO_DELTA`."""
    both = DPPO_DELTA[cfg.policy_loss] if cfg.dppo_delta is None else cfg.dppo_delta
    return (both if cfg.dppo_delta_low is None else cfg.dppo_delta_low,
            both if cfg.dppo_delta_high is None else cfg.dppo_delta_high)


def takes_is_weights(cfg) -> bool:
    """Whether ``algo.policy_loss`` weighs the sampler correction's importance weights itself (VESPO folds them into
    its sequence weight), so the family must not also multiply the advantages by them."""
    return cfg.policy_loss == "vespo"


def trust_region_token_loss(cfg, logps: Tensor, old_logps: Tensor, batch: Experience) -> TokenLoss:
    """The per-token loss ``cfg.policy_loss`` names: ``clipped`` (PPO's clip, :func:`prefzoo.objective.clipped_surrogate_loss`
    with ``clip_eps_low`` / ``clip_eps_high``) or one of :data:`prefzoo.objective.TRUST_REGION_LOSSES`: ``dppo_tv`` /
    ``dppo_kl`` (:func:`prefzoo.objective.dppo_loss`; ``clip_fraction`` = the tokens its mask dropped), ``sapo``
    (:func:`prefzoo.objective.sapo_loss`; ``clip_fraction`` = tokens whose gate weight fell below 1/2, and
    ``gate_weight_mean``), ``dro`` (:func:`prefzoo.objective.dro_loss`; ``clip_fraction`` = tokens past the point where
    the penalty outweighs the advantage), ``vespo`` (:func:`prefzoo.objective.vespo_loss` with the sampler correction's
    weights folded into w when the rollout has them, ``batch.is_weights``; ``clip_fraction`` = tokens whose kernel fell
    below 1/2, and ``vespo_phi_mean``). All equal REINFORCE's gradient on a rollout's first pass (ratio 1), so with
    one optimizer step per rollout they differ from ``clipped`` only in the loss's logged value; they part from it on
    the later mini-batches and epochs. Shapes: (B, T)."""
    mask, a, name = batch.loss_mask, batch.advantages, cfg.policy_loss
    if name == "clipped":
        return TokenLoss(*clipped_surrogate_loss(logps, old_logps, a, mask, cfg.clip_eps_low, cfg.clip_eps_high,
                                                 cfg.clip_delta))
    if name in ("dppo_tv", "dppo_kl"):
        return TokenLoss(*dppo_loss(logps, old_logps, a, mask, name[5:], *dppo_deltas(cfg), cfg.dppo_ratio_cap))
    if name == "sapo":
        per_token, weight, low = sapo_loss(logps, old_logps, a, mask, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        return TokenLoss(per_token, low, tokens={"gate_weight_mean": (float(masked_sum(weight, mask)), float(mask.sum()))})
    if name == "dro":
        return TokenLoss(*dro_loss(logps, old_logps, a, mask, cfg.dro_beta))
    if name == "vespo":
        per_token, phi, low = vespo_loss(logps, old_logps, a, mask, cfg.vespo_k_pos, cfg.vespo_lambda_pos,
                                         cfg.vespo_k_neg, cfg.vespo_lambda_neg, batch.is_weights)
        return TokenLoss(per_token, low, tokens={"vespo_phi_mean": (float(masked_sum(phi, mask)), float(mask.sum()))})
    raise ConfigError(f"algo.policy_loss={name!r}; choose clipped or one of {', '.join(TRUST_REGION_LOSSES)}.")
