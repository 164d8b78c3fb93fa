"""Reward registry: resolving specs, weighted combination, and the checks on what functions return."""

import functools
import math

import numpy as np
import pytest

from prefzoo.errors import ConfigError, DataError, PrefzooError, ModelError, RewardError
from prefzoo.rewards import (
    BUILTIN_REWARDS,
    CombinedReward,
    check_reward_signature,
    correctness,
    format_reward,
    make_reward,
    resolve_reward,
    reward_name,
    sentiment,
)
from tests.rewards import helpers


def test_error_hierarchy():
    assert issubclass(ConfigError, PrefzooError) and issubclass(ConfigError, ValueError)
    assert issubclass(DataError, PrefzooError) and issubclass(DataError, ValueError)
    assert issubclass(RewardError, PrefzooError) and issubclass(RewardError, RuntimeError)
    assert issubclass(ModelError, PrefzooError) and issubclass(ModelError, RuntimeError)


def test_builtin_names():
    assert resolve_reward("correctness") is correctness
    assert resolve_reward("format") is format_reward
    assert resolve_reward("sentiment") is sentiment
    from prefzoo.rewards.reasoning_gym import reasoning_gym, reasoning_gym_accuracy

    assert resolve_reward("reasoning_gym") is reasoning_gym
    assert resolve_reward("reasoning_gym_accuracy") is reasoning_gym_accuracy
    assert set(BUILTIN_REWARDS) == {"correctness", "format", "sentiment", "fluent_sentiment", "reasoning_gym",
                                    "reasoning_gym_accuracy"}


def test_callable_passes_through():
    def mine(prompts, completions, **_):
        return [0.0] * len(completions)

    assert resolve_reward(mine) is mine


def test_import_path_loads_function_from_test_module():
    assert resolve_reward("tests.rewards.helpers:const_one") is helpers.const_one


def test_reward_names():
    assert reward_name("format") == "format"
    assert reward_name("tests.rewards.helpers:const_one") == "const_one"
    assert reward_name(helpers.length_reward) == "length_reward"


def test_weighted_sum_by_hand():
    """const_one gives [1, 1]; correctness gives [1, 0] (answer 68, completions '68' and '12').
    With weights 0.5 and 2.0 the totals are [0.5*1 + 2*1, 0.5*1 + 2*0] = [2.5, 0.5]."""
    reward = CombinedReward(["tests.rewards.helpers:const_one", "correctness"], weights=[0.5, 2.0])
    totals = reward(["p1", "p2"], ["68", "12"], answer=[68, 68])
    assert totals == [2.5, 0.5]
    assert reward.last_components == {"const_one": [1.0, 1.0], "correctness": [1.0, 0.0]}


def test_default_weights_are_one_and_zero_weight_is_still_recorded():
    """length_reward gives [3, 5] for 'abc', 'hello'; const_one [1, 1]. Equal weights: [4, 6]."""
    reward = make_reward([helpers.length_reward, helpers.const_one])
    assert reward(["", ""], ["abc", "hello"]) == [4.0, 6.0]
    muted = make_reward([helpers.length_reward, helpers.const_one], weights=[0.0, 1.0])
    assert muted(["", ""], ["abc", "hello"]) == [1.0, 1.0]
    assert muted.last_components["length_reward"] == [3.0, 5.0]


def test_last_components_are_replaced_each_call():
    reward = make_reward("tests.rewards.helpers:length_reward")
    reward([""], ["ab"])
    reward(["", ""], ["a", "abcd"])
    assert reward.last_components == {"length_reward": [1.0, 4.0]}


def test_numpy_output_accepted():
    reward = make_reward(lambda prompts, completions, **_: np.array([0.25, -1.5]))
    assert reward(["", ""], ["x", "y"]) == [0.25, -1.5]


def test_duplicate_names_get_suffixes():
    reward = make_reward(["tests.rewards.helpers:const_one", helpers.const_one])
    assert reward.names == ["const_one", "const_one_2"]
    assert reward([""], ["x"]) == [2.0]


def test_function_that_raises_is_wrapped_and_chained():
    def exploding(prompts, completions, **_):
        raise ValueError("kaboom")

    reward = make_reward(["format", exploding])
    with pytest.raises(RewardError, match="'exploding' raised ValueError: kaboom") as info:
        reward(["p", "p"], ["1", "2"])
    assert isinstance(info.value.__cause__, ValueError)
    assert "batch of 2 samples" in str(info.value)


def test_wrong_length_names_function_and_counts():
    def short(prompts, completions, **_):
        return [1.0]

    with pytest.raises(RewardError, match="'short' returned 1 scores, expected 3"):
        make_reward(short)(["", "", ""], ["a", "b", "c"])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_names_function_sample_and_completion(bad):
    def flaky(prompts, completions, **_):
        return [0.0, bad]

    long_completion = "z" * 200
    with pytest.raises(RewardError) as info:
        make_reward(flaky)(["", ""], ["ok", long_completion])
    message = str(info.value)
    assert "'flaky'" in message and "non-finite" in message and "sample 1" in message
    assert "z" * 77 + "..." in message  # truncated to 80 characters
    assert "z" * 78 not in message


@pytest.mark.parametrize("bad", ["1.0", [1.0]])  # None is a missing score (TRL's convention): test_trl_protocol.py
def test_non_number_names_function_and_sample(bad):
    def sloppy(prompts, completions, **_):
        return [bad]

    with pytest.raises(RewardError, match=r"'sloppy' returned a non-number .* sample 0 .*'only one'"):
        make_reward(sloppy)([""], ["only one"])


def test_non_list_return_rejected():
    def scalar(prompts, completions, **_):
        return 1.0

    with pytest.raises(RewardError, match="'scalar' returned a float"):
        make_reward(scalar)([""], ["x"])


def test_unknown_name_lists_builtins():
    with pytest.raises(ConfigError, match="unknown reward 'corectness'.*'correctness'.*'format'.*'sentiment'"):
        make_reward(["corectness"])


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("tests.rewards.no_such_module:fn", "could not import module 'tests.rewards.no_such_module'"),
        ("tests.rewards.helpers:no_such_fn", "has no attribute 'no_such_fn'"),
        ("tests.rewards.helpers:NOT_CALLABLE", "'NOT_CALLABLE' is not callable (it is int 42)"),
        (":const_one", "bad reward import path"),
        ("tests.rewards.helpers:", "bad reward import path"),
    ],
)
def test_bad_import_paths(spec, fragment):
    with pytest.raises(ConfigError) as info:
        resolve_reward(spec)
    assert fragment in str(info.value)
    assert repr(spec) in str(info.value)


def test_non_string_non_callable_spec():
    with pytest.raises(ConfigError, match="a reward must be a name"):
        resolve_reward(3)


def test_weights_length_mismatch():
    with pytest.raises(ConfigError, match="got 1 weights for 2 reward functions"):
        CombinedReward(["correctness", "format"], weights=[1.0])


@pytest.mark.parametrize("weight", [math.nan, "1", None])
def test_bad_weight_value(weight):
    with pytest.raises(ConfigError, match="weight of reward 'format'"):
        CombinedReward(["format"], weights=[weight])


def test_empty_or_bare_function_list():
    with pytest.raises(ConfigError, match="empty"):
        CombinedReward([])
    with pytest.raises(ConfigError, match="list of reward specs"):
        CombinedReward("format")


def test_misaligned_inputs_raise_data_error():
    reward = make_reward("correctness")
    with pytest.raises(DataError, match="2 prompts but 1 completions"):
        reward(["a", "b"], ["1"], answer=[1])
    with pytest.raises(DataError, match="column 'answer' has 1 values but there are 2 completions"):
        reward(["a", "b"], ["1", "2"], answer=[1])


# ------------------------------------------------------------------ signatures, checked without a call

@pytest.mark.parametrize("fn,columns,fragment", [
    (helpers.one_argument, None, "has the signature (completions), but a reward function is called as "
                                 "fn(prompts, completions, **columns)"),
    (lambda p, c, x, /: [], None, "has the signature (p, c, x, /)"),  # x is positional-only: no column fills it
    (helpers.no_columns, ["answer"], "cannot be called with this data's columns [answer] (got an unexpected "
                                     "keyword argument 'answer'); it is called as fn(prompts, completions, "
                                     "**columns) -> list[float]: add **columns (or **_)"),
    (helpers.needs_subject, ["answer"], "missing a required argument: 'subject'"),
])
def test_check_reward_signature_refuses_what_cannot_be_called(fn, columns, fragment):
    with pytest.raises(ConfigError) as err:
        check_reward_signature("mod:fn", fn, columns)
    assert fragment in str(err.value) and "'mod:fn'" in str(err.value)


@pytest.mark.parametrize("fn,columns", [
    (helpers.const_one, ["answer", "subject"]), (helpers.no_columns, []), (helpers.needs_subject, ["subject"]),
    (helpers.needs_subject, None),  # without the columns, a required keyword may still come from one
    (lambda *args, **kw: [], ["answer"]), (BUILTIN_REWARDS["correctness"], ["answer"]),
    (functools.partial(helpers.needs_subject, subject=None), ["answer"]),
])
def test_check_reward_signature_accepts_what_can_be_called(fn, columns):
    check_reward_signature("mod:fn", fn, columns)
