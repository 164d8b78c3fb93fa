"""LoRA adapters (peft), 4-bit nf4 weights (bitsandbytes; QLoRA), or full fine-tuning.

Sources: Hu et al. 2021 (LoRA, arXiv:2106.09685); Dettmers et al. 2023 (QLoRA, arXiv:2305.14314).
"""

from __future__ import annotations

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training
from torch import nn

from prefzoo.errors import ConfigError

POLICY_ADAPTER = "default"


def bnb_4bit_config(compute_dtype: torch.dtype):
    """bitsandbytes nf4 config with double quantisation (QLoRA's recipe)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def peft_lora_config(lora) -> PeftLoraConfig:
    """peft's LoraConfig from prefzoo's ``model.lora`` settings."""
    targets = lora.target_modules
    if not isinstance(targets, str):
        targets = list(targets)
    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                          modules_to_save=list(lora.modules_to_save) if lora.modules_to_save else None,
                          bias="none", task_type="CAUSAL_LM")


def wrap_trainable(model: nn.Module, lora, *, quantized: bool, adapter_path: str | None,
                   gradient_checkpointing: bool) -> nn.Module:
    """Make ``model`` trainable: add (or load) a LoRA adapter, or unfreeze everything for full fine-tuning.

    Returns a ``peft.PeftModel`` when LoRA is on (only adapter weights, and ``modules_to_save``, train),
    else the model itself with every parameter trainable.

    Raises:
        ConfigError: ``adapter_path`` given with LoRA off.
    """
    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if not lora.enabled:
        if adapter_path:
            raise ConfigError("model.adapter_path needs LoRA: set model.lora.enabled=true.")
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if adapter_path:
        return PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
    return get_peft_model(model, peft_lora_config(lora))


def trainable_outside_adapter(model: nn.Module) -> list[str]:
    """Names of trainable parameters that are not LoRA A/B matrices (``modules_to_save``, embeddings...)."""
    return [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


def disable_dropout(model: nn.Module) -> int:
    """Turn every dropout of ``model`` off (``nn.Dropout`` p = 0, LoRA's dropout included, and the attention-
    probability dropout that Hugging Face attention layers keep as a float ``attention_dropout``), as TRL's
    ``disable_dropout=True`` does: in RL fine-tuning, dropout makes the log-probs of the policy at sampling time
    and at update time differ even before any update, so the importance ratio starts away from 1 and the KL
    estimates are biased. Returns the number of layers changed.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p:
            module.p = 0.0
            changed += 1
        rate = module.__dict__.get("attention_dropout")
        if isinstance(rate, float) and rate:
            module.attention_dropout = 0.0
            changed += 1
        config = module.__dict__.get("config")  # so that copies built from the config (rollout copies) have none
        for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
            if isinstance(getattr(config, key, None), float) and getattr(config, key):
                setattr(config, key, 0.0)
    return changed
