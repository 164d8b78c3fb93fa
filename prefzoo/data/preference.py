"""Preference datasets in the standard format, through the ``datasets`` library.

Accepted row forms (columns ``prompt``, ``chosen``, ``rejected``):

* plain text — ``{"prompt": str, "chosen": str, "rejected": str}``; the prompt is used as written;
* conversational — ``prompt`` a list of ``{"role", "content"}`` messages and ``chosen`` / ``rejected``
  lists holding the assistant turn(s); the tokenizer's chat template formats the prompt (with the
  generation prompt appended);
* implicit prompt — no ``prompt`` column; ``chosen`` and ``rejected`` are whole conversations that share
  a prefix of messages, which becomes the prompt.

Tokenisation rule: the completion is the text of the assistant's reply followed by EOS. The prompt is
truncated from the LEFT to ``max_prompt_length`` tokens (counted in a warning); then the completion is
truncated from the RIGHT to fit ``max_length`` (then it does not end with EOS). A prompt that leaves no
room for a completion is a bad row.

Bad rows (missing column, null or non-string text, an empty prompt, chosen or rejected, a chat role other
than system/user/assistant/tool, chosen == rejected, no room; for a file also a line that is not JSON) raise
:class:`~prefzoo.errors.DataError` naming the file's own row and line (:mod:`prefzoo.data.files`: also after
the held-out split) and the problem; with ``on_bad_row="skip"`` they are dropped and counted in one warning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import datasets
import torch
from torch import Tensor

from prefzoo.types import PreferenceBatch, SequenceBatch
from prefzoo.data.files import (bad_row_error, prompt_problem, read_file, row_label, row_problem, text_problem,
                                 with_origin)
from prefzoo.errors import DataError

log = logging.getLogger(__name__)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # the types read from disk


def load_table(path: str, split: str = "train") -> datasets.Dataset:
    """A ``datasets.Dataset`` from a local JSONL/JSON/Parquet/CSV file or a Hugging Face dataset name.

    Local files are read row by row (:func:`prefzoo.data.files.read_file`: text stays text, each row is judged
    alone, messages name the file's row and line); every table carries the column
    :data:`~prefzoo.data.files.ORIGIN` (each row's place in the file), which the tokenisers drop.

    Raises:
        DataError: the file does not exist, has an unknown extension, cannot be read (empty, not UTF-8, ...),
            or the dataset cannot be loaded.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext in FILE_BUILDERS:
        return read_file(path)
    if os.path.exists(path):
        if os.path.isdir(path):
            return with_origin(datasets.load_dataset(path, split=split))
        raise DataError(f"data.path={path!r}: unknown file type {ext!r}; use one of {sorted(FILE_BUILDERS)}.")
    try:
        return with_origin(datasets.load_dataset(path, split=split))
    except Exception as err:
        raise DataError(f"could not load the dataset {path!r} (split {split!r}): {err}. Give a local file or a "
                        "Hugging Face dataset name that is reachable or cached.") from err


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _message_text(messages: list[dict], what: str) -> str:
    parts = [m["content"] for m in messages if m["role"] == "assistant"] or [m["content"] for m in messages]
    if not all(isinstance(p, str) for p in parts):
        raise ValueError(f"{what} has a message whose content is not a string")
    return "".join(parts)


def split_implicit_prompt(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """Split two conversations sharing a message prefix into (prompt, chosen tail, rejected tail)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n > 0 and chosen[n - 1]["role"] == "assistant":  # the prompt ends before an assistant turn
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


@dataclass
class PreferenceExample:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    prompt_truncated: bool = False


PAIR_COLUMNS = ("prompt", "chosen", "rejected")


def normalise_row(row: dict, index: int) -> tuple[object, str, str]:
    """(prompt, chosen text, rejected text) of one row; raises ValueError describing what is wrong."""
    problem = row_problem(row, PAIR_COLUMNS)  # found reading the file (a line that is not JSON, a missing key, ...)
    if problem is not None:
        raise ValueError(problem)
    for col in ("chosen", "rejected"):
        if col not in row:
            raise ValueError(f"missing column {col!r}")
        problem = text_problem(col, row[col])
        if problem is not None:
            raise ValueError(problem)
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" in row:
        prompt = row["prompt"]
    else:
        if not (_is_messages(chosen) and _is_messages(rejected)):
            raise ValueError("missing column 'prompt' (only conversational chosen/rejected can imply the prompt)")
        prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
        if not prompt:
            raise ValueError("chosen and rejected share no prompt prefix")
    problem = prompt_problem(prompt)
    if problem is not None:
        raise ValueError(problem)
    texts = []
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if _is_messages(value):
            value = _message_text(value, name)
        if not value.strip():
            raise ValueError(f"{name} is empty")
        texts.append(value)
    if texts[0] == texts[1]:
        raise ValueError("chosen == rejected (a pair must differ)")
    return prompt, texts[0], texts[1]


def prompt_text(tokenizer, prompt) -> str:
    """The prompt as the model sees it: chat-templated (with generation prompt) if it is a conversation."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def tokenize_prompt(tokenizer, prompt, max_prompt_length: int | None) -> tuple[list[int], bool]:
    """Prompt token ids, left-truncated to ``max_prompt_length``; returns (ids, was_truncated)."""
    ids = tokenizer(prompt_text(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    if max_prompt_length is not None and len(ids) > max_prompt_length:
        return ids[-max_prompt_length:], True
    return ids, False


def checked_examples(examples: list, bad: list, truncated: int, source: str, max_prompt_length: int | None,
                     columns: str) -> list:
    """The end of a file's tokenisation: one warning for the skipped bad rows (``bad``: (where, why) pairs) and one
    for the left-truncated prompts; ``examples`` back.

    Raises:
        DataError: no usable row (naming ``source`` and the ``columns`` to check).
    """
    if bad:
        log.warning("%s: skipped %d bad rows (data.on_bad_row=skip); first: %s: %s", source, len(bad), *bad[0])
    if truncated:
        log.warning("%s: %d prompts were longer than data.max_prompt_length=%s and were truncated from the left",
                    source, truncated, max_prompt_length)
    if not examples:
        raise DataError(f"{source}: no usable rows ({len(bad)} bad). Check the columns {columns}.")
    return examples


def prompt_and_room(tokenizer, prompt, max_prompt_length: int | None, max_length: int) -> tuple[list[int], bool, int]:
    """:func:`tokenize_prompt` plus the tokens left for a completion within ``max_length``.

    Returns (prompt ids, was_truncated, room). Raises ValueError (the caller names the row) when the prompt leaves
    no room."""
    prompt_ids, cut = tokenize_prompt(tokenizer, prompt, max_prompt_length)
    room = max_length - len(prompt_ids)
    if room < 1:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens and data.max_length={max_length} leaves "
                         "no room for the completion (raise data.max_length or set data.max_prompt_length)")
    return prompt_ids, cut, room


def tokenize_completion(tokenizer, text: str, room: int) -> list[int]:
    """Completion ids: the text then EOS, right-truncated to ``room`` tokens (then without EOS)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids[:room]


def tokenize_preferences(table: datasets.Dataset, tokenizer, max_length: int, max_prompt_length: int | None,
                         on_bad_row: str = "error", source: str = "dataset") -> list[PreferenceExample]:
    """Validate and tokenise every row of a preference table (see the module docstring for the rules).

    Raises:
        DataError: a bad row when ``on_bad_row="error"`` (names the row index, the problem, and the fix).
    """
    examples, bad = [], []
    truncated = 0
    for index, row in enumerate(table):
        try:
            where = row_label(row, index)
            prompt, chosen, rejected = normalise_row(row, index)
            prompt_ids, cut, room = prompt_and_room(tokenizer, prompt, max_prompt_length, max_length)
        except ValueError as err:
            if on_bad_row != "skip":
                raise bad_row_error(source, where, err) from None
            bad.append((where, str(err)))
            continue
        truncated += cut
        examples.append(PreferenceExample(prompt_ids, tokenize_completion(tokenizer, chosen, room),
                                          tokenize_completion(tokenizer, rejected, room), cut))
    return checked_examples(examples, bad, truncated, source, max_prompt_length, "prompt/chosen/rejected")


def pad_rows(rows: list[list[int]], side: str, pad_id: int) -> tuple[Tensor, Tensor]:
    """(ids, mask) of shape (N, max len), padded on ``side`` (``"left"`` or ``"right"``)."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if not r:
            continue
        sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(r, dtype=torch.long)
        mask[i, sl] = True
    return ids, mask


def collate_preferences(examples: list[PreferenceExample], indices: list[int], pad_id: int,
                        ref_logps: dict[int, tuple[float, float]] | None = None) -> PreferenceBatch:
    """Pad a list of examples into a :class:`PreferenceBatch` (prompts left, completions right)."""
    prompt_ids, prompt_mask = pad_rows([e.prompt_ids for e in examples], "left", pad_id)
    chosen_ids, chosen_mask = pad_rows([e.chosen_ids for e in examples], "right", pad_id)
    rejected_ids, rejected_mask = pad_rows([e.rejected_ids for e in examples], "right", pad_id)
    ref_c = ref_r = None
    if ref_logps is not None:
        ref_c = torch.tensor([ref_logps[i][0] for i in indices], dtype=torch.float32)
        ref_r = torch.tensor([ref_logps[i][1] for i in indices], dtype=torch.float32)
    return PreferenceBatch(
        chosen=SequenceBatch(prompt_ids, prompt_mask, chosen_ids, chosen_mask),
        rejected=SequenceBatch(prompt_ids.clone(), prompt_mask.clone(), rejected_ids, rejected_mask),
        index=torch.tensor(indices, dtype=torch.long), ref_chosen_logps=ref_c, ref_rejected_logps=ref_r,
    )


@dataclass
class PreferenceData:
    """Tokenised train and held-out preference pairs."""

    train: list[PreferenceExample]
    eval: list[PreferenceExample] = field(default_factory=list)
