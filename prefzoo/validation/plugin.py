"""The pre-flight's checks of the run's settings against its plugin's declaration (and the launch's process count):
what the plugin can honour (a controller, a correction, a divergence, turn rewards), the rows a step needs, a KL budget
that something measures, the environment."""

from __future__ import annotations

from prefzoo.errors import ConfigError

__all__ = ["check_reward_shaping", "check_parallel", "check_batch_size", "check_kl_controller",
           "check_divergence_support", "check_explicit_reward", "check_correction_support", "check_environment",
           "check_step_rows", "has_reference", "check_kl_budget", "check_demonstrations"]


def check_batch_size(cfg, min_rows: int, processes: int = 1) -> None:
    """``trainer.batch_size`` must give each of ``processes`` processes at least ``min_rows`` rows per step.

    Raises:
        ConfigError: it does not (one line naming the key, the algorithm's need and the smallest valid value).
    """
    need = min_rows * max(1, processes)
    if min_rows > 1 and cfg.trainer.batch_size < need:
        per = f" ({min_rows} per process x {processes} processes)" if processes > 1 else ""
        raise ConfigError(f"trainer.batch_size={cfg.trainer.batch_size}: algo={cfg.algo.name} needs at least {min_rows} "
                          f"rows per process and step (it compares the rows of a step with each other); give "
                          f"trainer.batch_size >= {need}{per}.")


def check_kl_controller(cfg, adapts_beta: bool) -> None:
    """``objective.kl_controller=adaptive`` needs a plugin that updates the controller (``adaptive_beta``).

    Raises:
        ConfigError: the run asks for the adaptive controller and its plugin keeps beta fixed.
    """
    if cfg.objective.kl_controller == "adaptive" and not adapts_beta:
        raise ConfigError(f"objective.kl_controller=adaptive: algo={cfg.algo.name} keeps beta fixed (the adaptive "
                          "controller of Ziegler et al. 2019 is implemented by algo=ppo); use objective."
                          "kl_controller=fixed with objective.beta, or objective.kl_budget to stop at a KL.")


def check_divergence_support(cfg, supported: bool) -> None:
    """``objective.divergence`` other than reverse KL (``objective=forward_kl|js|alpha``) with a plugin whose loss has no
    f-divergence link (capability ``f_divergence``: DPO's family) is refused: the run would train the reverse-KL
    objective (or none) while its config and summary said otherwise.

    Raises:
        ConfigError: naming the key, the algorithm and the plugins that take it.
    """
    if cfg.objective.divergence != "reverse_kl" and not supported:
        raise ConfigError(f"objective.divergence={cfg.objective.divergence}: algo={cfg.algo.name} has no f-divergence "
                          "link to change (the f-divergences of Wang et al. 2024 apply to algo=dpo|rpo|online_dpo; the "
                          "online plugins estimate KL(pi || pi_ref) with objective.kl_estimator); drop objective=... "
                          "(reverse_kl, the default).")


def check_explicit_reward(cfg, overrides: list[str] | None) -> None:
    """``data=reasoning_gym`` with ``reward=arithmetic`` written on the command line is refused (the tasks are scored
    by their own verifiers; the arithmetic reward would read the last number of a reply): only the untouched default is
    replaced by ``reward=reasoning_gym`` (:func:`prefzoo.config.resolve_defaults`, which says so in the log).

    Raises:
        ConfigError: naming both choices.
    """
    if cfg.data.name != "reasoning_gym" or not overrides:
        return
    given = [o.lstrip("+~") for o in overrides]
    if "reward=arithmetic" in given or any(o.startswith("reward.functions=") and "correctness" in o for o in given):
        from prefzoo.data.reasoning_gym import check_reward_choice

        check_reward_choice(cfg.data.name, "arithmetic")


def check_correction_support(cfg, supported: bool) -> None:
    """``rollout.correction.mode`` / ``bypass`` with a plugin that cannot apply them (its loss has no advantages to
    weight, or it samples nothing: Online DPO, best-of-n, the offline plugins) is refused before any model loads,
    rather than a run that looks corrected and is not. ``supported``: the plugin declares the capability
    ``sampler_correction``.

    Raises:
        ConfigError: naming the key, the algorithm and what to do.
    """
    c = cfg.rollout.correction
    what = "rollout.correction.bypass=true" if c.bypass else (
        f"rollout.correction.mode={c.mode}" if c.mode is not None else None)
    if what and not supported:
        raise ConfigError(f"{what}: algo={cfg.algo.name} does not weight its loss by the sampler correction (only the "
                          "policy-gradient family does: grpo, rloo, reinforce_pp, gspo, cispo, ppo); drop the setting "
                          "(the mismatch is still logged with rollout.log_mismatch=true or rollout.engine=vllm).")


def check_environment(cfg, online: bool, turn_rewards: bool = False) -> None:
    """``env=...`` (multi-turn episodes, :mod:`prefzoo.environments`): the environment builds (its class's shape, its
    tools' schemas), the budget holds a turn, and the run can play it, before any model loads.

    Raises:
        ConfigError: :func:`prefzoo.environments.check_env`'s reasons; an algorithm that samples nothing (DPO, KTO,
            ...: an environment answers rollouts); ``rollout.engine=vllm`` (episodes run on the hf engine; vLLM's
            engine samples single turns here); ``env.reward_placement=turn`` with a plugin whose advantage is one
            number per trajectory (``turn_rewards``: the plugin declares the capability of that name).
    """
    if cfg.env.name == "none":
        return
    from prefzoo.environments import check_env

    if not online:
        raise ConfigError(f"env={cfg.env.name} plays episodes with an online algorithm's rollouts, and "
                          f"algo={cfg.algo.name} samples nothing; use algo=grpo|rloo|ppo|... or drop env=.")
    if cfg.rollout.engine != "hf":
        raise ConfigError(f"env={cfg.env.name} with rollout.engine={cfg.rollout.engine}: multi-turn episodes run on the "
                          "hf engine (prefzoo's decode loop); use rollout.engine=hf.")
    check_env(cfg)
    if cfg.env.reward_placement == "turn" and not turn_rewards:
        raise ConfigError(f"env.reward_placement=turn with algo={cfg.algo.name}: its advantage is one number per "
                          "trajectory, so step rewards can only add up; use algo=ppo or algo=reinforce_pp (per-token "
                          "returns), or env.reward_placement=trajectory.")


def check_step_rows(cfg, num_minibatches: int, num_samples: int) -> None:
    """``algo.num_minibatches`` cannot exceed the rows of a step (``trainer.batch_size`` x ``algo.num_samples``).

    Raises:
        ConfigError: naming both keys.
    """
    rows = cfg.trainer.batch_size * max(1, num_samples)
    if num_minibatches > rows:
        raise ConfigError(f"algo.num_minibatches={num_minibatches} exceeds the {rows} rows of a step "
                          "(trainer.batch_size x algo.num_samples); lower it or raise trainer.batch_size.")


def has_reference(cfg, declared: bool) -> bool:
    """Whether the run will have a reference policy: declared by the plugin, or free under LoRA (the adapter-disabled
    model, for drift metrics: :func:`prefzoo.training.build.build_parts`, which builds none when weights outside the
    adapter train, ``model.lora.modules_to_save``)."""
    m = cfg.model
    return declared or (m.lora.enabled and not m.adapter_path and m.reference != "copy" and not m.lora.modules_to_save)


def check_kl_budget(cfg, declaration) -> None:
    """``objective.kl_budget`` needs a KL measurement: the online algorithms measure KL(pi || pi_ref) on every step's
    rollouts (metric ``kl``); the others only in held-out evaluations during training.

    Raises:
        ConfigError: a KL budget, but nothing measures the KL during training (no reference, or an offline plugin
            without evaluations during training).
    """
    if cfg.objective.kl_budget is None or not declaration.trains:
        return
    if not has_reference(cfg, declaration.reference):
        raise ConfigError(f"objective.kl_budget is set, but this run has no reference to measure KL against "
                          f"(algo={cfg.algo.name} declares none; the free one, the adapter switched off, needs LoRA "
                          "without model.lora.modules_to_save or model.adapter_path); use LoRA or drop the budget.")
    periodic = cfg.eval.every or cfg.eval.steps or cfg.trainer.early_stopping.metric
    if not declaration.online and not periodic:
        raise ConfigError(f"objective.kl_budget: algo={cfg.algo.name} measures no KL while it trains (it "
                          "samples nothing); set eval.every=N to measure KL(pi || pi_ref) on held-out samples every "
                          "N steps, which the budget then uses.")


def check_reward_shaping(cfg, declaration) -> None:
    """GDPO's per-function normalisation and DAPO's overlong penalty shape an online plugin's training rewards.

    Raises:
        ConfigError: ``reward.aggregation=gdpo`` without groups of >= 2 samples; ``reward.overlong_buffer`` with a plugin
            that trains on no sampled completion.
    """
    d = declaration
    if cfg.reward.aggregation == "gdpo" and not (d.online and d.trains and d.num_samples >= 2):
        raise ConfigError(f"reward.aggregation=gdpo normalises each reward within a prompt's group of samples; "
                          f"algo={cfg.algo.name} samples {d.num_samples} per prompt. Use a group-sampling "
                          "plugin with algo.num_samples >= 2, or reward.aggregation=sum.")
    if cfg.reward.overlong_buffer is not None and not (d.online and d.trains):
        raise ConfigError(f"reward.overlong_buffer shapes the rewards of an online plugin's training samples; "
                          f"algo={cfg.algo.name} trains on none (its data or answers are scored as they are). "
                          "Drop reward.overlong_buffer.")


def check_parallel(cfg, declaration, processes: int) -> None:
    """What runs in one process only: the in-process vLLM engine, the asynchronous rollout worker, dynamic sampling's
    extra draws (``processes``: the launch's data-parallel process count).

    Raises:
        ConfigError: one of them with several processes (or dynamic sampling with asynchronous rollouts).
    """
    r = cfg.rollout
    if r.engine == "vllm" and processes > 1:
        raise ConfigError("rollout.engine=vllm runs one engine beside one trainer process; data parallelism is not "
                          "supported with it yet. Launch one process, or use rollout.engine=hf.")
    if r.asynchronous and declaration.online and processes > 1:
        raise ConfigError("rollout.asynchronous=true runs one rollout worker beside one trainer; data parallelism "
                          f"({processes} processes) is not supported with it yet: drop one of the two.")
    if declaration.draws_prompts and (processes > 1 or r.asynchronous):
        raise ConfigError("algo.dynamic_sampling=true draws more prompts within a step, which prefzoo does in one "
                          "process with synchronous rollouts only; set it to false, or run without data parallelism "
                          "and rollout.asynchronous=false.")


def check_model_parts(cfg, declaration) -> None:
    """What :func:`prefzoo.training.build.build_parts` would refuse once the model is loaded, asked of the config
    before it loads: the weights' dtype for full fine-tuning (:func:`prefzoo.models.precision.check_weight_dtype`),
    a reference mode that cannot give the reference it names (:func:`prefzoo.models.reference.reference_refusal`, with
    ``model.lora.modules_to_save`` as the weights that train outside the adapter), and the value head's adapter
    against gradient checkpointing (:func:`prefzoo.models.value.check_value_adapter`). The same functions run again on
    the built model (a backstop for what the config cannot see, e.g. an adapter folder's own ``modules_to_save``).

    Raises:
        ConfigError: the first of them, in the message the build would give.
    """
    from prefzoo.models.precision import check_weight_dtype
    from prefzoo.models.reference import reference_refusal
    from prefzoo.models.value import check_value_adapter

    m, d = cfg.model, declaration
    check_weight_dtype(m.dtype, m.lora.enabled, d.trains)
    if d.reference:
        refusal = reference_refusal(m.reference, lora_enabled=m.lora.enabled, adapter_loaded=bool(m.adapter_path),
                                    outside=list(m.lora.modules_to_save or []))
        if refusal:
            raise ConfigError(refusal)
    if d.value_head is not None:
        check_value_adapter(d.value_head.adapter, m.gradient_checkpointing)


def check_early_stopping_reported(cfg, declaration) -> None:
    """``trainer.early_stopping.metric`` must be one this run's evaluation reports, not only a metric of the
    evaluation (:func:`prefzoo.validation.references.check_early_stopping_metric`): ``kl_*`` needs a reference
    (:func:`has_reference`), ``gold_*`` the gold reward (``eval.gold_reward.functions``), ``preference_accuracy`` a
    plugin with implicit rewards. Otherwise the run would stop at its first evaluation during training. Whether the
    data carries answers (``task_accuracy``) is known once the data is read; the evaluation refuses it then.

    Raises:
        ConfigError: naming the metric, why this run does not report it, and the fix.
    """
    metric = cfg.trainer.early_stopping.metric
    if metric is None:
        return
    name = metric.removeprefix("ood_").removesuffix("_se")
    why = None
    if name.startswith("kl_") and not has_reference(cfg, declaration.reference):
        why = (f"algo={cfg.algo.name} has no reference here to measure KL against (it declares none, and without LoRA "
               "none comes free); use LoRA or another metric")
    elif name.startswith("gold_") and not cfg.eval.gold_reward.functions:
        why = "there is no gold reward; set eval.gold_reward.functions or choose another metric"
    elif name == "preference_accuracy" and not declaration.has("implicit_rewards"):
        why = (f"algo={cfg.algo.name} has no implicit rewards to rank held-out pairs with; choose another metric "
               "(task_reward, task_accuracy, ...)")
    if why:
        raise ConfigError(f"trainer.early_stopping.metric={metric!r} is not reported by this run: {why}.")


def check_demonstrations(cfg, declaration) -> None:
    """``data.demonstrations=true`` (a built-in task's prompts with their known answers) needs a plugin that trains on
    supervised sequences (``data="sequences"``: SFT) and a built-in task with known answers, not a file.

    Raises:
        ConfigError: a plugin that samples its own data or trains on pairs or labelled rows; ``data.path`` given
            (a file's rows are read as they are); the sentiment task (no known answers).
    """
    d = cfg.data
    if not d.demonstrations:
        return
    if declaration.online or declaration.data != "sequences":
        what = "samples its own completions" if declaration.online else f"trains on {declaration.data}"
        raise ConfigError(f"data.demonstrations=true: algo={cfg.algo.name} {what}; demonstrations are one known answer "
                          "per prompt, what algo=sft trains on. Use algo=sft, or drop data.demonstrations.")
    if d.path:
        raise ConfigError(f"data.demonstrations=true applies to the built-in tasks' known answers, not to data.path="
                          f"{d.path} (a file's rows are read as they are: give a prompt/completion file). Drop one.")
    if d.name not in ("arithmetic", "reasoning_gym"):
        raise ConfigError(f"data.demonstrations=true: data={d.name} has no known answers to demonstrate; use "
                          "data=arithmetic or data=reasoning_gym.")
