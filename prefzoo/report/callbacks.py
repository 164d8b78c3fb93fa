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
    """Write the sweep's report (``report.md`` + plots) into the sweep folder when a multirun ends. ``peak_d``: a
    pre-registered d of the gold peak (:func:`prefzoo.report.write_report`)."""

    def __init__(self, peak_d: float | None = None):
        self.peak_d = peak_d

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from prefzoo.errors import PrefzooError
        from prefzoo.report import write_report

        root = Path(config.hydra.sweep.dir)
        try:
            result = write_report(root, peak_d=self.peak_d)
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
        per: a config key the sweep may sweep (e.g. ``data.pairs.seed=0,1``): one prerequisite per value v, in
            ``<subdir>_<v>``, each run with ``per_overrides`` added, ``{value}`` replaced by v (e.g.
            ``[data.pairs.seed={value}, trainer.seed={value}]``); the jobs find theirs as
            ``${hydra:sweep.dir}/<subdir>_${<per>}``. ``reuse_key`` does not apply then (a finished
            ``<subdir>_<v>`` in the sweep folder is reused).
        per_overrides: see ``per``.
    Raises:
        RuntimeError: the prerequisite run failed (its exit status and folder are in the message).
    """

    def __init__(self, overrides: list[str], subdir: str, done_file: str = SUMMARY_FILE, what: str = "prerequisite",
                 reuse_key: str | None = None, per: str | None = None, per_overrides: list[str] | None = None):
        self.overrides, self.subdir, self.done_file, self.what = list(overrides), subdir, done_file, what
        self.reuse_key = reuse_key
        self.per, self.per_overrides = per, list(per_overrides or [])

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
        sweep = Path(config.hydra.sweep.dir)
        if self.per:
            for value in swept_values(config, self.per):
                extra = [o.replace("{value}", value) for o in self.per_overrides]
                self._train(sweep / f"{self.subdir}_{value}", [], extra, f"{self.what} ({self.per}={value})")
            return
        self._train(sweep / self.subdir, self._reused(config), [], self.what)

    def _train(self, folder: Path, reusable: list[Path], extra: list[str], what: str) -> None:
        for found in reusable + [folder]:
            if (found / self.done_file).is_file():
                print(f"[prefzoo] {what}: found {found}, not retrained", flush=True)
                return
        # hydra.output_subdir=null: no .hydra/ folder, so the report does not count it as one of the sweep's jobs
        cmd = [*TRAIN_CMD, *self.overrides, *extra, f"hydra.run.dir={folder}", "hydra.output_subdir=null"]
        print(f"[prefzoo] {what}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=_env_importing_prefzoo())
        if proc.returncode != 0:
            raise RuntimeError(f"the {what} run failed (exit status {proc.returncode}); its folder: {folder}")
        print(f"[prefzoo] {what}: done in {time.perf_counter() - start:.0f} s -> {folder}", flush=True)


def swept_values(config: DictConfig, key: str) -> list[str]:
    """The values a multirun gives ``key``: from the command line (``hydra.overrides.task``, e.g. ``key=0,1``), else
    the sweeper's ``params`` (a recipe's), else the config's one value. Strings, as Hydra writes them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    given = [o for o in config.hydra.overrides.task if o.split("=", 1)[0].lstrip("+~") == key]
    if given:
        spec = given[-1].lstrip("+~")
    else:
        params = OmegaConf.select(config, "hydra.sweeper.params") or {}
        if key not in params:
            return [str(OmegaConf.select(config, key))]
        spec = f"{key}={params[key]}"
    override = OverridesParser.create().parse_override(spec)
    if override.is_sweep_override():
        return [str(v) for v in override.sweep_string_iterator()]
    return [override.get_value_element_as_str()]
