"""Diversity of a policy's samples: distinct-n and per-token entropy (Li et al. 2016; Kirk et al. 2024).

Diversity is measured *across samples of the same prompt* (several completions per prompt, the
"per-input" diversity of Kirk et al. 2024, sec. 4), then averaged over prompts: a policy that always
writes the same completion for a prompt has distinct-n near 1/G even if it writes different things for
different prompts.
"""

from __future__ import annotations

from prefzoo.text import distinct_n, words  # noqa: F401 (distinct-n lives with the text helpers, prefzoo.text)


def grouped_distinct_n(texts: list[str], num_samples: int, n: int) -> float:
    """Mean over prompts of distinct-n among that prompt's ``num_samples`` consecutive samples."""
    groups = [texts[i:i + num_samples] for i in range(0, len(texts), num_samples)]
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
