"""Prompt sets for online algorithms (GRPO, PPO, best-of-n) and for task evaluation.

A prompt set is a ``datasets.Dataset`` with a ``prompt`` column (a string, or a list of chat messages)
and any other columns the reward functions need (e.g. ``answer``). Built-in generated tasks come from
:mod:`prefzoo.data.tasks`; a user's own set from ``data.path`` (JSONL/JSON/Parquet/CSV or a hub name).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import datasets

from prefzoo.types import PROMPT_MESSAGES, PromptBatch
from prefzoo.data.files import ORIGIN, bad_row_error, prompt_problem, row_label, row_problem
from prefzoo.data.preference import load_table, pad_rows, prompt_text
from prefzoo.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class PromptSet:
    """Tokenised prompts plus their other columns. N = prompts.

    Attributes:
        prompt_ids: N token-id lists (chat template applied, left-truncated to ``max_prompt_length``).
        texts: N prompt strings as the model sees them.
        columns: other columns, each a list of N values.
        raw: the N prompts as given (strings or lists of chat messages).
    """

    prompt_ids: list[list[int]]
    texts: list[str]
    columns: dict[str, list]
    raw: list = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def batch(self, indices: list[int], pad_id: int) -> PromptBatch:
        ids, mask = pad_rows([self.prompt_ids[i] for i in indices], "left", pad_id)
        cols = {k: [v[i] for i in indices] for k, v in self.columns.items()}
        cols["prompt_text"] = [self.texts[i] for i in indices]
        if self.raw is not None and any(not isinstance(self.raw[i], str) for i in indices):
            cols[PROMPT_MESSAGES] = [self.raw[i] for i in indices]  # chat messages: TRL-style rewards get them
        return PromptBatch(ids, mask, cols)

    def subset(self, n: int) -> "PromptSet":
        return PromptSet(self.prompt_ids[:n], self.texts[:n], {k: v[:n] for k, v in self.columns.items()},
                         self.raw[:n] if self.raw is not None else None)


def tokenize_prompts(table: datasets.Dataset, tokenizer, max_prompt_length: int | None, on_bad_row: str = "error",
                     source: str = "dataset") -> PromptSet:
    """Validate and tokenise a prompt table.

    A prompt longer than ``max_prompt_length`` tokens is a bad row (online algorithms must see the whole
    question; raise ``data.max_prompt_length`` to keep it); so is a null, empty or non-text prompt and a chat
    message of an unknown role. Messages name the file's own row (and line) for a table read by
    :func:`~prefzoo.data.preference.load_table`. The other columns (without ``ORIGIN``) go to the reward.

    Raises:
        DataError: missing ``prompt`` column, a bad row (with ``on_bad_row="error"``), or no usable rows.
    """
    if "prompt" not in table.column_names:
        raise DataError(f"{source} has no 'prompt' column (columns: {table.column_names}). Online algorithms need "
                        "a prompt per row; rename the column or choose another data set.")
    others = [c for c in table.column_names if c not in ("prompt", ORIGIN)]
    ids, texts, raw, columns, bad = [], [], [], {c: [] for c in others}, []
    for index, row in enumerate(table):
        prompt = row["prompt"]
        where = row_label(row, index)
        try:
            problem = row_problem(row, ["prompt", *others]) or prompt_problem(prompt)
            if problem is not None:
                raise ValueError(problem)
            text = prompt_text(tokenizer, prompt)
            tok = tokenizer(text, add_special_tokens=False)["input_ids"]
            if max_prompt_length is not None and len(tok) > max_prompt_length:
                raise ValueError(f"prompt has {len(tok)} tokens, more than data.max_prompt_length={max_prompt_length} "
                                 "(raise data.max_prompt_length)")
        except ValueError as err:
            if on_bad_row != "skip":
                raise bad_row_error(source, where, err) from None
            bad.append((where, str(err)))
            continue
        ids.append(tok)
        texts.append(text)
        raw.append(prompt)
        for c in others:
            columns[c].append(row[c])
    if bad:
        log.warning("%s: skipped %d bad prompts (data.on_bad_row=skip); first: %s: %s", source, len(bad), *bad[0])
    if not ids:
        raise DataError(f"{source}: no usable prompts.")
    return PromptSet(ids, texts, columns, raw)


def load_prompt_table(path: str, split: str) -> datasets.Dataset:
    """A user's prompt set from a file or the hub (see :func:`prefzoo.data.preference.load_table`)."""
    return load_table(path, split)
