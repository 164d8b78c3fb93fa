"""Glue between Hydra and the training loop: typed config, logging set-up, clear errors, the run folder.

``python -m prefzoo.cli pairs [overrides]`` builds (or finds) the cached built-in preference pairs
(:func:`build_pairs`).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from prefzoo import config as _config
from prefzoo.config import Config
from prefzoo.errors import ConfigError, PrefzooError, RunFolderError

log = logging.getLogger("prefzoo")

#: Config keys renamed for one spelling each (DESIGN.md's glossary): old key -> new key. A command line that uses
#: an old key fails with a message naming the new one (:func:`check_renamed_keys`).
RENAMED_KEYS = {
    "algo.num_generations": "algo.num_samples",
    "algo.num_iterations": "algo.epochs",
    "algo.epsilon_low": "algo.clip_eps_low",
    "algo.epsilon_high": "algo.clip_eps_high",
    "algo.clip_range": "algo.clip_eps_low and algo.clip_eps_high",
    "algo.value_clip_range": "algo.value_clip_eps",
    "algo.gamma": "algo.gae_gamma",
    "algo.lam": "algo.gae_lambda",
    "data.pairs.samples_per_prompt": "data.pairs.num_samples",
    "rollout.is_correction_cap": "rollout.correction.mode=token_truncate rollout.correction.clip_max=C",
    "rollout.async": "rollout.asynchronous (async is a Python keyword, and config keys are attributes)",
    "algo_tuning": "the algorithm's config (algo.default_temperature, algo.default_batch_size); conf/algo_tuning is gone",
}


#: keys renamed for one algorithm only (the same key is current for the others): algo name -> {old key: new key}
RENAMED_KEYS_OF = {
    "cispo": {"algo.clip_eps_low": "algo.is_clip_eps_low (CISPO bounds an importance WEIGHT, not PPO's ratio)",
              "algo.clip_eps_high": "algo.is_clip_eps_high (CISPO bounds an importance WEIGHT, not PPO's ratio)"},
}


def check_renamed_keys(overrides: list[str]) -> None:
    """Raise :class:`ConfigError` naming the new key when a command-line override uses a renamed one (of every
    algorithm, or of the ``algo=`` the overrides choose)."""
    chosen = [item.split("=", 1)[1] for item in overrides if item.lstrip("+~").split("=", 1)[0] == "algo"]
    renamed = dict(RENAMED_KEYS)
    for name in chosen[-1].split(",") if chosen else ():
        renamed.update(RENAMED_KEYS_OF.get(name.strip(), {}))
    for item in overrides:
        key = item.lstrip("+~").split("=", 1)[0]
        if key in renamed:
            raise ConfigError(f"{key} was renamed: use {renamed[key]} (prefzoo uses one spelling per quantity; "
                              "see docs/algorithms.md, 'Renamed keys').")


def reject_renamed_keys(argv: list[str]) -> None:
    """:func:`check_renamed_keys` for a command line: print the one-line error and exit with status 2."""
    try:
        check_renamed_keys([a for a in argv if "=" in a and not a.startswith("-")])
    except ConfigError as err:
        print(f"prefzoo: error: {err}", file=sys.stderr)
        sys.exit(2)


def register_configs() -> None:
    """Register the typed schemas and every plugin's config with Hydra (built-ins, and installed plugins of the
    ``prefzoo.algorithms`` entry-point group, which become ``algo=<name>`` without a yaml)."""
    from prefzoo.algos import REGISTRY, entry_point_algorithms, get_algorithm
    from prefzoo.report.sweep_dirs import register_resolver

    register_resolver()  # ${prefzoo.job_dirname:} in hydra.sweep.subdir (conf/config.yaml)
    extra = {}
    for name in entry_point_algorithms():
        if name not in REGISTRY:
            extra[name] = get_algorithm(name).config_class
    _config.register_configs({n: c.config_class for n, c in REGISTRY.items()}, extra)


@dataclass
class Preflight:
    """What the pre-flight checked, for the run to use as it is: the typed config and its plugin (built once)."""

    config: Config
    algo: Any  # prefzoo.algos.Algorithm (imported lazily: the plugins load with the pre-flight)


def to_typed(cfg: DictConfig) -> Config:
    """Hydra's composed config -> the typed, resolved and validated :class:`~prefzoo.config.Config` (:func:`preflight`'s
    config).

    Raises:
        ConfigError: no or an unknown algorithm, a bad value, a bad combination (one line naming the key).
        PluginError: ``algo.target`` names something that is not a plugin.
    """
    return preflight(cfg).config


def preflight(cfg: DictConfig) -> Preflight:
    """Hydra's composed config -> the typed, resolved and validated config and its plugin, before any model loads:
    the algorithm exists (built-in, installed, or ``algo=custom algo.target=...``), the run's values are valid, and
    the plugin's own settings pass its ``validate_settings`` against the resolved objective. The plugin is built here
    once (:func:`prefzoo.training.plugin.build_algorithm`) and the run trains that very object.

    Raises:
        ConfigError: no or an unknown algorithm, a bad value, a bad combination (one line naming the key).
        PluginError: ``algo.target`` names something that is not a plugin.
    """
    from prefzoo.algos import get_algorithm, load_target

    if OmegaConf.is_missing(cfg, "algo") or "name" not in cfg.algo:
        raise ConfigError("no algorithm chosen: add algo=<name> (e.g. algo=dpo).")
    target = cfg.algo.get("target") if not OmegaConf.is_missing(cfg.algo, "target") else None
    if cfg.algo.name == "custom" and not target:
        raise ConfigError("algo=custom needs algo.target=<import path of your plugin class>, e.g. "
                          "algo.target=my_pkg.algos:MyAlgo.")
    if target:
        cls = load_target(str(target))
        given = {k: v for k, v in OmegaConf.to_container(cfg.algo, resolve=True).items() if k != "name"}
        try:
            node = OmegaConf.merge(OmegaConf.structured(cls.config_class), given)
        except Exception as err:  # an unknown key or a wrong type for the plugin's config
            raise ConfigError(f"algo.target={target}: {err}".splitlines()[0]) from None
        node.name = cls.name
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.algo = node
    else:
        cls = get_algorithm(cfg.algo.name)
    typed = _config.to_typed(cfg)
    from prefzoo.training.plugin import build_algorithm
    from prefzoo.validation import (check_batch_size, check_correction_support, check_environment, check_kl_controller,
                                    check_names, check_references, check_teacher, warn_idle)

    check_names(typed)  # the annotator, eval.ood's shifted task: names in the data's registries

    algo = build_algorithm(typed)  # runs the plugin's validate_settings on the resolved objective
    declaration = algo.declaration
    from prefzoo.training.distributed import launched_world_size

    check_batch_size(typed, declaration.min_batch_size, launched_world_size())  # rows per process and step
    check_kl_controller(typed, declaration.has("adaptive_beta"))
    # env=...: the class's shape, the budget and the reward placement, before any model loads
    check_environment(typed, declaration.online, declaration.has("turn_rewards"))
    check_correction_support(typed, declaration.has("sampler_correction"))  # rollout.correction.* honoured?
    check_references(typed, declaration.num_samples)  # early-stopping metric, adapter folder, reward functions
    check_teacher(declaration.teacher)  # algo=distill: a teacher prefzoo can load
    if typed.reward.aggregation == "gdpo" and not (declaration.online and declaration.trains
                                                   and declaration.num_samples >= 2):
        raise ConfigError(f"reward.aggregation=gdpo normalises each reward within a prompt's group of samples; "
                          f"algo={typed.algo.name} samples {declaration.num_samples} per prompt. Use a group-sampling "
                          "plugin with algo.num_samples >= 2, or reward.aggregation=sum.")
    if typed.reward.overlong_buffer is not None and not (declaration.online and declaration.trains):
        raise ConfigError(f"reward.overlong_buffer shapes the rewards of an online plugin's training samples; "
                          f"algo={typed.algo.name} trains on none (its data or answers are scored as they are). "
                          "Drop reward.overlong_buffer.")
    if declaration.draws_prompts and (launched_world_size() > 1 or typed.rollout.asynchronous):
        raise ConfigError("algo.dynamic_sampling=true draws more prompts within a step, which prefzoo does in one "
                          "process with synchronous rollouts only; set it to false, or run without data parallelism "
                          "and rollout.asynchronous=false.")
    from prefzoo.training.trackers import check_report_to

    check_report_to(typed)  # trainer.report_to: known trackers, their packages installed
    from prefzoo.validation import check_rollout_servers

    check_rollout_servers(typed)  # rollout.engine=vllm_server: the servers answer and serve the run's model
    warn_idle(typed, declaration.trains, declaration.uses_beta)
    return Preflight(typed, algo)


def run_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under Hydra (tests calling run_from_hydra directly)
        return Path.cwd()


def in_multirun() -> bool:
    """Whether this job is part of a Hydra sweep (``-m``); False outside Hydra or when its mode is unset."""
    if not HydraConfig.initialized():
        return False
    mode = getattr(HydraConfig.get(), "mode", None)
    return getattr(mode, "name", None) == "MULTIRUN"


def secondary_process_overrides(argv: list[str]) -> list[str]:
    """``argv`` plus, in a process other than rank 0 of a multi-process launch (torchrun, accelerate launch),
    Hydra overrides that keep it from writing a run folder, ``.hydra/`` or log files of its own: every process
    works in the main process's run folder (see :func:`run_from_hydra`), where only the main process writes."""
    from prefzoo.training.distributed import launched_rank, launched_world_size

    if launched_world_size() <= 1 or launched_rank() == 0:
        return argv
    extra = ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    if not any(a.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for a in argv):
        extra.append("hydra.run.dir=.")  # a folder that exists: nothing is written there
    return list(argv) + extra


def check_data(typed, declaration) -> None:
    """The first pass over ``data.path`` (:func:`prefzoo.data.check.check_data_file`), before the loop is imported;
    ``declaration``: the plugin's (online plugins read no preference file; offline ones pairs or unpaired rows)."""
    from prefzoo.data.check import check_data_file

    check_data_file(typed, declaration.online, declaration.data)


def run_from_hydra(cfg: DictConfig) -> float | None:
    """Validate ``cfg`` (before any model loads), train, and print where the results are.

    Under several processes (``accelerate launch`` / ``torchrun``), the process group is set up first and
    every process uses the main process's run folder (Hydra names it after the time, which may differ by a
    second between processes); only the main process writes the resolved config and prints.

    Returns the run's headline metric (for Hydra sweepers), or exits with status 2 and a one-paragraph
    message on a configuration, data, model or reward error.
    """
    try:
        checked = preflight(cfg)
        typed = checked.config
        check_data(typed, checked.algo.declaration)  # a bad data file fails here, in seconds (prefzoo.data.check)
        from prefzoo.training.distributed import setup_data_parallel
        from prefzoo.training.loop import Trainer, write_resolved_config
        from prefzoo.training.run_folder import open_run_folder
        from prefzoo.training.setup import pick_device

        dp = setup_data_parallel(typed, pick_device(typed.trainer.device))
        out = Path(dp.broadcast_object(str(run_dir())))
        folder = open_run_folder(typed, out, dp)  # writable, not in use, resumable with this config: before config.yaml
        if dp.is_main:
            write_resolved_config(typed, out)
        summary = Trainer(typed, out, dp, folder=folder, algo=checked.algo).run()
    except PrefzooError as err:
        from prefzoo.training.distributed import launched_rank

        if launched_rank() == 0 or not isinstance(err, (ConfigError, RunFolderError)):  # the same error everywhere
            print(f"prefzoo: error: {err}", file=sys.stderr)
        if in_multirun():  # let Hydra record the failed job and go on with the sweep
            raise
        sys.exit(2)
    if dp.is_main:
        print(f"[prefzoo] run folder: {out}  (summary.json, metrics.jsonl, eval_*.json, adapter/)", flush=True)
    dp.close()
    after = summary.get("eval_after") or {}
    return after.get("task_accuracy", after.get("task_reward"))


def build_pairs(argv: list[str] | None = None) -> int:
    """``python -m prefzoo.cli pairs [overrides]``: build (or find) the cached pairs and print where they are. It
    samples them from the model even where a set ships with prefzoo for these settings (a shipped copy in the cache is
    replaced), so the shipped set can be rebuilt and compared.

    Takes the same overrides as ``train.py`` (e.g. ``data.pairs.num_prompts=512 reward=sentiment``). A prefzoo
    error is printed as one line (``prefzoo: error: ...``) and the exit status is 2.
    """
    import json

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from prefzoo.models.loading import cache_dir, load_tokenizer
    from prefzoo.training.setup import build_reward, pick_device, preference_data, task_prompts

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    register_configs()
    conf = Path(__file__).resolve().parent / "conf"  # packaged with prefzoo (prefzoo/conf), installed or in a clone
    try:
        with initialize_config_dir(config_dir=str(conf), version_base=None):
            cfg = to_typed(compose("config", overrides=list(sys.argv[1:] if argv is None else argv)))
        tokenizer = load_tokenizer(cfg.model.name)
        train, held = task_prompts(cfg, tokenizer)
        data, stats = preference_data(cfg, tokenizer, build_reward(cfg), train, held, pick_device(cfg.trainer.device),
                                      shipped=False)  # sampled from the model, also where a set ships with prefzoo
    except (PrefzooError, HydraException) as err:  # a bad override or value: one line, no traceback
        print("prefzoo: error: " + "; ".join(line.strip() for line in str(err).splitlines() if line.strip()),
              file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2))
    print(f"{len(data.train)} train pairs, {len(data.eval)} held-out pairs, cached in {cache_dir() / 'pairs'}")
    return 0


#: ``python -m prefzoo.cli COMMAND [overrides]``
COMMANDS = {"pairs": build_pairs}


def main(argv: list[str] | None = None) -> int:
    """``python -m prefzoo.cli COMMAND [overrides]`` (training itself is ``python train.py [overrides]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        got = f"got {argv[0]!r}" if argv else "got none"
        print(f"prefzoo: error: python -m prefzoo.cli needs a command: {', '.join(COMMANDS)} ({got}); "
              "e.g. `python -m prefzoo.cli pairs data.pairs.num_prompts=64`", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
