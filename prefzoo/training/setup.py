"""Build a run's parts from the typed config: data, tokenizer, model, policy, reward, evaluator.

Each part is built only if the algorithm needs it: no reference copy when the plugin declares none
(with LoRA the adapter-disabled model still serves drift metrics for free), no value head unless
a value head only when it declares one, no preference pairs for online algorithms.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from prefzoo.algos.base import Declaration
from prefzoo.config import Config
from prefzoo.data.files import split_held_out
from prefzoo.data.pairs import build_or_load_pairs, pairs_seed, unpaired_path
from prefzoo.data.preference import PreferenceData, load_table, tokenize_preferences
from prefzoo.data.unpaired import UnpairedData, check_one_format, class_counts, is_unpaired, pairs_of, split_pairs, tokenize_unpaired
from prefzoo.data.prompts import PromptSet, tokenize_prompts
from prefzoo.data.tasks import get_task
from prefzoo.errors import ConfigError
from prefzoo.models.loading import DTYPES, cache_dir, load_causal_lm, load_tokenizer
from prefzoo.models.lora import bnb_4bit_config, wrap_trainable
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.models.precision import check_weight_dtype, keep_trainable_float32, warn_if_emulated
from prefzoo.models.reference import make_reference
from prefzoo.rewards import make_reward

log = logging.getLogger(__name__)

BUILTIN_TASKS = ("arithmetic", "sentiment", "reasoning_gym")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu.")
    return torch.device(name)


def task_prompts(cfg: Config, tokenizer) -> tuple[PromptSet, PromptSet]:
    """(train, held-out) prompt sets of the configured task or prompt file."""
    d = cfg.data
    if d.name == "model":  # data=model (reward=model's default): the reward model's own task or prompt file
        from prefzoo.rewards.model import reward_model_data

        d = reward_model_data(cfg.reward.path, d)
    if d.name in BUILTIN_TASKS:
        kwargs = {"num_train": d.num_train, "num_eval": d.num_eval, "seed": d.seed}
        if d.name == "arithmetic":
            kwargs.update(digits=d.digits, ops=tuple(d.ops), word_problems=d.word_problems)
        task = reasoning_gym_task(cfg) if d.name == "reasoning_gym" else get_task(d.name, **kwargs)
        train = tokenize_prompts(task.to_dataset("train"), tokenizer, d.max_prompt_length, d.on_bad_row, f"{d.name} task")
        held = tokenize_prompts(task.to_dataset("eval"), tokenizer, d.max_prompt_length, d.on_bad_row, f"{d.name} eval")
        return train, held
    if not d.path:
        raise ConfigError(f"data={d.name} needs data.path=<file or dataset name>.")
    table = load_table(d.path, d.split)
    if d.eval_split:
        held_table = load_table(d.path, d.eval_split)
    else:
        table, held_table = split_held_out(table, d.eval_fraction, d.seed, d.path)
    train = tokenize_prompts(table, tokenizer, d.max_prompt_length, d.on_bad_row, d.path)
    warn_if_smaller_than_batch(len(train), cfg.trainer.batch_size, f"{d.path}: the training prompts")
    return train, tokenize_prompts(held_table, tokenizer, d.max_prompt_length, d.on_bad_row, f"{d.path} (held out)")


def reasoning_gym_task(cfg: Config):
    """``data=reasoning_gym``'s task (:mod:`prefzoo.data.reasoning_gym`), after checking the reward scores it."""
    from prefzoo.data.reasoning_gym import check_reward_choice, reasoning_gym_task as build

    check_reward_choice(cfg.data.name, cfg.reward.name)
    return build(cfg.data)


def preference_data(cfg: Config, tokenizer, reward_fn, train_prompts: PromptSet | None, eval_prompts: PromptSet | None,
                    device: torch.device, shipped: bool = True) -> tuple[PreferenceData, dict]:
    """Tokenised preference pairs: a user's file, or the built-in on-policy pairs of the task (built once, or the set
    shipped with prefzoo for these settings; ``shipped=False``: sampled from the model)."""
    d = cfg.data
    stats: dict = {}
    if d.name in BUILTIN_TASKS and not d.path:
        train_path, eval_path, stats = builtin_pairs(cfg, tokenizer, reward_fn, train_prompts, eval_prompts, device,
                                                     shipped=shipped)
        train_table, eval_table = load_table(str(train_path)), load_table(str(eval_path))
    else:
        train_table, eval_table = data_file_tables(cfg)
    tok = lambda t, name: tokenize_preferences(t, tokenizer, d.max_length, d.max_prompt_length, d.on_bad_row, name)  # noqa
    data = PreferenceData(tok(train_table, d.path or f"{d.name} pairs"), tok(eval_table, f"{d.path or d.name} held-out pairs"))
    warn_if_smaller_than_batch(len(data.train), cfg.trainer.batch_size, f"{d.path or d.name}: the training pairs")
    return data, stats


def builtin_pairs(cfg: Config, tokenizer, reward_fn, train_prompts, eval_prompts, device: torch.device,
                  unpaired: bool = False, shipped: bool = True):
    """(train path, eval path, stats) of the task's built-in pairs, built from the reference model once
    (:func:`prefzoo.data.pairs.build_or_load_pairs`; ``unpaired``: with their unpaired rows beside them)."""
    d = cfg.data

    def reference_policy():
        gen = torch.Generator(device=device).manual_seed(pairs_seed(cfg))  # (data.pairs.seed, else data.seed)
        model = build_base_model(cfg, tokenizer, device)
        return CausalLMPolicy(model.eval(), tokenizer, generator=gen)

    return build_or_load_pairs(cfg, tokenizer, reference_policy, reward_fn, train_prompts, eval_prompts, cache_dir(),
                               progress=cfg.trainer.progress, unpaired=unpaired, shipped=shipped)


def data_file_tables(cfg: Config):
    """(train, held-out) tables of ``data.path``: its ``data.eval_split``, or ``data.eval_fraction`` held out."""
    d = cfg.data
    if not d.path:
        raise ConfigError(f"data={d.name}: give data.path=<preference file or dataset name>.")
    table = load_table(d.path, d.split)
    if d.eval_split:
        return table, load_table(d.path, d.eval_split)
    return split_held_out(table, d.eval_fraction, d.seed, d.path)


def unpaired_data(cfg: Config, tokenizer, reward_fn, train_prompts: PromptSet | None, eval_prompts: PromptSet | None,
                  device: torch.device) -> tuple[UnpairedData, dict]:
    """Tokenised unpaired training rows and held-out pairs (:mod:`prefzoo.data.unpaired`): a file in the unpaired
    format (its held-out pairs: each prompt's first desirable row against its first undesirable one), a preference
    file split into rows, or the built-in task's graded samples (held out: its built-in pairs). ``stats["rows"]``
    holds the training rows' class counts."""
    d = cfg.data
    stats: dict = {}
    limits = (d.max_length, d.max_prompt_length, d.on_bad_row)
    prefs = lambda t, name: tokenize_preferences(t, tokenizer, *limits, name)  # noqa: E731
    rows = lambda t, name: tokenize_unpaired(t, tokenizer, *limits, name)  # noqa: E731
    if d.name in BUILTIN_TASKS and not d.path:
        train_path, eval_path, stats = builtin_pairs(cfg, tokenizer, reward_fn, train_prompts, eval_prompts, device,
                                                     unpaired=True)
        data = UnpairedData(rows(load_table(str(unpaired_path(train_path))), f"{d.name} unpaired samples"),
                            prefs(load_table(str(eval_path)), f"{d.name} held-out pairs"))
    else:
        train_table, eval_table = data_file_tables(cfg)
        check_one_format(train_table.column_names, d.path)
        if is_unpaired(train_table.column_names):
            data = UnpairedData(rows(train_table, d.path), pairs_of(rows(eval_table, f"{d.path} (held out)")))
        else:
            data = UnpairedData(split_pairs(prefs(train_table, d.path)), prefs(eval_table, f"{d.path} held-out pairs"))
    stats = {**stats, "rows": class_counts(data.train)}
    log.info("%s: %d unpaired training rows (%d desirable, %d undesirable), %d held-out pairs", d.path or d.name,
             len(data.train), stats["rows"]["desirable"], stats["rows"]["undesirable"], len(data.eval))
    warn_if_smaller_than_batch(len(data.train), cfg.trainer.batch_size, f"{d.path or d.name}: the training rows")
    return data, stats


def offline_data(cfg: Config, tokenizer, reward_fn, train_prompts, eval_prompts, device: torch.device,
                 kind: str = "pairs"):
    """What an offline plugin trains on (its declared ``data``): :func:`preference_data` or :func:`unpaired_data`."""
    fn = unpaired_data if kind == "unpaired" else preference_data
    return fn(cfg, tokenizer, reward_fn, train_prompts, eval_prompts, device)


def warn_if_smaller_than_batch(rows: int, batch_size: int, what: str) -> None:
    """Warn that every step repeats rows when a training set holds fewer rows than ``trainer.batch_size``."""
    if rows < batch_size:
        log.warning("%s are %d, fewer than trainer.batch_size=%d: every step repeats rows of them. Give more rows "
                    "or a smaller trainer.batch_size.", what, rows, batch_size)


def build_base_model(cfg: Config, tokenizer, device: torch.device):
    """The un-adapted model in the configured dtype/quantisation, on ``device``."""
    m = cfg.model
    quant = bnb_4bit_config(torch.float32 if m.dtype == "float32" else getattr(torch, m.dtype)) \
        if m.quantization == "4bit" else None
    model = load_causal_lm(m.name, dtype=m.dtype, quantization_config=quant, seed=cfg.trainer.seed, tokenizer=tokenizer,
                           tiny_kwargs={"hidden_size": m.tiny_hidden_size, "num_layers": m.tiny_layers},
                           device_map={"": device.index or 0} if quant is not None and device.type == "cuda" else None)
    return model if quant is not None else model.to(device)


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


@dataclass
class Built:
    policy: CausalLMPolicy
    model: torch.nn.Module
    tokenizer: object
    load_seconds: float


def build_policy(cfg: Config, declaration: Declaration, tokenizer, device: torch.device) -> Built:
    """The trainable policy with the reference (and value head) the algorithm declares it needs."""
    start = time.perf_counter()
    m = cfg.model
    check_weight_dtype(m.dtype, m.lora.enabled, declaration.trains)
    warn_if_emulated({"model.dtype": m.dtype, "model.compute_dtype": m.compute_dtype}, device)
    model = build_base_model(cfg, tokenizer, device)
    engine = {"vllm": lambda: build_engine(cfg, model, tokenizer),  # (the base, before LoRA wraps it)
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
    gen = torch.Generator(device=device).manual_seed(cfg.trainer.seed)
    fast = m.fast
    copies = [model] + ([reference.module] if reference is not None and reference.module is not model else [])
    if fast.fused_lora and m.lora.enabled:
        from prefzoo.models.fast_lora import enable_fast_lora

        for module in copies:  # (the value adapter lives in the same layers)
            enable_fast_lora(module)
    if fast.gqa_attention:
        from prefzoo.models.attention import use_gqa_attention

        for module in copies:
            use_gqa_attention(module)
    padding_free = use_padding_free(fast, declaration, copies, value_model)
    teacher = None
    if declaration.teacher is not None:  # algo=distill: frozen beside the policy
        from prefzoo.training.trained import build_teacher

        teacher = build_teacher(cfg, declaration.teacher, tokenizer, device)
    policy = CausalLMPolicy(model, tokenizer, reference, value_model, generator=gen, fused_logps=fast.fused_logps,
                            share_prompts=fast.share_prompts, head_chunk_size=fast.head_chunk_size,
                            merged_rollout=fast.merged_rollout,
                            compute_dtype=getattr(torch, m.compute_dtype) if m.compute_dtype else None,
                            engine=engine, padding_free=padding_free, teacher=teacher)
    return Built(policy, model, tokenizer, time.perf_counter() - start)


def hf_engine(cfg: Config):
    """The hf rollout engine (prefzoo's decode loop) with the run's ``rollout.*`` and ``model.fast.merged_rollout``
    (its merged copy in ``rollout.dtype`` when set)."""
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
    return HFEngine(factory, kv_cache=r.kv_cache, compile_decode=r.compile_decode, report_logps=r.log_mismatch,
                    exact=r.dtype is None)


def build_rollout_worker(cfg: Config):
    """In the asynchronous rollout worker's process (``rollout.asynchronous``, :mod:`prefzoo.rollout.async_rollouts`):
    the policy's LoRA model built as :func:`build_policy` builds it (the same base weights, files and seed; the adapter
    as configured, its values replaced by the trainer's after every step), on the CPU, and the hf engine that samples
    its merged copy and reports the log-probs it drew with. Returns (model, engine)."""
    m = cfg.model
    device = torch.device("cpu")
    model = build_base_model(cfg, load_tokenizer(m.name), device)
    model = wrap_trainable(model, m.lora, quantized=False, adapter_path=m.adapter_path, gradient_checkpointing=False)
    keep_trainable_float32(model, DTYPES[m.dtype])
    if m.fast.gqa_attention:  # the same attention as the trainer's sampler
        from prefzoo.models.attention import use_gqa_attention

        use_gqa_attention(model)
    model.eval()
    engine = hf_engine(cfg)
    engine.report_logps = True
    return model, engine


def build_engine(cfg: Config, base_model: torch.nn.Module, tokenizer):
    """The vLLM rollout engine (``rollout.engine=vllm``, :mod:`prefzoo.rollout.vllm_engine`) on the run's base model.

    vLLM loads the frozen base from a folder: SmolLM2's converted cache folder, a local model folder or hub id as
    given, or -- model=tiny, random weights made here -- ``base_model`` saved with the tokenizer into the engine's
    work folder. Called before LoRA wraps ``base_model``.

    Raises:
        ConfigError: data parallelism (one engine per process is not supported yet).
    """
    from prefzoo.models.loading import smollm2_local_dir
    from prefzoo.rollout.vllm_engine import VLLMEngine
    from prefzoo.training.distributed import launched_world_size

    if launched_world_size() > 1:
        raise ConfigError("rollout.engine=vllm runs one engine beside one trainer process; data parallelism is not "
                          "supported with it yet. Launch one process, or use rollout.engine=hf.")
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


def build_reward(cfg: Config):
    """The task's combined reward function (``reward.functions`` weighted by ``reward.weights``)."""
    if cfg.reward.name == "model":
        from prefzoo.rewards.model import reward_model_function

        return make_reward([reward_model_function(cfg.reward.path)], None)
    return make_reward(list(cfg.reward.functions), list(cfg.reward.weights) if cfg.reward.weights else None)


def build_gold_reward(cfg: Config):
    """The evaluation's gold reward (``eval.gold_reward.functions``, weighted), or None when none is configured."""
    gold = cfg.eval.gold_reward
    if not gold.functions:
        return None
    return make_reward(list(gold.functions), list(gold.weights) if gold.weights else None)


def heldout_pair_prompts(cfg: Config, tokenizer) -> PromptSet | None:
    """Offline runs on a preference file: the prompts of its held-out pairs (the same split as
    :func:`preference_data`), so the shared evaluation can sample answers to them (reward, KL, diversity);
    None, with a warning, when the file's prompts cannot serve (no ``prompt`` column, over-long prompts)."""
    from prefzoo.errors import DataError

    d = cfg.data
    try:
        if d.eval_split:
            table = load_table(d.path, d.eval_split)
        else:
            table = split_held_out(load_table(d.path, d.split), d.eval_fraction, d.seed, d.path)[1]
        return tokenize_prompts(table, tokenizer, d.max_prompt_length, "skip", f"{d.path} (held-out prompts)")
    except DataError as err:
        log.warning("no held-out prompts from %s for the task evaluation (reward, KL, diversity are left out): %s",
                    cfg.data.path, err)
        return None


def check_reward_columns(cfg: Config, prompts: PromptSet | None) -> None:
    """Before the model loads: each of ``reward.functions`` takes the columns of the prompts it will score in
    training or pair building (``prompts``: the training prompts; None when the reward only serves the
    evaluation, which warns about a reward that cannot score its prompts and goes on).

    Raises:
        ConfigError: a reward function cannot take these columns (see
            :func:`~prefzoo.rewards.registry.check_reward_signature`).
    """
    if prompts is None or cfg.reward.name == "model":
        return
    from prefzoo.rewards.registry import check_reward_signature, resolve_reward

    for spec in cfg.reward.functions:
        try:
            check_reward_signature(spec, resolve_reward(spec), list(prompts.columns))
        except ConfigError as err:
            raise ConfigError(f"reward.functions: {err}") from None


#: the completion the reward is called with before training (:func:`probe_reward`)
PLACEHOLDER_COMPLETION = "The answer is 4."


def probe_environment(make_episode, prompts: PromptSet | None) -> list | None:
    """Before the model loads (``env=...``): start one episode on each of the first two training rows, as a rollout
    does, and read its ``get_reward()`` (TRL's contract: an episode may end after its first turn, without a tool call,
    so the reward must be readable right after ``reset``), so that a class that cannot be built, or whose ``reset`` or
    ``get_reward`` fails, stops here in one line naming the class and the method; the episodes' environment instances
    (for :func:`probe_reward`'s ``environments=``), or None.

    Raises:
        ConfigError: ``__init__``, ``reset`` or ``get_reward`` (``init`` for skyrl-gym) raised (anything but a Ctrl-C),
            ``reset`` returned something else than a string or None, or ``get_reward`` something else than a number.
    """
    from prefzoo.errors import ConfigError, EnvironmentFailure, PrefzooError, describe_error
    from prefzoo.types import PROMPT_MESSAGES, ROLLOUT_SEED_COLUMN

    if make_episode is None or prompts is None or not len(prompts):
        return None
    batch = prompts.batch(list(range(min(2, len(prompts)))), pad_id=0)
    out = []
    for i in range(len(batch)):
        row = {k: v[i] for k, v in batch.columns.items() if k not in ("prompt_text", ROLLOUT_SEED_COLUMN, PROMPT_MESSAGES)}
        row["prompt"] = (batch.columns.get(PROMPT_MESSAGES) or [None] * len(batch))[i]
        try:
            episode = make_episode()
            episode.start(row)
            episode.reward()
        except EnvironmentFailure as err:
            raise ConfigError(f"{err.method} failed on the {('first', 'second')[i]} training row ({err.cause}); fix "
                              "the environment (checked before the model loads: the pre-flight builds it and calls "
                              "reset and get_reward once on the first two training rows).") from None
        except PrefzooError as err:
            raise ConfigError(f"{err} (on the {('first', 'second')[i]} training row; checked before the model "
                              "loads).") from None
        except Exception as err:  # (a shape the wrappers do not cover)
            raise ConfigError(f"the environment failed on training row {i + 1} ({describe_error(err)}); fix it "
                              "(checked before the model loads).") from None
        out.append(episode.instance)
    return out


def probe_reward(reward_fn, prompts: PromptSet | None, environments: list | None = None) -> None:
    """Before the model loads: call the run's reward functions once on two training prompts (their columns, as a
    rollout passes them) with a placeholder completion, so that a function that raises, or returns NaN, the wrong
    number of scores, strings or a scalar fails here in one line, not after the model has loaded and the evaluation
    before training has run (minutes on SmolLM2). Reward models (``reward=model``) are not probed.

    Raises:
        RewardError: what the call found (:meth:`prefzoo.rewards.registry.CombinedReward.probe`).
    """
    from prefzoo.rewards.protocol import COMPLETION_IDS
    from prefzoo.rewards.registry import CombinedReward
    from prefzoo.types import ROLLOUT_SEED_COLUMN

    if prompts is None or not len(prompts) or not isinstance(reward_fn, CombinedReward):
        return
    rows = list(range(min(2, len(prompts))))
    batch = prompts.batch(rows, pad_id=0)
    columns = {k: v for k, v in batch.columns.items() if k != ROLLOUT_SEED_COLUMN}
    texts = columns.pop("prompt_text")
    columns[COMPLETION_IDS] = [[0] for _ in rows]
    if environments is not None:  # env=...: TRL-style functions read the conversation and the environment
        from prefzoo.rewards.protocol import COMPLETION_MESSAGES, ENVIRONMENTS

        columns[COMPLETION_MESSAGES] = [[{"role": "assistant", "content": PLACEHOLDER_COMPLETION}] for _ in rows]
        columns[ENVIRONMENTS] = list(environments)
    reward_fn.probe(texts, [PLACEHOLDER_COMPLETION] * len(rows), **columns)


def reward_chosen(cfg: Config, overrides: list[str] | None = None) -> bool:
    """Whether the run's reward is the user's choice, not the default that comes with every config (the arithmetic
    task's exact match): its config differs from :class:`~prefzoo.config.RewardConfig`'s defaults (``reward=sentiment``,
    ``reward.functions=[...]``, weights, a recipe's reward), or the command line names it (``reward=arithmetic``).
    ``overrides``: the command line's overrides; None reads the running Hydra job's (none outside Hydra)."""
    from prefzoo.config import RewardConfig

    if cfg.reward != RewardConfig():
        return True
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    keys = [o.partition("=")[0].lstrip("+~") for o in overrides]
    return any(k == "reward" or k.startswith("reward.") for k in keys)


def evaluation_reward(cfg: Config, reward_fn, prompts: PromptSet | None):
    """The reward the held-out evaluation scores answers with: ``reward_fn``, or None when one of its functions cannot
    take the held-out prompts' columns (e.g. ``correctness`` on a preference file without an ``answer`` column):
    then task_reward / sample_reward are left out. A reward the user chose (:func:`reward_chosen`) is named in one
    warning line; the default reward, which a user's own file need not fit, is left out silently. (Training with a
    reward that cannot score its prompts fails earlier: :func:`check_reward_columns`.)"""
    if reward_fn is None or prompts is None or cfg.reward.name == "model":
        return reward_fn
    from prefzoo.rewards.registry import check_reward_signature, resolve_reward

    for spec in cfg.reward.functions:
        try:
            check_reward_signature(spec, resolve_reward(spec), [c for c in prompts.columns if c != "prompt_text"])
        except ConfigError as err:
            if reward_chosen(cfg):
                log.warning("reward.functions: the evaluation leaves out task_reward and sample_reward on %s: %s",
                            cfg.data.path or cfg.data.name, " ".join(str(err).split()))
            else:
                log.debug("the default reward (%s) does not apply to %s: %s", spec, cfg.data.path, err)
            return None
    return reward_fn


def correctness_function(cfg: Config, prompts: PromptSet | None):
    """Exact-match function when the prompts carry an ``answer`` column, else None (reasoning-gym tasks: their
    verifier's score of 1, :func:`~prefzoo.rewards.reasoning_gym.reasoning_gym_accuracy`)."""
    if prompts is None or "answer" not in prompts.columns:
        return None
    from prefzoo.rewards.reasoning_gym import has_columns, reasoning_gym_accuracy

    if has_columns(prompts.columns):
        return reasoning_gym_accuracy
    from prefzoo.rewards.arithmetic import correctness

    return correctness


__all__ = ["Path", "build_policy", "build_reward", "task_prompts", "preference_data", "unpaired_data", "offline_data",
           "pick_device", "load_tokenizer"]
