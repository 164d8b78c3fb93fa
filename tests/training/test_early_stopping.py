"""Early stopping on a held-out metric, and the KL budget (objective.kl_budget), alone and in tiny runs."""

from pathlib import Path

import pytest

from prefzoo.errors import ConfigError
from prefzoo.training.early_stopping import EarlyStopping


def test_stops_after_patience_evaluations_without_improvement():
    es = EarlyStopping("task_accuracy", "max", patience=2)
    seq = [0.20, 0.25, 0.24, 0.25, 0.30, 0.29, 0.28]
    out = [es.update({"task_accuracy": v}, step) for step, v in enumerate(seq, 1)]
    # improvements at 0.20, 0.25, 0.30; 0.25 after 0.25 is not an improvement (strict)
    assert [o[0] for o in out] == [True, True, False, False, True, False, False]
    assert [o[1] for o in out] == [False, False, False, True, False, False, True]
    assert es.best == 0.30 and es.best_step == 5


def test_min_mode_and_min_delta():
    es = EarlyStopping("kl_k1", "min", patience=1, min_delta=0.1)
    assert es.update({"kl_k1": 1.0}, 1) == (True, False)
    assert es.update({"kl_k1": 0.95}, 2) == (False, True)  # 0.05 < min_delta


def test_unknown_metric_lists_available_ones():
    es = EarlyStopping("accuracy")
    with pytest.raises(ConfigError, match="available: task_accuracy, task_reward"):  # one line, not a KeyError
        es.update({"task_accuracy": 0.1, "task_reward": 0.1, "greedy_examples": []}, 1)


def test_state_round_trip():
    es = EarlyStopping("m", patience=3)
    es.update({"m": 1.0}, 1)
    es.update({"m": 0.5}, 2)
    other = EarlyStopping("m", patience=3)
    other.load_state_dict(es.state_dict())
    assert other.update({"m": 0.5}, 3) == es.update({"m": 0.5}, 3)


# ------------------------------------------------------------------------------------- end to end (tiny runs)
def one_thread():
    from tests.models.helpers import threads

    return threads(1)


def _tiny(overrides, tmp_path):
    from prefzoo.training.loop import Trainer
    from tests.algos.hydra_runs import TINY_RUN, compose

    return Trainer(compose(overrides + TINY_RUN), tmp_path)


FIXTURE = str(Path(__file__).resolve().parents[1] / "fixtures" / "arithmetic_pairs.jsonl")


def test_early_stopping_end_to_end(tmp_path):
    """GRPO on the tiny model, early stopping on held-out task_accuracy every 2 steps, patience 1: the tiny model
    never answers right, so the first evaluation (step 2) is the best (0 > -inf) and the second (step 4) does not
    improve: the run stops at step 4, keeps the step-2 weights in best/, and says so in summary.json."""
    import json

    with one_thread():
        summary = _tiny(["algo=grpo", "trainer.max_steps=10", "trainer.early_stopping.metric=task_accuracy",
                         "trainer.early_stopping.patience=1", "trainer.early_stopping.every=2"], tmp_path).run()
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["stop_reason"] == summary["stop_reason"] == "early_stopping"
    assert summary["steps"] == 4 and summary["results"]["stop_reason"] == "early_stopping"
    assert summary["early_stopping"] == {"best": 0.0, "best_step": 2, "bad_evaluations": 1}
    assert (tmp_path / "best").is_dir() and (tmp_path / "eval_step000002.json").is_file()
    assert [h["step"] for h in summary["eval_history"]] == [0, 2, 4, 4]  # before, two during training, after


def test_kl_budget_end_to_end_online(tmp_path):
    """GRPO (the adapter-disabled model is the reference) with a large learning rate: the KL measured on each step's
    rollouts passes a tiny budget within a few steps; the run stops there with stop_reason kl_budget."""
    with one_thread():
        summary = _tiny(["algo=grpo", "trainer.max_steps=12", "trainer.lr=0.05", "objective.kl_budget=0.001",
                         "reward.functions=[tests.algos.hydra_runs:letter_share]", "reward=sentiment"],
                        tmp_path).run()
    assert summary["stop_reason"] == "kl_budget" and summary["steps"] < 12
    assert summary["kl_spent"] >= 0.001 and summary["kl_budget"] == 0.001
    assert summary["results"]["kl_spent"] == summary["kl_spent"] == summary["final_train_metrics"]["kl"]


def test_kl_budget_end_to_end_offline_needs_held_out_evaluations(tmp_path):
    """DPO samples nothing while it trains: a KL budget without periodic evaluations is refused; with eval.every=1
    the held-out KL estimate is measured every step and stops the run once it passes the budget."""
    from prefzoo.errors import ConfigError

    dpo = ["algo=dpo", "data=file", f"data.path={FIXTURE}", "data.eval_fraction=0.25", "trainer.max_steps=12",
           "trainer.lr=0.05", "objective.kl_budget=0.001", "eval.num_problems=4", "eval.diversity_prompts=4"]
    with one_thread():
        with pytest.raises(ConfigError, match="eval.every"):
            _tiny(dpo, tmp_path / "refused")
        summary = _tiny(dpo + ["eval.every=1"], tmp_path / "run").run()
    assert summary["stop_reason"] == "kl_budget" and summary["steps"] < 12
    during = [h for h in summary["eval_history"] if h["tag"].startswith("step")]
    assert during[-1]["kl_k1"] == summary["kl_spent"] >= 0.001


def test_evaluations_at_listed_steps(tmp_path):
    """eval.steps=[1, 3] with eval.every=0 on a 4-step GRPO run: evaluations before training (step 0), after steps 1
    and 3, and after training (step 4); none at step 2. eval.steps=[2] with eval.every=3 on 6 steps: the union, 2
    and 3 (6 is the evaluation after training, not repeated)."""
    with one_thread():
        summary = _tiny(["algo=grpo", "trainer.max_steps=4", "eval.steps=[1,3]"], tmp_path / "a").run()
        assert [h["step"] for h in summary["eval_history"]] == [0, 1, 3, 4]
        assert (tmp_path / "a" / "eval_step000001.json").is_file()
        assert not (tmp_path / "a" / "eval_step000002.json").exists()
        summary = _tiny(["algo=grpo", "trainer.max_steps=6", "eval.steps=[2]", "eval.every=3"], tmp_path / "b").run()
        assert [h["step"] for h in summary["eval_history"]] == [0, 2, 3, 6]


@pytest.mark.parametrize("value", ["[0]", "[-1]", "[2,2]", "[3,1]"])
def test_bad_eval_steps_are_one_line(value):
    """Steps are training steps, 1 and up, each once, in increasing order: anything else is a ConfigError naming
    the key and the value."""
    from prefzoo.config import validate
    from tests.algos.hydra_runs import compose

    with pytest.raises(ConfigError, match=r"eval\.steps="):
        validate(compose(["algo=grpo", "model=tiny", f"eval.steps={value}"]))
