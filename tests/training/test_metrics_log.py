"""Tests for prefzoo.training.metrics_log: one JSON object per step, truncation on resume."""

import json
import math

from prefzoo.training.metrics_log import MetricsLog, read_metrics


def test_one_json_object_per_logged_step_and_non_finite_values_as_strings(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    log.log(1, {"loss": 0.5, "kl": math.nan})
    log.log(2, {"loss": 0.25, "kl": math.inf})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 1, "loss": 0.5, "kl": "nan"}, {"step": 2, "loss": 0.25, "kl": "inf"}]
    assert read_metrics(tmp_path / "metrics.jsonl")[1]["step"] == 2


def test_truncate_after_drops_later_steps(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 6):
        log.log(step, {"loss": float(step)})
    log.truncate_after(3)
    log.log(4, {"loss": 40.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_tensorboard_writes_event_files(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=True)
    log.log(1, {"loss": 1.0, "name": "x"})
    log.close()
    assert any((tmp_path / "tb").iterdir())


def test_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False, enabled=False)
    log.log(1, {"loss": 1.0})
    log.truncate_after(0)
    assert not (tmp_path / "metrics.jsonl").exists()
