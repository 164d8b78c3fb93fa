"""The reference policy pi_ref: the model the divergence is measured against.

With LoRA, pi_ref is the same network with the adapter switched off — no second copy in memory — but
only while that really is the starting policy. If any weight outside the adapter trains
(``modules_to_save``, trainable embeddings or lm_head) or the adapter was loaded already trained,
switching the adapter off no longer gives the initial policy, so a frozen copy is taken instead
(``model.reference=auto``), or the run is refused (``model.reference=adapter_disabled``).
Without LoRA, pi_ref is a frozen copy in eval mode. When the algorithm needs none, there is none.

``model.reference=base`` anchors to the base weights even when the policy starts from a trained adapter
(``model.adapter_path``): pi_ref is then the model *before* that adapter, e.g. the pre-SFT model under an SFT
adapter. This is what note 000 sec. 6a warns against (anchoring to the pretrained model instead of the SFT one),
and what TRL does by default for a peft model loaded with a trained adapter and no reference given. It is there to
measure that choice, and the KL then starts above 0.
"""

from __future__ import annotations

import contextlib
import copy

from torch import nn

from prefzoo.errors import ConfigError
from prefzoo.models.lora import trainable_outside_adapter


class Reference:
    """Runs the reference network. ``context()`` is entered around a no-grad forward of ``module``."""

    kind: str = "none"

    def __init__(self, module: nn.Module, kind: str):
        self.module = module
        self.kind = kind

    def context(self):
        if self.kind == "adapter_disabled":
            return self.module.disable_adapter()
        return contextlib.nullcontext()


def make_reference(model: nn.Module, *, lora_enabled: bool, adapter_loaded: bool, mode: str) -> Reference:
    """Choose how pi_ref is computed for the freshly wrapped ``model`` (before any training step).

    Args:
        model: the trainable policy (a ``PeftModel`` under LoRA).
        lora_enabled: whether the policy trains through a LoRA adapter.
        adapter_loaded: whether the adapter was loaded already trained (``model.adapter_path``).
        mode: ``auto`` | ``adapter_disabled`` | ``copy`` | ``base`` (the base weights without the adapter, which
            with a loaded adapter is not the starting policy).

    Raises:
        ConfigError: ``adapter_disabled`` asked for where it would not give the initial policy; ``base`` where
            switching the adapter off does not give the base weights (LoRA off, weights outside the adapter train).
    """
    reasons = []
    if not lora_enabled:
        reasons.append("LoRA is off (full fine-tuning)")
    else:
        outside = trainable_outside_adapter(model)
        if outside:
            reasons.append(f"weights outside the adapter train ({', '.join(outside[:3])}...)")
    if mode == "base":  # a loaded adapter is the point here, so only the other reasons refuse
        if reasons:
            raise ConfigError("model.reference=base needs the base weights untouched under a LoRA adapter, but "
                              + "; ".join(reasons) + ". Use model.reference=copy (or auto).")
        return Reference(model, "adapter_disabled")
    if lora_enabled and adapter_loaded:
        reasons.append("the adapter was loaded already trained (model.adapter_path)")
    if mode == "adapter_disabled" and reasons:
        raise ConfigError("model.reference=adapter_disabled would not give the starting policy because "
                          + "; ".join(reasons) + ". Use model.reference=copy (or auto).")
    if mode == "copy" or reasons:
        ref = copy.deepcopy(model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return Reference(ref, "copy")
    return Reference(model, "adapter_disabled")
