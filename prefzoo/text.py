"""Text helpers that several rooms share, at the bottom of the house (like :mod:`prefzoo.errors`, it imports nothing of
prefzoo, and every room may import it):

* :data:`NUMBER_PATTERN`: how a number is read from text -- the data checks a task's answers with it
  (:mod:`prefzoo.data.reasoning_gym`), the rewards read a completion's answer with it
  (:mod:`prefzoo.rewards.arithmetic`, :mod:`prefzoo.rewards.reasoning_gym`).
* :func:`words` and :func:`distinct_n`: distinct-n over word and punctuation tokens (Li et al. 2016) -- the
  evaluation measures diversity with it (:mod:`prefzoo.evaluation.diversity`), the fluent-sentiment reward scores
  with it (:mod:`prefzoo.rewards.sentiment`).
"""

from __future__ import annotations

import re

__all__ = ["NUMBER_PATTERN", "WORD", "words", "distinct_n"]

# A number: an optional sign, digits (optionally grouped by thousands commas), an optional decimal part.
# A minus (ASCII "-" or Unicode "−") is a sign only when a digit follows it directly and no word
# character or ")" precedes it, so "10-3" reads as 10 and 3, while "x = -3" reads as -3.
# Thousands groups must be complete ("1,234", not "1,2345"); a list such as "1,2,3" reads as 1, 2, 3.
# A decimal point needs a digit after it, so the period ending "is 78." is not part of the number.
NUMBER_PATTERN = re.compile(
    r"(?:(?<![\w)])[-\u2212])?"
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
    r"(?:\.\d+)?"
)

WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """Lower-cased word and punctuation tokens (so '!!!' counts as three '!' tokens)."""
    return WORD.findall(text.lower())


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct-n of a set of texts: unique n-grams / total n-grams over all of them (Li et al. 2016, sec. 4).

    Returns 0.0 when the texts hold no n-gram. Units: a fraction in [0, 1].
    """
    grams = []
    for t in texts:
        w = words(t)
        grams += [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0
