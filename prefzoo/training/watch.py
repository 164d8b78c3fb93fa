"""Watching the step metrics for the warnings a plugin declares (:class:`prefzoo.algos.base.MetricWarning`).

The loop calls :meth:`MetricWatch.update` after every training step and logs the lines it returns: one line when a
metric has stood at or above its threshold for the declared number of consecutive steps (or for every step of a
run shorter than that), and nothing more until the streak breaks; a new streak warns again. E.g. GRPO on a reward
its model never earns: ``frac_zero_std_groups = 1 for 5 steps in a row (steps 1-5; reward 0): every group of
algo.num_samples=4 completions got one reward, ...``.
"""

from __future__ import annotations

from prefzoo.algos.base import MetricWarning

__all__ = ["MetricWatch"]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


class MetricWatch:
    """The streaks of the declared ``warnings`` over a run of ``max_steps`` steps (see the module docstring)."""

    def __init__(self, warnings: tuple[MetricWarning, ...], max_steps: int):
        self.warnings, self.max_steps = tuple(warnings), max_steps
        self.streak = {w.metric: 0 for w in self.warnings}
        self.first = {w.metric: 0 for w in self.warnings}
        self.warned = {w.metric: False for w in self.warnings}

    def update(self, step: int, metrics: dict) -> list[str]:
        """Count ``step``'s metrics; the warning lines due at this step (usually none)."""
        lines = []
        for w in self.warnings:
            value = metrics.get(w.metric)
            if not _number(value) or value < w.threshold:
                self.streak[w.metric], self.warned[w.metric] = 0, False
                continue
            if self.streak[w.metric] == 0:
                self.first[w.metric] = step
            self.streak[w.metric] += 1
            n = self.streak[w.metric]
            if self.warned[w.metric] or n < min(w.steps, max(1, self.max_steps)):
                continue
            self.warned[w.metric] = True
            shown = "".join(f"; {k} {metrics[k]:.3g}" for k in w.show if _number(metrics.get(k)))
            lines.append(f"{w.metric} = {value:g} for {n} steps in a row (steps {self.first[w.metric]}-{step}{shown}): "
                         f"{w.message}")
        return lines
