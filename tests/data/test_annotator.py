"""The length-biased annotator of the built-in pairs (``data.pairs.annotator=longer``; issue 16, item 1a).

A scripted sampler stands for the model (tests/data/test_preference.py), so every pair is known in advance. The
verifier is the arithmetic exact match, the answer is 5 for every prompt. Lengths are completion tokens (the
scripted completion's tokens plus EOS when it ended).
"""

import random

import pytest

from prefzoo.data.pairs import ANNOTATORS, select_longer_pair, sample_and_label
from prefzoo.data.prompts import PromptSet
from prefzoo.errors import DataError
from prefzoo.rewards import make_reward
from prefzoo.types import SamplingParams
from tests.data.test_preference import ScriptedSampler, ids

CORRECT = make_reward(["correctness"])
SHORT_RIGHT = "5"
LONG_WRONG = "Let me think. 2 plus 3 is 5, and adding 2 more gives 7"  # its last number is 7: wrong
LONG_WRONG_2 = "It could be 8, or maybe 9, I am not sure at all"
SHORT_WRONG = "7"


def prompts(n):
    questions = [f"What is 2 + 3? ({i})" for i in range(n)]
    return PromptSet([ids(q) for q in questions], questions, {"answer": [5] * n}, questions)


def label(script, annotator="longer", bias=1.0, seed=0, require_finished=True):
    rows, stats = sample_and_label(ScriptedSampler(script), prompts(len(script)), CORRECT, len(script[0]),
                                   SamplingParams(), batch_size=4, seed=seed, progress=False,
                                   require_finished=require_finished, annotator=annotator, length_bias=bias)
    return [(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in rows], stats


def test_the_annotators_by_name():
    assert tuple(ANNOTATORS) == ("gold", "longer", "shorter")
    with pytest.raises(DataError, match="data.pairs.annotator='median' is not an annotator; choose one of: gold, "
                                        "longer, shorter"):
        label([[("5", True), ("7", True)]], annotator="median")


def test_select_longer_pair_by_hand():
    """scores / ended / lengths of one group -> (chosen, rejected). Sample 0 right (4 tokens), 1 wrong and long (9),
    2 wrong and short (3). The verifier's pair is (0, a worst of 1 and 2 at random); at bias 1 the longer of that
    pair is chosen, at bias 0 the right one. Both wrong (1, 2): the verifier sees nothing, the annotator takes
    the longest (1) over the shortest (2). Equal lengths and scores: no pair."""
    scores, ended, lengths = [1.0, 0.0, 0.0], [True] * 3, [4, 9, 3]
    picks = {select_longer_pair(scores, ended, lengths, random.Random(s), 1.0) for s in range(30)}
    assert picks == {(1, 0), (0, 2)}  # rejected 1: the long wrong one is chosen; rejected 2: the right one is longer
    picks = {select_longer_pair(scores, ended, lengths, random.Random(s), 0.0) for s in range(30)}
    assert picks == {(0, 1), (0, 2)}  # bias 0: the verifier's label, as the gold annotator
    assert select_longer_pair([0.0, 0.0], [True, True], [9, 3], random.Random(0), 0.0) == (0, 1)
    assert select_longer_pair([0.0, 0.0], [True, True], [4, 4], random.Random(0), 1.0) is None
    # the longer one never ended: under require_finished it cannot be chosen, the verifier's label stands
    assert select_longer_pair([1.0, 0.0], [True, False], [2, 9], random.Random(0), 1.0) == (0, 1)
    assert select_longer_pair([0.0, 0.0], [True, False], [2, 9], random.Random(0), 1.0) is None


def test_bias_one_always_prefers_the_longer_even_when_it_is_wrong():
    """Prompt 0: right and short vs wrong and long -> the long wrong answer is chosen (gold: the right one).
    Prompt 1: both wrong, of different lengths -> the longer is chosen (gold: no pair). Prompt 2: both wrong and
    one token each -> no pair under either annotator. Before the annotator existed: a TypeError (no keyword
    ``annotator``)."""
    script = [[(SHORT_RIGHT, True), (LONG_WRONG, True)], [(SHORT_WRONG, True), (LONG_WRONG_2, True)],
              [("7", True), ("8", True)]]
    assert len(ids("7")) == len(ids("8"))
    got, stats = label(script, bias=1.0)
    assert got == [(LONG_WRONG, SHORT_RIGHT), (LONG_WRONG_2, SHORT_WRONG)]
    assert stats["chosen_longer"] == 1.0 and stats["chosen_better"] == 0.0  # 2 of 2 longer, 0 of 2 right over wrong
    gold, gold_stats = label(script, annotator="gold")
    assert gold == [(SHORT_RIGHT, LONG_WRONG)]
    assert gold_stats["chosen_longer"] == 0.0 and gold_stats["chosen_better"] == 1.0


def test_the_pairs_correlate_with_length_more_than_with_correctness():
    """400 prompts: half give a right-short / wrong-long group (the verifier separates them), half two wrong
    answers of different lengths. At bias 0.5 the expected share of pairs whose chosen is the longer one is
    0.5 * 0.5 (separated groups labelled by length) + 0.5 * 1 (the rest: always by length) = 0.75, and the share whose
    chosen the verifier prefers is 0.5 * 0.5 = 0.25. With 400 Bernoulli(0.5) draws on the 200 separated groups the
    standard error of the first share is 0.5 * sqrt(0.25 / 200) = 0.018 (the second's the same): 0.06 is 3.4 standard
    errors, exceeded with probability 7e-4 each (kind 4 of tests/bounds.py; seed 3 is fixed, so the test is
    deterministic). The annotator's stats are the same counts over 400 in float64: approx's default rel 1e-6
    (kind 1)."""
    script = [[(SHORT_RIGHT, True), (LONG_WRONG, True)] if i % 2 == 0 else [(SHORT_WRONG, True), (LONG_WRONG_2, True)]
              for i in range(400)]
    got, stats = label(script, bias=0.5, seed=3)
    assert len(got) == 400
    longer = sum(len(c) > len(r) for c, r in got) / len(got)
    right = sum(c == SHORT_RIGHT for c, _ in got) / len(got)
    assert longer == pytest.approx(0.75, abs=0.06) and right == pytest.approx(0.25, abs=0.06)
    assert stats["chosen_longer"] == pytest.approx(longer) and stats["chosen_better"] == pytest.approx(right)
    again, _ = label(script, bias=0.5, seed=3)
    assert again == got  # seeded: the same pairs again


def test_the_gold_annotator_is_unchanged():
    """annotator=gold (the default) gives the pairs select_pair gives: the same rows with or without the keyword."""
    script = [[(SHORT_RIGHT, True), (LONG_WRONG, True)], [(SHORT_WRONG, True), (LONG_WRONG_2, True)]]
    rows_default, _ = sample_and_label(ScriptedSampler(script), prompts(2), CORRECT, 2, SamplingParams(), 4, seed=0,
                                       progress=False)
    rows_gold, _ = sample_and_label(ScriptedSampler(script), prompts(2), CORRECT, 2, SamplingParams(), 4, seed=0,
                                    progress=False, annotator="gold")
    assert rows_default == rows_gold and [r["chosen"][0]["content"] for r in rows_gold] == [SHORT_RIGHT]


def test_the_cache_key_of_the_verifiers_pairs_is_unchanged_and_the_biased_pairs_have_their_own(tmp_path):
    """The folder names of the cached pairs: the default (gold) key is the one computed before the annotator
    existed (f1ee758d514b, printed by the code of the commit before), so the caches built so far stay valid; the
    length-biased pairs (and each bias) are cached apart."""
    from tests.data.test_pairs import build, never_right, prompts as three_prompts

    folder = lambda *o: build(tmp_path, never_right(), three_prompts(), three_prompts(), *o)[0].parent.name  # noqa
    assert folder() == folder("data.pairs.annotator=gold", "data.pairs.length_bias=0.9") == "arithmetic-f1ee758d514b"
    biased = folder("data.pairs.annotator=longer")
    assert biased != "arithmetic-f1ee758d514b" and folder("data.pairs.annotator=longer",
                                                          "data.pairs.length_bias=0.9") != biased


@pytest.mark.parametrize("override, message", [
    ("data.pairs.annotator=median", "data.pairs.annotator='median' is not valid; choose one of: gold, longer, shorter"),
    ("data.pairs.length_bias=1.5", "data.pairs.length_bias=1.5 must be in [0, 1]"),
])
def test_a_bad_annotator_setting_is_a_config_error(override, message):
    from prefzoo.errors import ConfigError
    from tests.test_config import typed

    with pytest.raises(ConfigError) as err:
        typed("model=tiny", override)
    assert str(err.value).startswith(message)


LONG_RIGHT = "Let me think. 2 plus 3 makes 5"  # its last number is 5: right


def test_bias_one_of_the_shorter_annotator_prefers_the_shorter_even_when_it_is_wrong():
    """The mirror of the longer annotator (issue 32's design (e): a proxy for which concision is the preferred
    feature). Prompt 0: wrong and short vs right and long -> the short wrong answer is chosen (gold: the right one).
    Prompt 1: both wrong, of different lengths -> the shorter is chosen. Prompt 2: both one token -> no pair. At bias
    0 the verifier's label stands where it separates the pair (prompt 0), length elsewhere (prompt 1)."""
    script = [[(SHORT_WRONG, True), (LONG_RIGHT, True)], [(SHORT_WRONG, True), (LONG_WRONG_2, True)],
              [("7", True), ("8", True)]]
    got, stats = label(script, annotator="shorter", bias=1.0)
    assert got == [(SHORT_WRONG, LONG_RIGHT), (SHORT_WRONG, LONG_WRONG_2)]
    assert stats["chosen_longer"] == 0.0 and stats["chosen_better"] == 0.0
    got, _ = label(script, annotator="shorter", bias=0.0)
    assert got == [(LONG_RIGHT, SHORT_WRONG), (SHORT_WRONG, LONG_WRONG_2)]


def test_the_shorter_annotators_chosen_must_have_ended():
    """Under require_finished the chosen answer must have ended by itself: a shorter answer that was cut (no EOS)
    cannot be chosen, so the verifier's label stands; of two wrong answers only the longer ended: length would choose
    the shorter, which did not end, so there is no pair; both ended: the shorter."""
    import random

    from prefzoo.data.pairs import select_shorter_pair

    assert select_shorter_pair([0.0, 1.0], [False, True], [2, 9], random.Random(0), 1.0) == (1, 0)
    assert select_shorter_pair([0.0, 0.0], [False, True], [2, 9], random.Random(0), 1.0) is None
    assert select_shorter_pair([0.0, 0.0], [True, True], [2, 9], random.Random(0), 1.0) == (0, 1)
