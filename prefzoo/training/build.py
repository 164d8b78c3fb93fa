"""What a run trains and samples with, built once before its first step: the model and what the plugin declares it
needs beside it, the engine stack that samples, and the policy the plugin sees.

* :func:`build_parts`: the base model (dtype, 4-bit), the base rollout engine (``rollout.engine=hf|vllm|vllm_server``:
  vLLM's is made from the base before LoRA wraps it), the trainable model (LoRA), a reference only where one is
  declared (with LoRA the adapter-disabled model still serves the drift metrics for free), a value head only where one
  is declared, a teacher (``algo=distill``), the fast paths;
* :func:`build_engine`: the engine stack, in order: the base engine, then the multi-turn layer if ``env=...``
  (:class:`~prefzoo.rollout.multiturn.MultiTurnEngine`), then the asynchronous layer if ``rollout.asynchronous``
  (:class:`~prefzoo.rollout.async_rollouts.AsyncEngine`). The policy receives it at construction; nothing swaps it
  later;
* :func:`make_policy`: the :class:`~prefzoo.models.policy.CausalLMPolicy` over those parts, with the data-parallel
  forward (``train_forward``) when there is one;
* :func:`build_policy`: the three in one process, for the tools and tests that need a run's policy without its loop;
  :func:`build_rollout_worker`: what the asynchronous worker samples with, in its own process.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from prefzoo.algos.base import Declaration
from prefzoo.config import Config
from prefzoo.models.loading import DTYPES, load_base_model, load_tokenizer
from prefzoo.models.lora import wrap_trainable
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.models.precision import check_weight_dtype, keep_trainable_float32, warn_if_emulated
from prefzoo.models.reference import Reference, make_reference
from prefzoo.errors import ConfigError
from prefzoo.types import RolloutEngine

log = logging.getLogger(__name__)

__all__ = ["ModelParts", "Built", "build_parts", "build_engine", "multi_turn_layer", "make_policy", "build_policy",
           "hf_engine", "build_rollout_worker"]


@dataclass
class ModelParts:
    """What :func:`build_parts` built: the trainable ``model`` (a peft model under LoRA), the ``reference``, the
    ``value_model`` and the ``teacher`` (each None unless declared, or free), the base rollout engine, the policy's
    random generator, whether its log-prob passes pack rows, and the seconds it took."""

    model: torch.nn.Module
    reference: Reference | None
    value_model: torch.nn.Module | None
    teacher: Reference | None
    base_engine: RolloutEngine
    generator: torch.Generator
    padding_free: bool
    load_seconds: float


@dataclass
class Built:
    """A policy built in one process (:func:`build_policy`)."""

    policy: CausalLMPolicy
    model: torch.nn.Module
    tokenizer: object
    load_seconds: float


def build_parts(cfg: Config, declaration: Declaration, tokenizer, device: torch.device) -> ModelParts:
    """The trainable model with the reference (and value head, teacher) the plugin declares it needs, and the base
    rollout engine (see the module docstring)."""
    start = time.perf_counter()
    m = cfg.model
    check_weight_dtype(m.dtype, m.lora.enabled, declaration.trains)
    warn_if_emulated({"model.dtype": m.dtype, "model.compute_dtype": m.compute_dtype}, device)
    model = load_base_model(m, cfg.trainer.seed, tokenizer, device)
    base_engine = {"vllm": lambda: build_vllm_engine(cfg, model, tokenizer),  # (the base, before LoRA wraps it)
                   "vllm_server": lambda: build_server_engine(cfg)}.get(cfg.rollout.engine, lambda: hf_engine(cfg))()
    model = wrap_trainable(model, m.lora, quantized=m.quantization == "4bit", adapter_path=m.adapter_path,
                           gradient_checkpointing=m.gradient_checkpointing)
    if m.quantization != "4bit":  # (4-bit: peft's prepare_model_for_kbit_training has cast the rest to float32)
        keep_trainable_float32(model, DTYPES[m.dtype])  # modules_to_save over a bf16 base: float32 master weights
    model.train()
    reference = None
    if declaration.reference:
        reference = make_reference(model, lora_enabled=m.lora.enabled, adapter_loaded=bool(m.adapter_path), mode=m.reference)
    elif m.lora.enabled and not m.adapter_path and m.reference != "copy":
        try:  # free: the adapter-disabled model, for drift metrics only
            reference = make_reference(model, lora_enabled=True, adapter_loaded=False, mode="adapter_disabled")
        except ConfigError:
            reference = None
    value_model = None
    if declaration.value_head is not None:
        from prefzoo.models.value import build_value_model

        value_model = build_value_model(cfg, declaration.value_head, model, device)
    if m.disable_dropout:  # after the value model: its adapter's dropout layers too
        from prefzoo.models.lora import disable_dropout

        if m.lora.enabled and m.lora.dropout:
            log.warning("model.lora.dropout=%s is switched off by model.disable_dropout=true (the default); set "
                        "model.disable_dropout=false to keep it.", m.lora.dropout)
        for module in (model, value_model):
            if module is not None:
                disable_dropout(module)
    generator = torch.Generator(device=device).manual_seed(cfg.trainer.seed)
    padding_free = _fast_paths(cfg, declaration, model, reference, value_model)
    teacher = None
    if declaration.teacher is not None:  # algo=distill: frozen beside the policy
        from prefzoo.training.trained import build_teacher

        teacher = build_teacher(cfg, declaration.teacher, tokenizer, device)
    return ModelParts(model, reference, value_model, teacher, base_engine, generator, padding_free,
                      time.perf_counter() - start)


def _fast_paths(cfg: Config, declaration: Declaration, model, reference, value_model) -> bool:
    """``model.fast.*`` on the model and its reference copy (fused LoRA, grouped-query attention); whether the
    log-prob passes pack rows (:func:`use_padding_free`)."""
    fast, m = cfg.model.fast, cfg.model
    copies = [model] + ([reference.module] if reference is not None and reference.module is not model else [])
    if fast.fused_lora and m.lora.enabled:
        from prefzoo.models.fast_lora import enable_fast_lora

        for module in copies:  # (the value adapter lives in the same layers)
            enable_fast_lora(module)
    if fast.gqa_attention:
        from prefzoo.models.attention import use_gqa_attention

        for module in copies:
            use_gqa_attention(module)
    return use_padding_free(fast, declaration, copies, value_model)


def use_padding_free(fast, declaration: Declaration, copies: list, value_model) -> bool:
    """``model.fast.padding_free`` for an offline plugin: switch the models' attention to the packed one
    (:func:`prefzoo.models.packing.use_packed_attention`) and say whether the log-prob passes pack. Online plugins
    keep padded passes (packing is measured on offline batches only). A model whose attention cannot run packs
    (eager, sliding-window, soft-capped) stays padded, with a warning."""
    if not fast.padding_free or declaration.online:
        return False
    from prefzoo.models.packing import packing_mode, use_packed_attention

    modules = list(copies)
    if value_model is not None and value_model.owns_backbone:
        modules.append(value_model.model)
    for module in modules:
        use_packed_attention(module)
    if packing_mode(copies[0]) is None:
        impl = getattr(getattr(copies[0], "config", None), "_attn_implementation", None)
        log.warning("model.fast.padding_free=true: the model's attention (%s) cannot run packed rows; batches stay "
                    "padded (set model.fast.padding_free=false to silence this).", impl)
        return False
    if value_model is not None:
        value_model.padding_free, value_model.share_prompts = True, fast.share_prompts
    return True


def build_engine(cfg: Config, parts: ModelParts, tokenizer, make_episode: Callable | None,
                 online: bool = True) -> RolloutEngine:
    """The run's engine stack over ``parts.base_engine``: the multi-turn layer when ``make_episode`` (``env=...``),
    then the asynchronous layer when ``rollout.asynchronous`` and the plugin samples its training data (``online``):
    it serves a training step's rollout from the worker, everything else (the evaluation) from the layers below."""
    engine = parts.base_engine
    if make_episode is not None:
        engine = multi_turn_layer(cfg, engine, tokenizer, make_episode)
    if cfg.rollout.asynchronous and online:
        from prefzoo.rollout.async_rollouts import AsyncEngine

        c, r = cfg.rollout.correction, cfg.rollout
        # the worker's log-probs serve a correction or the mismatch metrics; else one pass saved
        engine = AsyncEngine(engine, keep_logps=bool(c.mode or c.bypass or r.log_mismatch))
    return engine


def multi_turn_layer(cfg: Config, engine: RolloutEngine, tokenizer, make_episode: Callable) -> RolloutEngine:
    """``engine`` wrapped in the multi-turn layer (``env=...``): episodes of ``make_episode`` with ``cfg.env``'s budget,
    in the trainer's engine stack and in the asynchronous worker's alike."""
    from prefzoo.rollout.multiturn import MultiTurnEngine, MultiTurnSettings

    e = cfg.env
    return MultiTurnEngine(engine, tokenizer, make_episode, MultiTurnSettings(e.max_turns, e.max_tokens,
                                                                              e.reward_placement))


def make_policy(cfg: Config, parts: ModelParts, engine: RolloutEngine | None, tokenizer,
                train_forward: Callable | None = None) -> CausalLMPolicy:
    """The policy the plugin sees, over ``parts`` and the engine stack; ``train_forward``: the data-parallel wrapper
    of the trainable modules (None in one process)."""
    m = cfg.model
    fast = m.fast
    return CausalLMPolicy(parts.model, tokenizer, parts.reference, parts.value_model, generator=parts.generator,
                          fused_logps=fast.fused_logps, share_prompts=fast.share_prompts,
                          head_chunk_size=fast.head_chunk_size,
                          compute_dtype=getattr(torch, m.compute_dtype) if m.compute_dtype else None,
                          engine=engine, padding_free=parts.padding_free, teacher=parts.teacher,
                          train_forward=train_forward)


def build_policy(cfg: Config, declaration: Declaration, tokenizer, device: torch.device) -> Built:
    """The run's policy in one process (no data parallelism, no environment): :func:`build_parts`, :func:`build_engine`
    and :func:`make_policy` in a row."""
    parts = build_parts(cfg, declaration, tokenizer, device)
    policy = make_policy(cfg, parts, build_engine(cfg, parts, tokenizer, None, declaration.online), tokenizer)
    return Built(policy, parts.model, tokenizer, parts.load_seconds)


def hf_engine(cfg: Config, report_logps: bool | None = None):
    """The hf rollout engine (prefzoo's decode loop) with the run's ``rollout.*`` and ``model.fast.merged_rollout``
    (its merged copy in ``rollout.dtype`` when set); ``report_logps`` (default ``rollout.log_mismatch``): it reports
    the log-probs it sampled with."""
    from prefzoo.models.merged import merged_copy
    from prefzoo.rollout.engine import HFEngine
    from prefzoo.training.distributed import fsdp_requested, launched_world_size

    r = cfg.rollout
    factory = None
    sharded = fsdp_requested(cfg) and launched_world_size() > 1  # FSDP: the gathered shards sample, no copy of them
    if sharded and cfg.model.fast.merged_rollout:
        log.info("FSDP: the rollouts sample from the gathered LoRA model itself (model.fast.merged_rollout does not "
                 "apply: a merged copy would be a whole model beside the shards)")
    if cfg.model.fast.merged_rollout and not sharded:
        factory = merged_copy if r.dtype is None else partial(merged_copy, dtype=DTYPES[r.dtype])
    return HFEngine(factory, kv_cache=r.kv_cache, compile_decode=r.compile_decode,
                    report_logps=r.log_mismatch if report_logps is None else report_logps, exact=r.dtype is None)


def build_rollout_worker(cfg: Config):
    """In the asynchronous rollout worker's process (``rollout.asynchronous``, :mod:`prefzoo.rollout.async_rollouts`):
    the policy's LoRA model built as :func:`build_parts` builds it (the same base weights, files and seed; the adapter
    as configured, its values replaced by the trainer's after every step), on the CPU, and the hf engine that samples
    its merged copy and reports the log-probs it drew with; with ``env=...`` the multi-turn layer over it, the
    environment built here from ``cfg.env`` (its import path), so that whole episodes run in the worker. Returns
    (model, engine)."""
    from prefzoo.environments import episode_factory

    m = cfg.model
    device = torch.device("cpu")
    tokenizer = load_tokenizer(m.name)
    model = load_base_model(m, cfg.trainer.seed, tokenizer, device)
    model = wrap_trainable(model, m.lora, quantized=False, adapter_path=m.adapter_path, gradient_checkpointing=False)
    keep_trainable_float32(model, DTYPES[m.dtype])
    if m.fast.gqa_attention:  # the same attention as the trainer's sampler
        from prefzoo.models.attention import use_gqa_attention

        use_gqa_attention(model)
    model.eval()
    engine = hf_engine(cfg, report_logps=True)
    make_episode = episode_factory(cfg.env)
    return model, engine if make_episode is None else multi_turn_layer(cfg, engine, tokenizer, make_episode)


def build_vllm_engine(cfg: Config, base_model: torch.nn.Module, tokenizer):
    """The vLLM rollout engine (``rollout.engine=vllm``, :mod:`prefzoo.rollout.vllm_engine`) on the run's base model.

    vLLM loads the frozen base from a folder: SmolLM2's converted cache folder, a local model folder or hub id as
    given, or -- model=tiny, random weights made here -- ``base_model`` saved with the tokenizer into the engine's
    work folder. Called before LoRA wraps ``base_model`` (one process: the pre-flight refuses data parallelism)."""
    from prefzoo.models.loading import smollm2_local_dir
    from prefzoo.rollout.vllm_engine import VLLMEngine

    m, v = cfg.model, cfg.rollout.vllm
    work_dir = Path(tempfile.mkdtemp(prefix="prefzoo-vllm-"))
    if m.name == "smollm2":
        model_dir = str(smollm2_local_dir())
    elif m.name == "tiny":
        model_dir = str(work_dir / "base")
        base_model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    else:
        model_dir = m.name
    engine = VLLMEngine(model_dir, lora_rank=m.lora.r, dtype=v.dtype or m.dtype,
                        max_model_len=v.max_model_len, enforce_eager=v.enforce_eager,
                        gpu_memory_utilization=v.gpu_memory_utilization, sleep=v.sleep,
                        cpu_kv_cache_gib=v.cpu_kv_cache_gib, cpu_threads=v.cpu_threads or cfg.trainer.num_threads,
                        seed=cfg.trainer.seed if v.seed is None else v.seed, work_dir=work_dir)
    log.info("rollout engine: vLLM on %s (started in %.0f s)", model_dir, engine.start_seconds)
    return engine


def build_server_engine(cfg: Config):
    """The vLLM server engine (``rollout.engine=vllm_server``, :mod:`prefzoo.rollout.vllm_server`) on
    ``rollout.servers``, which :func:`prefzoo.validation.check_rollout_servers` checked before any model loaded."""
    from prefzoo.rollout.vllm_server import VLLMServerEngine, served_model_name

    m, v = cfg.model, cfg.rollout.vllm
    name = served_model_name(m.name, tiny_hidden_size=m.tiny_hidden_size, tiny_layers=m.tiny_layers, seed=cfg.trainer.seed)
    engine = VLLMServerEngine(list(cfg.rollout.servers), model_name=name, adapter_dir=v.adapter_dir,
                              timeout=v.request_timeout)
    log.info("rollout engine: %d vLLM server(s) (%s)", len(engine.servers), ", ".join(engine.servers))
    return engine
