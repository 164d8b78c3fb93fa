"""Tests for prefzoo.data.preference (and the prompt sets and pair selection built on it).

Expected token ids are computed independently with the tokenizer itself (``tok(text)`` and the chat
template), never with the functions under test.
"""

import json
import logging
import random

import datasets
import pytest
import torch

from prefzoo.data.files import ORIGIN
from prefzoo.data.pairs import select_pair
from prefzoo.data.preference import (collate_preferences, load_table, pad_rows, split_implicit_prompt,
                                     tokenize_preferences)
from prefzoo.data.prompts import tokenize_prompts
from prefzoo.errors import DataError
from tests.models.helpers import tokenizer

FIXTURE = "tests/fixtures/arithmetic_pairs.jsonl"
USER = [{"role": "user", "content": "What is 2 + 3?"}]


def ids(text: str) -> list[int]:
    return tokenizer()(text, add_special_tokens=False)["input_ids"]


def chat_prompt_ids(messages) -> list[int]:
    return ids(tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def tokenize(rows, max_length=256, max_prompt_length=128, on_bad_row="error"):
    table = datasets.Dataset.from_list(rows) if isinstance(rows, list) else rows
    return tokenize_preferences(table, tokenizer(), max_length, max_prompt_length, on_bad_row, "pairs.jsonl")


# --------------------------------------------------------------------------------------- row forms

def test_plain_text_row():
    ex, = tokenize([{"prompt": "Q: 2+3=", "chosen": " 5", "rejected": " 6"}])
    eos = tokenizer().eos_token_id
    assert ex.prompt_ids == ids("Q: 2+3=")  # used as written, no template
    assert ex.chosen_ids == ids(" 5") + [eos]
    assert ex.rejected_ids == ids(" 6") + [eos]
    assert not ex.prompt_truncated


def test_conversational_row_applies_the_chat_template():
    ex, = tokenize([{"prompt": USER, "chosen": [{"role": "assistant", "content": "5"}],
                     "rejected": [{"role": "assistant", "content": "It is 6."}]}])
    eos = tokenizer().eos_token_id
    assert ex.prompt_ids == chat_prompt_ids(USER)
    assert tokenizer().decode(ex.prompt_ids).endswith("<|im_start|>assistant\n")
    assert ex.chosen_ids == ids("5") + [eos]
    assert ex.rejected_ids == ids("It is 6.") + [eos]


def test_implicit_prompt_rows_split_on_the_shared_prefix():
    history = USER + [{"role": "assistant", "content": "5"}, {"role": "user", "content": "And 2 + 4?"}]
    row = {"chosen": history + [{"role": "assistant", "content": "6"}],
           "rejected": history + [{"role": "assistant", "content": "7"}]}
    ex, = tokenize([row])
    explicit, = tokenize([{"prompt": history, "chosen": [{"role": "assistant", "content": "6"}],
                           "rejected": [{"role": "assistant", "content": "7"}]}])
    assert ex == explicit
    assert ex.prompt_ids == chat_prompt_ids(history)


def test_split_implicit_prompt_never_ends_the_prompt_on_an_assistant_turn():
    a = USER + [{"role": "assistant", "content": "The answer is 5"}]
    b = USER + [{"role": "assistant", "content": "The answer is 5"}, {"role": "user", "content": "sure?"},
                {"role": "assistant", "content": "yes"}]
    prompt, chosen, rejected = split_implicit_prompt(a, b)
    assert prompt == USER and chosen == a[1:] and rejected == b[1:]


# ------------------------------------------------------------------------------------------- bad rows

GOOD = {"prompt": "Q", "chosen": "yes", "rejected": "no"}


@pytest.mark.parametrize("bad,problem", [
    ({"prompt": "Q", "chosen": "", "rejected": "no"}, "chosen is empty"),
    ({"prompt": "Q", "chosen": "yes", "rejected": "   "}, "rejected is empty"),
    ({"prompt": "Q", "chosen": "same", "rejected": "same"}, "chosen == rejected"),
    ({"prompt": "Q", "chosen": "yes", "rejected": None}, "rejected is null"),  # a null value, not a missing column
    ({"prompt": None, "chosen": "yes", "rejected": "no"}, "prompt is null"),
    ({"prompt": "  ", "chosen": "yes", "rejected": "no"}, "prompt is empty"),
])
def test_each_bad_row_kind_names_the_row_and_the_problem(bad, problem):
    with pytest.raises(DataError) as err:
        tokenize([GOOD, GOOD, bad])
    msg = str(err.value)
    assert "pairs.jsonl, row 2" in msg and problem in msg and "on_bad_row=skip" in msg


def test_missing_column_in_the_whole_table():
    with pytest.raises(DataError, match="row 0: missing column 'rejected'"):
        tokenize([{"prompt": "Q", "chosen": "yes"}])


@pytest.mark.parametrize("bad,problem", [
    ({"prompt": "Q", "chosen": 5, "rejected": "no"}, "chosen is int"),
    ({"prompt": 3.5, "chosen": "yes", "rejected": "no"}, "prompt is float"),
    ({"prompt": "Q", "chosen": [{"role": "assistant", "content": 7}], "rejected": "no"}, "content of type int"),
    ({"prompt": [{"role": "wizard", "content": "Q"}], "chosen": "yes", "rejected": "no"},
     "role 'wizard'; chat roles are system, user, assistant, tool"),
])
def test_non_string_values(bad, problem):
    """Mixed types cannot live in one Arrow column, so these rows come in as a plain list of dicts
    (``datasets`` tables are iterables of dicts; so is a list)."""
    with pytest.raises(DataError, match=f"row 1: .*{problem}"):
        tokenize_preferences([GOOD, bad], tokenizer(), 256, 128, "error", "pairs.jsonl")


def test_implicit_prompt_rows_that_share_no_prefix():
    row = {"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
           "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]}
    with pytest.raises(DataError, match="row 0: chosen and rejected share no prompt prefix"):
        tokenize_preferences([row], tokenizer(), 256, 128, "error", "pairs.jsonl")


def test_prompt_too_long_for_max_length_is_a_bad_row():
    long_prompt = "word " * 50
    with pytest.raises(DataError, match=r"row 1: the prompt has \d+ tokens and data.max_length=20 leaves no room"):
        tokenize([GOOD, {"prompt": long_prompt, "chosen": "a", "rejected": "b"}], max_length=20,
                 max_prompt_length=None)


def test_skip_drops_bad_rows_and_warns_once_with_the_count(caplog):
    rows = [GOOD, {"prompt": "Q", "chosen": "", "rejected": "no"}, {"prompt": "Q", "chosen": "x", "rejected": "x"},
            {"prompt": "P", "chosen": "a", "rejected": "b"}]
    with caplog.at_level(logging.WARNING, logger="prefzoo.data.preference"):
        examples = tokenize(rows, on_bad_row="skip")
    assert [tokenizer().decode(e.prompt_ids) for e in examples] == ["Q", "P"]
    warnings = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1
    assert "skipped 2 bad rows" in warnings[0].getMessage() and "row 1" in warnings[0].getMessage()


def test_skip_with_no_good_row_left_is_an_error():
    with pytest.raises(DataError, match="no usable rows"):
        tokenize([{"prompt": "Q", "chosen": "x", "rejected": "x"}], on_bad_row="skip")


# ----------------------------------------------------------------------------------------- truncation

def test_prompt_is_truncated_from_the_left_and_counted(caplog):
    prompt = " ".join(f"w{i}" for i in range(40))
    full = ids(prompt)
    assert len(full) > 10
    with caplog.at_level(logging.WARNING, logger="prefzoo.data.preference"):
        ex, = tokenize([{"prompt": prompt, "chosen": "a", "rejected": "b"}], max_length=64, max_prompt_length=10)
    assert ex.prompt_ids == full[-10:]  # the END of the prompt (next to the answer) is kept
    assert ex.prompt_truncated
    assert any("1 prompts were longer" in r.getMessage() for r in caplog.records)


def test_completion_is_truncated_from_the_right_and_keeps_eos_only_when_it_fits():
    """Prompt 'Q' is 1 token. A completion of n text tokens plus EOS fits in max_length = 1 + n + 1 with its
    EOS; with max_length = 1 + n it keeps its n text tokens and loses the EOS; with 1 + 3 its first 3."""
    eos = tokenizer().eos_token_id
    text = " one two three four five six"
    n = len(ids(text))
    assert len(ids("Q")) == 1 and n >= 5
    row = {"prompt": "Q", "chosen": text, "rejected": " no"}
    ex, = tokenize([row], max_length=1 + n + 1, max_prompt_length=None)
    assert ex.chosen_ids == ids(text) + [eos]
    ex, = tokenize([row], max_length=1 + n, max_prompt_length=None)
    assert ex.chosen_ids == ids(text) and ex.chosen_ids[-1] != eos
    ex, = tokenize([row], max_length=1 + 3, max_prompt_length=None)
    assert ex.chosen_ids == ids(text)[:3]
    assert ex.rejected_ids == (ids(" no") + [eos])[:3]
    assert len(ex.prompt_ids) + len(ex.chosen_ids) <= 4


def test_max_length_counts_prompt_plus_completion_after_prompt_truncation():
    prompt = " ".join(f"w{i}" for i in range(40))
    ex, = tokenize([{"prompt": prompt, "chosen": " a b c d e f g h", "rejected": " z"}], max_length=14,
                   max_prompt_length=10)
    assert len(ex.prompt_ids) == 10 and len(ex.chosen_ids) == 4


# ------------------------------------------------------------------------------------------- files

ROWS = [{"prompt": "Q1", "chosen": "a", "rejected": "b"}, {"prompt": "Q2", "chosen": "c", "rejected": "d"}]


@pytest.mark.parametrize("ext", ["jsonl", "json", "parquet", "csv"])
def test_loading_from_each_file_type(tmp_path, ext):
    path = tmp_path / f"pairs.{ext}"
    if ext == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif ext == "json":
        path.write_text(json.dumps(ROWS))  # a JSON array of objects
    elif ext == "parquet":
        datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    else:
        path.write_text("prompt,chosen,rejected\nQ1,a,b\nQ2,c,d\n")
    table = load_table(str(path))
    assert table.num_rows == 2 and [table[1][c] for c in ("prompt", "chosen", "rejected")] == ["Q2", "c", "d"]
    assert table.column_names == ["prompt", "chosen", "rejected", ORIGIN]  # + where each row came from
    examples = tokenize(table)
    assert [e.prompt_ids for e in examples] == [ids("Q1"), ids("Q2")]


def test_csv_cells_stay_text_even_when_they_look_like_numbers(tmp_path):
    """Arithmetic completions are often bare numbers. pandas would read "118" as the int 118 (then
    'chosen is int', a bad row) and "02" / "2.50" as 2 and 2.5 (silently different text)."""
    path = tmp_path / "pairs.csv"
    path.write_text("prompt,chosen,rejected\nWhat is 59 + 59?,118,02\nWhat is 1 + 1.5?,2.50,3\n")
    table = load_table(str(path))
    assert table.remove_columns(ORIGIN).to_list() == [{"prompt": "What is 59 + 59?", "chosen": "118", "rejected": "02"},
                                                      {"prompt": "What is 1 + 1.5?", "chosen": "2.50", "rejected": "3"}]
    first, second = tokenize(table)
    eos = tokenizer().eos_token_id
    assert first.chosen_ids == ids("118") + [eos] and second.chosen_ids == ids("2.50") + [eos]


def test_conversational_parquet_and_the_fixture_file(tmp_path):
    fixture = load_table(FIXTURE)
    path = tmp_path / "pairs.parquet"
    fixture.to_parquet(str(path))
    a, b = tokenize(load_table(FIXTURE)), tokenize(load_table(str(path)))
    assert len(a) == 40 and a == b
    first = json.loads(open(FIXTURE).readline())
    assert a[0].prompt_ids == chat_prompt_ids(first["prompt"])


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_table(str(tmp_path / "nope.jsonl"))
    (tmp_path / "pairs.txt").write_text("x")
    with pytest.raises(DataError, match="unknown file type"):
        load_table(str(tmp_path / "pairs.txt"))


# ---------------------------------------------------------------------------------------- collation

def test_collate_pads_prompts_left_and_completions_right():
    examples = tokenize([{"prompt": "Q", "chosen": " a b c", "rejected": " z"},
                         {"prompt": "A longer question here", "chosen": " y", "rejected": " p q r s"}])
    batch = collate_preferences(examples, [7, 9], pad_id=tokenizer().pad_token_id)
    assert batch.index.tolist() == [7, 9] and len(batch) == 2
    for side, seq in (("chosen", batch.chosen), ("rejected", batch.rejected)):
        for i, e in enumerate(examples):
            want = getattr(e, f"{side}_ids")
            assert seq.completion_ids[i][seq.completion_mask[i]].tolist() == want
            assert seq.completion_mask[i, : len(want)].all()  # right padding: real tokens first
            assert seq.prompt_ids[i][seq.prompt_mask[i]].tolist() == e.prompt_ids
            assert seq.prompt_mask[i, seq.prompt_mask.shape[1] - len(e.prompt_ids):].all()  # left padding
    sub = batch.select([1])
    assert sub.index.tolist() == [9] and sub.chosen.completion_ids.shape[0] == 1


def test_pad_rows_both_sides():
    ids_, mask = pad_rows([[1, 2], [3]], "left", 0)
    assert ids_.tolist() == [[1, 2], [0, 3]] and mask.tolist() == [[True, True], [False, True]]
    ids_, mask = pad_rows([[1, 2], [3]], "right", 0)
    assert ids_.tolist() == [[1, 2], [3, 0]] and mask.tolist() == [[True, True], [True, False]]


# ------------------------------------------------------------------------------------- prompts, pairs

def test_prompt_sets_refuse_overlong_prompts_and_skip_with_a_count(caplog):
    table = datasets.Dataset.from_list([{"prompt": "short", "answer": 1}, {"prompt": "w " * 30, "answer": 2},
                                        {"prompt": "", "answer": 3}])
    with pytest.raises(DataError, match="row 1: prompt has .* more than data.max_prompt_length=8"):
        tokenize_prompts(table, tokenizer(), 8)
    with caplog.at_level(logging.WARNING, logger="prefzoo.data.prompts"):
        prompts = tokenize_prompts(table, tokenizer(), 8, on_bad_row="skip")
    assert len(prompts) == 1 and prompts.columns["answer"] == [1] and prompts.prompt_ids == [ids("short")]
    assert any("skipped 2 bad prompts" in r.getMessage() for r in caplog.records)
    batch = prompts.batch([0], tokenizer().pad_token_id)
    assert batch.columns["prompt_text"] == ["short"] and batch.columns["answer"] == [1]


def test_select_pair_takes_best_ended_and_worst_and_breaks_ties_at_random():
    rng = random.Random(0)
    ended = [True] * 4
    assert select_pair([1.0, 1.0, 1.0], ended[:3], rng) is None
    assert select_pair([0.0, 1.0, 0.5], ended[:3], rng) == (1, 0)
    picks = {select_pair([1.0, 0.0, 1.0, 0.0], ended, random.Random(s)) for s in range(40)}
    assert picks == {(0, 1), (0, 3), (2, 1), (2, 3)}
    assert select_pair([0.0, 1.0], ended[:2], random.Random(5)) == select_pair([0.0, 1.0], ended[:2], random.Random(5))


def test_select_pair_needs_an_ended_chosen_strictly_better_than_rejected():
    """A truncated best answer cannot be chosen; an ended answer that scores the same as the worst is no pair."""
    rng = random.Random(0)
    assert select_pair([1.0, 0.0], [False, True], rng) is None  # the only right answer never ended
    assert select_pair([0.0, 0.0], [True, False], rng) is None  # ended vs truncated, both wrong: not a preference
    assert select_pair([1.0, 1.0, 0.0], [False, True, False], rng) == (1, 2)


def test_pad_rows_masks_are_bool():
    _, mask = pad_rows([[1]], "left", 0)
    assert mask.dtype == torch.bool


class ScriptedSampler:
    """Stands for the reference policy: returns fixed completions (text, ended?) for each prompt's k samples."""

    def __init__(self, script: list[list[tuple[str, bool]]]):
        self.tokenizer, self.pad_id, self.device = tokenizer(), tokenizer().pad_token_id, torch.device("cpu")
        self.script, self.done = script, 0

    def sample(self, batch, k, params):
        from prefzoo.types import SequenceBatch

        rows = [self.script[self.done + i][j] for i in range(len(batch)) for j in range(k)]
        self.done += len(batch)
        eos = self.tokenizer.eos_token_id
        completions = [ids(text) + ([eos] if ended else []) for text, ended in rows]
        c_ids, c_mask = pad_rows(completions, "right", self.pad_id)
        return SequenceBatch(batch.prompt_ids.repeat_interleave(k, 0), batch.prompt_mask.repeat_interleave(k, 0),
                             c_ids, c_mask, truncated=torch.tensor([not ended for _, ended in rows]))


def test_sample_and_label_pairs_follow_the_verifier():
    """Reward = 1 if the completion says '5'. Prompt 0: correct-ended vs wrong-ended -> a pair (5 over 7).
    Prompt 1: correct but truncated vs wrong but ended: 'ended' must not make the wrong answer chosen over the
    right one -> no pair. Prompt 2: all equal and ended -> no pair. Prompt 3: both wrong (one truncated): the
    verifier does not tell them apart -> no pair."""
    from prefzoo.types import SamplingParams
    from prefzoo.data.pairs import sample_and_label
    from prefzoo.data.prompts import PromptSet

    script = [[("5", True), ("7", True)], [("5 and more", False), ("7", True)], [("5", True), ("5", True)],
              [("7", True), ("8 and", False)]]
    prompts = PromptSet([ids(f"Q{i}") for i in range(4)], [f"Q{i}" for i in range(4)], {"answer": [5] * 4},
                        [f"Q{i}" for i in range(4)])

    def says_five(prompts_, completions, **_):
        return [1.0 if c.strip().startswith("5") else 0.0 for c in completions]

    rows, stats = sample_and_label(ScriptedSampler(script), prompts, says_five, 2, SamplingParams(), batch_size=3,
                                   seed=0, progress=False)
    got = {r["prompt"]: (r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in rows}
    assert got == {"Q0": ("5", "7")}
    assert all(r["chosen_reward"] > r["rejected_reward"] for r in rows)
    assert rows[0]["answer"] == 5 and rows[0]["chosen_reward"] == 1.0 and rows[0]["rejected_reward"] == 0.0
    assert stats["pairs"] == 1 and stats["samples"] == 8 and stats["mean_sample_reward"] == 4 / 8  # 1+0, 1+0, 1+1, 0+0


def test_sample_and_label_without_requiring_an_ended_chosen():
    """require_finished=False (data.pairs.require_finished=false): completions cut at the length limit compete as
    they are, so prompt 1 of the script above now gives the pair (truncated '5 and more' over '7')."""
    from prefzoo.types import SamplingParams
    from prefzoo.data.pairs import sample_and_label
    from prefzoo.data.prompts import PromptSet

    script = [[("5", True), ("7", True)], [("5 and more", False), ("7", True)], [("5", True), ("5", True)]]
    prompts = PromptSet([ids(f"Q{i}") for i in range(3)], [f"Q{i}" for i in range(3)], {}, [f"Q{i}" for i in range(3)])
    rows, _ = sample_and_label(ScriptedSampler(script), prompts,
                               lambda p, c, **_: [1.0 if x.strip().startswith("5") else 0.0 for x in c], 2,
                               SamplingParams(), batch_size=3, seed=0, progress=False, require_finished=False)
    assert {r["prompt"]: r["chosen"][0]["content"] for r in rows} == {"Q0": "5", "Q1": "5 and more"}
