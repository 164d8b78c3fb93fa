"""Where metrics go: ``metrics.jsonl`` (one JSON object per logged step), TensorBoard, and the progress bar."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from prefzoo.training.layout import METRICS_FILE

log = logging.getLogger(__name__)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLog:
    """Appends step metrics to ``<run>/metrics.jsonl`` and TensorBoard (``<run>/tb``).

    On resume, lines for steps after the checkpoint are dropped first, so the file reads like one
    uninterrupted run.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True, trackers=()):
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled
        self.trackers = list(trackers)  # trackio / wandb (prefzoo.training.trackers), given the same scalars
        self.writer = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(run_dir / "tb"))
            except ImportError:  # tensorboard is a dependency, but keep training if it is broken
                self.writer = None

    def truncate_after(self, step: int) -> None:
        """Keep the lines of steps up to ``step`` (a resume continues after it). A line that is not a JSON object --
        the last one, torn by a kill in mid-write -- is dropped with a warning naming the file and the line."""
        if not self.enabled or not self.path.is_file():
            return
        kept = []
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict):
                log.warning("%s:%d is not a JSON object (a line cut off when the run was stopped): dropped on resume",
                            self.path, number)
                continue
            if row.get("step", 0) <= step:
                kept.append(line)
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._scalars(step, metrics)

    def _scalars(self, step: int, metrics: dict) -> None:
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def log_eval(self, step: int, result: dict) -> None:
        """A held-out evaluation's numbers as ``eval/<metric>`` scalars at ``step`` (TensorBoard and trackers;
        the evaluation's own record is its ``eval_<tag>.json``)."""
        if not self.enabled:
            return
        self._scalars(step, {f"eval/{k}": v for k, v in result.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds"})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
