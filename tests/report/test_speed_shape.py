"""The test of "beta sets the speed, not the shape" (prefzoo.report.speed_shape) on synthetic curves.

Every run travels d = v * step / 10 (v its speed), evaluated every step for 40 steps, so its largest d is 4 v; the
slowest (v = 0.3) sets the common range [0, 1.2]. Gold g(d) = d (a - 0.4 log d) (Gao et al.'s RL form).

Tolerances. Synthetic float64 curves: nothing varies with threads or load. Exact quantities (ranges, speeds, the
seed spread OFFSET / sqrt(2): measured 7e-18 off) use approx's default rel 1e-6 or 1e-9, far above float64 rounding
(kind 1 of tests/bounds.py). The hand values that neglect the interpolation between evaluations carry that
neglect, measured: beta_spread 0.21016 against the hand 0.21 (7.8e-4 relative; rel 0.02 is 25x), and 0.0015 for
one shape at three speeds against its bound 0.004 (what "no spread beyond interpolation" means here; ratio 0.10
against 0.3).
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from prefzoo.report.runs import load_runs
from prefzoo.report.speed_shape import rl_curves, spread, speed_shape_test

SPEEDS = {0.0: 1.0, 0.03: 0.6, 0.1: 0.3}
OFFSET = 0.02  # seed 1 of beta 0 is seed 0's curve shifted by this (the "seed noise"), step 0 included


def gold(d, a=0.5):
    d = np.asarray(d, dtype=float)
    return np.where(d > 0, d * (a - 0.4 * np.log(np.where(d > 0, d, 1.0))), 0.0)


def write_run(root: Path, name: str, beta: float, seed: int, speed: float, a: float = 0.5, offset: float = 0.0):
    history = []
    for step in range(41):
        d = speed * step / 10
        history.append({"step": step, "kl_k1": d * d, "gold_sample_reward": float(gold(d, a)) + offset,
                        "sample_reward": d})
    folder = root / name
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"+recipe/overoptimisation_points={name}"]))
    (folder / "summary.json").write_text(json.dumps({"algo": "grpo", "beta": beta, "seed": seed,
                                                     "eval_history": history}))


def sweep(root: Path, a_of_beta=lambda beta: 0.5) -> list[dict]:
    for i, (beta, v) in enumerate(SPEEDS.items()):
        write_run(root, f"grpo_beta{beta:g}", beta, seed=2 * i, speed=v, a=a_of_beta(beta))
    write_run(root, "grpo_beta0_seed1", 0.0, seed=1, speed=SPEEDS[0.0], a=a_of_beta(0.0), offset=OFFSET)
    return speed_shape_test(rl_curves(load_runs(root)))


def test_spread_by_hand():
    """Two groups: rows {0, 1} differ by 2 everywhere (each 1 from their mean: 1 + 1 = 2 over 1 degree of
    freedom), row 2 alone (no degree of freedom): pooled variance 2, spread sqrt(2)."""
    values = np.array([[0.0, 1.0], [2.0, 3.0], [5.0, 5.0]])
    assert spread(values, [[0, 1], [2]]) == pytest.approx(math.sqrt(2))
    assert math.isnan(spread(values, [[0], [1], [2]]))


def test_one_shape_at_three_speeds_has_no_spread_beyond_interpolation(tmp_path):
    """Same a = 0.5 for every beta: at equal d the curves agree up to the error of interpolating between points
    spaced 0.03-0.1 apart (|g''| = 0.4/d, far below 0.01 over the grid), while seed 1 sits OFFSET above seed 0: the
    pooled within-beta variance is 2 (OFFSET/2)^2 / 1 = OFFSET^2 / 2, S_seed = OFFSET / sqrt(2) = 0.01414. The
    ratio is far below 1 (the claim holds). Speeds: d at step 40 / 40 = 4 v / 40 = v / 10."""
    (result,) = sweep(tmp_path)
    assert result["betas"] == [0.0, 0.03, 0.1] and result["seeds"] == {0.0: [0, 1], 0.03: [2], 0.1: [4]}
    assert (result["d_lo"], result["d_hi"]) == pytest.approx((0.0, 1.2)) and result["d_max"] == pytest.approx(4.0)
    assert result["seed_spread"] == pytest.approx(OFFSET / math.sqrt(2), rel=1e-9)
    assert result["beta_spread"] < 0.004 and result["ratio"] < 0.3 and result["consistent"] is True
    speeds = {c.beta: result["speeds"][c.label] for c in result["curves"] if c.seed in (0, 2, 4)}
    assert speeds == pytest.approx({beta: v / 10 for beta, v in SPEEDS.items()})


def test_different_shapes_give_a_large_ratio(tmp_path):
    """a = 0.5, 0.8, 1.1 for beta = 0, 0.03, 0.1: at equal d the curves differ by d (a - mean a), whose variance across
    the three betas is d^2 * 0.09 (the sample variance of 0.5, 0.8, 1.1), so S_beta = 0.3 sqrt(mean_k d_k^2), with
    d_k = 1.2 k / 24 (k = 0..24): mean d^2 = 1.2^2 * 49 / 144 = 0.49 and S_beta = 0.21 (the d log d parts cancel up
    to interpolation error); ratio = 0.21 / 0.01414 = 14.8: beta changed the shape."""
    (result,) = sweep(tmp_path, a_of_beta={0.0: 0.5, 0.03: 0.8, 0.1: 1.1}.get)
    assert result["beta_spread"] == pytest.approx(0.21, rel=0.02)
    assert result["ratio"] == pytest.approx(0.21 / (OFFSET / math.sqrt(2)), rel=0.02) and result["consistent"] is False


def test_no_test_without_two_betas_and_two_seeds(tmp_path):
    """One beta with two seeds, or three betas with one seed each: no number (nothing to compare with)."""
    write_run(tmp_path, "a", 0.0, 0, 1.0)
    write_run(tmp_path, "b", 0.0, 1, 1.0)
    assert speed_shape_test(rl_curves(load_runs(tmp_path))) == []
    other = tmp_path / "other"
    for i, (beta, v) in enumerate(SPEEDS.items()):
        write_run(other, f"r{i}", beta, i, v)
    assert speed_shape_test(rl_curves(load_runs(other))) == []


def test_the_report_has_the_section_and_the_plot(tmp_path):
    """write_report on the one-shape sweep: speed_shape.png and a row giving the numbers of the test above."""
    from prefzoo.report import write_report

    (result,) = sweep(tmp_path)
    report = write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert (tmp_path / "speed_shape.png") in report["plots"]
    row = next(line for line in text.splitlines() if line.startswith("| grpo | 0 (0, 1), 0.03 (2), 0.1 (4) |"))
    assert f"| {result['seed_spread']:.3f} | {result['ratio']:.3f} | yes |" in row and "| 0.000–1.200 | 4.000 |" in row
    assert "The common range covers 30% of the largest d reached" in text  # 1.2 / 4.0
