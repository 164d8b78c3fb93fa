"""Configuration checks beyond single values: what the config names exists in a registry of the data, the rewards,
the evaluation or on disk. The command line's pre-flight (:func:`prefzoo.cli.preflight`) runs them after
:func:`prefzoo.config.validate` (the values alone, which imports none of these rooms), before anything loads.

* :func:`check_names`: ``data.pairs.annotator`` names an annotator of the built-in pairs (:func:`check_annotator`);
  ``eval.ood`` is a shifted task disjoint from the training one (:func:`check_ood_eval`); a reasoning-gym
  ``data.system_prompt`` that is a single word names one of reasoning-gym's prompts.
* :func:`check_references`: what the config names exists. ``trainer.early_stopping.metric`` is a metric the
  evaluation reports; ``model.adapter_path`` is a folder holding ``adapter_config.json``; every reward function
  (``reward.functions``, ``eval.gold_reward.functions``) imports, is callable and takes ``(prompts,
  completions, **columns)``. Importing a reward function runs its module: that is user code by design.
* :func:`check_batch_size`: ``trainer.batch_size`` gives each process the rows per step the plugin declares it
  needs (``Declaration.min_batch_size``: KTO's z0 pairs each row with another row's completion).
* :func:`check_kl_controller`: ``objective.kl_controller=adaptive`` only with a plugin that adapts beta (capability
  ``adaptive_beta``); any other would keep beta fixed while the config says adaptive.
* :func:`warn_idle`: legal values that make a run do nothing (``trainer.lr=0``) are warned about.
* :func:`check_rollout_servers`: ``rollout.engine=vllm_server``: every server in ``rollout.servers`` answers, serves
  the run's base model with room for its tokens, and loads adapters at run time
  (:func:`prefzoo.rollout.vllm_server.check_servers`).
"""

from __future__ import annotations

import logging
import os

from prefzoo.errors import ConfigError
from prefzoo.models.files import pickled_adapter, pickled_model

log = logging.getLogger("prefzoo.config")

__all__ = ["check_teacher", "check_teacher_fits", "check_names", "check_annotator", "check_ood_eval", "check_early_stopping_metric", "check_adapter_path",
           "check_model_name",
           "check_reward_functions", "check_references", "check_batch_size", "check_kl_controller", "warn_idle",
           "check_rollout_servers", "warn_ignored", "check_divergence_support", "check_explicit_reward"]


def check_names(cfg) -> None:
    """The registry names of the data settings: :func:`check_annotator` and :func:`check_ood_eval`.

    Raises:
        ConfigError: naming the key, its value and the valid ones.
    """
    check_annotator(cfg.data.pairs)
    check_ood_eval(cfg)  # eval.ood: a shifted task that shares no problem with the training one
    if cfg.data.name == "reasoning_gym":
        from prefzoo.data.reasoning_gym import check_system_prompt

        check_system_prompt(cfg.data.system_prompt)  # a misspelt name would become every prompt's system message


def check_annotator(pairs) -> None:
    """``data.pairs.annotator`` names an annotator of :mod:`prefzoo.data.pairs` (``length_bias``, a value, is
    :func:`prefzoo.config.validate`'s).

    Raises:
        ConfigError: naming the key, its value and the valid ones.
    """
    from prefzoo.data.pairs import ANNOTATORS

    if pairs.annotator not in ANNOTATORS:
        raise ConfigError(f"data.pairs.annotator={pairs.annotator!r} is not valid; choose one of: "
                          f"{', '.join(ANNOTATORS)} (gold: the verifier labels the pairs; longer: a length-biased "
                          "annotator, see prefzoo.data.pairs).")


def check_early_stopping_metric(cfg, num_samples: int = 0) -> None:
    """``trainer.early_stopping.metric`` must be a metric of the held-out evaluation (see
    :mod:`prefzoo.evaluation.metrics`); ``num_samples``: the algorithm's declared ``num_samples`` (pass@k)."""
    from prefzoo.evaluation.metrics import metric_names

    metric = cfg.trainer.early_stopping.metric
    if metric is None:
        return
    valid = metric_names(num_samples, ood=_ood_enabled(cfg))
    if metric not in valid:
        shown = [n for n in valid if not n.endswith("_se")]
        raise ConfigError(f"trainer.early_stopping.metric={metric!r} is not a metric of the evaluation; choose one "
                          f"of: {', '.join(shown)} (or one's standard error <name>_se).")


def _ood_enabled(cfg) -> bool:
    from prefzoo.data.ood import ood_enabled

    return ood_enabled(cfg.eval.ood)


def check_ood_eval(cfg) -> None:
    """``eval.ood``: a shifted arithmetic task disjoint from the training one (:func:`prefzoo.data.ood.check_ood`).

    Raises:
        ConfigError: naming the ``eval.ood`` key and how to fix it.
    """
    from prefzoo.data.ood import check_ood

    check_ood(cfg.data, cfg.eval.ood, cfg.eval.num_problems)


def check_adapter_path(cfg) -> None:
    """``model.adapter_path`` must be a folder holding a peft adapter (``adapter_config.json``)."""
    path = cfg.model.adapter_path
    if not path:
        return
    if not os.path.isdir(path):
        what = "is a file, not a folder" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"model.adapter_path={path!r} {what}; give the folder of a trained adapter (it holds "
                          "adapter_config.json, e.g. <run folder>/adapter).")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        inner = os.path.join(path, "adapter")
        hint = (f" It looks like a run folder: use model.adapter_path={inner}."
                if os.path.isfile(os.path.join(inner, "adapter_config.json")) else "")
        raise ConfigError(f"model.adapter_path={path!r} holds no adapter_config.json, so it is not a peft adapter "
                          f"folder.{hint} Give the adapter/ folder of a run that trained with LoRA.")
    unsafe = pickled_adapter(path)
    if unsafe:
        raise ConfigError(f"model.adapter_path={path!r}: {unsafe}")


def check_teacher(spec: str | None) -> None:
    """A distillation teacher (``algo.teacher``, :class:`~prefzoo.algos.base.Declaration`'s ``teacher``) that names a
    local folder must be one prefzoo can load: a finished run (``config.yaml`` beside ``adapter/`` or ``model/``), a
    peft adapter folder (``adapter_config.json``) or a model folder (``config.json``). A name that is not on disk is
    taken for a Hugging Face id (loaded, or refused, with the model); one written as a path (``/``, ``.``, ``~``) must
    exist."""
    if spec is None:
        return
    path = os.path.expanduser(spec)
    if not os.path.exists(path):
        if spec.startswith(("/", ".", "~")):
            raise ConfigError(f"algo.teacher={spec!r} does not exist; give a finished run's folder, a LoRA adapter "
                              "folder, or a model path or id.")
        return
    if not os.path.isdir(path):
        raise ConfigError(f"algo.teacher={spec!r} is a file, not a folder; give a finished run's folder, a LoRA adapter "
                          "folder, or a model folder.")
    has = lambda name: os.path.exists(os.path.join(path, name))  # noqa: E731
    if has("adapter_config.json") or has("config.json"):
        return
    if has("config.yaml") and not (has("adapter") or has("model")):
        raise ConfigError(f"algo.teacher={spec!r} is a run folder with no adapter/ or model/ yet (an unfinished run?); "
                          "finish it (trainer.resume=true hydra.run.dir=<folder>) or give a finished run's folder.")
    if not (has("config.yaml") or has("adapter") or has("model")):
        raise ConfigError(f"algo.teacher={spec!r} holds no run (config.yaml with adapter/ or model/), no adapter "
                          "(adapter_config.json) and no model (config.json); give one of those folders.")


def check_teacher_fits(cfg, spec: str | None) -> None:
    """A distillation teacher must share the student's vocabulary and, as an adapter, fit the student's base model:
    checked here, before any model loads, from the tokenizers, the configs and the adapter's safetensors header
    (:mod:`prefzoo.models.files`); :func:`prefzoo.training.trained.build_teacher` loads it afterwards. A run folder's
    tokenizer (its ``config.yaml``'s model) or a model's must be the student's; a model's output layer must cover the
    tokenizer's tokens; an adapter folder's LoRA shapes must fit this run's base model; weights that are only pickles are
    refused.

    Raises:
        ConfigError: another vocabulary, a tokenizer that cannot be read, too few output rows, pickled weights.
        ModelError: an adapter of another base model (the tensor and the layer named).
    """
    if spec is None:
        return
    from omegaconf import OmegaConf

    from prefzoo.errors import ModelError
    from prefzoo.models.files import adapter_mismatch, base_config, vocabulary_mismatch
    from prefzoo.models.loading import load_tokenizer

    who = f"algo.teacher={spec}"
    path = os.path.expanduser(spec)
    student = load_tokenizer(cfg.model.name)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        unsafe = pickled_adapter(path)
        if unsafe:
            raise ConfigError(f"{who}: {unsafe}")
        why = adapter_mismatch(path, base_config(cfg.model, student))
        if why:
            raise ModelError(f"{who}: the adapter {path} does not load on its base model ({why}); an adapter loads on "
                             "the model it was trained on (a run folder names its base in config.yaml).")
        return
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, n)) for n in ("config.yaml", "adapter", "model")):
        try:
            name = str(OmegaConf.load(os.path.join(path, "config.yaml")).model.name)
        except Exception:  # noqa: BLE001 -- an unreadable run config: the loader's one-line error says it
            return
        why = vocabulary_mismatch(student, load_tokenizer(name))
        if why:
            raise ConfigError(f"{who}: the teacher run's tokenizer ({name}, {why}) is not the student's ({cfg.model.name})"
                              "; distillation compares next-token distributions over one vocabulary.")
        return
    name = path if os.path.exists(path) else spec
    if name in ("smollm2", "tiny"):  # (the built-in names use the student's tokenizer)
        return
    if os.path.isdir(name):
        unsafe = pickled_model(name)
        if unsafe:
            raise ConfigError(f"{who}: {unsafe}")
    from prefzoo.errors import ModelError as _ModelError

    try:
        teacher = load_tokenizer(name)
    except _ModelError as err:
        raise ConfigError(f"{who}: its tokenizer cannot be read ({err}), so its vocabulary cannot be checked against "
                          "the student's; give a model folder with its tokenizer files.") from None
    why = vocabulary_mismatch(student, teacher)
    if why:
        raise ConfigError(f"{who}: the teacher's tokenizer ({why}) is not the student's ({cfg.model.name}); "
                          "distillation compares next-token distributions over one vocabulary.")
    try:
        from transformers import AutoConfig

        rows = int(AutoConfig.from_pretrained(name).vocab_size)
    except Exception:  # noqa: BLE001 -- no config to read: the loader's error says it
        return
    if rows < len(student):
        raise ConfigError(f"{who}: the teacher's output layer covers {rows} tokens, the student's tokenizer has "
                          f"{len(student)}; the teacher must share the student's vocabulary.")


def check_reward_functions(cfg) -> None:
    """Every reward function the run will call resolves (module, attribute, callable) and takes
    ``(prompts, completions, **columns)``; the columns themselves are checked once the data is read
    (:func:`prefzoo.training.setup.check_reward_columns`)."""
    from prefzoo.rewards.registry import check_reward_signature, resolve_reward

    specs = [] if cfg.reward.name == "model" else [("reward.functions", s) for s in cfg.reward.functions]
    specs += [("eval.gold_reward.functions", s) for s in cfg.eval.gold_reward.functions]
    for key, spec in specs:
        try:
            check_reward_signature(spec, resolve_reward(spec))
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None


def check_model_name(cfg) -> None:
    """``model.name`` written as a local path (``/``, ``./``, ``../`` or ``~`` first) must be a folder that exists;
    anything else not a built-in name is a Hugging Face model id (or a folder).

    Raises:
        ConfigError: naming the key, the path and what to give instead.
    """
    name = cfg.model.name
    if name in ("smollm2", "tiny"):
        return
    path = os.path.expanduser(name)
    if name.startswith(("/", "./", "../", "~")) and not os.path.isdir(path):
        what = "is a file, not a folder" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"model.name={name!r} {what}; give a model folder (with config.json and the weights), a "
                          "Hugging Face model id (org/name), or model=smollm2 / model=tiny.")
    unsafe = pickled_model(path) if os.path.isdir(path) else None
    if unsafe:
        raise ConfigError(f"model.name={name!r}: {unsafe}")


def check_references(cfg, num_samples: int = 0) -> None:
    """The checks of names and paths (see the module docstring); raise :class:`ConfigError` on the first."""
    check_early_stopping_metric(cfg, num_samples)
    check_model_name(cfg)
    check_adapter_path(cfg)
    check_reward_functions(cfg)


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


def warn_idle(cfg, trains: bool, uses_beta: bool = True) -> None:
    """Warn about legal values that make a training run change nothing, and a beta the plugin does not use."""
    if not uses_beta and cfg.objective.beta:
        log.warning("objective.beta=%g does nothing for algo=%s: its loss has no divergence term (the summary records "
                    "beta as null); leave objective.beta unset.", cfg.objective.beta, cfg.algo.name)
    if trains and cfg.trainer.lr == 0 and cfg.trainer.max_steps > 0:
        log.warning("trainer.lr=0: the optimizer leaves every weight as it is, so the %d steps train nothing; "
                    "give a learning rate > 0, e.g. trainer.lr=2e-4.", cfg.trainer.max_steps)


def warn_ignored(cfg, online: bool) -> None:
    """One warning per setting that cannot apply to this run, though it changes nothing (round 4 of bad inputs): the
    run goes on as it would without it, and the line says what to drop. ``online``: the plugin samples its own
    training data (an offline plugin samples nothing: the rollout settings do not apply)."""
    from prefzoo.config import EnvConfig, RewardConfig, RolloutConfig

    r, e, rw = cfg.rollout, cfg.env, cfg.reward
    rollout_default = RolloutConfig()
    ignored = [
        (e.name != "retry" and e.turn_cost != EnvConfig().turn_cost,
         f"env.turn_cost={e.turn_cost} is env=retry's cost of another attempt, and this run plays env={e.name}"),
        (r.correction.mode is None and not r.correction.weight_kl,
         "rollout.correction.weight_kl=false weighs nothing without rollout.correction.mode (there are no weights)"),
        (not online and r.log_mismatch, f"rollout.log_mismatch=true: algo={cfg.algo.name} samples nothing to compare"),
        (not online and r.top_k != rollout_default.top_k,
         f"rollout.top_k={r.top_k}: algo={cfg.algo.name} samples nothing while it trains (the evaluation samples "
         "without top-k)"),
        (not online and r.asynchronous, f"rollout.asynchronous=true: algo={cfg.algo.name} samples no training batch"),
        (rw.overlong_buffer is None and rw.overlong_penalty != RewardConfig().overlong_penalty,
         f"reward.overlong_penalty={rw.overlong_penalty} applies over reward.overlong_buffer tokens, and none is set"),
        (bool(cfg.eval.steps) and max(cfg.eval.steps) > cfg.trainer.max_steps,
         f"eval.steps={list(cfg.eval.steps)} lists steps past trainer.max_steps={cfg.trainer.max_steps} (those "
         "evaluations never happen)"),
    ]
    for applies, what in ignored:
        if applies:
            log.warning("%s: the setting is ignored; drop it.", what)
    if r.dtype == "float16" and _device_type(cfg) == "cpu":
        log.warning("rollout.dtype=float16 on a CPU: float16 matmuls have no native kernels here and run far slower "
                    "than float32 (20x measured); use rollout.dtype=bfloat16 (native on CPUs with AVX512-BF16 or AMX) "
                    "or leave it unset.")


def _device_type(cfg) -> str:
    import torch

    device = cfg.trainer.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


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


def check_rollout_servers(cfg) -> None:
    """``rollout.engine=vllm_server``: ask each server in ``rollout.servers`` what it serves, before any model loads
    (:func:`prefzoo.rollout.vllm_server.check_servers`); nothing for the other engines.

    Raises:
        ConfigError: a server that does not answer, serves another base model, has too short a context, or cannot
            load adapters at run time (one line naming ``rollout.servers[i]`` and the fix).
    """
    r = cfg.rollout
    if r.engine != "vllm_server":
        return
    from prefzoo.rollout.vllm_server import check_servers, served_model_name

    folder = r.vllm.adapter_dir
    if folder is not None:  # the adapters are written here: a folder this process can write (made if missing)
        from pathlib import Path

        path = Path(folder).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
            ok = path.is_dir() and os.access(path, os.W_OK)
        except OSError:
            ok = False
        if not ok:
            raise ConfigError(f"rollout.vllm.adapter_dir={folder!r} is not a folder this process can write; give a "
                              "writable folder every server reads at the same path (a shared file system across "
                              "machines), or drop it for a temporary one (servers on this machine).")
    m = cfg.model
    name = served_model_name(m.name, tiny_hidden_size=m.tiny_hidden_size, tiny_layers=m.tiny_layers, seed=cfg.trainer.seed)
    check_servers(list(r.servers), name, cfg.data.max_prompt_length + max(r.max_new_tokens, cfg.eval.max_new_tokens))


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
    model, for drift metrics: :func:`prefzoo.training.build.build_parts`)."""
    m = cfg.model
    return declared or (m.lora.enabled and not m.adapter_path and m.reference != "copy")


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
                          f"(algo={cfg.algo.name} without LoRA loads none); use LoRA or drop the budget.")
    periodic = cfg.eval.every or cfg.eval.steps or cfg.trainer.early_stopping.metric
    if not declaration.online and not periodic:
        raise ConfigError(f"objective.kl_budget: algo={cfg.algo.name} measures no KL while it trains (it "
                          "samples nothing); set eval.every=N to measure KL(pi || pi_ref) on held-out samples every "
                          "N steps, which the budget then uses.")
