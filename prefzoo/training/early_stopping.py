"""Stop a run when a held-out metric stops improving (``trainer.early_stopping``)."""

from __future__ import annotations

import math

from prefzoo.errors import ConfigError


class EarlyStopping:
    """Tracks the best value of one evaluation metric; ``update`` says whether to stop.

    Args:
        metric: a key of the evaluation result (e.g. ``task_accuracy``).
        mode: ``max`` or ``min``: which direction is better.
        patience: evaluations without improvement before stopping.
        min_delta: the smallest change that counts as an improvement.
    """

    def __init__(self, metric: str, mode: str = "max", patience: int = 3, min_delta: float = 0.0):
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.best = -math.inf if mode == "max" else math.inf
        self.best_step = 0
        self.bad_evaluations = 0

    def improved(self, value: float) -> bool:
        return value > self.best + self.min_delta if self.mode == "max" else value < self.best - self.min_delta

    def update(self, result: dict, step: int) -> tuple[bool, bool]:
        """Record an evaluation; returns (improved, stop).

        Raises:
            ConfigError: this run's evaluation has no such metric (the message lists the available ones).
        """
        if self.metric not in result:
            numeric = sorted(k for k, v in result.items() if isinstance(v, (int, float)))
            raise ConfigError(f"trainer.early_stopping.metric={self.metric!r} is not an evaluation metric of this run; "
                              f"available: {', '.join(numeric)}")
        value = float(result[self.metric])
        if self.improved(value):
            self.best, self.best_step, self.bad_evaluations = value, step, 0
            return True, False
        self.bad_evaluations += 1
        return False, self.bad_evaluations >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "bad_evaluations": self.bad_evaluations}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step, self.bad_evaluations = state["best"], state["best_step"], state["bad_evaluations"]
