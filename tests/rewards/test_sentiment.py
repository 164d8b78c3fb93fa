"""Sentiment reward (VADER compound score)."""

import pytest

pytest.importorskip("vaderSentiment")

import importlib  # noqa: E402

from prefzoo.rewards.sentiment import sentiment as sentiment_fn  # noqa: E402

# prefzoo.rewards re-exports the function under the module's name, so fetch the module itself.
sentiment_module = importlib.import_module("prefzoo.rewards.sentiment")


def test_positive_and_negative_text():
    positive, negative = sentiment_fn(["", ""], ["I loved this wonderful film", "terrible, awful, boring"])
    assert positive > 0.5
    assert negative < -0.5


def test_neutral_and_empty_text_score_zero():
    assert sentiment_fn(["", ""], ["The film is a film.", ""]) == [0.0, 0.0]


def test_scores_lie_in_unit_interval_and_align_with_completions():
    completions = ["great great great great great!!!", "worst. ever. hate hate hate!!!", "ok", "fine"]
    scores = sentiment_fn([""] * 4, completions)
    assert len(scores) == 4
    assert all(isinstance(s, float) and -1.0 <= s <= 1.0 for s in scores)
    assert scores[0] > 0.5 and scores[1] < -0.5


def test_prompt_is_not_scored():
    bad_prompt = ["This is a terrible, awful, horrible prompt."]
    assert sentiment_fn(bad_prompt, ["I loved it"]) == sentiment_fn(["neutral"], ["I loved it"])


def test_analyzer_is_created_once():
    sentiment_fn([""], ["good"])
    first = sentiment_module._ANALYZER
    sentiment_fn([""], ["bad"])
    assert first is not None and sentiment_module._ANALYZER is first
