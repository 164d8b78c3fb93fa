"""reasoning-gym's verifiers as rewards: the task's own ``score_answer(answer, entry)``.

``reward=reasoning_gym`` (reward function ``reasoning_gym``) scores a completion in two steps, as reasoning-gym's
own evaluation does:

1. the final answer, read as the row's ``answer_format`` says (:func:`extract_answer`): ``tags``,
   ``reasoning_gym.utils.extract_answer(completion)``, the text of the LAST ``<answer>...</answer>`` span (stripped),
   or None when the completion has none (e.g. it was cut before ``</answer>``); ``number``, the text of the
   completion's last number (:data:`prefzoo.text.NUMBER_PATTERN`, thousands commas dropped, "−" read
   as "-"), or None;
2. ``score = dataset.score_answer(answer, entry)``: the task's verifier, in [0, 1]. 1.0 is a correct answer; some
   tasks give partial credit (countdown 0.05 for a well-formed wrong expression and 0.01 for no answer; the default
   verifier ``len(oracle) / len(answer)`` when the answer contains the oracle).

The entry and the task travel as data columns (:mod:`prefzoo.data.reasoning_gym`): ``entry`` (JSON text),
``task``, ``task_config`` (JSON text) and ``answer_format`` (``tags`` where the column is absent); the verifier is the ``score_answer`` of a dataset built with that task's
config (some verifiers read it: decimal_arithmetic, time_intervals, ...), cached per (task, config).

``reasoning_gym_accuracy`` (the evaluation's ``task_accuracy`` and pass@k on these tasks) is 1.0 where the score is
1.0, else 0.0: partial credit is not a correct answer.

A verifier that raises on a model's answer scores it 0.0 (a warning, once per task): a malformed answer is a wrong
answer, and one odd completion must not stop a run.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from prefzoo.errors import RewardError

log = logging.getLogger(__name__)

__all__ = ["COLUMNS", "extract_answer", "score", "reasoning_gym", "reasoning_gym_accuracy", "has_columns"]

#: the data columns the verifier reads
COLUMNS = ("task", "task_config", "entry")
_warned: set[str] = set()


def has_columns(columns) -> bool:
    """Whether prompts with these column names come from ``data=reasoning_gym``."""
    return all(c in columns for c in COLUMNS)


def extract_answer(completion: str, answer_format: str = "tags") -> str | None:
    """The model's final answer in ``completion``, or None: ``tags``, reasoning-gym's ``extract_answer`` (the last
    ``<answer>...</answer>``); ``number``, the text of the last number ("1,234" -> "1234", "−5" -> "-5").

    Raises:
        RewardError: an unknown ``answer_format``.
    """
    if answer_format == "tags":
        from reasoning_gym.utils import extract_answer as rg_extract

        return rg_extract(completion)
    if answer_format == "number":
        from prefzoo.text import NUMBER_PATTERN

        last = None
        for last in NUMBER_PATTERN.finditer(completion):
            pass
        return None if last is None else last.group().replace(",", "").replace("\u2212", "-")
    raise RewardError(f"reasoning_gym: answer_format {answer_format!r} is not one of tags, number (the "
                      "'answer_format' column comes from data=reasoning_gym's data.answer_format).")


@functools.lru_cache(maxsize=64)
def _verifier(task: str, task_config: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, seed=0, size=1, **json.loads(task_config)).score_answer


def _as_entry(value: Any, index: int) -> dict:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            entry = json.loads(value)
        except ValueError:
            entry = None
        if isinstance(entry, dict):
            return entry
    raise RewardError(f"reasoning_gym: entry[{index}] is {str(value)[:80]!r}, not a reasoning-gym entry; the 'entry' "
                      "column holds the entry as JSON text (data=reasoning_gym writes it).")


def score(completion: str, task: str, task_config: str | dict | None, entry: str | dict, index: int = 0,
          answer_format: str = "tags") -> float:
    """The task's ``score_answer`` of the completion's extracted answer (module docstring), in [0, 1]."""
    config = task_config if isinstance(task_config, str) else json.dumps(task_config or {}, sort_keys=True)
    try:
        verify = _verifier(task, config)
    except Exception as err:
        raise RewardError(f"reasoning_gym: row {index} names task {task!r} with config {config}, which reasoning-gym "
                          f"cannot build ({type(err).__name__}: {err}); the 'task' and 'task_config' columns come from "
                          "data=reasoning_gym.") from err
    try:
        answer = extract_answer(completion, answer_format)
        return float(verify(answer, _as_entry(entry, index)))
    except RewardError:
        raise
    except Exception as err:  # a verifier tripping over a malformed answer: a wrong answer
        if task not in _warned:
            _warned.add(task)
            log.warning("reasoning_gym: the %s verifier raised %s: %s on a completion; such answers score 0 "
                        "(warned once per task)", task, type(err).__name__, err)
        return 0.0


def _check_lengths(completions, **columns) -> None:
    for name, column in columns.items():
        if len(column) != len(completions):
            raise RewardError(f"reasoning_gym: got {len(completions)} completions but {len(column)} values of column "
                              f"{name!r}; pass the columns aligned with the completions (one per sample).")


def reasoning_gym(prompts: list[str], completions: list[str], task: list[str], task_config: list[str],
                  entry: list[str], answer_format: list[str] | None = None, **_: Any) -> list[float]:
    """The task's verifier score of each completion (module docstring). Length B in, B floats in [0, 1] out.

    Raises:
        RewardError: a column not aligned with the completions, an entry that is not JSON of a dict, a task
            reasoning-gym cannot build, or an unknown answer format.
    """
    formats = answer_format if answer_format is not None else ["tags"] * len(completions)
    _check_lengths(completions, task=task, task_config=task_config, entry=entry, answer_format=formats)
    return [score(c, t, k, e, i, f)
            for i, (c, t, k, e, f) in enumerate(zip(completions, task, task_config, entry, formats))]


def reasoning_gym_accuracy(prompts: list[str], completions: list[str], task: list[str], task_config: list[str],
                           entry: list[str], answer_format: list[str] | None = None, **_: Any) -> list[float]:
    """1.0 where the verifier's score is 1.0 (a correct answer), else 0.0."""
    scores = reasoning_gym(prompts, completions, task, task_config, entry, answer_format)
    return [1.0 if s >= 1.0 else 0.0 for s in scores]
