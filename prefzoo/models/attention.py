"""Grouped-query attention without copying the keys and values (``enable_gqa``), for CPU training.

SmolLM2 (like Llama 3, Qwen2, Mistral) has fewer key/value heads than query heads (3 vs 9). ``transformers``'
SDPA path uses PyTorch's ``enable_gqa`` only where no attention mask is given (its CUDA kernels would fall back
to the math kernel otherwise) and else ``repeat_kv``: a copy of K and V expanded to every query head, which the
backward then sums back, and which autograd keeps for the backward (2 x 576 instead of 2 x 192 floats per token
per layer on SmolLM2). PyTorch's CPU flash-attention kernel takes ``enable_gqa`` with a mask: the same numbers
(bit-identical here), ~35% less time in attention forward+backward on SmolLM2's shapes, and less memory.

:func:`use_gqa_attention` switches a model to it (an attention function registered with ``transformers``'
``AttentionInterface`` under :data:`GQA_SDPA`, with the SDPA mask format); the function hands every case it does
not cover (a single query token, soft-capping, position bias, no mask with fewer queries than keys, non-CPU
devices) to ``transformers``' own SDPA function, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GQA_SDPA", "sdpa_gqa_attention", "use_gqa_attention"]

GQA_SDPA = "prefzoo_sdpa_gqa"
_registered = False


def sdpa_gqa_attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """``transformers`` attention function: SDPA with ``enable_gqa`` (no K/V copy) on CPU, else HF's SDPA path.

    Shapes: query (B, H, q, hd), key/value (B, H_kv, k, hd), attention_mask (B, 1, q, k) bool or float, or None
    -> ((B, q, H, hd), None), as ``transformers.integrations.sdpa_attention.sdpa_attention_forward``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or query.shape[2] == 1 or query.device.type != "cpu" or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions", False)
            or (attention_mask is None and key.shape[2] != query.shape[2])):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and attention_mask is None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(GQA_SDPA, sdpa_gqa_attention)
        AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
        _registered = True


def use_gqa_attention(model: nn.Module) -> bool:
    """Switch a ``transformers`` model (peft-wrapped or not) from ``sdpa`` to :data:`GQA_SDPA`; True if switched.

    Models with another attention implementation (eager, flash, flex) or one query head per key head are left
    as they are."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(hf, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if not heads or not kv or heads == kv:
        return False
    _register()
    try:
        hf.set_attn_implementation(GQA_SDPA)
    except (ValueError, AttributeError, TypeError):
        return False
    return getattr(hf.config, "_attn_implementation", None) == GQA_SDPA
