"""The pre-flight's checks of names and paths: what the config names exists in a registry of the data, the rewards or
the evaluation, or on disk (an adapter, a model folder, a distillation teacher that fits the student), and holds no
pickled weights. Importing a reward function runs its module: that is user code by design."""

from __future__ import annotations

import os

from prefzoo.errors import ConfigError
from prefzoo.models.files import pickled_adapter, pickled_model

__all__ = ["check_names", "check_annotator", "check_early_stopping_metric", "check_ood_eval", "check_adapter_path",
           "check_teacher", "check_teacher_fits", "check_reward_functions", "check_model_name", "check_references"]


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
