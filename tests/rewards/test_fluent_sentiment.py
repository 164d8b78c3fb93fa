"""``fluent_sentiment``: VADER sentiment mapped to [0, 1] times the completion's own distinct-2 (issue 16, item 1b).

Every expected value is derived by hand from VADER's lexicon (good = 1.9, great = 3.1, bad = -2.5; compound =
s / sqrt(s^2 + 15) for a sum of valences s, no booster words or exclamation marks here) and the tokenisation of
prefzoo.text.words (lower-cased words and punctuation marks).

Tolerances (kind 1 of tests/bounds.py): VADER rounds its compound to 4 decimals, so both sides are the same few
float64 operations on the same 4-decimal numbers, ~1e-16 apart; abs 1e-12 and 1e-9 are far above that and far below
any other valence or bigram count (~1e-2).
"""

import math

import pytest

pytest.importorskip("vaderSentiment")

from prefzoo.rewards import BUILTIN_REWARDS, make_reward  # noqa: E402
from prefzoo.rewards.sentiment import fluent_sentiment  # noqa: E402


def compound(s: float) -> float:
    return round(s / math.sqrt(s * s + 15), 4)  # VADER rounds the compound score to 4 decimals


@pytest.mark.parametrize("text, expected", [
    # the, food, was, good, . -> 4 bigrams, all distinct: fluency 1; compound(1.9) = 0.4404 -> (1 + 0.4404) / 2
    ("The food was good.", (1 + compound(1.9)) / 2 * 1.0),
    # good good good -> bigrams (good, good) twice: 1 distinct of 2 = 0.5; compound(5.7) = 0.8271
    ("good good good", (1 + compound(5.7)) / 2 * 0.5),
    # great x 4 -> 3 bigrams, 1 distinct: 1/3; compound(12.4) = 0.9545
    ("great great great great", (1 + compound(12.4)) / 2 / 3),
    # a fluent negative sentence: compound(-2.5) = -0.5423 -> (1 - 0.5423) / 2 = 0.22885
    ("The food was bad.", (1 + compound(-2.5)) / 2),
    ("", 0.0),  # no bigram: fluency 0 (no review at all)
    ("good", 0.0),  # one token: no bigram either
])
def test_values_by_hand(text, expected):
    assert compound(1.9) == 0.4404 and compound(5.7) == 0.8271 and compound(12.4) == 0.9545  # the lexicon's sums
    assert fluent_sentiment(["a prompt"], [text]) == [pytest.approx(expected, abs=1e-12)]


def test_repetition_loses_what_plain_sentiment_gives_it():
    """Plain VADER ranks the repetitions above the sentence (0.9545 > 0.8271 > 0.4404); the fluent gold reverses
    that order (0.7202 > 0.4568 > 0.3258): the hack that optimising plain sentiment finds is what the gold punishes.
    Before this reward existed: KeyError / ConfigError "unknown reward 'fluent_sentiment'"."""
    texts = ["The food was good.", "good good good", "great great great great"]
    plain = make_reward(["sentiment"])([""] * 3, texts)
    gold = make_reward(["fluent_sentiment"])([""] * 3, texts)
    assert plain == sorted(plain) and gold == sorted(gold, reverse=True)
    assert gold == pytest.approx([0.7202, 0.456775, 0.9772500 / 3], abs=1e-9)
    assert BUILTIN_REWARDS["fluent_sentiment"] is fluent_sentiment


def test_the_prompt_is_not_scored_and_values_lie_in_the_unit_interval():
    texts = ["I loved this wonderful film, truly great!", "terrible awful boring", "!!!!!!", "ok ok"]
    scores = fluent_sentiment(["This is a terrible prompt."] * 4, texts)
    assert scores == fluent_sentiment([""] * 4, texts)
    assert all(0.0 <= s <= 1.0 for s in scores)
