"""Early stopping on a held-out metric."""

import pytest

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
    with pytest.raises(KeyError, match="available: task_accuracy, task_reward"):
        es.update({"task_accuracy": 0.1, "task_reward": 0.1, "greedy_examples": []}, 1)


def test_state_round_trip():
    es = EarlyStopping("m", patience=3)
    es.update({"m": 1.0}, 1)
    es.update({"m": 0.5}, 2)
    other = EarlyStopping("m", patience=3)
    other.load_state_dict(es.state_dict())
    assert other.update({"m": 0.5}, 3) == es.update({"m": 0.5}, 3)
