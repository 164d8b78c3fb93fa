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


def reference_refusal(mode: str, *, lora_enabled: bool, adapter_loaded: bool, outside: list[str]) -> str | None:
    """Why ``model.reference=mode`` cannot give the reference it names, as a one-line message, or None when it can.
    The pre-flight asks it from the config alone (``outside`` = ``model.lora.modules_to_save``), before any model
    loads; :func:`make_reference` asks it again of the wrapped model (``outside`` = its trainable non-LoRA weights).

    Args:
        mode: ``auto`` | ``adapter_disabled`` | ``copy`` | ``base`` (``auto`` and ``copy`` are never refused).
        lora_enabled: the policy trains through a LoRA adapter.
        adapter_loaded: the adapter was loaded already trained (``model.adapter_path``).
        outside: names of weights that train outside the adapter (``modules_to_save``, ...).
    """
    if mode not in ("adapter_disabled", "base"):
        return None
    reasons = []
    if not lora_enabled:
        reasons.append("LoRA is off (full fine-tuning)")
    elif outside:
        reasons.append(f"weights outside the adapter train ({', '.join(outside[:3])}...)")
    if mode == "base":  # a loaded adapter is the point here, so only the other reasons refuse
        if not reasons:
            return None
        return ("model.reference=base needs the base weights untouched under a LoRA adapter, but "
                + "; ".join(reasons) + ". Use model.reference=copy (or auto).")
    if lora_enabled and adapter_loaded:
        reasons.append("the adapter was loaded already trained (model.adapter_path)")
    if not reasons:
        return None
    return ("model.reference=adapter_disabled would not give the starting policy because "
            + "; ".join(reasons) + ". Use model.reference=copy (or auto).")


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
            switching the adapter off does not give the base weights (LoRA off, weights outside the adapter train):
            :func:`reference_refusal`, which the pre-flight asks first from the config.
    """
    outside = trainable_outside_adapter(model) if lora_enabled else []
    refusal = reference_refusal(mode, lora_enabled=lora_enabled, adapter_loaded=adapter_loaded, outside=outside)
    if refusal:
        raise ConfigError(refusal)
    if mode == "base":
        return Reference(model, "adapter_disabled")
    if mode == "copy" or not lora_enabled or outside or adapter_loaded:  # auto: switching the adapter off would not do
        ref = copy.deepcopy(model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return Reference(ref, "copy")
    return Reference(model, "adapter_disabled")
