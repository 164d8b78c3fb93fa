"""The beta doctor (:mod:`prefzoo.report.diagnose`, issue 16 item 5): one synthetic run folder per verdict, written
here as the loop writes them (``metrics.jsonl``, ``summary.json``'s ``eval_history``, ``config.yaml``); a real tiny
run; the command line (``python -m prefzoo diagnose``, the console script's entry point, and ``python -m
prefzoo.diagnose``) and its one-line error on a folder that is not a run.

Each test derives the numbers the doctor must quote from the stream it wrote (window means over the first and last
quarter of the steps, :data:`~prefzoo.report.diagnose.WINDOW`; least-squares slopes of exact lines), in its
docstring. Before: ``prefzoo.report.diagnose`` did not exist (ModuleNotFoundError) and ``prefzoo diagnose`` answered
"prefzoo needs a command: train, pairs, report, conformance, toy (got 'diagnose')" with exit status 2.

Tolerances: the doctor's numbers are float64 window means and least-squares slopes of at most 20 values, against
the same means written out here or copied from the run's files (kind 1 of tests/bounds.py): rounding ~1e-15, so
``pytest.approx``'s default rel 1e-6 cannot be reached by rounding, only by a wrong window or formula. The other
thresholds (KL < 0.1, loss change < 5%, ...) are the doctor's own verdict rules, claims, not tolerances.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prefzoo.errors import DataError, RunFolderError
from prefzoo.report.diagnose import DEFAULT_KL_BUDGET, Limits, diagnose, load_run

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "arithmetic_pairs.jsonl"


def write_run(path: Path, steps: list[dict], evals=(), *, algo="dpo", beta=0.1, lr=2e-4, online=False,
              objective=None, algo_settings=None, summary=True, declaration=None) -> Path:
    """A run folder: ``steps`` numbered 1..N into metrics.jsonl, ``evals`` (each with its step) as the summary's
    eval_history, and the config keys the doctor reads."""
    path.mkdir(parents=True, exist_ok=True)
    rows = [{"step": i + 1, **row} for i, row in enumerate(steps)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"algo": {"name": algo, **(algo_settings or {})},
              "objective": {"beta": beta, "divergence": "reverse_kl", "kl_controller": "fixed", "kl_target": None,
                            "kl_horizon": 10000, "kl_budget": None, **(objective or {})},
              "trainer": {"lr": lr, "batch_size": 4}, "rollout": {"max_new_tokens": 64}, "eval": {"diversity_samples": 4}}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    if summary:
        (path / "summary.json").write_text(json.dumps({
            "algo": algo, "beta": beta, "final_beta": beta, "steps": len(rows),
            "results": {"train_kl": rows[-1].get("kl") if online else None}, "eval_history": list(evals),
            **(declaration or {})}))
    return path


def verdicts(path: Path, limits: Limits = Limits()) -> dict:
    findings, _, _ = diagnose(load_run(path), limits)
    return {f.verdict: f for f in findings}


def test_not_moving_with_a_flat_loss_points_at_the_learning_rate(tmp_path):
    """DPO, lr 1e-7, 20 steps: loss 0.6931 throughout (log 2: chance), rewards/margins 1e-4 at beta 0.1, i.e. a
    log-ratio margin of 1e-4 / 0.1 = 0.001 nats (< 0.1), held-out KL 0.004 nats (< 0.1): not moving. The loss changed
    0% (< 5%) while grad_norm is 1: the optimiser's steps are too small -> trainer.lr 1e-07 -> 1e-06."""
    steps = [{"loss": 0.6931, "rewards/margins": 1e-4, "grad_norm": 1.0}] * 20
    evals = [{"step": 0, "kl_k1": 0.0, "preference_accuracy": 0.5},
             {"step": 20, "kl_k1": 0.004, "preference_accuracy": 0.52}]
    found = verdicts(write_run(tmp_path / "run", steps, evals, lr=1e-7))
    assert list(found) == ["not_moving"]
    f = found["not_moving"]
    assert "after 20 steps KL 0.004 nats per completion" in f.evidence
    assert "log-ratio margin 0.001 nats" in f.evidence and "preference accuracy 0.5 -> 0.52" in f.evidence
    assert "loss 0.693 -> 0.693 (+0.0%, training steps 1-5 vs 16-20)" in f.evidence
    assert f.numbers["margin_nats"] == pytest.approx(0.001) and f.numbers["suggests"] == ["lr"]
    assert f.change == "trainer.lr 1e-07 -> 1e-06 (or more trainer.max_steps)"


def test_not_moving_with_a_falling_loss_points_at_beta(tmp_path):
    """DPO at beta 5, 20 steps: steps 1-10 loss 0.693 and margin 0, steps 11-20 loss 0.576 and rewards/margins 0.25
    (-log sigmoid(0.25) = 0.576). The end window (steps 16-20) has a log-ratio margin of 0.25 / 5 = 0.05 nats (< 0.1)
    and the held-out KL is 0.02 nats: not moving, yet the loss fell (0.576 - 0.693) / 0.693 = -17%: beta 5 (>= 0.5)
    turns a tiny move into a low loss -> objective.beta 5 -> 0.5."""
    steps = [{"loss": 0.693, "rewards/margins": 0.0, "grad_norm": 1.0}] * 10 \
        + [{"loss": 0.576, "rewards/margins": 0.25, "grad_norm": 1.0}] * 10
    found = verdicts(write_run(tmp_path / "run", steps, [{"step": 0, "kl_k1": 0.0}, {"step": 20, "kl_k1": 0.02}],
                               beta=5.0))
    f = found["not_moving"]
    assert "log-ratio margin 0.05 nats" in f.evidence and "KL 0.02 nats" in f.evidence
    assert "beta 5 >= 0.5, loss 0.693 -> 0.576 (-17%) with the margin still near 0: beta too high" in f.evidence
    assert f.numbers["suggests"] == ["beta"] and f.change == "objective.beta 5 -> 0.5"


def test_not_moving_without_a_gradient_blames_the_reward(tmp_path):
    """GRPO (beta 0) whose every group got one reward: grad_norm 0 and frac_zero_std_groups 1 on all 8 steps, KL 0 on
    the rollouts: neither beta (0) nor lr can move it; the reward has to tell the samples apart."""
    steps = [{"kl": 0.0, "grad_norm": 0.0, "frac_zero_std_groups": 1.0, "completion_length": 8.0, "loss": 0.0}] * 8
    found = verdicts(write_run(tmp_path / "run", steps, algo="grpo", beta=0.0, online=True))
    f = found["not_moving"]
    assert "KL 0 nats per completion (rollouts of steps 7-8" in f.evidence
    assert "grad_norm 0 over steps 7-8, frac_zero_std_groups 1: no learning signal" in f.evidence
    assert f.numbers["suggests"] == ["reward"] and "rollout.temperature or algo.num_samples" in f.change


@pytest.mark.parametrize("beta,suggests,change", [
    (0.05, ["lr"], "trainer.lr 0.0002 -> 0.002 (or more trainer.max_steps)"),
    (1.0, ["beta"], "objective.beta 1 -> 0.1"),
])
def test_not_moving_online_is_read_from_beta_not_the_loss(tmp_path, beta, suggests, change):
    """PPO with a gradient (grad_norm 1) and rollout KL 0.01 nats (< 0.1) for 10 steps: not moving. Its loss is
    advantage-weighted (about 0 by construction) and says nothing; beta does: 0.05 (< 0.5) cannot be what holds the
    policy -> lr; 1.0 (>= 0.5) is large -> beta."""
    steps = [{"kl": 0.01, "grad_norm": 1.0, "loss": 1e-9, "completion_length": 20.0}] * 10
    f = verdicts(write_run(tmp_path / "run", steps, algo="ppo", beta=beta, online=True))["not_moving"]
    assert "KL 0.01 nats per completion (rollouts of steps 9-10" in f.evidence
    assert f.numbers["suggests"] == suggests and f.change == change and "loss" not in f.numbers


def test_drifting_kl_past_its_budget_and_still_growing(tmp_path):
    """PPO at beta 0.05, KL = 0.5 * step on the rollouts (no evaluation). Latest KL: the mean over the last 5 steps
    (16..20) = 0.5 * 18 = 9 nats > the default budget 6. The slope over those steps is exactly 0.5 nats/step; it adds
    0.5 * 4 = 2 nats over the window, more than 5% of 9: still growing."""
    steps = [{"kl": 0.5 * s, "grad_norm": 1.0, "loss": 0.1} for s in range(1, 21)]
    found = verdicts(write_run(tmp_path / "run", steps, algo="ppo", beta=0.05, online=True))
    f = found["drifting"]
    assert DEFAULT_KL_BUDGET == 6.0
    assert f.evidence == ("KL 9 nats per completion (rollouts of steps 16-20) is past the budget of 6; still growing: "
                          "+0.5 nats/step over steps 16-20")
    assert f.numbers["slope"] == pytest.approx(0.5)
    assert f.change.startswith("objective.beta 0.05 -> 0.1 (note 004: it fixes the price of KL, not the KL), or "
                               "objective.kl_controller=adaptive objective.kl_target=6")
    assert "objective.kl_budget=6 stops the run there" in f.change


@pytest.mark.parametrize("objective,limits,expected", [
    ({}, Limits(), "KL 8 nats per completion (rollouts of steps 16-20) is past the budget of 6; levelled off: "
                   "+0 nats/step"),
    ({"kl_controller": "adaptive", "kl_target": 3.0}, Limits(), "past the budget of 3;"),
    ({"kl_budget": 7.0}, Limits(), "past the budget of 7;"),
    ({}, Limits(kl_budget=20.0), None),
])
def test_the_kl_budget_comes_from_the_run_or_the_flag(tmp_path, objective, limits, expected):
    """KL 8 nats on every step (slope 0: levelled off). The budget is the run's objective.kl_budget (7), else the
    adaptive controller's kl_target (3), else 6; --kl-budget 20 overrides them all: 8 < 20, no drift."""
    steps = [{"kl": 8.0, "grad_norm": 1.0, "loss": 0.1}] * 20
    found = verdicts(write_run(tmp_path / "run", steps, algo="ppo", beta=0.05, online=True, objective=objective),
                     limits)
    if expected is None:
        assert "drifting" not in found and list(found) == ["healthy"]
    else:
        assert expected in found["drifting"].evidence
    if objective.get("kl_controller") == "adaptive":
        assert "objective.kl_horizon 10000 -> 1000" in found["drifting"].change


def test_gold_falling_while_the_proxy_rises(tmp_path):
    """Five evaluations: gold_sample_reward 0.1, 0.4, 0.6, 0.45, 0.3 (se 0.02 each), the proxy sample_reward 0.1 ...
    0.9 rising, KL 0, 1, 2, 4, 5 (under the budget). Gold peaks at step 20 (0.6, KL 2) and ends 0.3 lower, i.e.
    0.3 / sqrt(0.02^2 + 0.02^2) = 10.6 standard errors, while the proxy rose 0.7 -> 0.9: stop at step 20 / KL 2."""
    gold, proxy, kl = [0.1, 0.4, 0.6, 0.45, 0.3], [0.1, 0.5, 0.7, 0.8, 0.9], [0.0, 1.0, 2.0, 4.0, 5.0]
    evals = [{"step": 10 * i, "gold_sample_reward": g, "gold_sample_reward_se": 0.02, "sample_reward": p, "kl_k1": k}
             for i, (g, p, k) in enumerate(zip(gold, proxy, kl))]
    steps = [{"kl": 0.1 * s, "grad_norm": 1.0, "loss": 0.1} for s in range(1, 41)]
    f = verdicts(write_run(tmp_path / "run", steps, evals, algo="ppo", online=True))["drifting"]
    assert f.evidence == ("gold_sample_reward peaked at step 20 (0.6, KL 2) and fell to 0.3 at step 40 (10.6 standard "
                          "errors) while the proxy sample_reward rose 0.7 -> 0.9")
    assert "trainer.max_steps=20, or objective.kl_budget=2 (the KL at the peak)" in f.change
    assert "trainer.early_stopping.metric=gold_sample_reward" in f.change


def test_gold_within_its_noise_is_no_finding(tmp_path):
    """The same, but gold ends at 0.57: 0.03 below its peak is 1.06 standard errors (< 2): no finding."""
    evals = [{"step": 10 * i, "gold_sample_reward": g, "gold_sample_reward_se": 0.02, "sample_reward": p, "kl_k1": 1.0}
             for i, (g, p) in enumerate(zip([0.1, 0.6, 0.57], [0.1, 0.5, 0.9]))]
    steps = [{"kl": 1.0, "grad_norm": 1.0, "loss": 0.1}] * 20
    assert list(verdicts(write_run(tmp_path / "run", steps, evals, algo="ppo", online=True))) == ["healthy"]


def test_verbose_completions_longer_and_cut_at_the_cap(tmp_path):
    """GRPO rollouts: steps 1-5 have 20 tokens and none cut, steps 16-20 have 60 tokens and half cut
    (frac_truncated 0.5): length x3.00 (>= 1.5) and the cut share up 0.5 (>= 0.1). KL 1 nat: neither still nor
    drifting. The change names the cap (rollout.max_new_tokens=64) and GRPO's algo.mask_truncated."""
    steps = [{"kl": 1.0, "grad_norm": 1.0, "completion_length": 20.0 if s <= 10 else 60.0,
              "frac_truncated": 0.0 if s <= 10 else 0.5} for s in range(1, 21)]
    found = verdicts(write_run(tmp_path / "run", steps, algo="grpo", beta=0.04, online=True,
                               algo_settings={"mask_truncated": False}))
    assert list(found) == ["verbose"]
    f = found["verbose"]
    assert "completion_length 20 -> 60 tokens (x3.00, training steps 1-5 vs 16-20)" in f.evidence
    assert "(frac_truncated) 0.00 -> 0.50 (training steps 1-5 vs 16-20)" in f.evidence
    assert f.change.startswith("rollout.max_new_tokens=64 is the cap, algo.mask_truncated=true")
    assert "objective.beta 0.04 -> 0.08" in f.change


def test_repetitive_distinct_n_down_since_the_first_evaluation(tmp_path):
    """DPO moving (rewards/margins 1 at beta 0.1: 10 nats), evaluations at steps 0 and 20: distinct-2 0.9 -> 0.6
    (-33%, >= 20%), distinct-1 0.6 -> 0.5 (-17%, not listed), entropy 2.0 -> 1.8 (-10%: no collapse), KL 2 nats."""
    evals = [{"step": 0, "kl_k1": 0.0, "distinct_1": 0.6, "distinct_2": 0.9, "entropy": 2.0, "max_repeat": 1.2},
             {"step": 20, "kl_k1": 2.0, "distinct_1": 0.5, "distinct_2": 0.6, "entropy": 1.8, "max_repeat": 3.0}]
    steps = [{"loss": 0.3, "rewards/margins": 1.0, "grad_norm": 1.0}] * 20
    found = verdicts(write_run(tmp_path / "run", steps, evals))
    assert list(found) == ["repetitive"]
    f = found["repetitive"]
    assert f.evidence == "distinct-2 0.9 -> 0.6 (-33%, evaluations at steps 0 and 20); max_repeat 1.2 -> 3"
    assert f.numbers == {"distinct_2": [0.9, 0.6]}
    assert f.change.startswith("objective.beta 0.1 -> 0.2") and "objective=forward_kl" in f.change


def test_collapsing_entropy_down_and_one_answer_per_prompt(tmp_path):
    """Evaluations at steps 0 and 20: entropy 2.0 -> 0.5 nats (-75%, >= 50%), distinct-2 0.95 -> 0.25 <= 1.25 / 4
    (G = eval.diversity_samples = 4 equal samples give 1/4); task accuracy 0.3 -> 0.2 (fell: no narrowing note)."""
    evals = [{"step": 0, "kl_k1": 0.0, "entropy": 2.0, "distinct_2": 0.95, "task_accuracy": 0.3},
             {"step": 20, "kl_k1": 4.0, "entropy": 0.5, "distinct_2": 0.25, "task_accuracy": 0.2}]
    steps = [{"loss": 0.3, "rewards/margins": 1.0, "grad_norm": 1.0}] * 20
    found = verdicts(write_run(tmp_path / "run", steps, evals))
    assert set(found) == {"repetitive", "collapsing"}
    f = found["collapsing"]
    assert f.evidence == ("entropy 2 -> 0.5 nats per token (-75%, evaluations at steps 0 and 20); distinct-2 0.25 <= "
                          "1.25/4 at step 20: one answer per prompt (of eval.diversity_samples=4)")
    assert f.numbers == {"entropy": [2.0, 0.5], "distinct_2": 0.25}
    assert "trainer.lr 0.0002 -> 5e-05" in f.change


def test_collapsing_accuracy_at_zero_with_a_large_kl_like_the_kto_run(tmp_path):
    """/work/runs/zoo/kto's shape: one evaluation (step 40): task_accuracy 0.000 and KL 50.28 nats; KTO's own step
    metric ``kl`` (-59: its mismatched-pair reference point, not KL to the reference) must not be read as the KL.
    Drifting (50.3 > 6, trend unknown from one measurement) and collapsing."""
    steps = [{"kl": -59.0, "loss": 1.5, "rewards/margins": -3.4, "grad_norm": 0.1}] * 40
    found = verdicts(write_run(tmp_path / "run", steps, [{"step": 40, "task_accuracy": 0.0, "kl_k1": 50.28}],
                               algo="kto"))
    assert list(found) == ["drifting", "collapsing"]
    assert found["drifting"].evidence == ("KL 50.3 nats per completion (held-out evaluation at step 40) is past the "
                                          "budget of 6; its trend is unknown (one KL measurement; eval.every=N "
                                          "measures it while training)")
    assert found["collapsing"].evidence == "task_accuracy 0.000 at step 40 with KL 50.3 nats, past the budget of 6"
    assert found["collapsing"].numbers == {"task_accuracy": 0.0, "kl": 50.28}
    assert found["collapsing"].change.endswith("trainer.lr 0.0002 -> 5e-05; or steadier steps: trainer.batch_size 4 -> 8")


def test_a_narrowing_that_raised_accuracy_says_so_once(tmp_path):
    """ORPO-like: entropy 2.28 -> 0.51 (-78%) and distinct-2 0.93 -> 0.65 (-30%) while task accuracy rose 0.255 ->
    0.705. Both findings fire; the note on the one-answer task comes once, on the last; ORPO has no KL term, so the
    change is not a beta."""
    evals = [{"step": 0, "kl_k1": 0.0, "entropy": 2.28, "distinct_2": 0.93, "task_accuracy": 0.255},
             {"step": 40, "kl_k1": 3.6, "entropy": 0.51, "distinct_2": 0.65, "task_accuracy": 0.705}]
    found = verdicts(write_run(tmp_path / "run", [{"loss": 0.3, "grad_norm": 1.0}] * 40, evals, algo="orpo"))
    assert list(found) == ["repetitive", "collapsing"]
    note = "while task_accuracy rose 0.255 -> 0.705"
    assert note not in found["repetitive"].evidence and note in found["collapsing"].evidence
    assert found["collapsing"].change.startswith("algo=orpo's loss has no KL term")
    assert "trainer.batch_size" not in found["collapsing"].change  # a narrowing, not a noisy collapse to accuracy 0


def test_the_declaration_recorded_in_the_summary_decides_not_the_algorithm_name(tmp_path):
    """The same ORPO-like narrowing under a plugin name the doctor has never heard of: a summary declaring no
    reference gets the reference-free advice (no beta); one declaring a reference and no adaptive_beta gets the
    beta change and objective.kl_budget, not the adaptive controller."""
    evals = [{"step": 0, "kl_k1": 0.0, "entropy": 2.28, "distinct_2": 0.93, "task_accuracy": 0.255},
             {"step": 40, "kl_k1": 9.0, "entropy": 0.51, "distinct_2": 0.65, "task_accuracy": 0.705}]
    steps = [{"loss": 0.3, "grad_norm": 1.0}] * 40
    free = verdicts(write_run(tmp_path / "free", steps, evals, algo="my_plugin",
                              declaration={"reference": False, "capabilities": []}))
    assert free["collapsing"].change.startswith("algo=my_plugin's loss has no KL term")
    kl = verdicts(write_run(tmp_path / "kl", steps, evals, algo="orpo",
                            declaration={"reference": True, "capabilities": ["implicit_rewards"]}))
    assert kl["drifting"].change.startswith("objective.beta 0.1 -> 0.2")
    assert "objective.kl_budget=6" in kl["drifting"].change and "kl_controller" not in kl["drifting"].change


def test_an_online_run_at_beta_0_is_told_to_turn_the_penalty_on(tmp_path):
    """GRPO at beta 0 declares no reference (none is built when nothing penalises the KL), but its beta IS the KL
    coefficient: the advice is objective.beta=0.04, not the reference-free family's "lower the lr". The fluency run
    of issue 16 (KL 7.97 > 6 at step 15) was told "algo=grpo's loss has no KL term (its objective.beta weighs another
    one)" before. KL 8 on the held-out evaluation at step 15 > the default budget 6: drifting."""
    steps = [{"kl": 0.5 * s, "reward": 0.1 * s, "grad_norm": 1.0, "loss": 0.0, "completion_length": 32.0}
             for s in range(1, 16)]
    evals = [{"step": 0, "kl_k1": 0.0}, {"step": 15, "kl_k1": 8.0}]
    found = verdicts(write_run(tmp_path / "run", steps, evals, algo="grpo", beta=0.0, online=True,
                               declaration={"reference": False, "capabilities": []}))
    assert found["drifting"].change.startswith("objective.beta=0.04 (now 0: no KL penalty")


def test_a_healthy_run(tmp_path):
    """KL 2 (< 6, >= 0.1), entropy 2.0 -> 1.6 (-20%), distinct-2 0.9 -> 0.85 (-6%), length 30 -> 33 (x1.1): healthy,
    with those numbers."""
    evals = [{"step": 0, "kl_k1": 0.0, "entropy": 2.0, "distinct_2": 0.9, "completion_length": 30.0},
             {"step": 20, "kl_k1": 2.0, "entropy": 1.6, "distinct_2": 0.85, "completion_length": 33.0}]
    found = verdicts(write_run(tmp_path / "run", [{"loss": 0.3, "rewards/margins": 1.0, "grad_norm": 1.0}] * 20, evals))
    assert list(found) == ["healthy"]
    assert found["healthy"].evidence == ("KL 2 nats per completion within the budget of 6; entropy 2 -> 1.6; "
                                         "distinct-2 0.9 -> 0.85; completion_length 30 -> 33")


def test_too_few_steps_to_judge(tmp_path):
    """3 logged steps < MIN_STEPS = 5: one finding saying so (not a crash); --min-steps 2 judges them."""
    run = write_run(tmp_path / "run", [{"loss": 0.6931, "rewards/margins": 0.0, "grad_norm": 1.0}] * 3,
                    [{"step": 3, "kl_k1": 0.0}])
    found = verdicts(run)
    assert list(found) == ["too_few_steps"]
    assert found["too_few_steps"].evidence.startswith("3 training steps logged, too few to judge (the doctor needs 5")
    assert list(verdicts(run, Limits(min_steps=2))) == ["not_moving"]


def test_a_run_still_going_reads_its_eval_files(tmp_path):
    """No summary.json yet: eval_before.json is step 0, eval_step000010.json step 10; the distinct-2 drop 0.9 ->
    0.5 (-44%) between them is found."""
    run = write_run(tmp_path / "run", [{"loss": 0.3, "rewards/margins": 1.0, "grad_norm": 1.0}] * 10, summary=False)
    (run / "eval_before.json").write_text(json.dumps({"distinct_2": 0.9, "kl_k1": 0.0}))
    (run / "eval_step000010.json").write_text(json.dumps({"distinct_2": 0.5, "kl_k1": 1.0}))
    assert "distinct-2 0.9 -> 0.5 (-44%, evaluations at steps 0 and 10)" in verdicts(run)["repetitive"].evidence


def test_a_folder_that_is_not_a_run(tmp_path):
    """An empty folder and a missing one: a RunFolderError naming the path and what is missing; a cut-off line of
    metrics.jsonl (line 2) and a cut-off summary.json: a DataError naming the file (and line)."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunFolderError, match=f"{tmp_path / 'empty'} is not a run folder: it has neither "
                                             "metrics.jsonl nor summary.json"):
        load_run(tmp_path / "empty")
    with pytest.raises(RunFolderError, match="nowhere is not a run folder: it does not exist"):
        load_run(tmp_path / "nowhere")
    bad = write_run(tmp_path / "bad", [{"loss": 1.0}])
    (bad / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, \n')
    with pytest.raises(DataError, match=r"metrics.jsonl:2: not a JSON object"):
        load_run(bad)
    (bad / "metrics.jsonl").write_text('{"step": 1}\n')
    (bad / "summary.json").write_text('{"algo": ')
    with pytest.raises(DataError, match=r"summary.json: not JSON \(Expecting value at line 1\)"):
        load_run(bad)


def _cli(*args, module="prefzoo"):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", module, *(["diagnose"] if module == "prefzoo" else []), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_command_prints_the_verdicts_and_json(tmp_path):
    """``python -m prefzoo diagnose`` (the console script's ``prefzoo.commands:main``): the header, then per finding
    a line of evidence and one of the change; ``--json`` the same findings; the KTO-shaped run of above."""
    run = write_run(tmp_path / "run", [{"loss": 1.5, "grad_norm": 0.1}] * 40,
                    [{"step": 40, "task_accuracy": 0.0, "kl_k1": 50.28}], algo="kto")
    proc = _cli(str(run))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == (f"prefzoo diagnose {run}: algo=kto, 40 steps, beta=0.1, KL budget 6 nats (the default; "
                        "--kl-budget sets another)")
    assert lines[1].startswith("drifting: KL 50.3 nats per completion") and lines[2].startswith("    -> objective.beta")
    assert lines[3].startswith("collapsing: task_accuracy 0.000 at step 40") and len(lines) == 5
    data = json.loads(_cli(str(run), "--json", "--kl-budget", "60").stdout)
    assert data["kl_budget"] == 60.0 and data["kl_budget_source"] == "--kl-budget"
    assert [f["verdict"] for f in data["findings"]] == ["healthy"]


def test_the_command_on_a_folder_that_is_not_a_run(tmp_path):
    """One line on stderr, exit status 2, no traceback; ``python -m prefzoo.diagnose`` is the same command."""
    proc = _cli(str(tmp_path), module="prefzoo.diagnose")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"prefzoo: error: {tmp_path} is not a run folder: it has neither metrics.jsonl nor "
                           "summary.json. A training run writes metrics.jsonl as it trains and summary.json when it "
                           "ends; give the folder a run printed as 'run folder:'.\n")


@pytest.mark.slow  # ~20 s of CPU: 6 DPO steps of the tiny model, two small evaluations
def test_a_real_tiny_run_at_a_tiny_learning_rate_is_not_moving(tmp_path):
    """``train.py model=tiny algo=dpo trainer.lr=1e-7`` for 6 steps: the loss stays at log 2 = 0.693 and the KL at
    ~0. Expected, read from the run's own files: not moving, pointing at the lr; the loss quoted is the mean of steps
    1-2 and of 5-6 of metrics.jsonl, the KL the after-training evaluation's |kl_k1|."""
    run = tmp_path / "run"
    args = ["algo=dpo", "model=tiny", "data=file", f"data.path={FIXTURE}", "trainer.max_steps=6", "trainer.batch_size=2",
            "trainer.lr=1e-7", "trainer.progress=false", "trainer.tensorboard=false", "trainer.num_threads=1",
            "trainer.device=cpu", "trainer.save_every=0", "model.lora.r=4", "data.max_length=96",
            "data.max_prompt_length=64", "eval.num_problems=4", "eval.max_new_tokens=8", "eval.diversity_prompts=2",
            "eval.diversity_samples=2", f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    kl = abs(json.loads((run / "eval_after.json").read_text())["kl_k1"])
    found = verdicts(run)
    assert list(found) == ["not_moving"]
    f = found["not_moving"]
    assert f.numbers["loss"] == pytest.approx([sum(losses[:2]) / 2, sum(losses[-2:]) / 2])
    assert f.numbers["kl"] == pytest.approx(kl) and kl < 0.1
    assert f.numbers["suggests"] == ["lr"] and f.change == "trainer.lr 1e-07 -> 1e-06 (or more trainer.max_steps)"
    summary = json.loads((run / "summary.json").read_text())  # the plugin's declaration, recorded for the doctor
    assert summary["reference"] is True
    assert summary["capabilities"] == ["f_divergence", "implicit_rewards", "precomputed_reference"]
