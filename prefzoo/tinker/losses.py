"""The Tinker API's built-in losses (``forward_backward(data, loss_fn)``), each prefzoo's own function from
:mod:`prefzoo.objective` called with the SDK's documented convention.

The SDK's conventions (Thinking Machines, "Loss functions" docs; ``tinker`` 0.38.0) differ from prefzoo's plugins in
three ways, the same for every loss:

* one ``Datum`` is one sequence; every tensor in ``loss_fn_inputs`` is aligned with ``model_input``: position i of the
  input predicts ``target_tokens[i]``, and ``logprobs`` (the sampler's), ``advantages`` and ``weights`` are per
  position. Prompt positions are not masked: their weight or advantage is 0, so every position counts in the formula;
* the loss is a SUM over every position of every datum (``loss:sum``), with no normaliser: a client that wants a mean
  scales its weights or advantages (the cookbook does). prefzoo's plugins reduce with a normaliser
  (:func:`prefzoo.objective.aggregate_loss`);
* clip thresholds are RATIO bounds (``clip_low_threshold`` = 1 - clip_eps_low, ``clip_high_threshold`` = 1 +
  clip_eps_high, default 0.8 and 1.2; gspo's docs name no default, so it takes these too), in ``loss_fn_config``;
  DRO's ``beta`` likewise (default 0.05, the value of the docs' example; the hosted default is not documented).

Each function here takes the datum's log-probs ``logps`` Shape (1, N) (with their graph), its inputs (float32 or
int64 tensors of Shape (N,)) and the config, and returns the per-position loss Shape (1, N) whose sum is the datum's
share of ``loss:sum``. docs/tinker.md has the table: the SDK's formula, the function used, and what prefzoo's plugin
of the same name does differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from prefzoo.errors import PrefzooError
from prefzoo.objective import (clipped_is_weight, clipped_surrogate_loss, dro_loss, importance_sampling_loss,
                               sequence_log_ratio, weighted_policy_gradient_loss)

__all__ = ["LOSSES", "LossSpec", "LossInputError", "loss_config", "check_inputs"]


class LossInputError(PrefzooError):
    """A ``forward_backward`` request the loss cannot run on (unknown loss, missing or misshapen inputs, bad config)."""


Tensor = torch.Tensor


def _all(logps: Tensor) -> Tensor:
    return torch.ones_like(logps, dtype=torch.bool)


def cross_entropy(logps: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """-sum_i w_i log p(target_i): weighted negative log-likelihood (SFT; also the backward of
    ``forward_backward_custom``, whose weights are -dC/dlogp)."""
    return weighted_policy_gradient_loss(logps, inputs["weights"][None], _all(logps))


def importance_sampling(logps: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """-sum_i exp(lp_i - lp_sampler_i) A_i."""
    return importance_sampling_loss(logps, inputs["logprobs"][None], inputs["advantages"][None], _all(logps))


def ppo(logps: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """-sum_i min(ratio_i A_i, clip(ratio_i, low, high) A_i)."""
    loss, _ = clipped_surrogate_loss(logps, inputs["logprobs"][None], inputs["advantages"][None], _all(logps),
                                     clip_eps_low=1.0 - config["clip_low_threshold"],
                                     clip_eps_high=config["clip_high_threshold"] - 1.0)
    return loss


def cispo(logps: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """-sum_i sg(clip(ratio_i, low, high)) lp_i A_i."""
    mask = _all(logps)
    weight, _ = clipped_is_weight(logps, inputs["logprobs"][None], mask, clip_eps_low=1.0 - config["clip_low_threshold"],
                                  clip_eps_high=config["clip_high_threshold"] - 1.0)
    return weighted_policy_gradient_loss(logps, inputs["advantages"][None], mask, weight)


def dro(logps: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """-sum_i (lp_i A_i - beta/2 (lp_i - lp_sampler_i)^2)."""
    loss, _ = dro_loss(logps, inputs["logprobs"][None], inputs["advantages"][None], _all(logps), beta=config["beta"])
    return loss


def gspo(logps: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """GSPO-token: -sum_t min(s_t A_t, clip(s_t, low, high) A_t), s_t = sg(s) pi_t / sg(pi_t), with s the geometric
    mean of the ratios over the positions ``sequence_ratio_mask`` marks (non-zero)."""
    in_ratio = inputs["sequence_ratio_mask"][None] != 0
    log_s = sequence_log_ratio(logps, inputs["logprobs"][None], in_ratio).detach()  # (1,)
    token_log_ratio = log_s[:, None] + logps - logps.detach()  # every position: s's value, its own gradient
    loss, _ = clipped_surrogate_loss(token_log_ratio, torch.zeros_like(logps), inputs["advantages"][None],
                                     _all(logps), clip_eps_low=1.0 - config["clip_low_threshold"],
                                     clip_eps_high=config["clip_high_threshold"] - 1.0)
    return loss


@dataclass(frozen=True)
class LossSpec:
    """One SDK loss: its function, the ``loss_fn_inputs`` it needs (besides ``target_tokens``), its config keys and
    their defaults."""

    fn: Callable[[Tensor, dict[str, Tensor], dict[str, float]], Tensor]
    inputs: tuple[str, ...]
    defaults: dict[str, float]


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
#: the losses served, by the SDK's name
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",), {}),
    "importance_sampling": LossSpec(importance_sampling, ("logprobs", "advantages"), {}),
    "ppo": LossSpec(ppo, ("logprobs", "advantages"), _CLIP),
    "cispo": LossSpec(cispo, ("logprobs", "advantages"), _CLIP),
    "dro": LossSpec(dro, ("logprobs", "advantages"), {"beta": 0.05}),
    "gspo": LossSpec(gspo, ("logprobs", "advantages", "sequence_ratio_mask"), _CLIP),
}


def loss_config(name: str, given: dict | None) -> dict[str, float]:
    """The loss's config: its defaults updated with ``given``; LossInputError for an unknown loss, an unknown key, a
    non-number, or thresholds out of range."""
    if name not in LOSSES:
        raise LossInputError(f"loss_fn {name!r} is not served here; served: {', '.join(LOSSES)} (and "
                             "forward_backward_custom, which runs on cross_entropy).")
    spec = LOSSES[name]
    config = dict(spec.defaults)
    for key, value in (given or {}).items():
        if key not in spec.defaults:
            known = ", ".join(spec.defaults) or "none"
            raise LossInputError(f"loss_fn_config key {key!r} is not one of {name}'s ({known}).")
        if isinstance(value, str) or not float(value) == float(value):
            raise LossInputError(f"loss_fn_config[{key!r}] = {value!r}: must be a number.")
        config[key] = float(value)
    if "clip_low_threshold" in config:
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        if not 0.0 < low <= 1.0 <= high:
            raise LossInputError(f"clip thresholds ({low}, {high}): need 0 < clip_low_threshold <= 1 <= "
                                 "clip_high_threshold (they bound the ratio pi/pi_sampler).")
    if config.get("beta", 0.0) < 0:
        raise LossInputError(f"loss_fn_config beta = {config['beta']}: must be >= 0.")
    return config


def check_inputs(name: str, index: int, n_tokens: int, inputs: dict[str, Tensor]) -> None:
    """LossInputError unless datum ``index`` has ``target_tokens`` and the loss's inputs, each of Shape (N,) with N
    the datum's number of input tokens."""
    for key in ("target_tokens", *LOSSES[name].inputs):
        if key not in inputs:
            raise LossInputError(f"datum {index}: loss_fn {name} needs loss_fn_inputs[{key!r}] (has "
                                 f"{', '.join(sorted(inputs)) or 'none'}).")
        shape = tuple(inputs[key].shape)
        if shape != (n_tokens,):
            raise LossInputError(f"datum {index}: loss_fn_inputs[{key!r}] has shape {shape}; expected ({n_tokens},), "
                                 "one value per model_input token.")
