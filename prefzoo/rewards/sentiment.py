"""Sentiment reward: how positive a completion reads, for the "write positively" task.

Ziegler et al. 2019 (Fine-Tuning Language Models from Human Preferences, Sec. 3) reward positive
continuations with a sentiment classifier trained on reviews. Here the classifier is VADER
(Hutto & Gilbert 2014), a rule-based lexicon scorer: no model to download, deterministic, fast on
CPU. Its compound score is the normalised sum of word valences, in [-1, 1]; like any proxy reward it
can be gamed (e.g. by repeating positive words), which is part of what the KL term is there to limit.
"""

from __future__ import annotations

from typing import Any

from prefzoo.errors import RewardError

__all__ = ["sentiment"]

_ANALYZER = None


def _analyzer():
    """The VADER analyzer, built on first use (loading its lexicon takes a fraction of a second)."""
    global _ANALYZER
    if _ANALYZER is None:
        try:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        except ImportError as err:
            raise RewardError(
                "sentiment: the 'vaderSentiment' package is not installed; install it with "
                "`pip install vaderSentiment` (it is a dependency of prefzoo)."
            ) from err
        _ANALYZER = SentimentIntensityAnalyzer()
    return _ANALYZER


def sentiment(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """VADER compound sentiment of each completion, in [-1, 1] (positive text scores above 0).

    The prompt is not scored: only what the policy wrote counts. Text without sentiment words (or an
    empty completion) scores 0.0.

    Args:
        prompts: the prompt texts (unused). Length B.
        completions: the generated texts. Length B.

    Returns:
        B floats in [-1, 1].

    Raises:
        RewardError: vaderSentiment is not installed.
    """
    analyzer = _analyzer()
    return [float(analyzer.polarity_scores(text)["compound"]) for text in completions]
