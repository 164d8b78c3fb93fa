"""reward=reasoning_gym: the task's own score_answer on the extracted answer (prefzoo.rewards.reasoning_gym).

Entries are written here by hand, and each expected score is derived from the verifier's rule in reasoning-gym
0.1.25 (quoted in the docstrings). Before this module: ``make_reward(["reasoning_gym"])`` raised ConfigError
"unknown reward 'reasoning_gym'".
"""

import json

import pytest

from prefzoo.errors import RewardError
from prefzoo.rewards import make_reward
from prefzoo.rewards.reasoning_gym import extract_answer, reasoning_gym, reasoning_gym_accuracy

# Countdown: reach 309 with 6, 61, 94, 4. 94*4 - 61 - 6 = 376 - 67 = 309.
COUNTDOWN = {"question": "Calculate 309 using all of these numbers: 6, 61, 94, 4.", "answer": "94*4 - 61 - 6",
             "metadata": {"source_dataset": "countdown", "numbers": [6, 61, 94, 4], "target": 309}}
# basic_arithmetic: 5 - 3 - 6 = -4 (reasoning-gym writes the answer as the string "-4").
ARITHMETIC = {"question": "Calculate 5 - 3 - 6.", "answer": "-4",
              "metadata": {"source_dataset": "basic_arithmetic", "expression": "5 - 3 - 6"}}


def score(entry, completions, answer_format="tags", task_config="{}"):
    n = len(completions)
    return reasoning_gym([""] * n, completions, [entry["metadata"]["source_dataset"]] * n, [task_config] * n,
                         [json.dumps(entry)] * n, [answer_format] * n)


def test_countdown_scores_by_its_rule():
    """Countdown's verifier: 1.0 if the expression uses exactly the given numbers and equals the target; 0.05 if it
    parses but uses other numbers or misses the target; 0.01 for no answer. 94*4 - 61 - 6 = 309 -> 1.0 (spaces
    inside the tags are stripped); 94*4 - 61 + 6 = 321 -> 0.05; 94*4 - 61 = 315 leaves out the 6 -> 0.05; no
    <answer> tags (or an unclosed one) -> None -> 0.01; the last of two spans is the answer -> 1.0."""
    completions = ["<answer> 94*4 - 61 - 6 </answer>", "<answer>94*4 - 61 + 6</answer>", "<answer>94*4 - 61</answer>",
                   "94*4 - 61 - 6", "<answer>94*4 - 61 - 6", "<answer>1+1</answer> then <answer>94*4 - 61 - 6</answer>"]
    assert score(COUNTDOWN, completions) == [1.0, 0.05, 0.05, 0.01, 0.01, 1.0]


def test_basic_arithmetic_scores_by_the_default_rule():
    """basic_arithmetic keeps ProceduralDataset.score_answer: 1.0 when the answer equals the oracle string "-4";
    else len(oracle) / len(answer) when the oracle is a substring ("-40": 2/3); else 0.0 ("4" does not contain
    "-4"; no tags: None -> 0.0)."""
    assert score(ARITHMETIC, ["<answer>-4</answer>", "<answer>4</answer>", "<answer>-40</answer>", "-4"]) == \
        pytest.approx([1.0, 0.0, 2 / 3, 0.0])  # 2/3 is one float64 division on either side (kind 1: default rel 1e-6)


def test_the_number_format_reads_the_last_number():
    """answer_format=number: the last number of the reply is the answer. "5 - 3 - 6 = -4" -> "-4" -> 1.0;
    "The answer is 4." -> "4" -> 0.0; "-4 ... or maybe 2" -> "2" -> 0.0; "−4" (Unicode minus) -> "-4" -> 1.0;
    no number -> None -> 0.0."""
    completions = ["5 - 3 - 6 = -4", "The answer is 4.", "-4 ... or maybe 2", "\u22124", "no idea"]
    assert score(ARITHMETIC, completions, "number") == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert extract_answer("1,234 apples", "number") == "1234"


def test_accuracy_counts_only_full_scores():
    """Partial credit (countdown's 0.05, basic_arithmetic's 2/3) is not a correct answer: 1, 0, 0."""
    n = 3
    cols = dict(task=["basic_arithmetic"] * n, task_config=["{}"] * n, entry=[json.dumps(ARITHMETIC)] * n)
    assert reasoning_gym_accuracy([""] * n, ["<answer>-4</answer>", "<answer>-40</answer>", "x"], **cols) == [1, 0, 0]


def test_the_reward_equals_the_generating_datasets_score_answer():
    """On rows of a generated task (a config of its own, answer_format=tags), the reward through the columns equals
    score_answer of the very dataset object that generated the entries, on the extracted answers: the oracle (1.0)
    and a wrong number."""
    import reasoning_gym as rg
    from reasoning_gym.utils import extract_answer as rg_extract

    from prefzoo.data.reasoning_gym import ReasoningGymTask

    config = {"min_terms": 3, "max_terms": 3, "max_digits": 2}
    rows = ReasoningGymTask("chain_sum", config, num_train=0, num_eval=6, seed=7).eval()
    dataset = rg.create_dataset("chain_sum", seed=7, size=6, **config)
    completions = [r["answer_completion"] for r in rows] + [f"<answer>{int(r['answer']) + 1}</answer>" for r in rows]
    cols = {k: [r[k] for r in rows] * 2 for k in ("task", "task_config", "entry", "answer_format")}
    expected = [dataset.score_answer(rg_extract(c), dataset[i % 6]) for i, c in enumerate(completions)]
    assert expected == [1.0] * 6 + [0.0] * 6
    assert reasoning_gym([""] * 12, completions, **cols) == expected


def test_it_is_a_builtin_reward_with_the_columns_as_keywords():
    """make_reward finds it by name and calls it with the data's columns; extra columns (question, answer, ...) are
    ignored; 1.0 and 0.0 as in test_basic_arithmetic_scores_by_the_default_rule."""
    reward = make_reward(["reasoning_gym", "reasoning_gym_accuracy"])
    cols = dict(task=["basic_arithmetic"] * 2, task_config=["{}"] * 2, entry=[json.dumps(ARITHMETIC)] * 2,
                answer_format=["tags"] * 2, question=["q"] * 2, answer=["-4"] * 2)
    assert reward(["p", "p"], ["<answer>-4</answer>", "<answer>4</answer>"], **cols) == [2.0, 0.0]


def test_a_verifier_that_raises_scores_zero_and_warns_once(monkeypatch, caplog):
    import prefzoo.rewards.reasoning_gym as module

    def broken(answer, entry):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(module, "_verifier", lambda task, config: broken)
    monkeypatch.setattr(module, "_warned", set())
    assert score(ARITHMETIC, ["<answer>1</answer>", "<answer>2</answer>"]) == [0.0, 0.0]
    assert sum("ZeroDivisionError: boom" in r.message for r in caplog.records) == 1


def test_bad_columns_are_reward_errors():
    with pytest.raises(RewardError, match="not a reasoning-gym entry"):
        reasoning_gym([""], ["<answer>1</answer>"], ["chain_sum"], ["{}"], ["not json"])
    with pytest.raises(RewardError, match="got 2 completions but 1 values of column 'entry'"):
        reasoning_gym(["", ""], ["a", "b"], ["chain_sum"] * 2, ["{}"] * 2, [json.dumps(ARITHMETIC)])
    with pytest.raises(RewardError, match="answer_format 'xml' is not one of tags, number"):
        score(ARITHMETIC, ["-4"], "xml")
