"""Glue between Hydra and the training loop: typed config, logging set-up, clear errors, the run folder."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from prefzoo.config import to_typed
from prefzoo.errors import ConfigError, PrefzooError

log = logging.getLogger("prefzoo")


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


def check_data(typed) -> None:
    """The first pass over ``data.path`` (:func:`prefzoo.data.check.check_data_file`), before the loop is imported."""
    from prefzoo.algos import get_algorithm
    from prefzoo.data.check import check_data_file

    check_data_file(typed, get_algorithm(typed.algo.name).online)


def run_from_hydra(cfg: DictConfig) -> float | None:
    """Validate ``cfg`` (before any model loads), train, and print where the results are.

    Under several processes (``accelerate launch`` / ``torchrun``), the process group is set up first and
    every process uses the main process's run folder (Hydra names it after the time, which may differ by a
    second between processes); only the main process writes the resolved config and prints.

    Returns the run's headline metric (for Hydra sweepers), or exits with status 2 and a one-paragraph
    message on a configuration, data, model or reward error.
    """
    try:
        typed = to_typed(cfg)
        check_data(typed)  # a bad data file fails here, in seconds (prefzoo.data.check)
        from prefzoo.training.distributed import setup_data_parallel
        from prefzoo.training.loop import Trainer, write_resolved_config
        from prefzoo.training.setup import pick_device

        dp = setup_data_parallel(typed, pick_device(typed.trainer.device))
        out = Path(dp.broadcast_object(str(run_dir())))
        if dp.is_main:
            out.mkdir(parents=True, exist_ok=True)
            write_resolved_config(typed, out)
        summary = Trainer(typed, out, dp).run()
    except PrefzooError as err:
        from prefzoo.training.distributed import launched_rank

        if launched_rank() == 0 or not isinstance(err, ConfigError):  # every process finds the same config error
            print(f"prefzoo: error: {err}", file=sys.stderr)
        if in_multirun():  # let Hydra record the failed job and go on with the sweep
            raise
        sys.exit(2)
    if dp.is_main:
        print(f"[prefzoo] run folder: {out}  (summary.json, metrics.jsonl, eval_*.json, adapter/)", flush=True)
    dp.close()
    after = summary.get("eval_after") or {}
    return after.get("task_accuracy", after.get("task_reward"))
