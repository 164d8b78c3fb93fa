"""User code that misbehaves as a new user's might (round 4 of bad inputs and faults, issue 46): a plugin that takes a
built-in's name, one that calls ``sys.exit()`` in its loss, and a reward function that counts its calls."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from prefzoo.algos import AlgoConfig, Algorithm, Declaration
from prefzoo.objective import mean_logps
from prefzoo.types import LossOutput


@dataclass
class ImpostorConfig(AlgoConfig):
    name: str = "dpo"  # a built-in's name: the run folder and summary would say dpo


class Impostor(Algorithm):
    """Chosen-only NLL under the name ``dpo``."""

    config_class = ImpostorConfig

    def declare(self):
        return Declaration(reference=False, aggregation="example_mean")

    def loss(self, policy, batch, step):
        logps, _ = policy.logps(batch.chosen)
        return LossOutput(-mean_logps(logps, batch.chosen.completion_mask), None, {})


@dataclass
class ExitsConfig(AlgoConfig):
    name: str = "exits_in_loss"


class ExitsInLoss(Algorithm):
    """A plugin whose loss calls ``sys.exit(0)`` at its second call (the first training step's second micro-batch)."""

    config_class = ExitsConfig
    calls = 0

    def declare(self):
        return Declaration(reference=False, aggregation="example_mean")

    def loss(self, policy, batch, step):
        type(self).calls += 1
        if type(self).calls >= 2:
            sys.exit(0)
        logps, _ = policy.logps(batch.chosen)
        return LossOutput(-mean_logps(logps, batch.chosen.completion_mask), None, {})


def counting_reward(prompts, completions, **_):
    """1.0 for every completion; appends one line per call (the first completion) to ``$COUNTED_CALLS``."""
    path = os.environ.get("COUNTED_CALLS")
    if path:
        with Path(path).open("a") as f:
            f.write(repr(completions[0]) + "\n")
    return [float(len(c) % 3) for c in completions]
