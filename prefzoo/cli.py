"""Glue between Hydra and the training loop: typed config, logging set-up, clear errors, the run folder."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from prefzoo.config import to_typed
from prefzoo.errors import PrefzooError

log = logging.getLogger("prefzoo")


def run_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under Hydra (tests calling run_from_hydra directly)
        return Path.cwd()


def run_from_hydra(cfg: DictConfig) -> float | None:
    """Validate ``cfg`` (before any model loads), train, and print where the results are.

    Returns the run's headline metric (for Hydra sweepers), or exits with status 2 and a one-paragraph
    message on a configuration, data, model or reward error.
    """
    try:
        typed = to_typed(cfg)
        from prefzoo.training.loop import Trainer, write_resolved_config

        out = run_dir()
        write_resolved_config(typed, out)
        summary = Trainer(typed, out).run()
    except PrefzooError as err:
        print(f"prefzoo: error: {err}", file=sys.stderr)
        if HydraConfig.initialized() and HydraConfig.get().mode.name == "MULTIRUN":
            raise
        sys.exit(2)
    print(f"[prefzoo] run folder: {out}  (summary.json, metrics.jsonl, eval_*.json, adapter/)", flush=True)
    after = summary.get("eval_after") or {}
    return after.get("task_accuracy", after.get("task_reward"))
