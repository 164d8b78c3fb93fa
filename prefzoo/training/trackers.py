"""Experiment trackers beside ``metrics.jsonl``: ``trainer.report_to=[tensorboard, trackio, wandb]`` (or ``[none]``).

Each goes through the library itself, as TRL's ``report_to`` does:

* ``tensorboard`` (the default): ``<run>/tb`` (``torch.utils.tensorboard``), off with ``trainer.tensorboard=false``
  too;
* ``trackio``: ``trackio.init(project, name, config)``, local by default (its SQLite store under ``TRACKIO_DIR``,
  ``~/.cache/huggingface/trackio`` by default; a Space or a server only when you set ``TRACKIO_SPACE_ID`` or
  ``TRACKIO_SERVER_URL``);
* ``wandb``: ``wandb.init(project, name, config, dir=<run>, mode=$WANDB_MODE)`` (offline unless you set
  ``WANDB_MODE=online``; ``wandb sync <run>/wandb/offline-run-*`` uploads later).

Off the network unless asked (:func:`offline_defaults`): when ``WANDB_MODE`` is unset, prefzoo sets it to ``offline``
in its process before W&B starts. Passing ``mode="offline"`` to ``wandb.init`` alone is not enough: W&B's process-wide
settings (read from the environment when it first starts) decide whether it sends its own usage telemetry, which
otherwise resolves and posts to W&B's server from a background thread even for an offline run. trackio reaches the
network only with ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL``, which prefzoo never sets.

trackio and wandb are optional (``pip install 'prefzoo[trackers]'``); asking for one that is not installed fails
before any model loads (:func:`check_report_to`). Every tracker gets the training scalars at their step, the
held-out evaluations as ``eval/<metric>`` at the step they ran (before: 0, every N steps, after: the last), and the
run's resolved config as its hyperparameters. The project is ``$WANDB_PROJECT`` / ``$TRACKIO_PROJECT`` or
``prefzoo``, the run's name its folder's name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from pathlib import Path

from prefzoo.errors import ConfigError

REPORT_TO = ("tensorboard", "trackio", "wandb", "none")
OPTIONAL = {"trackio": "trackio", "wandb": "wandb"}  # report_to value -> the package it needs


def check_report_to(cfg) -> None:
    """``trainer.report_to``: known names, ``none`` alone, and the package of each optional tracker installed."""
    values = list(cfg.trainer.report_to or [])
    for value in values:
        if value not in REPORT_TO:
            raise ConfigError(f"trainer.report_to: unknown tracker {value!r}; choose from {list(REPORT_TO)}, e.g. "
                              "trainer.report_to=[tensorboard,wandb].")
    if "none" in values and len(values) > 1:
        raise ConfigError(f"trainer.report_to={values}: 'none' turns every tracker off, so it stands alone; drop "
                          "it or the others.")
    for value in values:
        package = OPTIONAL.get(value)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"trainer.report_to: {value} needs the package {package!r}, which is not installed; "
                              f"`pip install {package}` (or `pip install 'prefzoo[trackers]'`), or drop it from "
                              "trainer.report_to.")


def numeric(metrics: dict) -> dict[str, float]:
    """The finite numbers of ``metrics`` (booleans left out), as floats."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def config_dict(cfg) -> dict:
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)


class TrackioTracker:
    def __init__(self, cfg, run_dir: Path):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "prefzoo"), name=run_dir.name,
                                config=config_dict(cfg))

    def log(self, step: int, metrics: dict) -> None:
        self.trackio.log(numeric(metrics), step=step)

    def finish(self) -> None:
        self.trackio.finish()


#: environment variables prefzoo sets, when unset, before a tracker starts: they keep it off the network
OFFLINE_DEFAULTS = {"wandb": {"WANDB_MODE": "offline"}}


def offline_defaults(tracker: str, environ=os.environ) -> dict[str, str]:
    """Set ``tracker``'s :data:`OFFLINE_DEFAULTS` in ``environ`` where the user has set nothing; return those set."""
    added = {k: v for k, v in OFFLINE_DEFAULTS.get(tracker, {}).items() if k not in environ}
    environ.update(added)
    return added


class WandbTracker:
    def __init__(self, cfg, run_dir: Path):
        offline_defaults("wandb")  # before W&B first reads its settings (module docstring)
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "prefzoo"), name=run_dir.name,
                              config=config_dict(cfg), dir=str(run_dir), mode=os.environ["WANDB_MODE"])

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(numeric(metrics), step=step)

    def finish(self) -> None:
        self.run.finish()


TRACKERS = {"trackio": TrackioTracker, "wandb": WandbTracker}


def open_trackers(cfg, run_dir: Path) -> list:
    """The trackers of ``trainer.report_to`` other than TensorBoard (which :class:`MetricsLog` writes itself)."""
    return [TRACKERS[v](cfg, run_dir) for v in (cfg.trainer.report_to or []) if v in TRACKERS]


def open_metrics_log(cfg, run_dir: Path, is_main: bool):
    """The run's :class:`~prefzoo.training.metrics_log.MetricsLog`: metrics.jsonl, TensorBoard when
    ``trainer.report_to`` has it (and ``trainer.tensorboard`` is true), and the other trackers (main process only)."""
    from prefzoo.training.metrics_log import MetricsLog

    report_to = list(cfg.trainer.report_to or [])
    tensorboard = cfg.trainer.tensorboard and "tensorboard" in report_to
    return MetricsLog(run_dir, tensorboard=tensorboard, enabled=is_main,
                      trackers=open_trackers(cfg, run_dir) if is_main else [])
