"""How a reward function is called: prefzoo's positional form, or TRL's keyword protocol (found by signature).

Two protocols, told apart once per function (and set of columns) by :func:`call_style`, from its signature:

* **positional** (prefzoo's): ``fn(prompts, completions, **columns)``, prompts and completions plain strings (the
  prompt as the model sees it, chat template applied). Any function that can be called this way is.
* **keyword** (TRL's ``GRPOTrainer``): ``fn(prompts=..., completions=..., completion_ids=..., **columns)``, for a
  function that cannot be called positionally, such as TRL's ``reward_len(completions, **kwargs)``. On
  conversational prompts (chat messages), ``prompts`` are the message lists and each completion is
  ``[{"role": "assistant", "content": text}]``, as TRL passes them; ``completion_ids`` the completion's token ids
  (None where the caller has none).

Either may return None for a sample it does not apply to (TRL's convention): that score is missing, left out of
the weighted sum and of the function's mean, and counted (``reward/<name>/missing``).
"""

from __future__ import annotations

import inspect
from typing import Any

from prefzoo.types import PROMPT_MESSAGES

__all__ = ["PROMPT_MESSAGES", "COMPLETION_IDS", "COMPLETION_MESSAGES", "ENVIRONMENTS", "POSITIONAL", "KEYWORD", "call_style", "keyword_arguments",
           "completion_id_lists"]

# PROMPT_MESSAGES (prefzoo.types): reserved batch column, the prompts as chat messages when conversational
#: reserved batch column: each completion's token ids (a list of ints per sample)
COMPLETION_IDS = "completion_ids"
#: reserved batch columns of multi-turn episodes: each sample's conversation after the prompt (the policy's turns and
#: the environment's messages), and the environment instance that played it (TRL's ``environments=``)
COMPLETION_MESSAGES = "completion_messages"
ENVIRONMENTS = "environments"
#: the columns a reward function never receives as data columns
RESERVED = (PROMPT_MESSAGES, COMPLETION_IDS, COMPLETION_MESSAGES, ENVIRONMENTS)

POSITIONAL = "positional"
KEYWORD = "keyword"


def _binds(sig: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def accepts_keyword(sig: inspect.Signature, name: str) -> bool:
    """Whether ``name`` can be passed to a function of signature ``sig`` as a keyword."""
    for p in sig.parameters.values():
        if p.kind == p.VAR_KEYWORD:
            return True
        if p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return True
    return False


def positional_shape(sig: inspect.Signature) -> bool:
    """Whether ``sig`` can take ``(prompts, completions)`` positionally: two positional parameters (or ``*args``),
    no further required positional-only one, and no parameter named ``prompts`` / ``completions`` other than the
    first / second (TRL's ``f(completions, ground_truth, **kwargs)`` is a keyword function)."""
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in positional]
    if ("prompts" in names and names.index("prompts") != 0) or ("completions" in names and names.index("completions") != 1):
        return False
    stuck = [p.name for p in positional[2:] if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
    return (len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)) and not stuck


def keyword_shape(sig: inspect.Signature) -> bool:
    """Whether ``sig`` can take ``prompts=`` and ``completions=`` as keywords (the rest may come from columns)."""
    stuck = [p for p in sig.parameters.values() if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
    return accepts_keyword(sig, "prompts") and accepts_keyword(sig, "completions") and not stuck


def bind_error(sig: inspect.Signature, columns) -> TypeError | None:
    """Why neither form binds with these column names (the positional form's reason when it has that shape)."""
    cols = {c: None for c in columns}
    errors = []
    if positional_shape(sig):
        try:
            sig.bind(None, None, **cols)
            return None
        except TypeError as err:
            errors.append(err)
    if keyword_shape(sig):
        extra = {COMPLETION_IDS: None} if accepts_keyword(sig, COMPLETION_IDS) else {}
        try:
            sig.bind(prompts=None, completions=None, **extra, **cols)
            return None
        except TypeError as err:
            errors.append(err)
    return errors[0] if errors else TypeError("takes neither (prompts, completions) nor prompts=, completions=")


def call_style(fn, columns=()) -> str | None:
    """:data:`POSITIONAL` when ``fn(prompts, completions, **columns)`` binds (:func:`positional_shape`), else
    :data:`KEYWORD` when ``fn(prompts=, completions=, [completion_ids=,] **columns)`` does, else None (neither:
    the caller's error). A callable without an introspectable signature is taken as positional (as before)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return POSITIONAL
    cols = {c: None for c in columns}
    if positional_shape(sig) and _binds(sig, None, None, **cols):
        return POSITIONAL
    extra = {COMPLETION_IDS: None} if accepts_keyword(sig, COMPLETION_IDS) else {}
    if keyword_shape(sig) and _binds(sig, prompts=None, completions=None, **extra, **cols):
        return KEYWORD
    return None


def completion_id_lists(samples) -> list[list[int]]:
    """Each completion's token ids (the tokens its mask keeps) of a ``SequenceBatch``, as TRL passes
    ``completion_ids`` to a reward function."""
    return [row[mask].tolist() for row, mask in zip(samples.completion_ids, samples.completion_mask)]


def keyword_arguments(fn, prompts, completions, columns: dict, messages, completion_ids, conversations=None,
                      environments=None) -> dict:
    """The keywords TRL passes: prompts and completions (message lists when ``messages`` holds the prompts as chat
    messages; a multi-turn sample's whole conversation after the prompt, ``conversations``), ``completion_ids`` and
    ``environments`` (the episodes' environment instances) where the function takes them, and every data column."""
    if messages is not None:
        prompts = list(messages)
        completions = ([list(c) for c in conversations] if conversations is not None else
                       [[{"role": "assistant", "content": text}] for text in completions])
    out = {"prompts": list(prompts), "completions": list(completions)}
    try:
        sig = inspect.signature(fn)
        takes = {name: accepts_keyword(sig, name) for name in (COMPLETION_IDS, ENVIRONMENTS)}
    except (TypeError, ValueError):
        takes = {COMPLETION_IDS: True, ENVIRONMENTS: True}
    if takes[COMPLETION_IDS]:
        out[COMPLETION_IDS] = completion_ids
    if environments is not None and takes[ENVIRONMENTS]:
        out[ENVIRONMENTS] = list(environments)
    return {**out, **columns}
