"""Generated prompt tasks: determinism, disjoint splits, correct answers, dataset columns.

Answers are recomputed here from the numbers in the question text (regex), not taken from the task.
"""

import json
import operator
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prefzoo.data.tasks import (
    PLAIN_INSTRUCTION,
    WORD_PROBLEM_INSTRUCTION,
    ArithmeticTask,
    SentimentTask,
    get_task,
)
from prefzoo.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
PLAIN_QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def questions(problems):
    return [p["question"] for p in problems]


def test_same_seed_same_problems_other_seed_different():
    a, b = ArithmeticTask(seed=3, num_train=300, num_eval=50), ArithmeticTask(seed=3, num_train=300, num_eval=50)
    assert a.train() == b.train() and a.eval() == b.eval()
    c = ArithmeticTask(seed=4, num_train=300, num_eval=50)
    assert questions(c.train()) != questions(a.train())
    assert SentimentTask(seed=1).train() == SentimentTask(seed=1).train()
    assert SentimentTask(seed=1).eval() != SentimentTask(seed=2).eval()


_DIGEST_SCRIPT = """
import json
from prefzoo.data.tasks import ArithmeticTask, SentimentTask
a = ArithmeticTask(ops=("+", "-", "*"), num_train=100, num_eval=20, seed=7)
s = SentimentTask(num_train=50, num_eval=10, seed=7)
print(json.dumps([a.train(), a.eval(), s.train(), s.eval()]))
"""


def test_splits_do_not_depend_on_hash_seed():
    """Fresh interpreters with different PYTHONHASHSEED produce exactly the problems made here."""
    a = ArithmeticTask(ops=("+", "-", "*"), num_train=100, num_eval=20, seed=7)
    s = SentimentTask(num_train=50, num_eval=10, seed=7)
    here = [a.train(), a.eval(), s.train(), s.eval()]
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True,
        )
        assert json.loads(out.stdout) == here


def test_eval_split_does_not_depend_on_num_train_and_is_prefix_stable():
    small = ArithmeticTask(num_train=10, num_eval=40, seed=0)
    big = ArithmeticTask(num_train=500, num_eval=20, seed=0)
    assert big.eval() == small.eval()[:20]
    assert SentimentTask(num_train=5, num_eval=30).eval()[:10] == SentimentTask(num_train=900, num_eval=10).eval()


@pytest.mark.parametrize("word_problems", [True, False])
def test_train_and_eval_disjoint_without_repeats(word_problems):
    task = ArithmeticTask(ops=("+", "-", "*"), num_train=2000, num_eval=200, word_problems=word_problems)
    train, held_out = questions(task.train()), questions(task.eval())
    assert len(train) == 2000 and len(held_out) == 200
    assert len(set(train)) == 2000 and len(set(held_out)) == 200
    assert not set(train) & set(held_out)


def test_eval_facts_unseen_in_training_even_with_operands_swapped():
    task = ArithmeticTask(ops=("+", "*"), num_train=1500, num_eval=300, word_problems=False)

    def facts(problems):
        out = set()
        for q in questions(problems):
            a, op, b = PLAIN_QUESTION.fullmatch(q).groups()
            out.add((op, frozenset((int(a), int(b)))))
        return out

    assert not facts(task.train()) & facts(task.eval())


@pytest.mark.parametrize("digits", [1, 2, 3, 4])
def test_plain_answers_recomputed_from_question(digits):
    task = ArithmeticTask(digits=digits, ops=("+", "-", "*"), num_train=40, num_eval=20, word_problems=False)
    for problem in task.train() + task.eval():
        a, op, b = PLAIN_QUESTION.fullmatch(problem["question"]).groups()
        assert len(a) == digits and len(b) == digits
        assert problem["answer"] == OPERATORS[op](int(a), int(b))
        assert type(problem["answer"]) is int


@pytest.mark.parametrize("op", ["+", "-", "*"])
def test_word_problem_answers_recomputed_from_question(op):
    """With one operator, every story must hold exactly two numbers and answer first-op-second."""
    task = ArithmeticTask(ops=(op,), num_train=300, num_eval=30, word_problems=True)
    for problem in task.train() + task.eval():
        numbers = [int(n) for n in re.findall(r"\d+", problem["question"])]
        assert len(numbers) == 2, problem["question"]
        assert problem["answer"] == OPERATORS[op](*numbers), problem["question"]


@pytest.mark.parametrize("word_problems", [True, False])
def test_subtraction_never_negative(word_problems):
    task = ArithmeticTask(digits=1, ops=("-",), num_train=35, num_eval=10, word_problems=word_problems)
    answers = [p["answer"] for p in task.train() + task.eval()]
    assert min(answers) >= 0
    assert 0 in answers  # all 45 one-digit facts are used, including a - a


def test_capacity_boundary_for_one_digit_addition():
    """One-digit operands 1..9, a + b == b + a: 9 * 10 / 2 = 45 distinct facts."""
    task = ArithmeticTask(digits=1, ops=("+",), num_train=40, num_eval=5, word_problems=False)
    pairs = {
        tuple(sorted(map(int, PLAIN_QUESTION.fullmatch(q).group(1, 3))))
        for q in questions(task.train() + task.eval())
    }
    assert pairs == {(a, b) for a in range(1, 10) for b in range(a, 10)}
    with pytest.raises(ConfigError, match="only 45 distinct problems"):
        ArithmeticTask(digits=1, ops=("+",), num_train=41, num_eval=5)


@pytest.mark.parametrize("word_problems, instruction", [(True, WORD_PROBLEM_INSTRUCTION), (False, PLAIN_INSTRUCTION)])
def test_prompt_is_one_user_message_with_instruction(word_problems, instruction):
    for problem in ArithmeticTask(num_train=20, num_eval=5, word_problems=word_problems).train():
        assert problem["prompt"] == [{"role": "user", "content": f"{problem['question']} {instruction}"}]


def test_plain_and_word_instruction_texts():
    assert PLAIN_INSTRUCTION == "Reply with just the number."
    assert WORD_PROBLEM_INSTRUCTION == "Give the final answer as a number at the end."


def test_arithmetic_to_dataset():
    task = ArithmeticTask(num_train=30, num_eval=7)
    train, held_out = task.to_dataset("train"), task.to_dataset("eval")
    assert set(train.column_names) == {"prompt", "answer", "question"}
    assert len(train) == 30 and len(held_out) == 7
    assert train[0]["prompt"] == task.train()[0]["prompt"]
    assert held_out["answer"] == [p["answer"] for p in task.eval()]
    empty = ArithmeticTask(num_train=3, num_eval=0).to_dataset("eval")
    assert len(empty) == 0 and set(empty.column_names) == {"prompt", "answer", "question"}
    with pytest.raises(ConfigError, match="unknown split 'test'"):
        task.to_dataset("test")


def test_sentiment_task():
    task = SentimentTask(num_train=200, num_eval=40, seed=0)
    train, held_out = task.train(), task.eval()
    assert len(train) == 200 and len(held_out) == 40
    assert not {p["subject"] for p in train} & {p["subject"] for p in held_out}
    for problem in train + held_out:
        assert problem["subject"] in problem["question"]
        assert problem["question"].startswith(("Write a short", "You just"))
        assert problem["prompt"] == [{"role": "user", "content": problem["question"]}]
    ds = task.to_dataset("eval")
    assert set(ds.column_names) == {"prompt", "question", "subject"} and len(ds) == 40


def test_sentiment_defaults():
    task = SentimentTask()
    assert len(task.train()) == 1000 and len(task.eval()) == 100
    assert len(set(questions(task.train()))) == 1000


def test_get_task():
    assert get_task("arithmetic", num_train=5, num_eval=2).train() == ArithmeticTask(num_train=5, num_eval=2).train()
    assert isinstance(get_task("sentiment", num_train=5, num_eval=2), SentimentTask)
    with pytest.raises(ConfigError, match=r"unknown task 'gsm8k'.*\['arithmetic', 'sentiment'\]"):
        get_task("gsm8k")
    with pytest.raises(ConfigError, match="bad arguments for task 'sentiment'.*digits"):
        get_task("sentiment", digits=2)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"digits": 0}, "digits must be"),
        ({"digits": 5}, "digits must be"),
        ({"ops": ("/",)}, "ops must be"),
        ({"ops": ()}, "ops must be"),
        ({"num_train": -1}, "num_train must be"),
        ({"seed": "zero"}, "seed must be"),
    ],
)
def test_arithmetic_bad_arguments(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ArithmeticTask(**kwargs)
