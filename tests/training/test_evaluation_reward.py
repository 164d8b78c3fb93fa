"""The evaluation measures only what applies to the data (the ecosystem-fit issue, item 6): a DPO run on a user's
preference file without an ``answer`` column, with the reward left at its default (the arithmetic task's exact
match), has no task accuracy or task reward and says nothing about them; a reward the user chose that needs a column
the file lacks is named in one warning line before training."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from prefzoo.training.loop import Trainer
from prefzoo.training.setup import reward_chosen
from tests.algos.hydra_runs import TINY_RUN, compose

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "arithmetic_pairs.jsonl"


def needs_label(prompts, completions, label, **_):
    """A user's reward that reads a ``label`` column (which the test file does not have)."""
    return [float(text.strip() == str(x)) for text, x in zip(completions, label)]


@pytest.fixture
def user_file(tmp_path) -> Path:
    """The fixture's 40 pairs without their ``answer`` column: a preference file as a user brings it."""
    path = tmp_path / "my_pairs.jsonl"
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "answer"}) + "\n" for r in rows))
    return path


def _run(user_file: Path, tmp_path: Path, extra: list[str]) -> dict:
    cfg = compose(["algo=dpo", "data=file", f"data.path={user_file}", "data.eval_fraction=0.25",
                   "trainer.max_steps=1", *TINY_RUN, *extra])
    Trainer(cfg, tmp_path / "run").run()
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def test_a_default_reward_that_does_not_apply_is_not_evaluated_and_not_warned_about(user_file, tmp_path, caplog):
    """Before: every evaluation warned `reward function 'correctness' raised TypeError: correctness() missing 1
    required positional argument: 'answer'` (twice a run: before and after training), though the user chose no
    reward. Now: no warning at all, and the evaluation has no task_reward / sample_reward / task_accuracy (nothing
    scores the answers), while preference accuracy and KL are there."""
    with caplog.at_level(logging.WARNING):
        summary = _run(user_file, tmp_path, [])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [w for w in warnings if "correctness" in w or "answer" in w], warnings
    after = summary["eval_after"]
    assert not {"task_reward", "sample_reward", "task_accuracy"} & set(after)
    assert "preference_accuracy" in after and "kl_k1" in after


def test_a_chosen_reward_that_needs_a_missing_column_is_one_warning_line(user_file, tmp_path, caplog):
    """reward.functions=[needs_label] on a file without `label`: one warning (not one per evaluation), one line,
    naming the function, the missing column and the file, before training; the run goes on without reward
    metrics."""
    with caplog.at_level(logging.WARNING):
        summary = _run(user_file, tmp_path, ['reward.functions=["tests.training.test_evaluation_reward:needs_label"]'])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "needs_label" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "\n" not in warnings[0] and "'label'" in warnings[0] and str(user_file) in warnings[0]
    assert "task_reward" not in summary["eval_after"]


def test_which_rewards_count_as_chosen():
    """The reward is the user's choice when its config differs from the default (reward=sentiment,
    reward.functions=[...], weights), or when the command line names it (`reward=arithmetic` explicitly)."""
    base = ["algo=dpo", "data=file", f"data.path={FIXTURE}", "model=tiny"]
    assert reward_chosen(compose(base), base) is False
    assert reward_chosen(compose(base + ["reward=arithmetic"]), base + ["reward=arithmetic"]) is True
    assert reward_chosen(compose(base + ["reward=sentiment"]), []) is True
    assert reward_chosen(compose(base + ["reward.weights=[2.0]"]), []) is True
