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
from prefzoo.errors import (ConfigError, EnvironmentFailure, PrefzooError, RewardError, RunFolderError, UserCodeError,
                            describe_error, user_code_frame)

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
    "distill": {"algo.loss_type": "algo=distill for the JSD, algo=teacher_reward for the teacher's log-ratio as a "
                                  "per-token reward (loss_type=teacher_reward is its own plugin now)",
                "algo.discount": "algo=teacher_reward's algo.discount (the reward-to-go is algo=teacher_reward's, "
                                 "algo=distill's JSD has none)"},
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
    from prefzoo.training.names import register_algo_name_resolver

    register_resolver()  # ${prefzoo.job_dirname:} in hydra.sweep.subdir (conf/config.yaml)
    register_algo_name_resolver()  # ${prefzoo.algo_name:} in hydra.run.dir
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


def plugin_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` with its ``algo`` node the chosen plugin's config: a built-in's or an installed one's as composed, or
    ``algo=custom algo.target=...``'s class's schema merged with the given keys (checked: the class is a plugin, its
    keys exist, its name is not a built-in's).

    Raises:
        ConfigError: no algorithm chosen, ``algo=custom`` without a target, an unknown key or name.
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
        check_plugin_name(cls, str(target))
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.algo = node
    else:
        get_algorithm(cfg.algo.name)  # (an unknown name: one line, naming the known ones)
    return cfg


def preflight(cfg: DictConfig, overrides: list[str] | None = None) -> Preflight:
    """Hydra's composed config -> the typed, resolved and validated config and its plugin, before any model loads:
    the algorithm exists (built-in, installed, or ``algo=custom algo.target=...``), the run's values are valid, and
    the plugin's own settings pass its ``validate_settings`` against the resolved objective. The plugin is built here
    once (:func:`prefzoo.training.plugin.build_algorithm`) and the run trains that very object. ``overrides``: the
    words the user wrote (the Python API's; default: the command line's, from Hydra), for the checks of what was
    chosen explicitly.

    Raises:
        ConfigError: no or an unknown algorithm, a bad value, a bad combination (one line naming the key).
        PluginError: ``algo.target`` names something that is not a plugin.
    """
    cfg = plugin_config(cfg)
    typed = _config.to_typed(cfg)
    from prefzoo.training.distributed import launched_world_size
    from prefzoo.training.plugin import build_algorithm
    from prefzoo.training.trackers import check_report_to
    from prefzoo.validation import check_names, check_run

    check_names(typed)  # the annotator, eval.ood's shifted task: names in the data's registries
    algo = build_algorithm(typed)  # runs the plugin's validate_settings on the resolved objective
    check_run(typed, algo.declaration, launched_world_size(), given_overrides(overrides))  # prefzoo.validation
    check_report_to(typed)  # trainer.report_to: known trackers, their packages installed
    return Preflight(typed, algo)


def given_overrides(overrides: list[str] | None = None) -> list[str] | None:
    """The overrides the user wrote (``overrides``, else the command line's as Hydra recorded them), or None."""
    if overrides is not None:
        return list(overrides)
    if HydraConfig.initialized():
        return list(HydraConfig.get().overrides.task)
    return None


def check_plugin_name(cls, target: str) -> None:
    """A user's plugin (``algo=custom algo.target=...``) must not take a built-in plugin's name: its run folder,
    ``summary.json`` and the report would call it by that name.

    Raises:
        ConfigError: naming the plugin, the name and how to rename it.
    """
    from prefzoo.algos import REGISTRY

    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ConfigError(f"algo.target={target}: the plugin is named {cls.name!r}, a built-in algorithm's name; its "
                          f"run folder, summary.json and the report would call it {cls.name}. Give it a name of its own "
                          "(the name field of its config dataclass).")


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

    check_data_file(typed, declaration.online, declaration.data, declaration.loss_tokens)


def run_from_hydra(cfg: DictConfig) -> float | None:
    """Validate ``cfg`` (before any model loads), train, and print where the results are.

    Under several processes (``accelerate launch`` / ``torchrun``), the process group is set up first and
    every process uses the main process's run folder (Hydra names it after the time, which may differ by a
    second between processes); only the main process writes the resolved config and prints.

    Returns the run's headline metric (for Hydra sweepers), or exits with status 2 and a one-line message on a
    configuration, data, model or reward error, or an environment's (anything a reward function or an environment
    raises, ``SystemExit`` included, is reported in one line naming it); with status
    130 and one line on Ctrl-C (where it stopped, and the checkpoint ``trainer.resume=true`` continues from). User code
    that calls ``sys.exit()`` (a plugin, a hook) stops the run with status 2 and one line naming its file and line,
    never a silent exit 0; an ordinary exception from a plugin keeps its traceback (it shows where the bug is).
    """
    trainer, out = None, None
    try:
        checked = preflight(cfg)
        typed = checked.config
        check_data(typed, checked.algo.declaration)  # a bad data file fails here, in seconds (prefzoo.data.check)
        from prefzoo.training.distributed import setup_data_parallel
        from prefzoo.training.loop import Trainer, write_resolved_config
        from prefzoo.training.run_folder import open_run_folder, record_hydra_run
        from prefzoo.training.setup import pick_device, resolve_precision

        dp = setup_data_parallel(typed, pick_device(typed.trainer.device))
        out = Path(dp.broadcast_object(str(run_dir())))
        resolve_precision(typed, dp.device or pick_device(typed.trainer.device))  # model.dtype=auto, before config.yaml
        folder = open_run_folder(typed, out, dp)  # writable, not in use, resumable with this config: before config.yaml
        if dp.is_main:
            record_hydra_run(out, cfg)  # .hydra/ and train.log, now that the folder is accepted (nothing before)
            try:
                write_resolved_config(typed, out)
            except OSError as err:  # a full disk, a folder made read-only since the check
                raise RunFolderError(f"cannot write {out / 'config.yaml'} ({err.strerror or err}); free space on "
                                     "that disk or choose another folder (hydra.run.dir=...).") from None
        trainer = Trainer(typed, out, dp, folder=folder, algo=checked.algo)
        summary = trainer.run()
    except PrefzooError as err:
        from prefzoo.training.distributed import launched_rank

        if launched_rank() == 0 or not isinstance(err, (ConfigError, RunFolderError)):  # the same error everywhere
            when = during(trainer) if isinstance(err, (EnvironmentFailure, RewardError)) else ""  # user code's
            print(f"prefzoo: error: {err}{when}{resume_hint(trainer)}", file=sys.stderr)
        if in_multirun():  # let Hydra record the failed job and go on with the sweep
            raise
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever it landed
        from prefzoo.training.distributed import launched_rank

        if launched_rank() == 0:
            print(f"prefzoo: {stopped_line(trainer, out)}", file=sys.stderr, flush=True)
        if in_multirun():
            raise
        sys.exit(130)
    except BaseException as err:  # noqa: BLE001 -- SystemExit (and kin) from user code: its error, in one line
        where = user_code_frame(err)
        if isinstance(err, Exception) or where is None:  # an ordinary exception: its traceback shows where (a plugin's
            raise  # bug, or prefzoo's own); rewards and environments already report theirs in one line

        from prefzoo.training.distributed import launched_rank

        if launched_rank() == 0:
            print(f"prefzoo: error: your code raised {describe_error(err)} at {where}{during(trainer)}"
                  f"{resume_hint(trainer)}", file=sys.stderr)
        if in_multirun():
            raise UserCodeError(describe_error(err)) from None
        sys.exit(2)
    if dp.is_main:
        weights = ("model/tinker_checkpoint.json: the server's state" if typed.backend.name == "tinker" else
                   "adapter/" if typed.model.lora.enabled else "model/")
        print(f"[prefzoo] run folder: {out}  (summary.json, metrics.jsonl, eval_*.json, {weights})", flush=True)
    del trainer  # the model and its DDP wrapper go before the process group does (DataParallel.close)
    dp.close()
    after = summary.get("eval_after") or {}
    return after.get("task_accuracy", after.get("task_reward"))


def during(trainer) -> str:
    """`` during training step N`` / `` before training`` (the loop's place), for a one-line error."""
    if trainer is None:
        return " while the run was set up"
    return f" during training step {trainer.step + 1}" if trainer.started else " before training (the evaluation)"


def _last_checkpoint(trainer) -> str | None:
    from prefzoo.training.resume import complete_checkpoints

    try:
        found = complete_checkpoints(trainer.run_dir)
    except OSError:
        return None
    return found[-1].name if found else None


def resume_hint(trainer) -> str:
    """For an error after training began: ``; the last checkpoint (step-N) is kept: trainer.resume=true continues``."""
    if trainer is None or not trainer.started:
        return ""
    last = _last_checkpoint(trainer)
    if last is None:
        return "; no checkpoint was written yet (trainer.save_every), so a new run starts over"
    return f"; the last checkpoint ({last}) is kept: fix it and continue with trainer.resume=true"


def stopped_line(trainer, out) -> str:
    """The one line Ctrl-C prints: where the run stopped and what continues it."""
    if trainer is None:
        return "stopped (Ctrl-C) before training started; nothing to resume."
    last = _last_checkpoint(trainer)
    done = f"after {trainer.step} of {trainer.max_steps} steps" if trainer.started else "before its first step"
    if last is None:
        return f"stopped (Ctrl-C) {done}; no checkpoint was written yet, so a new run starts over."
    return (f"stopped (Ctrl-C) {done}; the last checkpoint is {last} in {out}: `trainer.resume=true` continues from "
            "it.")


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
