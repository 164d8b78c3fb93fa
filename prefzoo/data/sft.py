"""Supervised rows (SFT's data) in the four forms TRL's ``SFTTrainer`` reads, and a preference file's chosen side.

Formats (:data:`SFT_FORMATS`), told apart by the table's columns (:func:`sft_format`):

* ``text`` -- ``{"text": "The sky is blue."}`` (language modeling): the loss on every token.
* ``prompt/completion`` -- ``{"prompt": ..., "completion": ...}``, each a string, or the prompt a list of chat
  messages (formatted by the tokenizer's chat template, with the generation prompt) and the completion a list holding
  the one assistant reply: the loss on the completion only (``algo.completion_only_loss=true``, the default, as TRL's
  ``completion_only_loss=None`` for these rows), or on every token after the first.
* ``messages`` -- ``{"messages": [{"role": ..., "content": ...}, ...]}`` (conversational language modeling): the
  whole conversation rendered by the chat template; the loss on the assistant turns only
  (``algo.assistant_only_loss=true``, prefzoo's default) or on every token after the first (TRL's default).
* ``pairs`` -- ``{"prompt": ..., "chosen": ..., "rejected": ...}`` (or the implicit-prompt form): the prompt and the
  chosen completion, tokenised exactly as the preference tokeniser does (:mod:`prefzoo.data.preference`), so that SFT
  on a preference file trains on what it did before there were other formats.

A table with none of these column sets, or with the sets of two formats, is refused in one line naming its columns and
the accepted sets; so is a ``prompt``/``completion`` table with a ``label`` column (KTO's unpaired rows: SFT would learn
the undesirable completions too).

Tokenisation. Every row becomes a :class:`SFTExample`: its tokens split into a ``prompt`` (the tokens before the first
one with a loss: nothing predicts them) and a ``completion`` (the rest, up to the last token with a loss), with a
loss mask over the completion. Prompt/completion and pair rows follow the preference rule (the prompt left-truncated
to ``data.max_prompt_length``, the completion's text plus EOS right-truncated to fit ``data.max_length``). A text row
is tokenised with the tokenizer's own special tokens (its BOS, where it has one, as TRL does) plus EOS; a messages row
is the chat template's rendering of the whole conversation, tokenised once; both are right-truncated to
``data.max_length`` (counted in a warning).

The assistant turns of a messages row (:func:`assistant_spans`). The chat template renders the conversation; the
characters of assistant message i are those its rendering adds after the generation prompt: with ``before`` = the
rendering of messages 0..i-1 with the generation prompt and ``through`` = the rendering of messages 0..i, the span
starts at ``len(before)`` and ends after the first EOS token text that follows (the stop token the policy emits to
end its turn; what the template writes after it -- a newline -- is glue that the next turn's context holds), or at the
end of ``through`` when the template writes no EOS there. This needs a template whose renderings of a conversation's
prefixes are prefixes of one another (SmolLM2's and most ChatML templates; a template that rewrites past turns, e.g.
drops earlier reasoning, is refused for that row); no ``{% generation %}`` markers are needed. A token carries the
loss when its characters (the fast tokenizer's offsets in the whole rendering) overlap an assistant span.

Bad rows (a missing or null column, a value of the wrong type or form, an empty text, prompt or completion, a
completion of several messages, a messages row without an assistant turn under ``assistant_only_loss``, a row with
no token left to train on after truncation; a line that is not JSON) raise :class:`~prefzoo.errors.DataError` naming
the file, its row and line and the fix; ``data.on_bad_row=skip`` drops them with one warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import datasets
import torch

from prefzoo.data.files import (ORIGIN, bad_row_error, prompt_problem, require_columns, row_label, text_problem)
from prefzoo.data.preference import (PreferenceExample, checked_examples, normalise_row, pad_rows, prompt_and_room,
                                     tokenize_completion)
from prefzoo.errors import DataError
from prefzoo.types import LossTokens, SequenceBatch

log = logging.getLogger(__name__)

__all__ = ["SFT_FORMATS", "SFTExample", "SFTData", "sft_format", "normalise_sft_row", "assistant_spans",
           "conversation_tokens", "tokenize_sft", "collate_sft", "demonstration_rows"]

#: format -> the columns it needs (``pairs`` may also have a ``prompt``; other columns are carried along, unused)
SFT_FORMATS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "prompt/completion": ("prompt", "completion"),
    "messages": ("messages",),
    "pairs": ("chosen", "rejected"),
}
_ACCEPTED = "text; prompt + completion; messages; prompt + chosen + rejected (SFT trains on chosen)"


@dataclass
class SFTExample:
    """One tokenised supervised row. P = prompt tokens, C = completion tokens.

    Attributes:
        prompt_ids: the P >= 1 tokens before the first token with a loss.
        completion_ids: the C tokens from there to the last token with a loss.
        loss_mask: C bools, True where the token carries the loss; None when every completion token does.
        truncated: the row was cut to fit ``data.max_prompt_length`` / ``data.max_length``.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[bool] | None = None
    truncated: bool = False


@dataclass
class SFTData:
    """Tokenised supervised training rows, and held-out PAIRS for the evaluation's preference accuracy (a preference
    file's; empty for the other formats)."""

    train: list[SFTExample]
    eval: list[PreferenceExample] = field(default_factory=list)


def sft_format(columns, where: str) -> str:
    """The format of a table with these ``columns`` (one of :data:`SFT_FORMATS`).

    Raises:
        DataError: none of the formats' column sets (naming the columns found and the accepted sets), the sets of
            several formats (which to train on would be a guess), or ``prompt``/``completion`` with KTO's ``label``.
    """
    found_columns = [c for c in columns if c != ORIGIN]
    found = [name for name, need in SFT_FORMATS.items() if all(c in found_columns for c in need)]
    if not found:
        raise DataError(f"{where} has none of the column sets SFT reads (its columns: {', '.join(found_columns)}); "
                        f"give one of: {_ACCEPTED}.")
    if len(found) > 1:
        raise DataError(f"{where} has the columns of several SFT formats ({' and '.join(found)}): which to train on is "
                        f"ambiguous. Keep the columns of one: {_ACCEPTED}.")
    if found[0] == "prompt/completion" and "label" in found_columns:
        raise DataError(f"{where} has a 'label' column beside prompt and completion: these are unpaired rows "
                        "(algo=kto's), and SFT would train on the undesirable completions too. Keep the desirable "
                        "rows and drop the column, or train with algo=kto.")
    return found[0]


def _completion(value) -> str:
    """A prompt/completion row's completion as text: a string, or a list holding one assistant message."""
    if isinstance(value, list):
        if len(value) != 1 or value[0]["role"] != "assistant":
            roles = ", ".join(m["role"] for m in value)
            raise ValueError(f"completion holds {len(value)} message{'s' if len(value) != 1 else ''} ({roles}); a "
                             "prompt/completion row's completion is one assistant reply: put a longer conversation in "
                             "a messages column")
        value = value[0]["content"]
    if not value.strip():
        raise ValueError("completion is empty")
    return value


def normalise_sft_row(row: dict, fmt: str, index: int, assistant_only_loss: bool = True):
    """The checked content of one row of format ``fmt``: the text (``text``), (prompt, completion text)
    (``prompt/completion``, ``pairs``: the chosen side) or the messages (``messages``). Raises ValueError describing
    what is wrong (and the column)."""
    if fmt == "pairs":
        prompt, chosen, _ = normalise_row(row, index)
        return prompt, chosen
    require_columns(row, SFT_FORMATS[fmt])
    if fmt == "text":
        text = row["text"]
        problem = text_problem("text", text)
        if problem is None and not isinstance(text, str):
            problem = "text is a list of messages; a text row holds a string (put a conversation in a messages column)"
        if problem is None and not text.strip():
            problem = "text is empty"
        if problem is not None:
            raise ValueError(problem)
        return text
    if fmt == "prompt/completion":
        problem = prompt_problem(row["prompt"]) or text_problem("completion", row["completion"])
        if problem is not None:
            raise ValueError(problem)
        return row["prompt"], _completion(row["completion"])
    messages = row["messages"]
    problem = text_problem("messages", messages)
    if problem is None and isinstance(messages, str):
        problem = "messages is a string; a messages row holds a list of chat messages (put plain text in a text column)"
    if problem is not None:
        raise ValueError(problem)
    if assistant_only_loss and not any(m["role"] == "assistant" for m in messages):
        raise ValueError("messages has no assistant message, and algo.assistant_only_loss=true (the default) trains on "
                         "the assistant turns only: add the reply, or set algo.assistant_only_loss=false to train on "
                         "every token")
    return messages


# --------------------------------------------------------------------------------------------- conversations
def assistant_spans(tokenizer, messages: list[dict], rendered: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant message's turn in ``rendered`` (the chat template's rendering of
    ``messages``), found by rendering prefixes (module docstring).

    Raises:
        ValueError: the template's renderings of the conversation's prefixes are not prefixes of one another.
    """
    render = lambda part, gen: tokenizer.apply_chat_template(part, tokenize=False,  # noqa: E731
                                                             add_generation_prompt=gen)
    eos = tokenizer.eos_token or ""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[:i + 1], False)
        if not (through.startswith(before) and rendered.startswith(through)):
            raise ValueError(f"the chat template does not render this conversation's turns as prefixes of one "
                             f"another (message {i}, the assistant's, cannot be located): assistant_only_loss needs a "
                             "template that renders earlier turns unchanged, or set algo.assistant_only_loss=false")
        stop = through.find(eos, len(before)) if eos else -1
        spans.append((len(before), stop + len(eos) if stop >= 0 else len(through)))
    return spans


def conversation_tokens(tokenizer, messages: list[dict], assistant_only_loss: bool) -> tuple[list[int], list[bool]]:
    """(token ids of the chat template's rendering of ``messages``, per token: does it carry the loss?).

    Every token when ``assistant_only_loss`` is False; else the tokens whose characters overlap an assistant turn
    (:func:`assistant_spans`). Raises ValueError (:func:`assistant_spans`)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=assistant_only_loss)
    ids = list(encoded["input_ids"])
    if not assistant_only_loss:
        return ids, [True] * len(ids)
    spans = assistant_spans(tokenizer, messages, rendered)
    mask = [any(start < e and end > s for s, e in spans) for start, end in encoded["offset_mapping"]]
    return ids, mask


# ---------------------------------------------------------------------------------------------- tokenising
def _split(ids: list[int], mask: list[bool], truncated: bool) -> SFTExample:
    """The example of a row's ``ids`` and loss ``mask``: the prompt before the first counted token (position 0 never
    counts: nothing predicts it), the completion up to the last one. Raises ValueError when none is left."""
    counted = [i for i, m in enumerate(mask) if m and i > 0]
    if not counted:
        raise ValueError("no token with a loss is left" + (" within data.max_length (raise it)" if truncated else ""))
    first, last = counted[0], counted[-1] + 1
    part = mask[first:last]
    return SFTExample(ids[:first], ids[first:last], None if all(part) else part, truncated)


def _example(tokenizer, fmt: str, content, loss: LossTokens, max_length: int, max_prompt_length: int | None
             ) -> SFTExample:
    """One checked row's :class:`SFTExample` (module docstring). Raises ValueError (no room, nothing to train on)."""
    if fmt in ("prompt/completion", "pairs"):
        prompt, completion = content
        prompt_ids, cut, room = prompt_and_room(tokenizer, prompt, max_prompt_length, max_length)
        completion_ids = tokenize_completion(tokenizer, completion, room)
        cut = cut or completion_ids[-1] != tokenizer.eos_token_id  # (cut short: no EOS at the end)
        if loss.completion_only_loss:
            return SFTExample(prompt_ids, completion_ids, None, cut)
        ids = prompt_ids + completion_ids
        return _split(ids, [True] * len(ids), cut)
    if fmt == "text":
        ids = list(tokenizer(content)["input_ids"])  # the tokenizer's own special tokens (its BOS), as TRL
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)
        mask = [True] * len(ids)
    else:
        ids, mask = conversation_tokens(tokenizer, content, loss.assistant_only_loss)
    cut = len(ids) > max_length
    return _split(ids[:max_length], mask[:max_length], cut)


def tokenize_sft(table: datasets.Dataset, tokenizer, loss: LossTokens, max_length: int, max_prompt_length: int | None,
                 on_bad_row: str = "error", source: str = "dataset", fmt: str | None = None) -> list[SFTExample]:
    """Validate and tokenise every row of a supervised table (module docstring); ``fmt``: its format (default: told
    from its columns by :func:`sft_format`).

    Raises:
        DataError: the table's format (:func:`sft_format`); a bad row when ``on_bad_row="error"`` (file, row, line,
            problem, fix); no usable row at all.
    """
    fmt = fmt or sft_format(table.column_names, source)
    examples, bad, truncated = [], [], 0
    for index, row in enumerate(table):
        where = row_label(row, index)
        try:
            content = normalise_sft_row(row, fmt, index, loss.assistant_only_loss)
            example = _example(tokenizer, fmt, content, loss, max_length, max_prompt_length)
        except ValueError as err:
            if on_bad_row != "skip":
                raise bad_row_error(source, where, err) from None
            bad.append((where, str(err)))
            continue
        truncated += example.truncated
        examples.append(example)
    if truncated:
        log.warning("%s: %d rows were cut to fit data.max_length=%d (prompt/completion rows: the prompt to "
                    "data.max_prompt_length=%s from the left, then the completion from the right)", source, truncated,
                    max_length, max_prompt_length)
    return checked_examples(examples, bad, 0, source, max_prompt_length, f"of one format: {_ACCEPTED}")


def collate_sft(examples: list[SFTExample], pad_id: int) -> SequenceBatch:
    """Pad supervised examples into a :class:`~prefzoo.types.SequenceBatch`: prompts left, completions right;
    ``completion_mask`` = the tokens with a loss, and ``token_mask`` = every completion token when some row has tokens
    without one (a conversation's user turns: part of the context, as an environment's tokens are), else None."""
    prompt_ids, prompt_mask = pad_rows([e.prompt_ids for e in examples], "left", pad_id)
    completion_ids, present = pad_rows([e.completion_ids for e in examples], "right", pad_id)
    if all(e.loss_mask is None for e in examples):
        return SequenceBatch(prompt_ids, prompt_mask, completion_ids, present)
    counted = torch.zeros_like(present)
    for row, e in enumerate(examples):
        n = len(e.completion_ids)
        counted[row, :n] = True if e.loss_mask is None else torch.tensor(e.loss_mask, dtype=torch.bool)
    return SequenceBatch(prompt_ids, prompt_mask, completion_ids, counted, token_mask=present)


def demonstration_rows(prompts) -> datasets.Dataset:
    """A built-in task's prompts with their known answers as prompt/completion rows (``data.demonstrations``): the
    completion is the ``answer_completion`` column where the task has one (reasoning-gym's answer in its format, e.g.
    ``<answer>42</answer>``), else the ``answer`` written as text.

    Raises:
        DataError: the task has no known answers (no ``answer`` column: the sentiment task).
    """
    columns = prompts.columns
    answers = columns.get("answer_completion", columns.get("answer"))
    if answers is None:
        raise DataError("data.demonstrations=true needs a task with known answers (an 'answer' column: "
                        "data=arithmetic or data=reasoning_gym); this task has none.")
    raw = prompts.raw if prompts.raw is not None else prompts.texts
    return datasets.Dataset.from_dict({"prompt": list(raw), "completion": [str(a) for a in answers]})
