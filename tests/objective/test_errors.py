"""Tests for prefzoo.objective.errors: the error type and the checks that build its messages."""

import pytest
import torch

from prefzoo.objective.errors import (
    ObjectiveError,
    check_choice,
    check_mask,
    check_number,
    check_same_shape,
)


def test_objective_error_is_a_value_error():
    assert issubclass(ObjectiveError, ValueError)
    with pytest.raises(ValueError):
        raise ObjectiveError("x")


def test_check_choice_lists_valid_names():
    check_choice("estimator", "k1", ("k1", "k2"))
    with pytest.raises(ObjectiveError) as info:
        check_choice("estimator", "k9", ("k1", "k2"))
    assert str(info.value) == "unknown estimator 'k9'; valid estimators are 'k1', 'k2'"


def test_check_same_shape_names_both_shapes():
    with pytest.raises(ObjectiveError) as info:
        check_same_shape("logps", torch.zeros(2, 3), "ref_logps", torch.zeros(2, 5))
    assert "logps has shape (2, 3)" in str(info.value)
    assert "ref_logps has shape (2, 5)" in str(info.value)


def test_check_mask_requires_bool_and_says_how_to_fix():
    with pytest.raises(ObjectiveError, match=r"mask\.bool\(\)"):
        check_mask(torch.ones(2, 2), torch.zeros(2, 2))
    with pytest.raises(ObjectiveError, match=r"\(2, 2\).*\(2, 3\)"):
        check_mask(torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 2))
    check_mask(torch.ones(2, 2, dtype=torch.bool), torch.zeros(2, 2))


def test_check_number_bounds_and_hint():
    assert check_number("beta", 0, low=0.0) == 0.0
    with pytest.raises(ObjectiveError, match=r"beta must be >= 0.0, got -1.0; use 0 for none"):
        check_number("beta", -1, low=0.0, hint="use 0 for none")
    with pytest.raises(ObjectiveError, match=r"must be > 0.0 and < 1.0"):
        check_number("alpha", 1.0, low=0.0, strict_low=True, high=1.0, strict_high=True)
    with pytest.raises(ObjectiveError, match="finite"):
        check_number("kl", float("nan"))
    with pytest.raises(ObjectiveError, match="number"):
        check_number("kl", "abc")
