"""summary.json holds the same comparable keys for every algorithm (``results``), KL to the reference included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefzoo.training.loop import RESULT_KEYS, Trainer
from tests.algos.hydra_runs import TINY_RUN, compose
from tests.models.helpers import one_thread_fixture

FIXTURE = str(Path(__file__).resolve().parents[1] / "fixtures" / "arithmetic_pairs.jsonl")
PAIRS = ["data=file", f"data.path={FIXTURE}", "data.eval_fraction=0.25"]


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


@pytest.mark.parametrize("algo, extra", [
    ("dpo", PAIRS), ("simpo", PAIRS), ("orpo", PAIRS), ("sft", PAIRS), ("grpo", []), ("ppo", ["algo.epochs=1"]), ("bon", ["algo.n=2"]),
    ("rm", PAIRS),
])
def test_results_block_has_the_same_keys_for_every_algorithm(algo, extra, tmp_path):
    """Every run writes results with exactly RESULT_KEYS. Policies (with LoRA) have a KL to the reference and a reward:
    DPO against its frozen reference, SimPO and GRPO (beta = 0: no reference needed) against the adapter-disabled
    model, best-of-n its analytic KL; DPO/SimPO on a preference FILE are evaluated on the held-out pairs' prompts. A
    reward model samples nothing: its policy keys are None, its held-out pair accuracy is there."""
    tiny = [o for o in TINY_RUN if algo != "rm" or "num_problems" not in o]  # conf/algo/rm.yaml: no sampling
    summary = Trainer(compose([f"algo={algo}", "trainer.max_steps=1"] + extra + tiny), tmp_path).run()
    results = json.loads((tmp_path / "summary.json").read_text())["results"]
    assert tuple(results) == RESULT_KEYS and results == summary["results"]
    # what the rewards were measured on (the report's frontier draws a line per algorithm, task and environment)
    assert (summary["task"], summary["env"]) == ("arithmetic_pairs.jsonl" if extra is PAIRS else "arithmetic 2-digit +",
                                                 "none")
    assert results["wall_seconds"] >= results["train_seconds"] >= 0 and results["steps"] == (0 if algo == "bon" else 1)
    if algo == "rm":
        assert results["kl"] is None and results["reward"] is None and results["preference_accuracy"] is not None
        return
    assert isinstance(results["kl"], float) and isinstance(results["reward"], float)
    assert results["kl_method"] == ("analytic" if algo == "bon" else "sampled")
    assert isinstance(results["distinct_2"], float) and isinstance(results["sample_reward"], float)
    assert (results["entropy"] is None) == (algo == "bon")
    if algo in ("grpo", "ppo"):
        assert results["train_reward"] is not None and results["train_kl"] is not None


def test_the_before_after_line_shows_each_shared_metric_with_its_standard_errors(capsys):
    """The line printed after training (issue 48: `make train` showed only the evaluation after): the metrics both
    evaluations have, in CHANGE_KEYS' order, rounded to 3 decimals as written here by hand."""
    from prefzoo.training.summary import print_change

    before = {"task_accuracy": 0.255, "task_accuracy_se": 0.0308, "kl_k1": 0.0, "kl_k1_se": 0.0, "entropy": 1.0}
    after = {"task_accuracy": 0.745, "task_accuracy_se": 0.0309, "kl_k1": 5.2612, "kl_k1_se": 0.31, "entropy": 0.5,
             "sample_reward": 0.5}
    print_change(before, after)
    assert capsys.readouterr().out == ("[prefzoo] before -> after training: task_accuracy 0.255±0.031 -> 0.745±0.031, "
                                       "kl_k1 0.000±0.000 -> 5.261±0.310\n")
    print_change(None, after)  # no evaluation before training (eval.before=false): no line
    print_change(before, {"entropy": 0.5})  # nothing shared among the headline metrics: no line
    assert capsys.readouterr().out == ""


def test_task_name_says_what_the_rewards_were_measured_on():
    """A run's task in a few words, the same from a config object and from the mapping of a saved config.yaml: the
    built-in arithmetic task's digits and operators (``data.digits=3 'data.ops=[*]'``, the calculator environment's
    task), the reasoning-gym task or mix, a file's name."""
    import dataclasses

    from prefzoo.config import DataConfig
    from prefzoo.training.names import task_name

    cases = [(DataConfig(), "arithmetic 2-digit +"), (DataConfig(digits=3, ops=["*"]), "arithmetic 3-digit *"),
             (DataConfig(ops=["+", "-"], word_problems=True), "arithmetic 2-digit +- words"),
             (DataConfig(name="reasoning_gym", task="chain_sum"), "chain_sum"),
             (DataConfig(name="reasoning_gym", task=["chain_sum", "basic_arithmetic"]), "chain_sum+basic_arithmetic"),
             (DataConfig(name="file", path="/data/pairs/calc.jsonl"), "calc.jsonl"),
             (DataConfig(name="sentiment"), "sentiment")]
    for data, name in cases:
        assert task_name(data) == name and task_name(dataclasses.asdict(data)) == name
