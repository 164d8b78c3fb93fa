"""Kirk et al.'s other half, one command: ``python train.py -m +recipe=kirk_ood_small`` (SFT, DPO, GRPO, best-of-n
trained on 2-digit sums, evaluated in distribution and on 3-digit sums and differences), end to end on the tiny model
(one sweep shared by the assertions), and the report's in / out-of-distribution section on hand-made runs.

The tiny random model answers nothing right (every accuracy is 0); what the sweep checks is that each point runs with
the recipe's settings and that both halves of every evaluation reach summary.json and the report. Before the recipe
existed, ``+recipe=kirk_ood_small`` failed to compose (Hydra: "Could not find 'recipe/kirk_ood_small'").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prefzoo.report.ood import ood_section

#: the recipes' end-to-end sweeps (several training jobs each): `make test-recipes`, which CI runs; not `make test`
pytestmark = pytest.mark.recipes

ROOT = Path(__file__).resolve().parents[2]
#: the recipe's own settings, shrunk only in size (steps, problems, samples, tokens, pairs)
TINY = ["model=tiny", "trainer.device=cpu", "trainer.tensorboard=false", "trainer.max_steps=2", "eval.num_problems=4",
        "eval.diversity_prompts=2", "eval.diversity_samples=2", "eval.max_new_tokens=6", "rollout.max_new_tokens=6",
        "eval.pass_k_problems=2", "eval.batch_size=8", "data.pairs.num_prompts=8", "data.pairs.eval_prompts=4",
        "data.pairs.max_new_tokens=6", "data.num_train=16", "data.num_eval=8"]
QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("kirk_ood")
    cmd = [sys.executable, "train.py", "-m", "+recipe=kirk_ood_small", *TINY, f"hydra.sweep.dir={folder}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, proc


def _summaries(folder: Path) -> dict[str, dict]:
    return {p.name: json.loads((p / "summary.json").read_text()) for p in sorted(folder.iterdir())
            if (p / "summary.json").is_file()}


def test_each_point_trains_on_two_digit_sums_and_is_evaluated_on_both(sweep):
    """One folder per point, named by it; each run's config is the recipe's (2-digit sums, eval.ood 3-digit + and -,
    rollouts at 0.7, 4 prompts per step); its evaluation after training (and before, for the runs that train) has
    the in-distribution keys and the same keys prefixed ood_, summary.json's results block the ood_* numbers; the
    shifted greedy examples ask 3-digit sums or differences."""
    folder, _ = sweep
    summaries = _summaries(folder)
    assert list(summaries) == ["0-sft", "1-dpo", "2-grpo", "3-bon"]
    assert [s["algo"] for s in summaries.values()] == ["sft", "dpo", "grpo", "bon"]
    for name, s in summaries.items():
        cfg = yaml.safe_load((folder / name / "config.yaml").read_text())
        assert (cfg["data"]["digits"], cfg["data"]["ops"], cfg["eval"]["ood"]["digits"], cfg["eval"]["ood"]["ops"]) == (
            2, ["+"], 3, ["+", "-"])
        assert cfg["rollout"]["temperature"] == 0.7 and cfg["trainer"]["batch_size"] == 4
        for when in ("eval_after",) + (("eval_before",) if s["algo"] != "bon" else ()):
            ev = s[when]
            for key in ("task_accuracy", "task_accuracy_se", "distinct_2", "sample_reward"):
                assert isinstance(ev[key], float) and isinstance(ev[f"ood_{key}"], float), (name, when, key)
            assert ev["ood_n_problems"] == 4 and ev["ood_task"] == "3-digit +, - (plain questions)"
        assert s["results"]["ood_task_accuracy"] == s["eval_after"]["ood_task_accuracy"]
        assert s["results"]["ood_distinct_2"] == s["eval_after"]["ood_distinct_2"]
        examples = json.loads((folder / name / "eval_after.json").read_text())["ood_greedy_examples"]
        for a, op, b in (QUESTION.search(e["prompt"]).groups() for e in examples):
            assert len(a) == len(b) == 3 and op in "+-"


def test_the_report_has_the_in_and_out_of_distribution_table_and_plot(sweep):
    """report.md: the section's table has the policy before training (from the first trained run's evaluation before
    training) and one row per point, each cell the run's own numbers, an `against SFT` column; ood.png is written and
    listed first among the plots."""
    folder, proc = sweep
    summaries = _summaries(folder)
    text = (folder / "report.md").read_text()
    assert "## In and out of distribution (Kirk et al. 2024)" in text and "(3-digit +, - (plain questions))" in text
    section = text.split("## In and out of distribution")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
    header, rows = rows[0], rows[1:]
    assert header[:5] == ["run", "algo", "steps", "ID accuracy", "OOD accuracy"] and header[-1] == "against SFT"
    assert [r[0] for r in rows] == ["before training (π_ref)", "sft", "dpo", "grpo", "bon"]
    before = summaries["0-sft"]["eval_before"]
    assert rows[0][7] == f"{before['ood_distinct_2']:.3f}"
    for row, s in zip(rows[1:], summaries.values()):
        after = s["eval_after"]
        assert row[1] == s["algo"] and row[2] == str(s["steps"])
        assert row[4] == f"{after['ood_task_accuracy']:.3f} ± {after['ood_task_accuracy_se']:.3f}"
        assert (row[6], row[7]) == (f"{after['distinct_2']:.3f}", f"{after['ood_distinct_2']:.3f}")
    assert rows[1][-1] == "–"  # SFT against itself
    assert (folder / "ood.png").is_file()
    plots = [line.split("plot: ")[1] for line in proc.stdout.splitlines() if "plot: " in line]
    assert plots[0] == str(folder / "ood.png")


def _run(name: str, algo: str, steps: int, acc, acc_se, ood_acc, ood_se, d2, ood_d2) -> dict:
    ev = {"task_accuracy": acc, "task_accuracy_se": acc_se, "ood_task_accuracy": ood_acc, "ood_task_accuracy_se": ood_se,
          "distinct_2": d2, "ood_distinct_2": ood_d2, "ood_task": "3-digit +, - (plain questions)"}
    return {"dir": Path(name), "summary": {"algo": algo, "steps": steps, "eval_after": ev}, "overrides": {}}


def test_each_run_against_sft_numbers_derived_by_hand():
    """SFT: OOD accuracy 0.20 ± 0.04, distinct-2 0.80. GRPO: 0.40 ± 0.05, distinct-2 0.50: difference +0.200, combined
    s.e. sqrt(0.04² + 0.05²) = 0.064, 0.200 > 2 x 0.064 and 0.50 < 0.80: better OOD and less diverse, Kirk et al.'s
    pattern. DPO: 0.25 ± 0.04: +0.050 ± sqrt(2) x 0.04 = 0.057, within 2 s.e.; distinct-2 0.85 >= 0.80. OOD - ID of
    GRPO: 0.40 - 0.60 = -0.200 ± sqrt(0.05² + 0.03²) = 0.058."""
    runs = [_run("sft", "sft", 10, 0.5, 0.04, 0.20, 0.04, 0.9, 0.80), _run("grpo", "grpo", 10, 0.6, 0.03, 0.40, 0.05,
                                                                           0.6, 0.50),
            _run("dpo", "dpo", 10, 0.55, 0.04, 0.25, 0.04, 0.9, 0.85)]
    text = ood_section(runs, ["sft", "grpo", "dpo"])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| run")}
    assert rows["grpo"][5] == "-0.200 ± 0.058"
    assert rows["grpo"][-1] == ("accuracy +0.200 ± 0.064, distinct-2 -0.300: better OOD, less diverse "
                                "(Kirk et al.'s pattern)")
    assert rows["dpo"][-1] == "accuracy +0.050 ± 0.057, distinct-2 +0.050: OOD within 2 s.e., as or more diverse"
    assert ood_section([{**runs[0], "summary": {"algo": "sft", "eval_after": {"task_accuracy": 0.5}}}], ["sft"]) == ""
