"""A run killed during a given step, for the resume tests: the stand-in for kill -9 that a test can catch."""

from __future__ import annotations

import pytest


class Interrupted(Exception):
    """Raised in place of a training step: the run stops there as if killed (checkpoints before it are on disk)."""


def run_until_killed(trainer, step: int) -> None:
    """Run ``trainer`` and kill it as its ``step``-th training step (1-based) starts: steps 1 .. step - 1 are done."""
    real, calls = trainer.train_step, []

    def dies():
        calls.append(1)
        if len(calls) == step:
            raise Interrupted
        return real()

    trainer.train_step = dies
    with pytest.raises(Interrupted):
        trainer.run()
