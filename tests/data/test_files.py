"""Reading data files (prefzoo.data.files through load_table and the run set-up): every bad file or row is a
DataError naming the file, its own row and line, and the problem; text stays text; each row is judged alone.

The files are written here from the 40-row fixture with one known change, so the expected row and line are the
ones this test changed (rows count from 0 like ``table[i]``; lines from 1 like an editor; in a JSON Lines file
without blank lines, line = row + 1). Values before the fix are noted per test ("before: ...").
"""

import json
import logging

import datasets
import pytest
import torch

from prefzoo.data.files import ORIGIN, origin
from prefzoo.data.preference import load_table
from prefzoo.errors import DataError
from prefzoo.training.setup import preference_data, task_prompts
from tests.models.helpers import tokenizer
from tests.test_config import typed

FIXTURE = "tests/fixtures/arithmetic_pairs.jsonl"
ROWS = [json.loads(line) for line in open(FIXTURE)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def changed(row: int, **values) -> list[dict]:
    rows = [dict(r) for r in ROWS]
    rows[row].update(values)
    return rows


def pairs(path, *overrides):
    cfg = typed("model=tiny", "data=file", f"data.path={path}", *overrides)
    return preference_data(cfg, tokenizer(), None, None, None, torch.device("cpu"))[0]


def plain(rows):
    """The fixture as plain-text rows whose completions are bare numbers ("122"), as arithmetic data often is."""
    return [{"prompt": r["prompt"][0]["content"], "chosen": str(r["answer"]), "rejected": str(r["answer"] + 1),
             "answer": r["answer"]} for r in rows]


# ----------------------------------------------------------------------------------- the whole file

@pytest.mark.parametrize("name,content,needles", [
    ("empty.jsonl", b"", ["empty.jsonl: the file holds no rows (it is empty)"]),  # before: StopIteration
    ("blank.jsonl", b"\n\n  \n", ["the file holds no rows"]),
    ("empty.csv", b"", ["the file holds no rows"]),  # before: datasets error on a file with no columns
    ("header.csv", b"prompt,chosen,rejected\n", ["a header line but no rows"]),
    ("latin1.csv", "prompt,chosen,rejected\nQ,a,b\ncafé,a,b\n".encode("latin-1"),  # before: UnicodeDecodeError
     ["latin1.csv, line 3: byte 0xe9 at column 4 is not UTF-8", "Save the file as UTF-8"]),
    ("array.json", b'[{"prompt": "Q", "chosen": "a", "rejected": "b"},\n {"prompt": "Q" "chosen": "a"}]',
     ["array.json, line 2: not valid JSON (Expecting ',' delimiter at column 17)"]),  # after ' {"prompt": "Q" '
    ("broken.parquet", b"PAR1 this is not parquet", ["broken.parquet: not a readable Parquet file"]),
])
def test_a_bad_file_is_one_error_naming_the_file_and_line(tmp_path, name, content, needles):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as err:
        load_table(str(path))
    for needle in needles:
        assert needle in str(err.value)


def test_an_empty_parquet_file(tmp_path):
    path = tmp_path / "none.parquet"
    datasets.Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []}).to_parquet(str(path))
    with pytest.raises(DataError, match="none.parquet: the file holds no rows"):
        load_table(str(path))


def test_a_one_row_file_cannot_be_split(tmp_path):
    """ceil(0.05 * 1) = 1 row is held out, leaving 0 to train on. Before: datasets' ValueError 'With n_samples=1,
    test_size=0.05 and train_size=None, the resulting train set will be empty'."""
    path = write_jsonl(tmp_path / "one.jsonl", ROWS[:1])
    with pytest.raises(DataError, match=r"one.jsonl has 1 row: too few to hold out data.eval_fraction=0.05 of them "
                                        r"\(1\) and train on the rest. Give at least 2 rows"):
        pairs(path)


# -------------------------------------------------------------------------------------- bad lines

def test_a_malformed_line_is_a_bad_row_naming_its_line(tmp_path):
    """Line 4 (row 3) cut off after '"chosen": '. Before: pandas' 'ValueError: Expected object or value at
    position 25' (no file, no line); with skip the 39 other rows are kept (ceil(0.05 * 39) = 2 held out)."""
    lines = open(FIXTURE).read().splitlines()
    lines[3] = '{"prompt": "x", "chosen": '
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        pairs(path)
    assert "pairs.jsonl, row 3 (line 4): not valid JSON (Expecting value at column 27)" in str(err.value)
    data = pairs(path, "data.on_bad_row=skip")
    assert (len(data.train), len(data.eval)) == (37, 2)


def test_non_utf8_bytes_name_the_line_and_byte(tmp_path):
    """Byte 0xe9 (latin-1 'é') on line 6. Before: 'ValueError: Invalid octet in UTF-8 sequence when decoding
    'string' at position 11' from pyarrow."""
    lines = [line.encode() for line in open(FIXTURE).read().splitlines()]
    lines[5] = b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}'
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=r"pairs.jsonl, row 5 \(line 6\): byte 0xe9 at column 16 is not UTF-8"):
        pairs(path)


def test_a_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + "[1, 2]\n" + json.dumps(ROWS[1]) + "\n")
    table = load_table(str(path))
    assert [origin(r)["line"] for r in table] == [1, 3, 4]  # the blank line 2 is no row
    with pytest.raises(DataError, match=r"row 1 \(line 3\): a JSON array, expected an object"):
        pairs(path)


# ----------------------------------------------------------------------------- the file's own rows

def test_row_numbers_are_the_files_own_after_the_held_out_split(tmp_path):
    """Row 20 (line 21) gets chosen == rejected. The seeded split moves it to position 10 of the training part;
    before, the message said 'row 10'."""
    rows = changed(20, chosen=ROWS[20]["rejected"])
    with pytest.raises(DataError) as err:
        pairs(write_jsonl(tmp_path / "pairs.jsonl", rows))
    assert "pairs.jsonl, row 20 (line 21): chosen == rejected" in str(err.value)
    assert "row 10" not in str(err.value)


def test_prompt_files_also_name_their_own_rows(tmp_path):
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in ROWS]
    rows[20]["prompt"] = [{"role": "user", "content": " "}]
    cfg = typed("model=tiny", "algo=grpo", "data=file", f"data.path={write_jsonl(tmp_path / 'p.jsonl', rows)}")
    with pytest.raises(DataError, match=r"p.jsonl, row 20 \(line 21\): prompt is empty"):
        task_prompts(cfg, tokenizer())


# ------------------------------------------------------------------------------ each row alone

def test_one_non_string_value_does_not_turn_the_column_into_numbers(tmp_path):
    """38 completions like "122" and, on row 5, the int 122. Before: pandas read the whole column as ints, every
    row was 'chosen is int' (with skip: 'no usable rows (38 bad)'); now only row 5 is bad, the other 39 keep
    their text: 37 train + ceil(0.05 * 39) = 2 held out."""
    rows = plain(ROWS)
    rows[5]["chosen"] = int(rows[5]["chosen"])
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DataError, match=r"row 5 \(line 6\): chosen is int \(\d+\), expected a string"):
        pairs(path)
    data = pairs(path, "data.on_bad_row=skip")
    assert (len(data.train), len(data.eval)) == (37, 2)
    table = load_table(str(path))
    assert table[0]["chosen"] == str(ROWS[0]["answer"]) and table[5]["chosen"] is None
    eos = tokenizer().eos_token_id
    texts = {tokenizer().decode(e.chosen_ids[:-1]) for e in data.train}
    assert all(e.chosen_ids[-1] == eos for e in data.train)
    assert texts <= {str(r["answer"]) for r in ROWS}


def test_a_column_of_mixed_scalars_is_read_as_text(tmp_path):
    rows = plain(ROWS[:3])
    rows[1]["answer"] = str(rows[1]["answer"])
    table = load_table(str(write_jsonl(tmp_path / "pairs.jsonl", rows)))
    assert table["answer"] == [str(r["answer"]) for r in ROWS[:3]]


def test_a_null_value_is_not_a_missing_column(tmp_path):
    """Before: 'row 10: missing column 'rejected'' for a null on row 20."""
    with pytest.raises(DataError, match=r"row 20 \(line 21\): rejected is null"):
        pairs(write_jsonl(tmp_path / "pairs.jsonl", changed(20, rejected=None)))
    rows = [dict(r) for r in ROWS]
    del rows[20]["rejected"]
    with pytest.raises(DataError, match=r"row 20 \(line 21\): no 'rejected' in this row \(other rows have one\)"):
        pairs(write_jsonl(tmp_path / "pairs.jsonl", rows))


@pytest.mark.parametrize("prompt,problem", [
    ([{"role": "user", "content": ""}], "prompt is empty"),  # before: accepted
    ([{"role": "wizard", "content": "What is 2 + 2?"}],  # before: accepted, templated as '<|im_start|>wizard'
     "prompt message 0 has the role 'wizard'; chat roles are system, user, assistant, tool"),
    ([], "prompt is an empty list of messages"),
    ("What is 2 + 2?", "prompt is a string but row 0's is a list of messages"),
    (17, "prompt is int (17)"),
])
def test_bad_prompts_are_refused_or_skipped(tmp_path, prompt, problem):
    path = write_jsonl(tmp_path / "pairs.jsonl", changed(3, prompt=prompt))
    with pytest.raises(DataError) as err:
        pairs(path)
    assert f"row 3 (line 4): {problem}" in str(err.value)
    data = pairs(path, "data.on_bad_row=skip")
    assert len(data.train) + len(data.eval) == 39


def test_csv_lines_with_too_many_or_too_few_fields(tmp_path):
    path = tmp_path / "pairs.csv"
    path.write_text('prompt,chosen,rejected\nQ1,a,b\nQ2,a,b,c\n"Q3\nsecond line",a\nQ4,c,d\n')
    table = load_table(str(path))
    assert [origin(r)["line"] for r in table] == [2, 3, 4, 6]
    problems = [origin(r)["problems"] for r in table]
    assert problems[1] == {"*": "4 fields where the header has 3 (prompt, chosen, rejected)"}
    assert problems[2] == {"rejected": "no 'rejected' in this line (it has fewer fields than the header)"}
    assert table[2]["prompt"] == "Q3\nsecond line" and problems[0] == problems[3] == {}


# ------------------------------------------------------------------------------- smaller than a batch

def test_a_training_set_smaller_than_the_batch_is_a_warning(tmp_path, caplog):
    """5 rows: ceil(0.05 * 5) = 1 held out, 4 to train on; with trainer.batch_size=8 every step repeats rows.
    Before: no word."""
    path = write_jsonl(tmp_path / "pairs.jsonl", ROWS[:5])
    with caplog.at_level(logging.WARNING, logger="prefzoo"):
        pairs(path, "trainer.batch_size=4")
        assert not [r for r in caplog.records if "fewer than trainer.batch_size" in r.getMessage()]
        data = pairs(path, "trainer.batch_size=8", "trainer.micro_batch_size=8")
    assert len(data.train) == 4
    warned = [r.getMessage() for r in caplog.records if "fewer than trainer.batch_size" in r.getMessage()]
    assert warned == [f"{path}: the training pairs are 4, fewer than trainer.batch_size=8: every step repeats rows of "
                      "them. Give more rows or a smaller trainer.batch_size."]


def test_origin_survives_the_split_and_is_not_a_reward_column(tmp_path):
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in ROWS]
    cfg = typed("model=tiny", "algo=grpo", "data=file", f"data.path={write_jsonl(tmp_path / 'p.jsonl', rows)}")
    train, held = task_prompts(cfg, tokenizer())
    assert set(train.columns) == set(held.columns) == {"answer"} and ORIGIN not in train.columns
    assert len(train) + len(held) == 40
