"""A run that learns nothing says so while it happens (the ecosystem-fit issue, item 6): a plugin declares metric
warnings (:class:`prefzoo.algos.base.MetricWarning`), the loop watches them (:mod:`prefzoo.training.watch`).
The group-sampling plugins declare one on ``frac_zero_std_groups`` (every group's rewards equal: all advantages
zero, no gradient from the reward)."""

from __future__ import annotations

import logging

import pytest

from prefzoo.algos.base import MetricWarning
from prefzoo.training.loop import Trainer
from prefzoo.training.watch import MetricWatch
from tests.algos.hydra_runs import TINY_RUN, compose
from prefzoo.training.plugin import build_algorithm


def _watched(overrides: list[str]) -> dict[str, MetricWarning]:
    return {w.metric: w for w in build_algorithm(compose(["model=tiny", *overrides])).declaration.warnings}


def test_the_watch_warns_once_per_streak_of_n_steps():
    """Threshold 1.0 over 3 steps, metric values 1,1,1,1,1,0,1,1,1 at steps 1..9: one warning at step 3 (the third
    in a row), none at 4-5 (the same streak), the streak breaks at 6, a second warning at step 9."""
    watch = MetricWatch((MetricWarning("frac_zero_std_groups", 1.0, 3, "no signal"),), max_steps=100)
    said = {}
    for step, value in enumerate([1, 1, 1, 1, 1, 0, 1, 1, 1], start=1):
        lines = watch.update(step, {"frac_zero_std_groups": float(value), "reward": 0.0})
        if lines:
            said[step] = lines
    assert list(said) == [3, 9]
    assert said[3] == ["frac_zero_std_groups = 1 for 3 steps in a row (steps 1-3; reward 0): no signal"]


def test_a_short_run_warns_at_its_last_step():
    """A run of 2 steps with a 5-step warning: the streak covers the whole run, so it warns at step 2."""
    watch = MetricWatch((MetricWarning("frac_zero_std_groups", 1.0, 5, "no signal"),), max_steps=2)
    assert watch.update(1, {"frac_zero_std_groups": 1.0}) == []
    assert len(watch.update(2, {"frac_zero_std_groups": 1.0})) == 1


@pytest.mark.parametrize("overrides, metric", [
    (["algo=grpo"], "frac_zero_std_groups"), (["algo=gspo"], "frac_zero_std_groups"),
    (["algo=cispo"], "frac_zero_std_groups"), (["algo=rloo"], "frac_zero_std_groups"),
    (["algo=reinforce_pp", "algo.baseline=group"], "frac_zero_std_groups"),
    (["algo=online_dpo", "algo.judge=reward"], "frac_ties"),
])
def test_the_group_sampling_plugins_declare_the_warning(overrides, metric):
    warning = _watched(overrides)[metric]
    assert warning.threshold == 1.0 and "rollout.temperature" in warning.message


def test_plugins_whose_groups_are_not_the_baseline_declare_none():
    """REINFORCE++ without the group baseline whitens over the batch (one sample per prompt by default: every
    "group" of one has zero spread), Online DPO with a Bradley-Terry judge draws a winner of a tie at random; DPO
    samples nothing."""
    assert _watched(["algo=reinforce_pp", "algo.num_samples=1"]) == {}
    assert _watched(["algo=online_dpo", "algo.judge=bradley_terry"]) == {}
    assert _watched(["algo=dpo"]) == {}


def test_grpo_that_learns_nothing_says_so(tmp_path, caplog):
    """GRPO on the tiny random model with the exact-match arithmetic reward: no sample is ever right, every group's
    rewards are all 0 (frac_zero_std_groups = 1.0 each step). Before: the 3 steps ran without a word. Now one
    warning line (not one per step) naming the cause and the settings to change."""
    cfg = compose(["algo=grpo", "trainer.max_steps=3", *TINY_RUN])
    with caplog.at_level(logging.WARNING, logger="prefzoo"):
        summary = Trainer(cfg, tmp_path).run()
    assert summary["final_train_metrics"]["frac_zero_std_groups"] == 1.0
    lines = [r.getMessage() for r in caplog.records if "frac_zero_std_groups" in r.getMessage()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "\n" not in line and line.startswith("frac_zero_std_groups = 1 for 3 steps in a row (steps 1-3; reward 0)")
    assert "rollout.temperature=0.7" in line and "algo.num_samples=4" in line
