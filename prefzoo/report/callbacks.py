"""Hydra callbacks that make a recipe (``recipes/*.yaml``, run as ``python train.py -m +recipe=NAME``) one command.

* :class:`WriteReport` — ``on_multirun_end``: :func:`prefzoo.report.write_report` on the sweep folder, so every
  sweep ends with ``report.md`` and its plots (and prints where they are).
* :class:`TrainFirst` — ``on_multirun_start``: run one prerequisite training run before the sweep's jobs start
  (the overoptimisation recipe trains its proxy reward model this way), in a folder of the sweep; skipped when
  that folder already holds a finished run. It runs as a subprocess of ``train.py`` with the given overrides,
  so it is an ordinary, reproducible prefzoo run (its own ``config.yaml``, ``summary.json``), and every
  launcher (sequential, joblib, submitit) sees it finished before its jobs start.

Use them from a config's ``hydra.callbacks`` (see ``recipes/``)::

    hydra:
      callbacks:
        report:
          _target_: prefzoo.report.callbacks.WriteReport
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from prefzoo.training.layout import SUMMARY_FILE

log = logging.getLogger(__name__)

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"  # in a clone; an installed package has none
#: how a callback starts a training run: ``python -m prefzoo train`` (the same as train.py, installed or not)
TRAIN_CMD = [sys.executable, "-m", "prefzoo", "train"]


def _env_importing_prefzoo() -> dict:
    """The environment with this prefzoo importable (a clone run without an install included), for a subprocess
    that runs in the current folder, where the sweep's relative folders are."""
    import os

    import prefzoo

    here = str(Path(prefzoo.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": here + (os.pathsep + path if path else "")}


class WriteReport(Callback):
    """Write the sweep's report (``report.md`` + plots) into the sweep folder when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from prefzoo.errors import PrefzooError
        from prefzoo.report import write_report

        root = Path(config.hydra.sweep.dir)
        try:
            result = write_report(root)
        except PrefzooError as err:  # no finished run: say so, do not hide the sweep's own outcome
            print(f"[prefzoo] no report: {err}", flush=True)
            return
        print(f"[prefzoo] report of {result['runs']} runs: {result['report']}", flush=True)
        for p in result["plots"]:
            print(f"[prefzoo]   plot: {p}", flush=True)


class TrainFirst(Callback):
    """Before a multirun's jobs: ``python train.py <overrides> hydra.run.dir=<sweep dir>/<subdir>``, unless
    ``<sweep dir>/<subdir>/<done_file>`` exists.

    Args:
        overrides: the prerequisite run's command-line overrides (e.g. ``[algo=rm, reward=sentiment, ...]``).
        subdir: its folder inside the sweep folder; the sweep's jobs find it as ``${hydra:sweep.dir}/<subdir>``.
        done_file: the file whose presence means the run is done (default ``summary.json``).
        what: a few words for the log line.
        reuse_key: a config key naming a folder (the overoptimisation recipes: ``reward.path``) that, when it holds
            ``done_file``, is the prerequisite already done: nothing is trained, so ``reward.path=<an algo=rm run>``
            reuses that proxy (by default the key names the sweep's own folder). Read when the sweep starts, with
            ``${hydra:...}`` resolved as in the jobs.
    Raises:
        RuntimeError: the prerequisite run failed (its exit status and folder are in the message).
    """

    def __init__(self, overrides: list[str], subdir: str, done_file: str = SUMMARY_FILE, what: str = "prerequisite",
                 reuse_key: str | None = None):
        self.overrides, self.subdir, self.done_file, self.what = list(overrides), subdir, done_file, what
        self.reuse_key = reuse_key

    def _reused(self, config: DictConfig) -> list[Path]:
        """The folder ``reuse_key`` names ([] without one)."""
        if not self.reuse_key:
            return []
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        try:  # ${hydra:sweep.dir} resolves as it will in every job (a sweep's config is a full Hydra config)
            HydraConfig.instance().set_config(config)
        except Exception:  # noqa: BLE001 -- a partial config (tests): a ${hydra:...} value then does not resolve
            pass
        value = OmegaConf.select(config, self.reuse_key, throw_on_resolution_failure=False)
        return [Path(str(value))] if value else []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = Path(config.hydra.sweep.dir) / self.subdir
        for found in self._reused(config) + [folder]:
            if (found / self.done_file).is_file():
                print(f"[prefzoo] {self.what}: found {found}, not retrained", flush=True)
                return
        # hydra.output_subdir=null: no .hydra/ folder, so the report does not count it as one of the sweep's jobs
        cmd = [*TRAIN_CMD, *self.overrides, f"hydra.run.dir={folder}", "hydra.output_subdir=null"]
        print(f"[prefzoo] {self.what}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=_env_importing_prefzoo())
        if proc.returncode != 0:
            raise RuntimeError(f"the {self.what} run failed (exit status {proc.returncode}); its folder: {folder}")
        print(f"[prefzoo] {self.what}: done in {time.perf_counter() - start:.0f} s -> {folder}", flush=True)
