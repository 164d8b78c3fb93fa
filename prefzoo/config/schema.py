"""The typed configuration's groups: every default of prefzoo lives in these dataclasses (``conf/*.yaml`` files hold only
what differs); :mod:`prefzoo.config` registers them with Hydra and checks their values."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

__all__ = ["LoraConfig", "FastPathConfig", "ModelConfig", "PairsConfig", "DataConfig", "RewardConfig",
           "ObjectiveConfig", "VLLMConfig", "CorrectionConfig", "RolloutConfig", "GoldRewardConfig", "OODConfig",
           "EvalConfig", "EarlyStoppingConfig", "TrainerConfig", "EnvConfig", "BackendConfig", "Config", "GROUP_SCHEMAS",
           "resolve_defaults"]

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
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16: the frozen base weights; what trains stays float32
    # (bf16/fp16 need LoRA); auto (the default): bfloat16 where the device has native bf16 and LoRA is on, else
    # float32 (models.precision; docs/benchmarks.md "bf16 by default": the accuracy check that made it the default)
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
    # built-in tasks (arithmetic, reasoning_gym) with algo=sft: train on each training prompt with its known answer as
    # the completion (reasoning_gym: in its answer format) instead of the built-in pairs' chosen samples
    demonstrations: bool = False
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
class BackendConfig:
    """Where the policy's weights, forward and backward passes, optimizer and sampler live (:mod:`prefzoo.tinker.backend`).

    ``local`` (the default): this process. ``tinker``: a Tinker API server (hosted Tinker, ``prefzoo serve --api
    tinker``) through the ``tinker`` SDK: sampling and the optimizer step there, the plugin's loss here on the log-probs
    it returns. The API key is read from ``TINKER_API_KEY`` (a local server takes any ``tml-`` key), never from the
    config, so it stays out of the run folder.
    """

    name: str = "local"  # local | tinker
    url: Optional[str] = None  # backend=tinker: the server, http(s)://host[:port]
    base_model: Optional[str] = None  # backend=tinker: the server's name of model.name; None: model.name
    timeout: float = 600.0  # seconds to wait for one result of the server (a forward, a step, a sampling request)


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
    backend: BackendConfig = field(default_factory=BackendConfig)


GROUP_SCHEMAS = {"model": ModelConfig, "data": DataConfig, "reward": RewardConfig,
                 "objective": ObjectiveConfig, "trainer": TrainerConfig, "env": EnvConfig, "backend": BackendConfig}


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
