"""What a model or adapter folder holds, read without loading its weights: the checks the pre-flight makes before
any model loads (:mod:`prefzoo.validation`), and the loaders make again when they load.

* :func:`pickled_adapter` / :func:`pickled_model`: a folder whose weights are only pickles is refused (loading one can
  run code; prefzoo loads safetensors only);
* :func:`base_config`: the ``transformers`` config of ``model.*`` (the tiny model's from its settings, SmolLM2's from
  its converted copy or its GGUF header), no weights read;
* :func:`adapter_mismatch`: the first LoRA tensor of an adapter folder whose shape does not fit a base model's layer
  (an adapter trained on another base), from the safetensors header and a model built on the ``meta`` device;
* :func:`vocabulary_mismatch`: two tokenizers that do not share one vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["pickled_adapter", "pickled_model", "base_config", "adapter_mismatch", "vocabulary_mismatch"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def pickled_adapter(folder) -> str | None:
    """Why a peft adapter folder is refused, or None: one whose weights are only a pickle (``adapter_model.bin``, no
    ``adapter_model.safetensors``). Loading a pickle can run code, and peft's own error then advises
    ``weights_only=False`` -- the one dangerous fix; prefzoo loads adapter weights from safetensors only."""
    if os.path.isfile(os.path.join(folder, "adapter_model.bin")) and \
            not os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
        return ("its weights are adapter_model.bin, a pickle (loading one can run code), and there is no "
                "adapter_model.safetensors: prefzoo loads adapters in the safetensors format only. Where you trust the "
                "file, convert it (peft: load it, then save_pretrained(folder, safe_serialization=True)).")
    return None


def pickled_model(folder) -> str | None:
    """Why a model folder is refused, or None: one whose weights are only pickles (``pytorch_model*.bin``, no
    ``*.safetensors``). Loading a pickle can run code (transformers then fails with torch's UnpicklingError and the
    advice to allow it); prefzoo loads model weights from safetensors only, as it does adapters."""
    names = os.listdir(folder)
    if any(n.endswith(".safetensors") for n in names):
        return None
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if not pickles:
        return None
    return (f"its weights are {pickles[0]}, a pickle (loading one can run code), and there is no .safetensors file: "
            "prefzoo loads model weights in the safetensors format only. Where you trust the file, convert it "
            "(transformers: load it, then save_pretrained(folder, safe_serialization=True)).")


def base_config(model_cfg, tokenizer):
    """The ``transformers`` config of the base model ``model_cfg`` (``cfg.model``) names, without its weights: the tiny
    model's from its settings, SmolLM2's from its converted copy (or its GGUF file's header on a first run), any other
    from its folder or id (``AutoConfig``)."""
    from transformers import AutoConfig

    from prefzoo.models.loading import SMOLLM2_CACHE_NAME, cache_dir, smollm2_gguf_path, tiny_llama_config

    name = model_cfg.name
    if name == "tiny":
        return tiny_llama_config(len(tokenizer), hidden_size=model_cfg.tiny_hidden_size,
                                 num_layers=model_cfg.tiny_layers)
    if name == "smollm2":
        converted = cache_dir() / SMOLLM2_CACHE_NAME
        if (converted / "config.json").is_file():
            return AutoConfig.from_pretrained(converted)
        gguf = smollm2_gguf_path()
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoConfig.from_pretrained(os.path.expanduser(name))


def adapter_mismatch(folder, config) -> str | None:
    """The first tensor of the LoRA adapter in ``folder`` that does not fit the base model of ``config``, described,
    or None when every one fits (or the adapter cannot be read here: the loader then says why).

    A LoRA pair on a linear layer ``W`` (out x in) is ``lora_A`` (r x in) and ``lora_B`` (out x r); the layer is looked
    up in the base built on the ``meta`` device (no memory, no weights)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    weights = Path(folder) / "adapter_model.safetensors"
    if not weights.is_file():
        return None
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 -- an unreadable file or an unknown architecture: the loader's error says it
        return None
    for key, shape in sorted(shapes.items()):
        for part, dim in (("lora_A", 1), ("lora_B", 0)):
            marker = f".{part}."
            if marker not in key:
                continue
            path = key.split(marker)[0].removeprefix("base_model.model.")
            try:
                layer = base.get_submodule(path)
            except AttributeError:
                return f"{key} belongs to a layer {path} the base model does not have"
            want = layer.in_features if part == "lora_A" else layer.out_features
            if len(shape) != 2 or shape[dim] != want:
                side = "input" if part == "lora_A" else "output"
                return (f"{key} has shape {list(shape)}, and the base model's {path} has {want} {side} features (an "
                        "adapter trained on another base model)")
    return None


def vocabulary_mismatch(student, teacher) -> str | None:
    """``"<n> tokens against <m>"`` when two tokenizers do not share one vocabulary (token -> id), else None."""
    if teacher.get_vocab() == student.get_vocab():
        return None
    return f"{len(teacher)} tokens against the student's {len(student)}"

