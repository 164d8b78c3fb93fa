"""Diversity of a policy's samples: distinct-n and per-token entropy (Li et al. 2016; Kirk et al. 2024).

Diversity is measured *across samples of the same prompt* (several completions per prompt, the
"per-input" diversity of Kirk et al. 2024, sec. 4), then averaged over prompts: a policy that always
writes the same completion for a prompt has distinct-n near 1/G even if it writes different things for
different prompts.
"""

from __future__ import annotations

import re

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


def grouped_distinct_n(texts: list[str], group_size: int, n: int) -> float:
    """Mean over prompts of distinct-n among that prompt's ``group_size`` consecutive samples."""
    groups = [texts[i:i + group_size] for i in range(0, len(texts), group_size)]
    return sum(distinct_n(g, n) for g in groups) / max(1, len(groups))


def max_repeat_run(text: str) -> int:
    """Longest run of one repeated word/punctuation token (e.g. 'great great great' -> 3, '!!!!' -> 4)."""
    best = run = 0
    prev = None
    for w in words(text):
        run = run + 1 if w == prev else 1
        prev = w
        best = max(best, run)
    return best
