"""Unpaired labelled data (KTO's): the standard unpaired format, and pairs split into unpaired rows.

Accepted row forms (columns ``prompt``, ``completion``, ``label``, as TRL reads them):

* plain text -- ``{"prompt": str, "completion": str, "label": true|false}``;
* conversational -- ``prompt`` a list of ``{"role", "content"}`` messages (formatted by the tokenizer's chat
  template, with the generation prompt), ``completion`` a list holding the assistant turn(s).

``label`` is true for a desirable completion and false for an undesirable one: a JSON/Parquet boolean, or the
text ``true``/``false`` (any case: what a CSV file holds). Tokenisation follows the preference files
(:mod:`prefzoo.data.preference`): the prompt left-truncated to ``max_prompt_length``, the completion's text plus
EOS right-truncated to fit ``max_length``.

Bad rows (a missing column, a null or non-text prompt/completion, an empty one, a label that is not a boolean, an
unknown chat role, no room for the completion; a line that is not JSON) raise :class:`~prefzoo.errors.DataError`
naming the file, its own row and line, the column and the fix; ``on_bad_row="skip"`` drops them with one warning.

Preference pairs (``prompt``/``chosen``/``rejected``, the built-in pairs included) become two rows each: chosen
desirable, rejected undesirable (:func:`split_pairs`). The held-out pairs of an unpaired file, for the
evaluation's preference accuracy, are each prompt's first desirable row against its first undesirable one
(:func:`pairs_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import datasets
import torch

from prefzoo.errors import DataError
from prefzoo.data.files import bad_row_error, prompt_problem, require_columns, row_label, text_problem
from prefzoo.data.preference import (PreferenceExample, _is_messages, _message_text, checked_examples,
                                     collate_preferences, pad_rows, prompt_and_room, tokenize_completion)
from prefzoo.types import UnpairedBatch


UNPAIRED_COLUMNS = ("prompt", "completion", "label")


@dataclass
class UnpairedExample:
    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool
    prompt_truncated: bool = False


@dataclass
class UnpairedData:
    """Tokenised unpaired training rows, and held-out PAIRS (the evaluation's preference accuracy; may be empty)."""

    train: list[UnpairedExample]
    eval: list[PreferenceExample] = field(default_factory=list)


def is_unpaired(columns) -> bool:
    """Whether a table with these columns is in the unpaired format (it has ``completion`` or ``label``)."""
    return "completion" in columns or "label" in columns


def check_one_format(columns, where: str) -> None:
    """A table is pairs (``chosen``/``rejected``) or unpaired rows (``completion``/``label``), not both.

    Raises:
        DataError: it has columns of both formats (which rows to train on would be a guess), naming them.
    """
    pair_columns = [c for c in ("chosen", "rejected") if c in columns]
    unpaired_columns = [c for c in ("completion", "label") if c in columns]
    if pair_columns and unpaired_columns:
        raise DataError(f"{where} has both preference-pair columns ({'/'.join(pair_columns)}) and unpaired ones "
                        f"({'/'.join(unpaired_columns)}): which rows to train on is ambiguous. Keep one format: "
                        "prompt/chosen/rejected (pairs; algo=kto splits them into rows) or prompt/completion/label.")


def parse_label(value) -> bool:
    """``label`` as a bool: a boolean, or the text true/false in any case; raises ValueError otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    shown = "null" if value is None else repr(value) if isinstance(value, str) else f"{type(value).__name__} {value!r}"
    raise ValueError(f"column 'label' is {shown}, not a boolean: give true (desirable) or false (undesirable)")


def normalise_unpaired_row(row: dict) -> tuple[object, str, bool]:
    """(prompt, completion text, label) of one row; raises ValueError describing what is wrong (and the column)."""
    require_columns(row, UNPAIRED_COLUMNS, "unpaired rows need prompt, completion and label")
    problem = text_problem("completion", row["completion"]) or prompt_problem(row["prompt"])
    if problem is not None:
        raise ValueError(problem)
    completion = row["completion"]
    if _is_messages(completion):
        completion = _message_text(completion, "completion")
    if not completion.strip():
        raise ValueError("completion is empty")
    return row["prompt"], completion, parse_label(row["label"])


def tokenize_unpaired(table: datasets.Dataset, tokenizer, max_length: int, max_prompt_length: int | None,
                      on_bad_row: str = "error", source: str = "dataset") -> list[UnpairedExample]:
    """Validate and tokenise every row of an unpaired table (see the module docstring for the rules).

    Raises:
        DataError: a bad row when ``on_bad_row="error"`` (file, row, line, problem, fix); no usable row at all.
    """
    examples, bad, truncated = [], [], 0
    for index, row in enumerate(table):
        where = row_label(row, index)
        try:
            prompt, completion, label = normalise_unpaired_row(row)
            prompt_ids, cut, room = prompt_and_room(tokenizer, prompt, max_prompt_length, max_length)
        except ValueError as err:
            if on_bad_row != "skip":
                raise bad_row_error(source, where, err) from None
            bad.append((where, str(err)))
            continue
        truncated += cut
        examples.append(UnpairedExample(prompt_ids, tokenize_completion(tokenizer, completion, room), label, cut))
    return checked_examples(examples, bad, truncated, source, max_prompt_length, "prompt/completion/label")


def split_pairs(pairs: list[PreferenceExample]) -> list[UnpairedExample]:
    """Each pair as two unpaired rows, in order: (prompt, chosen, desirable), (prompt, rejected, undesirable)."""
    out = []
    for p in pairs:
        out += [UnpairedExample(p.prompt_ids, p.chosen_ids, True, p.prompt_truncated),
                UnpairedExample(p.prompt_ids, p.rejected_ids, False, p.prompt_truncated)]
    return out


def pairs_of(rows: list[UnpairedExample]) -> list[PreferenceExample]:
    """Held-out pairs from unpaired rows: for each prompt (in order of first appearance) that has rows of both
    labels, its first desirable completion as chosen against its first undesirable one."""
    first: dict[tuple[int, ...], dict[bool, UnpairedExample]] = {}
    for r in rows:
        first.setdefault(tuple(r.prompt_ids), {}).setdefault(r.label, r)
    return [PreferenceExample(list(p), sides[True].completion_ids, sides[False].completion_ids)
            for p, sides in first.items() if len(sides) == 2]


def class_counts(rows: list[UnpairedExample]) -> dict[str, int]:
    """``{"desirable": n_D, "undesirable": n_U}`` of unpaired rows."""
    n_d = sum(1 for r in rows if r.label)
    return {"desirable": n_d, "undesirable": len(rows) - n_d}


def collate_unpaired(examples: list[UnpairedExample], indices: list[int], pad_id: int) -> UnpairedBatch:
    """Pad unpaired examples into an :class:`~prefzoo.types.UnpairedBatch` (prompts left, completions right)."""
    prompt_ids, prompt_mask = pad_rows([e.prompt_ids for e in examples], "left", pad_id)
    completion_ids, completion_mask = pad_rows([e.completion_ids for e in examples], "right", pad_id)
    return UnpairedBatch(prompt_ids, prompt_mask, completion_ids, completion_mask,
                         labels=torch.tensor([bool(e.label) for e in examples], dtype=torch.bool),
                         index=torch.tensor(indices, dtype=torch.long))


def collate_examples(examples: list, indices: list[int], pad_id: int,
                     ref_logps: dict[int, tuple[float, float]] | None = None):
    """A training batch of offline examples: a :class:`PreferenceBatch` of pairs, an
    :class:`~prefzoo.types.UnpairedBatch` of unpaired rows, or a :class:`~prefzoo.types.SequenceBatch` of supervised
    rows (:mod:`prefzoo.data.sft`) (here, beside them: this module reads the preference one, not the other way
    round)."""
    from prefzoo.data.sft import SFTExample, collate_sft

    if examples and isinstance(examples[0], UnpairedExample):
        return collate_unpaired(examples, indices, pad_id)
    if examples and isinstance(examples[0], SFTExample):
        return collate_sft(examples, pad_id)
    return collate_preferences(examples, indices, pad_id, ref_logps)
