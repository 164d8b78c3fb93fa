"""Unpaired labelled data (prefzoo.data.unpaired): the standard unpaired format, pairs split into rows, and the
built-in task's graded samples (prefzoo.data.pairs). Expected token ids come from the tokenizer itself (``ids``,
the chat template), never from the functions under test."""

import json

import datasets
import pytest
import torch

from prefzoo.data.files import read_file
from prefzoo.data.pairs import build_or_load_pairs, sample_and_label, unpaired_path
from prefzoo.data.preference import PreferenceExample, tokenize_preferences
from prefzoo.data.unpaired import (UnpairedExample, class_counts, collate_unpaired, pairs_of, split_pairs,
                                   tokenize_unpaired)
from prefzoo.errors import DataError
from prefzoo.types import SamplingParams
from prefzoo.training.setup import unpaired_data
from tests.data.test_pairs import CORRECT, never_right, prompts
from tests.data.test_preference import FIXTURE, USER, ScriptedSampler, chat_prompt_ids, ids
from tests.models.helpers import tokenizer
from tests.test_config import typed


def tokenize(rows, on_bad_row="error"):
    table = datasets.Dataset.from_list(rows) if isinstance(rows, list) else rows
    return tokenize_unpaired(table, tokenizer(), 256, 128, on_bad_row, "rows.jsonl")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------------------------------ the unpaired format

def test_plain_rows():
    eos = tokenizer().eos_token_id
    a, b = tokenize([{"prompt": "Q: 2+3=", "completion": " 5", "label": True},
                     {"prompt": "Q: 2+3=", "completion": " 6", "label": False}])
    assert a == UnpairedExample(ids("Q: 2+3="), ids(" 5") + [eos], True)
    assert b == UnpairedExample(ids("Q: 2+3="), ids(" 6") + [eos], False)


def test_conversational_rows_apply_the_chat_template():
    ex, = tokenize([{"prompt": USER, "completion": [{"role": "assistant", "content": "It is 5."}], "label": False}])
    assert ex.prompt_ids == chat_prompt_ids(USER)
    assert ex.completion_ids == ids("It is 5.") + [tokenizer().eos_token_id] and ex.label is False


def test_csv_labels_are_text_true_or_false_in_any_case(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("prompt,completion,label\nQ,a,true\nR,b,False\nS,c,TRUE\n")
    assert [r.label for r in tokenize(read_file(str(path)))] == [True, False, True]


def test_collated_rows_keep_labels_and_indices():
    batch = collate_unpaired([UnpairedExample([7, 8], [1], True), UnpairedExample([9], [2, 3], False)], [4, 9], 0)
    assert batch.labels.tolist() == [True, False] and batch.index.tolist() == [4, 9]
    assert batch.prompt_ids.tolist() == [[7, 8], [0, 9]] and batch.completion_ids.tolist() == [[1, 0], [2, 3]]
    assert batch.select([1]).labels.tolist() == [False]


@pytest.mark.parametrize("row,needle", [
    ({"prompt": "Q", "completion": "a"}, "row 1 (line 2): no 'label' in this row (other rows have one)"),
    # (a column of booleans and an int is read as text: the int is shown as the file writes it)
    ({"prompt": "Q", "completion": "a", "label": 1}, "row 1 (line 2): column 'label' is '1', not a boolean: give "
                                                     "true (desirable) or false (undesirable)"),
    ({"prompt": "Q", "completion": "a", "label": "yes"}, "row 1 (line 2): column 'label' is 'yes', not a boolean"),
    ({"prompt": "Q", "completion": "a", "label": None}, "row 1 (line 2): column 'label' is null, not a boolean"),
    ({"prompt": "Q", "completion": [{"role": "assistant", "content": " "}], "label": True},
     "row 1 (line 2): completion is empty"),
    ({"prompt": "Q", "completion": "", "label": True}, "row 1 (line 2): completion is empty"),
    ({"prompt": "Q", "completion": 5, "label": True}, "row 1 (line 2): completion is int (5)"),
    ({"prompt": "Q", "label": True}, "row 1 (line 2): no 'completion' in this row (other rows have one)"),
    ({"prompt": " ", "completion": "a", "label": True}, "row 1 (line 2): prompt is empty"),
])
def test_a_bad_row_names_the_file_row_column_and_fix(tmp_path, row, needle):
    """Row 1 of the file (its line 2) is bad; row 0 is good. The message: file, row (line), the problem with its
    column, and the fixes (the row, or data.on_bad_row=skip)."""
    good = {"prompt": "P", "completion": [{"role": "assistant", "content": "b"}] if isinstance(row.get("completion"), list)
            else "b", "label": False}
    path = write_jsonl(tmp_path / "rows.jsonl", [good, row])
    with pytest.raises(DataError) as err:
        tokenize_unpaired(read_file(path), tokenizer(), 256, 128, "error", path)
    msg = str(err.value)
    assert msg.startswith(f"{path}, ") and needle in msg and "\n" not in msg
    assert msg.endswith("Fix the row, or set data.on_bad_row=skip to drop bad rows.")
    good, = tokenize_unpaired(read_file(path), tokenizer(), 256, 128, "skip", path)
    assert good.label is False


def test_a_file_without_a_label_column_or_with_int_labels_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "P", "completion": "b"}] * 2)
    with pytest.raises(DataError, match=r"rows.jsonl, row 0 \(line 1\): missing column 'label' \(unpaired rows need "
                                        r"prompt, completion and label\)"):
        tokenize_unpaired(read_file(path), tokenizer(), 256, 128, "error", path)
    with pytest.raises(DataError, match="row 0: column 'label' is int 1, not a boolean"):
        tokenize([{"prompt": "P", "completion": "b", "label": 1}, {"prompt": "P", "completion": "c", "label": 0}])


# ------------------------------------------------------------------------------------------ pairs into rows

def test_pairs_split_into_a_desirable_and_an_undesirable_row():
    pairs = [PreferenceExample([1], [2], [3]), PreferenceExample([4, 5], [6, 7], [8])]
    assert split_pairs(pairs) == [UnpairedExample([1], [2], True), UnpairedExample([1], [3], False),
                                  UnpairedExample([4, 5], [6, 7], True), UnpairedExample([4, 5], [8], False)]


def test_a_preference_file_trains_kto_on_its_split_pairs_and_keeps_its_held_out_pairs():
    """The fixture's 40 pairs: 2 held out (ceil(0.05 * 40)) stay pairs for the preference accuracy, the other 38
    become 76 rows, each pair's chosen (desirable) then its rejected (undesirable)."""
    cfg = typed("algo=kto", "model=tiny", "data=file", f"data.path={FIXTURE}")
    data, stats = unpaired_data(cfg, tokenizer(), None, None, None, torch.device("cpu"))
    from prefzoo.data.files import split_held_out
    from prefzoo.data.preference import load_table

    train, held = split_held_out(load_table(FIXTURE), 0.05, 0, FIXTURE)
    pairs = tokenize_preferences(train, tokenizer(), cfg.data.max_length, cfg.data.max_prompt_length)
    assert len(data.train) == 76 and len(data.eval) == 2
    for i, p in enumerate(pairs):
        assert data.train[2 * i] == UnpairedExample(p.prompt_ids, p.chosen_ids, True, p.prompt_truncated)
        assert data.train[2 * i + 1] == UnpairedExample(p.prompt_ids, p.rejected_ids, False, p.prompt_truncated)
    assert data.eval == tokenize_preferences(held, tokenizer(), cfg.data.max_length, cfg.data.max_prompt_length)
    assert stats["rows"] == {"desirable": 38, "undesirable": 38}


def test_an_unpaired_file_holds_out_pairs_of_its_rows(tmp_path):
    """Held-out pairs: each prompt's first desirable row against its first undesirable one, prompts with both."""
    rows = [UnpairedExample([1], [10], True), UnpairedExample([1], [11], False), UnpairedExample([1], [12], True),
            UnpairedExample([2], [13], True), UnpairedExample([3], [14], False), UnpairedExample([3], [15], True)]
    assert pairs_of(rows) == [PreferenceExample([1], [10], [11]), PreferenceExample([3], [15], [14])]
    assert class_counts(rows) == {"desirable": 4, "undesirable": 2}


# ------------------------------------------------------------------------------------------ the built-in rows

def test_every_built_in_sample_is_a_row_labelled_by_the_verifier():
    """Answers 5, 6, 7. Prompt 0: "5" right, "12" wrong; prompt 1: "6 and" right but cut at the length limit (not
    desirable while a chosen answer must end by itself), "13" wrong; prompt 2: "7" twice, right. Labels True, False,
    False, False, True, True; the rewards are the verifier's 1, 0, 1, 0, 1, 1. Without require_finished the cut
    "6 and" is desirable."""
    script = [[("5", True), ("12", True)], [("6 and", False), ("13", True)], [("7", True), ("7", True)]]
    graded = []
    rows, _ = sample_and_label(ScriptedSampler(script), prompts(), CORRECT, 2, SamplingParams(), 2, seed=0,
                               progress=False, graded=graded)
    assert [r["completion"][0]["content"] for r in graded] == ["5", "12", "6 and", "13", "7", "7"]
    assert [r["label"] for r in graded] == [True, False, False, False, True, True]
    assert [r["reward"] for r in graded] == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert graded[0]["prompt"] == [{"role": "user", "content": "What is 2 + 3?"}] and graded[2]["answer"] == 6
    loose = []
    sample_and_label(ScriptedSampler(script), prompts(), CORRECT, 2, SamplingParams(), 2, seed=0, progress=False,
                     require_finished=False, graded=loose)
    assert [r["label"] for r in loose] == [True, False, True, False, True, True]
    tokenize(graded)  # the standard conversational unpaired format


def test_a_model_that_never_answers_right_adds_the_known_answers_as_desirable_rows():
    graded = []
    sample_and_label(never_right(), prompts(), CORRECT, 2, SamplingParams(), 2, seed=0, progress=False,
                     known_answer=True, graded=graded)
    assert [(r["completion"][0]["content"], r["label"]) for r in graded] == [
        ("12", False), ("I think 13", False)] * 3 + [("5", True), ("6", True), ("7", True)]


def test_the_cache_holds_the_unpaired_rows_and_an_older_cache_is_built_again_only_for_them(tmp_path):
    """Built once: train.jsonl, eval.jsonl and train_unpaired.jsonl (9 rows: 6 samples, 3 known answers). A cache
    without the unpaired file (made before it existed) serves pairs as it is (the sampler is not called); asked for
    the unpaired rows, it samples the 3 training prompts again (not the held-out ones: the sampler's script holds
    3 prompts' samples only) and writes the rows, leaving the cached pairs untouched."""
    cfg = typed("model=tiny", "data.pairs.num_samples=2", "data.pairs.num_prompts=3", "data.pairs.eval_prompts=3")

    def build(sampler, unpaired):
        return build_or_load_pairs(cfg, None, lambda: sampler, CORRECT, prompts(), prompts(), tmp_path,
                                   progress=False, unpaired=unpaired)

    train_path, _, _ = build(never_right(), unpaired=False)
    pairs_before = train_path.read_text()
    assert len(unpaired_path(train_path).read_text().splitlines()) == 9
    unpaired_path(train_path).unlink()

    class NoSampling:
        def __getattr__(self, name):
            raise AssertionError("the pairs were sampled again")

    assert build(NoSampling(), unpaired=False)[0] == train_path
    train_path.write_text(pairs_before.replace('"5"', '"five"'))  # (the cached pairs must stay as they are)
    build(ScriptedSampler([[("12", True), ("I think 13", True)] for _ in range(3)]), unpaired=True)
    assert train_path.read_text() == pairs_before.replace('"5"', '"five"') and len(unpaired_path(train_path).read_text().splitlines()) == 9
