"""The out-of-distribution half of the evaluation (``eval.ood``, prefzoo.evaluation.ood): in- and out-of-distribution
accuracy and diversity side by side in one evaluation, in ``eval_*.json``, ``summary.json`` (``eval_after`` and the
``results`` block) and the eval history.

Before eval.ood existed the override failed to compose ("Could not override 'eval.ood.digits'"), and an evaluation
had no ``ood_*`` key.
"""

from __future__ import annotations

import contextlib
import json
import re

import torch

from prefzoo.config import EvalConfig
from prefzoo.data.ood import check_ood, ood_task
from prefzoo.data.prompts import PromptSet
from prefzoo.data.tasks import ArithmeticTask
from prefzoo.evaluation.evaluate import Evaluator
from prefzoo.evaluation.ood import OOD_RESULTS, OODEvaluator
from prefzoo.rewards.arithmetic import correctness
from prefzoo.training.loop import RESULT_KEYS, Trainer
from tests.algos.hydra_runs import TINY_RUN, compose
from tests.data.test_ood import data, ood

QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


class CharTokenizer:
    """Token id = the character's code point; 0 is padding."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(i) for i in row.tolist() if i) for row in ids]


class ScriptedPolicy:
    """A policy whose answers are known in advance (no per-token log-probs, like best-of-n):

    * its greedy answer is "The answer is <a op b>" when it :func:`knows` the question, else "I do not know";
    * its two temperature-1 samples of a 2-digit question share no bigram ("The answer is <v>", "I think it <v>"),
      those of a 3-digit question are the same ("I do not know"), so distinct-2 is 1 in distribution and 1/2 out of it.
    """

    SAMPLES = ("The answer is {}", "I think it {}")

    tractable_logps, reference, value_model, analytic_kl = False, None, None, 0.0
    pad_id, device, generator = 0, torch.device("cpu"), None
    tokenizer = CharTokenizer()

    def seeded(self, generator):  # its samples are scripted: no randomness to seed
        return contextlib.nullcontext(self)

    def sample(self, batch, k, params):
        texts = []
        for prompt in batch.columns["prompt_text"]:
            a, op, b = QUESTION.search(prompt).groups()
            value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            for j in range(k):
                if params.greedy:
                    texts.append(f"The answer is {value}" if knows(a) else "I do not know")
                else:
                    texts.append(self.SAMPLES[j % 2].format(value) if len(a) == 2 else "I do not know")
        width = max(len(t) for t in texts)
        ids = torch.tensor([[ord(c) for c in t] + [0] * (width - len(t)) for t in texts])
        return type("Samples", (), {"completion_ids": ids, "completion_mask": ids != 0, "episodes": None})()


def prompt_set(problems) -> PromptSet:
    return PromptSet([[1]] * len(problems), [p["question"] for p in problems],
                     {"answer": [p["answer"] for p in problems], "question": [p["question"] for p in problems]})


def knows(a: str) -> bool:
    """The scripted policy knows a 2-digit question whose first operand is even, a 3-digit one whose first operand is
    a multiple of 5."""
    return int(a) % (2 if len(a) == 2 else 5) == 0


def known_share(problems) -> float:
    return sum(knows(QUESTION.search(p["question"]).group(1)) for p in problems) / len(problems)


def test_in_and_out_of_distribution_metrics_side_by_side():
    """20 two-digit sums in distribution, 20 three-digit sums and differences out of it, a scripted policy: accuracy is
    the share of questions it knows (:func:`knows`), counted here from the question texts of each set; distinct-2
    is 1.0 in distribution (2 different samples of 3 bigrams each: 6 distinct / 6) and 0.5 out of it (2 identical
    samples: 3 / 6). The OOD keys are the in-distribution ones prefixed ood_, with ood_task naming the shift."""
    cfg = EvalConfig(num_problems=20, diversity_prompts=20, diversity_samples=2, batch_size=8)
    id_problems = ArithmeticTask(digits=2, num_train=0, num_eval=20, seed=0, word_problems=False).eval()
    ood_problems = ood_task(check_ood(data(), ood(digits=3, ops=["+", "-"]), 20)).eval()
    main = Evaluator(ScriptedPolicy(), correctness, prompt_set(id_problems), cfg, correctness_fn=correctness,
                     progress=False)
    shifted = OODEvaluator(main, prompt_set(ood_problems), cfg, correctness, task="3-digit +, - (plain questions)")
    result = {**main.run(), **shifted.run()}
    assert result["task_accuracy"] == known_share(id_problems)
    assert result["ood_task_accuracy"] == known_share(ood_problems)
    assert result["task_accuracy"] != result["ood_task_accuracy"]
    assert (result["distinct_2"], result["ood_distinct_2"]) == (1.0, 0.5)
    assert result["ood_n_problems"] == 20 and result["ood_task"] == "3-digit +, - (plain questions)"
    in_keys = {k for k in result if not k.startswith("ood_")}
    assert {f"ood_{k}" for k in in_keys} == {k for k in result if k.startswith("ood_") and k != "ood_task"}


def test_a_tiny_run_reports_both_in_its_evaluations_and_summary(tmp_path):
    """GRPO on the tiny model, 1 step, eval.ood.digits=3 with 3 shifted problems: eval_before/eval_after.json, the
    summary's eval_after and eval history carry ood_* next to the in-distribution keys; results has every RESULT_KEY,
    its ood_* equal to eval_after's (ood_reward <- ood_task_reward, ood_kl <- ood_kl_k1); the greedy examples ask
    3-digit questions. The in-distribution numbers are those of the same run without eval.ood (the OOD half runs after
    them and draws from its own seeded generator)."""
    base = ["algo=grpo", "trainer.max_steps=1", *TINY_RUN]
    summary = Trainer(compose([*base, "eval.ood.digits=3", "eval.ood.num_problems=3"]), tmp_path / "ood").run()
    plain = Trainer(compose(base), tmp_path / "plain").run()
    for tag in ("before", "after"):
        result = json.loads((tmp_path / "ood" / f"eval_{tag}.json").read_text())
        for key in ("task_accuracy", "distinct_2", "entropy", "kl_k1"):
            assert isinstance(result[key], float) and isinstance(result[f"ood_{key}"], float), (tag, key)
        assert result["ood_n_problems"] == 3 and result["n_problems"] == 2
        questions = [QUESTION.search(e["prompt"]).groups() for e in result["ood_greedy_examples"]]
        assert len(questions) == 3 and all(len(a) == 3 and len(b) == 3 and op == "+" for a, op, b in questions)
    after, results = summary["eval_after"], summary["results"]
    assert tuple(results) == RESULT_KEYS
    assert {k: results[k] for k in OOD_RESULTS} == {k: after[v] for k, v in OOD_RESULTS.items()}
    assert "ood_greedy_examples" not in after and "ood_task_accuracy" in summary["eval_history"][-1]
    same = {k: v for k, v in after.items() if not k.startswith("ood_") and k != "seconds"}
    assert same == {k: v for k, v in plain["eval_after"].items() if k != "seconds"}
    assert all(plain["results"][k] is None for k in OOD_RESULTS)
