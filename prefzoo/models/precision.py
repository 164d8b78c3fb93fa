"""Mixed precision: where bf16 enters a run, and what stays float32.

Two ways to compute in bf16 (or fp16), each a model setting, on CPU (native bf16 matmuls: ``avx512_bf16``, AMX) and
CUDA alike:

* ``model.compute_dtype=bfloat16`` -- autocast (TRL's ``bf16=True``, PyTorch AMP): every weight stays float32 and
  each forward runs under ``torch.autocast``, which casts a matmul's inputs and weights to bf16 as it goes (each
  weight again at every pass) and keeps the residual stream, norms and softmax-type operations in float32.
* ``model.dtype=bfloat16`` -- bf16 storage of the frozen base weights (``from_pretrained(dtype=...)``, TRL's
  ``ModelConfig.dtype``): half the weight memory and half the bytes read per pass (a decode step is bandwidth-bound),
  no casts per pass. Everything that TRAINS stays float32, i.e. float32 master weights (Micikevicius et al. 2018,
  "Mixed precision training"): the LoRA matrices (peft upcasts them, ``autocast_adapter_dtype=True``, its default,
  also for the value adapter and for adapters loaded with ``model.adapter_path``), the value and reward heads, and
  ``model.lora.modules_to_save`` (:func:`keep_trainable_float32`); so their AdamW state (which takes each
  parameter's dtype) is float32 too, and an update smaller than bf16's 2^-8 of a weight is not rounded away. The
  low-rank term runs in bf16 on copies of A and B in the fused LoRA layer (:mod:`prefzoo.models.fast_lora`) and in
  float32 in peft's. Full fine-tuning over bf16 weights would train bf16 weights: refused
  (:func:`check_weight_dtype`), use autocast there.

In both, log-probs, log-ratios, KL estimates, values and losses are float32 (DESIGN.md). The fused output layer's
matmuls run in bf16 too (:meth:`prefzoo.models.policy.CausalLMPolicy.head_matmul_dtype`; left in float32 they were
about half a bf16 step's matmul time on bf16 hardware, ``bench/profile_bf16.py``), with the logits taken relative to
each label's logit inside the matmul's float32 accumulation and the log-softmax in float32
(:func:`prefzoo.objective.linear_token_logps`, ``matmul_dtype``: within a derived bound of float32 logits, and
about 30x closer to them than plain bf16 logits for sampled tokens); the plain path's
:func:`prefzoo.objective.token_logps` upcasts the model's bf16 logits chunk by chunk; the value head is a float32
layer on upcast hidden states. The reference is the same bf16 base (the adapter switched off, or a
frozen copy of the starting model), so pi_ref and the starting policy give the very same log-probs.

What stays as it was: 4-bit weights (``model.quantization=4bit``, QLoRA): bitsandbytes' nf4 storage with
``model.dtype`` as its compute dtype, and peft's ``prepare_model_for_kbit_training`` casts every other weight to
float32. The merged-weights rollout copy (:mod:`prefzoo.models.merged`) of a bf16 base is bf16: the merge
``W + s B A`` is rounded to bf16, so sampling sees the LoRA update only to bf16 resolution of W; the trainer
recomputes the log-probs it trains on with the unmerged float32 adapter.

Measured agreement with float32 (``tests/training/test_bf16.py`` on the tiny model, ``bench/check_bf16.py`` on
SmolLM2-135M; docs/usage.md gives the figures).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from prefzoo.errors import ConfigError

__all__ = ["check_weight_dtype", "keep_trainable_float32", "native_bf16", "warn_if_emulated", "resolve_auto_dtype",
           "resolve_model_dtype"]

log = logging.getLogger(__name__)


#: CPU feature flags (Linux ``/proc/cpuinfo``) of bf16 multiply units: x86's AVX512-BF16 and AMX-BF16, Arm's FEAT_BF16
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from Linux's ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``), or None where the
    file does not say (another OS)."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 natively: CUDA's ``is_bf16_supported``; on a CPU, the feature flags of bf16
    units (:data:`BF16_CPU_FLAGS`: ``avx512_bf16``, AMX, Arm's ``bf16``), else oneDNN's own answer where the OS does
    not list flags. oneDNN's ``_is_mkldnn_bf16_supported`` alone is not enough: it says True for any AVX-512 CPU,
    where bf16 is converted in software. Measured (torch 2.13, one thread, a 1024 x 1024 x 1024 matmul): an Intel
    Xeon with AVX-512 but no ``avx512_bf16`` (this project's machine in Dec 2026, loaded): float32 114 GFLOP/s, bf16
    27; an AMD EPYC with AVX2 only: float32 34, bf16 0.8-6 (a 1000 x 576 x 1536 matmul)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        flags = cpu_flags()
        if flags is not None:
            return bool(flags & BF16_CPU_FLAGS)
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # a torch without the check: assume it may
            return True
    return True


def resolve_auto_dtype(lora_enabled: bool, quantization: str, device: torch.device) -> tuple[str, str]:
    """What ``model.dtype=auto`` stores the frozen base weights in, and why (a sentence for the log).

    bfloat16 where it is both fast and safe: the device multiplies bf16 natively (:func:`native_bf16`: CUDA with bf16,
    a CPU with ``avx512_bf16`` or AMX) AND what trains is not the base (LoRA on, so the adapter, its optimizer state
    and every trained weight stay float32: :func:`keep_trainable_float32`). float32 otherwise: a device without native
    bf16 (emulated bf16 is 5-40x slower), full fine-tuning (its weights would train in bf16: choose
    ``model.compute_dtype=bfloat16``, autocast over float32 weights, explicitly), or 4-bit weights (nf4 storage; their
    compute dtype stays the explicit ``model.dtype``'s).

    Returns:
        (``"bfloat16"`` or ``"float32"``, the reason in one sentence).
    """
    where = (torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else str(device))
    if not native_bf16(device):
        return "float32", f"this device ({where}) has no native bf16 matmuls"
    if not lora_enabled:
        return "float32", ("full fine-tuning (model.lora.enabled=false) would train bf16 weights; "
                           "model.compute_dtype=bfloat16 gives autocast over float32 weights")
    if quantization != "none":
        return "float32", f"model.quantization={quantization} keeps its own storage"
    return "bfloat16", (f"this device ({where}) multiplies bf16 natively; the frozen base is bf16, the LoRA adapter and "
                        "its optimizer float32, log-probs and losses float32")


def resolve_model_dtype(model_cfg, device: torch.device) -> tuple[str, str | None]:
    """``model_cfg.dtype`` (``cfg.model``) with ``auto`` replaced IN PLACE by :func:`resolve_auto_dtype`'s choice for
    ``device``: (the dtype, the reason when it was ``auto``, else None). Runs resolve it before writing config.yaml
    (:func:`prefzoo.training.setup.resolve_precision`, which logs the reason); the model builders call this too, so a
    config composed without a run (a benchmark, a notebook) loads what a run would."""
    if model_cfg.dtype != "auto":
        return model_cfg.dtype, None
    model_cfg.dtype, why = resolve_auto_dtype(model_cfg.lora.enabled, model_cfg.quantization, device)
    return model_cfg.dtype, why


def warn_if_emulated(dtypes: dict[str, str | None], device: torch.device) -> None:
    """Log a warning when a half-precision setting (``{"model.dtype": ..., "model.compute_dtype": ...}``) runs where
    it is emulated: bf16 on a device without native bf16 matmuls, and float16 on a CPU (no float16 matmul kernels: a
    512 x 512 x 512 matmul took 213 ms in float16 against 1.9 ms in float32 on this project's 2-core AMD EPYC, 2
    threads, idle). The step is then many times slower."""
    bf16 = [f"{k}={v}" for k, v in dtypes.items() if v == "bfloat16"]
    if bf16 and not native_bf16(device):
        log.warning("%s on %s: this device has no native bf16 matmuls (bf16 is emulated, typically 5-40x slower "
                    "than float32 here); use model.dtype=float32 or auto (the default: float32 here) on this machine.",
                    " and ".join(bf16),
                    torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else device)
    fp16 = [f"{k}={v}" for k, v in dtypes.items() if v == "float16"]
    if fp16 and device.type == "cpu":
        log.warning("%s on the CPU: CPUs have no float16 matmul kernels (float16 is emulated: a matmul ran about "
                    "100x slower than in float32 on a 2-core AMD EPYC); use float32 (model.dtype=auto, the default, "
                    "gives it on a CPU) on a CPU.",
                    " and ".join(fp16))


def check_weight_dtype(dtype: str, lora_enabled: bool, trains: bool) -> None:
    """Refuse ``model.dtype`` other than float32 where every weight would train in it (full fine-tuning). ``auto``
    passes: it is float32 there (:func:`resolve_auto_dtype`).

    Raises:
        ConfigError: ``dtype`` is bfloat16/float16, LoRA is off and the algorithm trains.
    """
    if dtype not in ("float32", "auto") and not lora_enabled and trains:
        raise ConfigError(
            f"model.dtype={dtype} stores the frozen base weights in {dtype}, but with model.lora.enabled=false every "
            f"weight trains, and updates smaller than {dtype}'s resolution (2^-8 of a weight for bfloat16) would be "
            f"rounded away. For full fine-tuning keep model.dtype=float32 and set model.compute_dtype={dtype} "
            "(autocast: float32 weights, bf16 matmuls), or train a LoRA adapter (model.lora.enabled=true).")


def _cast_floats(value, dtype: torch.dtype):
    """``value`` with every floating tensor in it (also inside tuples, lists and dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _float32_inputs(module, args, kwargs):
    return _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)


def _outputs_in(dtype: torch.dtype, module, args, output):
    return _cast_floats(output, dtype)


def keep_trainable_float32(model: nn.Module, base_dtype: torch.dtype) -> list[str]:
    """Upcast every trainable parameter of ``model`` that is not float32 (``modules_to_save`` over a bf16 base) and
    make its module a float32 island: its floating inputs are cast to float32, its floating outputs back to
    ``base_dtype``, so the bf16 layers around it see what they expect. Hooks survive ``copy.deepcopy`` (the frozen
    reference copy). Returns the names of the parameters upcast.
    """
    upcast = []
    for name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False)
               if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32]
        if not own:
            continue
        for n, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        module.register_forward_pre_hook(_float32_inputs, with_kwargs=True)
        module.register_forward_hook(functools.partial(_outputs_in, base_dtype))
        upcast += [f"{name}.{n}" if name else n for n, _ in own]
    return upcast
