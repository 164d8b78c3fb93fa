"""The over-optimisation designs of issue 16 (recipes overoptimisation_length / _fluency / _fewpairs / _betas) end to end
on the tiny model: each recipe's own proxy settings (the reward model trained first, its annotator, reward and task),
shrunk only in size (steps, prompts, tokens), then the sweep and its report.

The tiny random model never answers an addition right, so the length design's pairs are the known-answer fallback
(the biased annotator itself is tested on scripted completions in tests/data/test_annotator.py) and every gold
accuracy is 0; what is checked here is that each recipe runs and its report has every section and plot.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

#: the recipes' end-to-end sweeps (several training jobs each): `make test-recipes`, which CI runs; not `make test`
pytestmark = pytest.mark.recipes

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny", "trainer.device=cpu", "trainer.tensorboard=false", "eval.num_problems=4",
        "eval.diversity_prompts=4", "eval.max_new_tokens=6", "rollout.max_new_tokens=6", "data.pairs.num_prompts=8"]
#: the reward model's sizes in these tests (its other settings are the recipe's own)
RM_SIZES = {"trainer.max_steps": "2", "data.pairs.eval_prompts": "8"}


def proxy_overrides(recipe: str, extra: list[str]) -> str:
    """The recipe's own reward-model overrides, resolved under the test's settings, with :data:`RM_SIZES`."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from prefzoo.cli import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"+recipe={recipe}", *(e for e in extra if "," not in e)],
                      return_hydra_config=True)  # (the swept points play no part in the proxy's settings)
    items = OmegaConf.to_container(cfg.hydra.callbacks.reward_model.overrides, resolve=True)
    items = [f"{k}={RM_SIZES[k]}" if (k := item.partition("=")[0]) in RM_SIZES else item for item in items]
    return "hydra.callbacks.reward_model.overrides=[" + ",".join(f"'{o}'" for o in items) + "]"


def multirun(recipe: str, folder: Path, *extra: str, own_proxy: bool = True) -> subprocess.CompletedProcess:
    args = [*TINY, *extra]
    cmd = [sys.executable, "train.py", "-m", f"+recipe={recipe}", *args, f"hydra.sweep.dir={folder}"]
    if own_proxy:
        cmd.append(proxy_overrides(recipe, args))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def length_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """overoptimisation_length_small with best-of-n 1, 2 and GRPO at beta 0 (seeds 0 and 1) and beta 0.1 (seed 3),
    4 steps each, evaluated every step: one multirun for the length design, the fits, best-of-n against RL and the
    beta test."""
    folder = tmp_path_factory.mktemp("length")
    proc = multirun("overoptimisation_length_small", folder, "trainer.max_steps=4", "eval.every=1",
                    "eval.pass_k_problems=2",
                    "+recipe/overoptimisation_points=bon_n1,bon_n2,grpo_beta0,grpo_beta0_seed1,grpo_beta0_1_seed3")
    return folder, proc


@pytest.fixture(scope="module")
def fluency_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("fluency")
    proc = multirun("overoptimisation_fluency_small", folder, "trainer.max_steps=3", "eval.every=1",
                    "+recipe/overoptimisation_points=bon_n1,bon_n2,bon_n4,grpo_beta0")
    return folder, proc


def test_the_length_design_trains_its_biased_proxy_and_reports_everything(length_sweep):
    """The proxy was trained with the recipe's length-biased annotator on the arithmetic task and the verifier's
    labels (its config.yaml); every policy run is scored by the proxy with the verifier as gold; the report has the
    fits with standard errors (5 points per RL run: steps 0-4), the gold-peak table, best-of-n against RL and the
    beta test with the seeds the points give."""
    folder, proc = length_sweep
    rm = yaml.safe_load((folder / "reward_model" / "config.yaml").read_text())
    assert (rm["data"]["name"], rm["data"]["pairs"]["annotator"], rm["reward"]["functions"]) == (
        "arithmetic", "longer", ["correctness"])
    assert rm["data"]["pairs"]["require_finished"] is False and rm["trainer"]["max_steps"] == 2
    runs = sorted(p.name for p in folder.iterdir() if (p / "summary.json").is_file())
    assert runs == ["0-bon", "1-bon", "2-grpo", "3-grpo", "4-grpo", "reward_model"]
    summaries = {r: json.loads((folder / r / "summary.json").read_text()) for r in runs if r != "reward_model"}
    assert {s["gold_reward"][0] for s in summaries.values()} == {"correctness"}
    assert [(s["beta"], s["seed"]) for r, s in sorted(summaries.items()) if s["algo"] == "grpo"] == [
        (0.0, 0), (0.0, 1), (0.1, 3)]
    assert [h["step"] for h in summaries["2-grpo"]["eval_history"]] == [0, 1, 2, 3, 4]
    text = (folder / "report.md").read_text()
    for heading in ("## Overoptimisation: gold vs proxy reward", "### Does gold fall past its peak",
                    "### Best-of-n against RL at the same KL", "## Beta sets the speed, not the shape"):
        assert heading in text, heading
    assert "| grpo | 0 (0, 1), 0.1 (3) |" in text
    fit_rows = [line for line in text.splitlines() if line.startswith("| grpo β=0 (2-grpo) | proxy | d(a − b·log d)")]
    assert len(fit_rows) == 1 and fit_rows[0].count(" ± ") >= 2  # a and b with their standard errors
    for plot in ("overoptimisation.png", "bon_vs_rl.png", "speed_shape.png"):
        assert (folder / plot).is_file() and f"plot: {folder / plot}" in proc.stdout


def test_the_fluency_design_scores_gold_with_fluent_sentiment(fluency_sweep):
    """The proxy learns plain sentiment (reward=sentiment pairs, 8 prompts here); gold is fluent_sentiment, a
    different number from the proxy's on the same samples; the report fits best-of-n (n = 1, 2, 4: two points with
    d > 0) and the RL run."""
    folder, _ = fluency_sweep
    rm = yaml.safe_load((folder / "reward_model" / "config.yaml").read_text())
    assert (rm["data"]["name"], rm["reward"]["functions"], rm["data"]["pairs"]["num_prompts"]) == (
        "sentiment", ["sentiment"], 8)
    grpo = json.loads((folder / "3-grpo" / "summary.json").read_text())
    assert grpo["gold_reward"] == ["fluent_sentiment"] and grpo["reward"] == "model"
    after = grpo["eval_after"]
    assert 0.0 <= after["gold_sample_reward"] <= 1.0 and after["gold_sample_reward"] != after["sample_reward"]
    text = (folder / "report.md").read_text()
    assert "| best-of-n | gold | d(a − b·d) |" in text and "| grpo β=0 (3-grpo) | gold | d(a − b·log d) |" in text


def test_the_fewpairs_design_and_a_reused_proxy(fluency_sweep, tmp_path):
    """overoptimisation_fewpairs_small asks for a proxy on 16 prompts (its resolved reward-model overrides); run with
    reward.path=<the fluency sweep's reward model> it trains none (TrainFirst's reuse_key) and its runs score with
    that proxy. Before reuse_key: the sweep trained a reward model of its own although reward.path named another."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from prefzoo.cli import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["+recipe=overoptimisation_fewpairs"], return_hydra_config=True)
    items = OmegaConf.to_container(cfg.hydra.callbacks.reward_model.overrides, resolve=True)
    assert "data.pairs.num_prompts=16" in items and "reward=sentiment" in items
    proxy = fluency_sweep[0] / "reward_model"
    proc = multirun("overoptimisation_fewpairs_small", tmp_path, "trainer.max_steps=2", "eval.every=1",
                    f"reward.path={proxy}", "+recipe/overoptimisation_points=bon_n1,grpo_beta0", own_proxy=False)
    assert f"[prefzoo] proxy reward model: found {proxy}, not retrained" in proc.stdout
    assert not (tmp_path / "reward_model").exists()
    grpo = json.loads((tmp_path / "1-grpo" / "summary.json").read_text())
    assert grpo["gold_reward"] == ["sentiment"] and (tmp_path / "report.md").is_file()


def test_the_concise_design_trains_two_proxies_and_pools_the_runs(tmp_path):
    """overoptimisation_concise_small with `data.pairs.seed=0,1` and both policy seeds (the full recipe's grid, tiny
    sizes): one proxy per pairs seed in reward_model_0 / reward_model_1, each built with the conciseness-biased
    annotator and that seed (its config.yaml); every GRPO job scores with its own proxy (its reward.path); the report
    pools the 4 GRPO runs (one row per evaluation step they share) and gives the pre-registered test at the recipe's
    peak d."""
    proc = multirun("overoptimisation_concise_small", tmp_path, "trainer.max_steps=2", "eval.steps=[1]",
                    "data.pairs.seed=0,1", "+recipe/overoptimisation_points=grpo_beta0,grpo_beta0_seed1")
    for seed in (0, 1):
        rm = yaml.safe_load((tmp_path / f"reward_model_{seed}" / "config.yaml").read_text())
        assert (rm["data"]["pairs"]["annotator"], rm["data"]["pairs"]["seed"], rm["trainer"]["seed"]) == (
            "shorter", seed, seed)
        assert f"proxy reward model (data.pairs.seed={seed})" in proc.stdout
    jobs = sorted(p.name for p in tmp_path.iterdir() if (p / ".hydra").is_dir())
    assert len(jobs) == 4 and all("proxy" in j for j in jobs)
    for job in jobs:
        cfg = yaml.safe_load((tmp_path / job / "config.yaml").read_text())
        assert cfg["reward"]["path"] == str(tmp_path / f"reward_model_{cfg['data']['pairs']['seed']}")
    text = (tmp_path / "report.md").read_text()
    assert "grpo β=0 pooled over 4 runs" in text and "### The pre-registered test (pooled runs)" in text
    assert "closest to d = 0.35" in text
