"""How prefzoo calls a causal LM incrementally: the positions of left-padded rows and the name of the KV-cache argument.
The decode loop's (:mod:`prefzoo.rollout.generate`), and the policy's log-prob passes use them too
(:mod:`prefzoo.models.policy`, :mod:`prefzoo.models.value`: the models room sits above the rollout room)."""

from __future__ import annotations

from torch import Tensor
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["position_ids_from_mask", "KV_CACHE_ARGUMENT"]

#: the KV cache's argument and output field: ``cache`` in transformers >= 5.2x, ``past_key_values`` before
KV_CACHE_ARGUMENT = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def position_ids_from_mask(mask: Tensor) -> Tensor:
    """Positions counting only real tokens, so left padding does not shift them. Shape (B, L) long."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
