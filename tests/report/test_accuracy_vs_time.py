"""The report's accuracy against training time (prefzoo.report.runs.training_seconds, plots.accuracy_against_time).

Hand-made run folders: metrics.jsonl with known ``time/step`` per step, summary.json with evaluations at known steps.
"""

import json
from pathlib import Path

import pytest

from prefzoo.report import write_report
from prefzoo.report.plots import accuracy_against_time
from prefzoo.report.runs import load_runs, training_seconds


def write_run(folder: Path, step_seconds: dict, evals: list[dict], algo="grpo"):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step, seconds in step_seconds.items():
            f.write(json.dumps({"step": step, "time/step": seconds, "loss": 0.1}) + "\n")
    (folder / "summary.json").write_text(json.dumps({"algo": algo, "eval_history": evals}))
    return folder


def test_training_seconds_add_up_once_per_step(tmp_path):
    """Steps 1..3 at 10, 20, 30 s: cumulative 10, 30, 60. Step 2 logged again at 25 s (a resume redid it) counts
    once, its last line: 10, 35, 65. A line that is not JSON is skipped."""
    folder = write_run(tmp_path / "r", {1: 10.0, 2: 20.0, 3: 30.0}, [])
    assert training_seconds({"dir": folder}) == {0: 0.0, 1: 10.0, 2: 30.0, 3: 60.0}
    with open(folder / "metrics.jsonl", "a") as f:
        f.write("not json\n" + json.dumps({"step": 2, "time/step": 25.0}) + "\n")
    assert training_seconds({"dir": folder}) == {0: 0.0, 1: 10.0, 2: 35.0, 3: 65.0}


def test_no_times_no_curve(tmp_path):
    """No metrics.jsonl, or a step without time/step: no times, so no points (not points at a wrong time)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "summary.json").write_text(json.dumps({"algo": "dpo", "eval_history": [{"step": 0, "task_accuracy": 0.2}]}))
    assert training_seconds({"dir": bare}) is None
    assert accuracy_against_time(load_runs(bare)[0]) == []
    folder = write_run(tmp_path / "r", {1: 10.0}, [])
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "loss": 0.3}) + "\n")
    assert training_seconds({"dir": folder}) is None


def test_points_in_minutes_at_each_evaluation(tmp_path):
    """Steps of 30 s each; evaluations at steps 0, 2 and 4: 0, 1 and 2 minutes. An evaluation at step 9, beyond the
    logged steps, and one without task_accuracy are left out."""
    evals = [{"step": 0, "task_accuracy": 0.25, "task_accuracy_se": 0.03},
             {"step": 2, "task_accuracy": 0.5, "task_accuracy_se": 0.035},
             {"step": 3, "kl_k1": 1.0},
             {"step": 4, "task_accuracy": 0.6},
             {"step": 9, "task_accuracy": 0.7}]
    write_run(tmp_path / "r", {s: 30.0 for s in range(1, 5)}, evals)
    (run,) = load_runs(tmp_path)
    assert accuracy_against_time(run) == [(0.0, 0.25, 0.03), (1.0, 0.5, 0.035), (2.0, 0.6, None)]


def test_report_draws_it_for_two_runs(tmp_path):
    """Two runs with accuracy at two points each: the report writes accuracy_vs_time.png and names it."""
    write_run(tmp_path / "a", {1: 60.0, 2: 60.0}, [{"step": 0, "task_accuracy": 0.2}, {"step": 2, "task_accuracy": 0.6}])
    write_run(tmp_path / "b", {1: 90.0, 2: 90.0}, [{"step": 0, "task_accuracy": 0.2}, {"step": 2, "task_accuracy": 0.7}],
              algo="distill")
    result = write_report(tmp_path)
    names = [p.name for p in result["plots"]]
    assert "accuracy_vs_time.png" in names
    assert (tmp_path / "accuracy_vs_time.png").stat().st_size > 1000
    assert "accuracy_vs_time.png" in result["report"].read_text()


@pytest.mark.parametrize("evals", [[], [{"step": 0, "task_accuracy": 0.2}]])
def test_one_point_or_none_draws_nothing(tmp_path, evals):
    write_run(tmp_path / "a", {1: 60.0}, evals)
    assert "accuracy_vs_time.png" not in [p.name for p in write_report(tmp_path)["plots"]]
