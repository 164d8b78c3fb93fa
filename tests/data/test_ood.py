"""The shifted task of ``eval.ood`` (prefzoo.data.ood): its problems' shape, disjointness from training, determinism,
and the refusals.

Operands, operators and answers are read back from the question text with a regex and recomputed here, never taken
from the task. Before prefzoo/data/ood.py and ``EvalConfig.ood`` existed, ``eval.ood.digits=3`` failed to compose
(Hydra: "Key 'ood' is not in struct").
"""

from __future__ import annotations

import operator
import re
from types import SimpleNamespace

import pytest

from prefzoo.data.ood import check_ood, ood_enabled, ood_task
from prefzoo.data.tasks import ArithmeticTask
from prefzoo.errors import ConfigError
from tests.algos.hydra_runs import compose

PLAIN = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def data(digits=2, ops=("+",), word_problems=False, seed=0, name="arithmetic", path=None):
    return SimpleNamespace(name=name, path=path, digits=digits, ops=list(ops), word_problems=word_problems, seed=seed)


def ood(digits=None, ops=None, word_problems=None, num_problems=None):
    return SimpleNamespace(digits=digits, ops=ops, word_problems=word_problems, num_problems=num_problems)


def facts(problems) -> set[tuple[str, int, int]]:
    """(op, larger operand, smaller operand) of each plain question: a + b and b + a are one fact."""
    out = set()
    for p in problems:
        a, op, b = PLAIN.fullmatch(p["question"]).groups()
        a, b = int(a), int(b)
        out.add((op, max(a, b), min(a, b)))
    return out


def test_three_digit_sums_and_differences_have_the_stated_shape():
    """Training on 2-digit sums, eval.ood.digits=3 with ops [+, -]: every question is "What is a op b?" with both
    operands in 100..999, op + or - (both present among 200), a >= b for -, the answer a op b recomputed here, and
    the prompt the question plus "Reply with just the number." (the training task's form: data.word_problems=false)."""
    settings = check_ood(data(), ood(digits=3, ops=["+", "-"]), num_problems=200)
    problems = ood_task(settings).eval()
    assert len(problems) == 200 and settings.seed == 0
    seen = set()
    for p in problems:
        a, op, b = PLAIN.fullmatch(p["question"]).groups()
        a, b = int(a), int(b)
        assert 100 <= a <= 999 and 100 <= b <= 999 and op in "+-"
        assert op != "-" or a >= b
        assert p["answer"] == OPS[op](a, b)
        assert p["prompt"] == [{"role": "user", "content": f"{p['question']} Reply with just the number."}]
        seen.add(op)
    assert seen == {"+", "-"}


def test_the_shifted_problems_share_no_fact_with_training_hand_checked():
    """One digit, so the supports can be written out by hand. Training on 1-digit sums (data.ops=[+]): its support
    is the 45 facts a + b with 1 <= b <= a <= 9, and train (40) + held out (5) use all 45. eval.ood.ops=[*] (same
    digits, another operator) with 45 problems must then be exactly the 45 products a * b, 1 <= b <= a <= 9: every
    fact of the shifted support, none of the training one. E.g. "What is 3 + 4?" is a training fact; "What is 3 * 4?"
    (or 4 * 3) is shifted, answer 12."""
    train = ArithmeticTask(digits=1, ops=("+",), num_train=40, num_eval=5, seed=0, word_problems=False)
    all_sums = {("+", a, b) for a in range(1, 10) for b in range(1, a + 1)}
    assert facts(train.train()) | facts(train.eval()) == all_sums and len(all_sums) == 45
    shifted = ood_task(check_ood(data(digits=1), ood(ops=["*"]), num_problems=45)).eval()
    assert facts(shifted) == {("*", a, b) for a in range(1, 10) for b in range(1, a + 1)}
    assert not facts(shifted) & all_sums
    example = next(p for p in shifted if facts([p]) == {("*", 4, 3)})
    assert example["answer"] == 12


def test_three_digit_problems_never_meet_the_two_digit_training_set():
    """The default training task (2-digit sums, 2000 train + 200 held out, seed 0) and 3-digit sums with the SAME
    seed: no shared fact and no shared question text (operands 10..99 against 100..999)."""
    train = ArithmeticTask(digits=2, ops=("+",), num_train=2000, num_eval=200, seed=0, word_problems=False)
    shifted = ood_task(check_ood(data(), ood(digits=3), num_problems=200)).eval()
    assert not facts(shifted) & (facts(train.train()) | facts(train.eval()))
    assert not {p["question"] for p in shifted} & {p["question"] for p in train.train() + train.eval()}


def test_the_shifted_problems_are_deterministic_and_a_prefix_of_more():
    """Seeded by data.seed alone: the same settings give the same problems; 20 problems are the first 20 of 100;
    another data.seed gives others."""
    a = ood_task(check_ood(data(seed=5), ood(digits=3), 100)).eval()
    assert a == ood_task(check_ood(data(seed=5), ood(digits=3), 100)).eval()
    assert ood_task(check_ood(data(seed=5), ood(digits=3), 20)).eval() == a[:20]
    assert [p["question"] for p in ood_task(check_ood(data(seed=6), ood(digits=3), 100)).eval()] != [
        p["question"] for p in a]


@pytest.mark.parametrize("shift, needle", [
    (ood(digits=2), "would ask problems of the training task"),  # nothing shifted
    (ood(ops=["+", "-"]), "the operators ['+'] draw training facts"),  # same digits, + in common
    (ood(word_problems=True), "changing eval.ood.word_problems alone only rewords them"),
    (ood(digits=5), "eval.ood.digits=5 is invalid"),
    (ood(ops=["/"]), "eval.ood.ops=['/'] is invalid"),
    (ood(digits=1, ops=["-"], num_problems=46), "has only 45 distinct problems"),
    (ood(num_problems=10), "eval.ood shifts nothing"),
])
def test_bad_shifts_are_refused_naming_the_key(shift, needle):
    """A shift inside the training support (2-digit sums) or out of range fails with the eval.ood key; one digit and
    one operator has 9 * 10 / 2 = 45 facts."""
    with pytest.raises(ConfigError) as err:
        check_ood(data(), shift, num_problems=200)
    assert needle in str(err.value) and "eval.ood" in str(err.value)


def test_no_shift_is_no_ood_evaluation_and_other_tasks_are_refused():
    assert check_ood(data(), ood(), 200) is None and not ood_enabled(ood())
    with pytest.raises(ConfigError, match="shifts the built-in arithmetic task, but the run trains on data=sentiment"):
        check_ood(data(name="sentiment"), ood(digits=3), 200)


def test_the_config_key_composes_validates_and_allows_ood_early_stopping():
    """eval.ood on the command line: the typed config carries it, a shift inside the training support fails at
    validation (before any model loads), and trainer.early_stopping.metric=ood_task_accuracy is a metric only when
    eval.ood is set."""
    cfg = compose(["algo=grpo", "eval.ood.digits=3", "eval.ood.ops=[+,-]", "eval.ood.num_problems=8"])
    assert (cfg.eval.ood.digits, list(cfg.eval.ood.ops), cfg.eval.ood.num_problems) == (3, ["+", "-"], 8)
    assert compose(["algo=grpo"]).eval.ood.digits is None
    with pytest.raises(ConfigError, match="eval.ood"):
        compose(["algo=grpo", "eval.ood.ops=[+]"])
    compose(["algo=grpo", "eval.ood.digits=3", "trainer.early_stopping.metric=ood_task_accuracy"])
    with pytest.raises(ConfigError, match="ood_task_accuracy"):
        compose(["algo=grpo", "trainer.early_stopping.metric=ood_task_accuracy"])
