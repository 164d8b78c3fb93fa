"""The recipe sft_then_grpo end to end on the tiny model: SFT on the task's demonstrations first (in <sweep>/sft), then
GRPO from that run's adapter (the sweep's job), then the report. The recipe's own settings, shrunk in size only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

#: the recipes' end-to-end sweeps: `make test-recipes`, which CI runs; not `make test`
pytestmark = pytest.mark.recipes

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny", "trainer.device=cpu", "trainer.tensorboard=false", "eval.num_problems=4", "eval.diversity_prompts=2",
        "eval.max_new_tokens=6", "rollout.max_new_tokens=6", "eval.pass_k_problems=2", "data.num_train=16",
        "data.num_eval=4", "trainer.max_steps=2"]


def test_sft_then_grpo_trains_grpo_from_the_sft_run_s_adapter(tmp_path):
    """The SFT run read the task's 16 demonstrations (data.demonstrations, the tags format) and changed the policy (its
    evaluation's seeded temperature-1 samples differ before and after); the GRPO job's model.adapter_path is that
    run's adapter, and its evaluation before training draws the SFT run's samples after training, text for text (the
    same policy and the same seeds), not the base model's."""
    cmd = [sys.executable, "train.py", "-m", "+recipe=sft_then_grpo", *TINY, f"hydra.sweep.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sft, grpo = tmp_path / "sft", tmp_path / "0-grpo"
    sft_config = yaml.safe_load((sft / "config.yaml").read_text())
    assert sft_config["algo"]["name"] == "sft" and sft_config["data"]["demonstrations"] is True
    assert sft_config["data"]["answer_format"] == "tags" and sft_config["model"]["name"] == "tiny"
    assert json.loads((sft / "summary.json").read_text())["data_stats"]["sft_rows"] == 16
    grpo_config = yaml.safe_load((grpo / "config.yaml").read_text())
    assert grpo_config["algo"]["name"] == "grpo" and grpo_config["model"]["adapter_path"] == str(sft / "adapter")
    answers = lambda run, tag: json.loads((run / f"eval_{tag}.json").read_text())["sample_examples"]  # noqa: E731
    assert answers(sft, "before") != answers(sft, "after")
    assert answers(grpo, "before") == answers(sft, "after")
    assert (tmp_path / "report.md").is_file()
