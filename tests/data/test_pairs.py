"""The built-in on-policy pairs when the reference model never answers right (issue 17, item 15).

A scripted sampler stands for the model (tests/data/test_preference.py: fixed completions per prompt), so the
expected pairs are known in advance: with the correctness verifier and answers 5, 6, 7, a sample "12" is wrong
for every prompt; the known answer "5" (prompt 0) is right, so it is chosen over the sampled "12".
"""

import json
import logging

import pytest

from prefzoo.types import SamplingParams
from prefzoo.data.pairs import build_or_load_pairs, sample_and_label
from prefzoo.data.prompts import PromptSet
from prefzoo.errors import DataError
from prefzoo.rewards import make_reward
from tests.data.test_preference import ScriptedSampler, ids
from tests.test_config import typed

QUESTIONS = ["What is 2 + 3?", "What is 2 + 4?", "What is 3 + 4?"]
ANSWERS = [5, 6, 7]
CORRECT = make_reward(["correctness"])


def prompts(with_answers=True):
    raw = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return PromptSet([ids(q) for q in QUESTIONS], QUESTIONS, {"answer": list(ANSWERS)} if with_answers else {}, raw)


def never_right():
    return ScriptedSampler([[("12", True), ("I think 13", True)] for _ in QUESTIONS * 2])  # train, then held out


def build(tmp_path, sampler, train, held, *overrides, reward=CORRECT):
    cfg = typed("model=tiny", "data.pairs.num_samples=2", "data.pairs.num_prompts=3",
                "data.pairs.eval_prompts=3", *overrides)
    return build_or_load_pairs(cfg, None, lambda: sampler, reward, train, held, tmp_path, progress=False)


def test_a_model_that_never_answers_right_gets_the_known_answer_as_chosen():
    """Every sample is wrong (reward 0), so no group holds a pair; each prompt's known answer scores 1 > 0 and is
    chosen against its first worst sample ("12"). Before: no rows at all."""
    rows, stats = sample_and_label(never_right(), prompts(), CORRECT, 2, SamplingParams(), batch_size=2, seed=0,
                                   progress=False, known_answer=True)
    assert [(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in rows] == [("5", "12"), ("6", "12"),
                                                                                          ("7", "12")]
    assert [r["answer"] for r in rows] == ANSWERS and all(r["chosen_reward"] == 1.0 for r in rows)
    assert rows[0]["prompt"] == [{"role": "user", "content": QUESTIONS[0]}]
    assert stats["pairs"] == stats["known_answer_pairs"] == 3 and stats["mean_sample_reward"] == 0.0


def test_a_model_that_finds_pairs_keeps_exactly_its_own():
    """Prompt 0 has a right and a wrong sample (a pair of its own); prompts 1 and 2 none: they stay without a pair,
    with or without the fallback (the real model's built-in pairs are unchanged)."""
    script = [[("5", True), ("12", True)], [("12", True), ("13", True)], [("12", True), ("12", True)]]
    own = [sample_and_label(ScriptedSampler(script), prompts(), CORRECT, 2, SamplingParams(), 2, seed=0,
                            progress=False, known_answer=flag) for flag in (False, True)]
    assert own[0] == own[1]
    rows, stats = own[1]
    assert [(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in rows] == [("5", "12")]
    assert "known_answer_pairs" not in stats


def test_the_cache_holds_the_known_answer_pairs_and_the_log_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="prefzoo"):
        train_path, eval_path, stats = build(tmp_path, never_right(), prompts(), prompts())
    rows = [json.loads(line) for line in train_path.read_text().splitlines()]
    assert [r["chosen"][0]["content"] for r in rows] == ["5", "6", "7"] and stats["train"]["known_answer_pairs"] == 3
    warned = [r.getMessage() for r in caplog.records if "known answer" in r.getMessage()]
    assert len(warned) == 2 and warned[0].startswith("train preference pairs: model=tiny gave no pair of its own "
                                                     "(sample accuracy 0.0% over 6 samples): 3 pairs use the task's "
                                                     "known answer as chosen against a sampled wrong answer")


def test_no_pair_and_no_known_answer_is_an_error_and_caches_nothing(tmp_path):
    """A review task (no answers) whose reward scores every sample 0.25: no pair, and no known answer to fall back
    on. Before: an empty train.jsonl was cached and datasets raised StopIteration reading it."""
    flat = make_reward([lambda p, c, **_: [0.25] * len(c)])
    with pytest.raises(DataError) as err:
        build(tmp_path, never_right(), prompts(with_answers=False), prompts(with_answers=False), "reward=sentiment",
              reward=flat)
    msg = str(err.value)
    assert msg.startswith("the built-in train preference pairs are empty: among 3 prompts x 2 samples of model=tiny "
                          "the verifier (sentiment) told no two samples of a prompt apart (mean sample reward 0.25)")
    assert "Nothing was cached" in msg and "data.pairs.num_samples" in msg and "data=file" in msg
    assert not list(tmp_path.rglob("*.jsonl"))


def test_an_empty_cached_set_is_built_again(tmp_path):
    """Caches written before this fix hold empty files: they are not a set of pairs."""
    train_path, eval_path, _ = build(tmp_path, never_right(), prompts(), prompts())
    train_path.write_text("")
    again, _, _ = build(tmp_path, never_right(), prompts(), prompts())
    assert again == train_path and len(train_path.read_text().splitlines()) == 3
