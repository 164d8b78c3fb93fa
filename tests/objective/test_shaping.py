"""DAPO's soft overlong punishment (eq. 13) and GDPO's decoupled normalisation (arXiv:2601.05242, sec. 3), against
values computed by hand.

Tolerances (tests/bounds.py, kind 1). overlong_penalty's values are dyadic (quarters, eighths): exact in float32.
decoupled_group_rewards normalises in float64 and rounds once to float32: against the same formula in Python float64
(on the float32 rewards it is given) within 2 u32 relative (u32 = 2**-24 for the rounding; the float64 sums in
another order, ~1e-16, fill the rest).
"""

from __future__ import annotations

import math

import pytest
import torch

from prefzoo.objective import ObjectiveError, decoupled_group_rewards, overlong_penalty
from tests.bounds import U32, sum_bound


def test_the_overlong_penalty_is_zero_then_linear_then_minus_one():
    """L_max = 10, L_cache = 4: no penalty up to 6 tokens, then (6 - |y|) / 4: 7 -> -0.25, 9 -> -0.75, 10 -> -1;
    beyond the cap -1; the factor scales it (floor -factor)."""
    lengths = torch.tensor([5, 6, 7, 9, 10, 11])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, 10, 4, factor=0.5).tolist() == [0.0, 0.0, -0.125, -0.375, -0.5, -0.5]
    with pytest.raises(ObjectiveError, match="buffer must be in"):
        overlong_penalty(lengths, 10, 11)


def _normalised(xs, eps=1e-4):
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return [(x - mean) / (std + eps) if std > 0 else 0.0 for x in xs]


def test_each_reward_is_normalised_in_its_group_then_weighted():
    """Two groups of 3, two rewards with weights 1 and 2, eps 1e-4 added to each std. Group 1: r1 = (1, 0, 0): mean 1/3,
    unbiased std 1/sqrt(3) = 0.57735, so (2/3) / 0.57745 = 1.1545 first; r2 = (0.2, 0.4, 0.9): mean 0.5, std
    sqrt(0.13) = 0.36056, so 0.4 / 0.36066 = 1.1091 last. Group 2: r1 = (1, 1, 0) likewise; r2 = (5, 5, 5) constant: 0.
    The helper reads the float32 rewards the function is given (0.2 is not a float32: on the float64 0.2 the results
    differ by 7.6e-8 relative, more than the u32 of the final rounding): within 2 u32 relative (module docstring); the
    4-decimal values of this docstring within half their last digit, 5e-5. Every group's decoupled sum is 0: the
    float32 sum of 3 values, each rounded once (u32 |x|), and the sum's own gamma_2 sum |x| (sum_bound; measured 1.2e-7,
    bound 5.9e-7; was a round 1e-5)."""
    components = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0], [0.2, 0.4, 0.9, 5.0, 5.0, 5.0]])
    r1, r2 = components.tolist()
    got = decoupled_group_rewards(components, torch.tensor([1.0, 2.0]), 3)
    a1 = _normalised(r1[:3]) + _normalised(r1[3:])
    a2 = _normalised(r2[:3]) + [0.0, 0.0, 0.0]
    want = [x + 2 * y for x, y in zip(a1, a2)]
    assert got.tolist() == pytest.approx(want, rel=2 * U32, abs=0)
    assert a1[0] == pytest.approx(1.1545, abs=5e-5) and a2[2] == pytest.approx(1.1091, abs=5e-5)
    for group in got.view(2, 3):  # every group's decoupled sum has mean 0
        abs_sum = float(group.abs().sum())
        assert abs(float(group.sum())) <= U32 * abs_sum + sum_bound(3, abs_sum)


def test_distinct_reward_combinations_stay_apart():
    """GDPO's motivating case (sec. 3): two 0/1 rewards, G = 2. A group whose completions differ in both rewards
    (sums 2 vs 0) and one whose completions differ in one (sums 2 vs 1): GRPO on the sums gives both the same
    advantages, +-0.5 / (std + eps) = +-0.7070, since normalising the sum by its std erases how much it differs. Per
    reward, the first group gets 0.7070 from each reward (1.4140 in all), the second 0.7070 from one (the other column
    is constant): twice as much for the completion that is better on both. Exactly twice: in float64 x + x = 2x, and
    rounding to float32 commutes with doubling (the old rel=1e-4 allowed 1e-4 off); one[0] within 2 u32 relative of
    the hand value (module docstring; measured 2.4e-8; was 1e-6)."""
    both = decoupled_group_rewards(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.ones(2), 2)
    one = decoupled_group_rewards(torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.ones(2), 2)
    assert float(both[0]) == 2 * float(one[0])
    assert float(one[0]) == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4), rel=2 * U32, abs=0)


def test_a_missing_score_counts_nothing_and_is_left_out_of_its_group():
    """r1 = (1, None, 0): the given (1, 0) have mean 0.5, std sqrt(0.5): (0.7071, 0, -0.7071). Within 2 u32 relative
    (module docstring; measured 2.4e-8), the missing score exactly 0."""
    got = decoupled_group_rewards(torch.tensor([[1.0, float("nan"), 0.0]]), torch.ones(1), 3)
    s = math.sqrt(0.5) + 1e-4
    assert got.tolist() == pytest.approx([0.5 / s, 0.0, -0.5 / s], rel=2 * U32, abs=0)
