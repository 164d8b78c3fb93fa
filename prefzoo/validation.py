"""Configuration checks beyond single values, run by :func:`prefzoo.config.validate` before anything loads.

* :func:`check_finite`: no float anywhere in the typed config (objective, trainer, data, model, rollout, eval,
  the algorithm's own settings, lists of weights) is NaN or infinite. A generic walk over the dataclasses, so a
  float key added later is covered without a line here.
* :func:`check_annotator`: ``data.pairs.annotator`` names an annotator of the built-in pairs, ``length_bias`` is
  in [0, 1].
* :func:`check_references`: what the config names exists. ``trainer.early_stopping.metric`` is a metric the
  evaluation reports; ``model.adapter_path`` is a folder holding ``adapter_config.json``; every reward function
  (``reward.functions``, ``eval.gold_reward.functions``) imports, is callable and takes ``(prompts,
  completions, **columns)``. Importing a reward function runs its module: that is user code by design.
* :func:`check_batch_size`: ``trainer.batch_size`` gives each process the rows per step the plugin declares it
  needs (``Declaration.min_batch_size``: KTO's z0 pairs each row with another row's completion).
* :func:`check_kl_controller`: ``objective.kl_controller=adaptive`` only with a plugin that adapts beta (capability
  ``adaptive_beta``); any other would keep beta fixed while the config says adaptive.
* :func:`warn_idle`: legal values that make a run do nothing (``trainer.lr=0``) are warned about.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Iterator

from prefzoo.errors import ConfigError

log = logging.getLogger("prefzoo.config")

__all__ = ["non_finite_floats", "check_finite", "check_annotator", "check_early_stopping_metric", "check_adapter_path",
           "check_reward_functions", "check_references", "check_batch_size", "check_kl_controller", "warn_idle"]


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
    """Raise :class:`ConfigError` naming the first key of ``cfg`` whose value is NaN or infinite."""
    for key, value, optional in non_finite_floats(cfg):
        raise ConfigError(f"{key}={value} is not a finite number; give a finite value"
                          f"{f' (or {key}=null)' if optional else ''}.")


def check_annotator(pairs) -> None:
    """``data.pairs.annotator`` names an annotator of :mod:`prefzoo.data.pairs` and ``length_bias`` is a probability.

    Raises:
        ConfigError: naming the key, its value and the valid ones.
    """
    from prefzoo.data.pairs import ANNOTATORS

    if pairs.annotator not in ANNOTATORS:
        raise ConfigError(f"data.pairs.annotator={pairs.annotator!r} is not valid; choose one of: "
                          f"{', '.join(ANNOTATORS)} (gold: the verifier labels the pairs; longer: a length-biased "
                          "annotator, see prefzoo.data.pairs).")
    if not 0 <= pairs.length_bias <= 1:
        raise ConfigError(f"data.pairs.length_bias={pairs.length_bias} must be in [0, 1]: the probability that "
                          "data.pairs.annotator=longer prefers the longer answer over the verifier's better one.")


def check_early_stopping_metric(cfg, group_size: int = 0) -> None:
    """``trainer.early_stopping.metric`` must be a metric of the held-out evaluation (see
    :mod:`prefzoo.evaluation.metrics`); ``group_size``: the algorithm's declared ``num_samples`` (pass@k)."""
    from prefzoo.evaluation.metrics import metric_names

    metric = cfg.trainer.early_stopping.metric
    if metric is None:
        return
    valid = metric_names(group_size, ood=_ood_enabled(cfg))
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


def check_references(cfg, group_size: int = 0) -> None:
    """The checks of names and paths (see the module docstring); raise :class:`ConfigError` on the first."""
    check_early_stopping_metric(cfg, group_size)
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


def warn_idle(cfg, trains: bool) -> None:
    """Warn about legal values that make a training run change nothing."""
    if trains and cfg.trainer.lr == 0 and cfg.trainer.max_steps > 0:
        log.warning("trainer.lr=0: the optimizer leaves every weight as it is, so the %d steps train nothing; "
                    "give a learning rate > 0, e.g. trainer.lr=2e-4.", cfg.trainer.max_steps)
