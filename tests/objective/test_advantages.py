"""Tests for prefzoo.objective.advantages: group-relative advantages and GAE.

Tolerances (tests/bounds.py, kind 1). group_advantages centres and scales in float64 whatever the rewards' dtype
(and returns the rewards' dtype), gae keeps float64 inputs in float64: the exact claims here run on float64 rewards
and compare within 1e-12, where the rounding of a few float64 operations on values of size <= 5 is ~1e-15 (1000x
below; measured <= 4.4e-16, 2026-12-06, 1 and 2 threads). Where no rounding happens (constant groups, masked
positions, the same operations repeated, sums of powers of two) the comparison is exact. A value quoted by hand to 10
decimals (so <= 5e-11 off) is checked within 1e-9.
"""

import math

import pytest
import torch

from prefzoo.objective import ObjectiveError, gae, group_advantages
from tests.bounds import U32
from tests.objective.two_ranks import run_on_two_ranks

# ------------------------------------------------------------------------------ group advantages


def test_group_of_four_hand_numbers():
    """[1, 0, 1, 0]: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.5773502692;
    A = +-0.5 / (0.5773502692 + 1e-4) = +-0.8658754298 ("group"), +-0.5 ("none", exact: no rounding)."""
    r = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    a = group_advantages(r, 4, "group", 1e-4)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert abs(expected - 0.8658754298) < 1e-9
    torch.testing.assert_close(a, torch.tensor([expected, -expected, expected, -expected], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert torch.equal(group_advantages(r, 4, "none", 1e-4),
                       torch.tensor([0.5, -0.5, 0.5, -0.5], dtype=torch.float64))


def test_batch_scale_hand_numbers():
    """Groups [1, 0, 1, 0] and [3, 3, 3, 3]. Batch: mean 14/8 = 1.75, squared deviations
    2 * 0.5625 + 2 * 3.0625 + 4 * 1.5625 = 13.5, unbiased var 13.5/7, std = 1.3887301496.
    Group 1: +-0.5 / (1.3887301496 + 1e-4); group 2 (all equal): exactly 0."""
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0, 3.0, 3.0, 3.0], dtype=torch.float64)
    a = group_advantages(r, 4, "batch", 1e-4)
    std = math.sqrt(13.5 / 7)
    assert abs(std - 1.3887301496) < 1e-9
    x = 0.5 / (std + 1e-4)
    torch.testing.assert_close(a, torch.tensor([x, -x, x, -x, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert (a[4:] == 0).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_give_exact_zeros(scale):
    """Eight float32 rewards of 0.35: the float32 std is ~3e-8, so a naive (r - mean)/(std + eps)
    amplifies rounding noise; here every advantage is exactly 0, even with a tiny eps."""
    r = torch.full((8,), 0.35, dtype=torch.float32)
    for eps in (1e-4, 1e-12):
        a = group_advantages(r, 8, scale=scale, eps=eps)
        assert a.dtype == torch.float32
        assert (a == 0).all()
    # a group of rewards equal up to float noise (computed along two paths) is also constant
    noisy = torch.tensor([0.1 + 0.2, 0.3, 0.3, 0.1 + 0.2], dtype=torch.float64)
    assert (group_advantages(noisy, 4, "group", 1e-12) == 0).all()


@pytest.mark.parametrize("rewards,group,scale", [
    (torch.full((8,), 0.35), 8, "group"), (torch.zeros(4), 4, "group"), (torch.zeros(4), 2, "batch"),
    (torch.full((6,), -1.0), 3, "batch"),
])
def test_constant_groups_give_exact_zeros_with_eps_zero(rewards, group, scale):
    """The hardening issue: with eps = 0 a constant group has std 0, and (r - mean) / std = 0 / 0 was NaN for every
    member (all-wrong groups are the most common ones). The advantage of a completion no better than its group's
    mean is 0, for any eps."""
    a = group_advantages(rewards, group, scale, 0.0)
    assert torch.equal(a, torch.zeros_like(rewards))


def test_close_but_really_different_rewards_are_not_zeroed():
    """Two distinct float32 rewards 0.35 and 0.3501 (d, their difference, 1.0001e-4, exact in float64) are not zeroed
    as noise: A = +-(d/2) / (d/sqrt(2) + eps) = +-0.7070068, 1/sqrt(2) less eps's relative sqrt(2) eps/d = 1.4e-4.
    The code works in float64 and rounds to float32 once: within u32 |A| of the float64 formula (bound 2 u32 |A| =
    8.4e-8; measured 1.8e-10)."""
    r = torch.tensor([0.35, 0.3501], dtype=torch.float32)
    a = group_advantages(r, 2, "group", 1e-8)
    d = float(r[1]) - float(r[0])
    x = (d / 2) / (d / math.sqrt(2) + 1e-8)
    assert abs(x - 0.7070068) < 1e-7
    torch.testing.assert_close(a.double(), torch.tensor([-x, x], dtype=torch.float64), rtol=2 * U32, atol=0)


def test_group_of_one_gives_zero():
    r = torch.tensor([0.3, 1.0, -2.0])
    for scale in ("group", "batch", "none"):
        assert (group_advantages(r, 1, scale, 1e-4) == 0).all()
    assert (group_advantages(torch.tensor([5.0]), 1, "batch", 1e-4) == 0).all()


def test_group_advantages_errors():
    with pytest.raises(ObjectiveError, match="multiple of num_samples=4"):
        group_advantages(torch.zeros(6), 4, "group", 1e-4)
    with pytest.raises(ObjectiveError, match="'group', 'batch', 'none'"):
        group_advantages(torch.zeros(4), 2, "rank", 1e-4)
    with pytest.raises(ObjectiveError, match=r"\(B,\)"):
        group_advantages(torch.zeros(2, 2), 2, "group", 1e-4)
    with pytest.raises(ObjectiveError, match="NaN"):
        group_advantages(torch.tensor([0.0, float("nan")]), 2, "group", 1e-4)
    with pytest.raises(ObjectiveError, match="num_samples"):
        group_advantages(torch.zeros(4), 0, "group", 1e-4)


# ------------------------------------------------------------------------------------------ GAE


@pytest.mark.numerics
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_data_parallel_groups_with_a_global_batch_std(scale):
    """Two processes, each with whole groups; all_reduce sums over them. Simulated with threads (a barrier
    pairs the calls): each half must equal its rows of the whole batch's advantages, for scale=batch too
    (the std of all rewards, not of the half); all_reduce is called only for scale=batch, twice.

    The bound (kind 1, float64 rewards: the code is float64 inside): torch's std of the 12 rewards against the
    all-reduced sums of the two halves, two sums of 12 terms (squared deviations <= 18.1) taken in different orders:
    <= 2 gamma_11 = 2.4e-15 relative on the variance, ~3e-15 on advantages <= 2.5; 1e-12 leaves 300x (measured 0)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0, 5.0, -2.0], dtype=torch.float64)
    whole = group_advantages(rewards, 4, scale, 1e-4)
    halves = [rewards[:4], rewards[4:]]  # one group vs two
    results, calls = run_on_two_ranks(lambda rank, all_reduce: group_advantages(halves[rank], 4, scale, 1e-4,
                                                                                all_reduce=all_reduce))
    torch.testing.assert_close(torch.cat(results), whole, atol=1e-6, rtol=0)
    assert calls == ([2, 2] if scale == "batch" else [0, 0])
    if scale == "batch":  # the local std alone would be wrong
        assert (group_advantages(halves[0], 4, scale, 1e-4) - whole[:4]).abs().max() > 1e-2


def test_gae_hand_computed_t3():
    """rewards (0, 0, 1), values (0.5, 0.6, 0.7), gamma 0.9, lam 0.8 (gamma*lam = 0.72):
    delta_2 = 1 + 0.9 * 0 - 0.7 = 0.3                  A_2 = 0.3
    delta_1 = 0 + 0.9 * 0.7 - 0.6 = 0.03               A_1 = 0.03 + 0.72 * 0.3 = 0.246
    delta_0 = 0 + 0.9 * 0.6 - 0.5 = 0.04               A_0 = 0.04 + 0.72 * 0.246 = 0.21712
    returns = A + V = (0.71712, 0.846, 1.0)."""
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, gae_gamma=0.9, gae_lambda=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]], dtype=torch.float64), rtol=0, atol=1e-12)


def _scalar_gae(rewards, values, gamma, lam):
    """Plain-Python reference on one row's valid steps only (independent of the vectorised code)."""
    adv, next_v, next_a = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_v - values[t]
        next_a = delta + gamma * lam * next_a
        next_v = values[t]
        adv[t] = next_a
    return adv


def test_gae_padding_is_ignored_and_holes_are_skipped():
    """Row 0: right padding (3 valid of 5); row 1: a hole in the middle (mask T F T T F).
    Garbage (1e6, NaN, inf) at masked positions must change nothing (exactly: the valid steps run the same float64
    operations, torch.where only selects); the valid steps must match GAE run on the compacted row (the same
    recursion in Python floats: within 1e-12, module docstring)."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(2, 5, generator=g, dtype=torch.float64)
    values = torch.randn(2, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False, False], [True, False, True, True, False]])
    adv, ret = gae(rewards, values, mask, gae_gamma=0.95, gae_lambda=0.9)
    r2, v2 = rewards.clone(), values.clone()
    r2[~mask] = torch.tensor([1e6, float("nan"), float("inf"), -1e6], dtype=torch.float64)
    v2[~mask] = torch.tensor([float("nan"), 1e6, -5.0, float("inf")], dtype=torch.float64)
    adv2, ret2 = gae(r2, v2, mask, gae_gamma=0.95, gae_lambda=0.9)
    assert torch.equal(adv2, adv) and torch.equal(ret2, ret)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    for b in range(2):
        m = mask[b]
        ref = _scalar_gae(rewards[b][m].tolist(), values[b][m].tolist(), 0.95, 0.9)
        torch.testing.assert_close(adv[b][m], torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-12)
        assert torch.equal(ret[b][m], adv[b][m] + values[b][m])  # returns = A + V, the same addition


def test_gae_terminal_reward_only_on_last_token():
    """Reward R only at the last valid token, zero values, gamma = 1: every valid token's
    return is R, and its advantage is R * lam^(steps to the end). Exact: every number is a power of two (R = 2,
    lam = 1/2), so no operation rounds."""
    rewards = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0]])
    values = torch.zeros(1, 5)
    mask = torch.tensor([[True, True, True, True, False]])
    adv, ret = gae(rewards, values, mask, gae_gamma=1.0, gae_lambda=0.5)
    assert torch.equal(adv, torch.tensor([[2 * 0.125, 2 * 0.25, 2 * 0.5, 2.0, 0.0]]))
    adv1, ret1 = gae(rewards, values, mask, gae_gamma=1.0, gae_lambda=1.0)
    assert torch.equal(ret1, torch.tensor([[2.0, 2.0, 2.0, 2.0, 0.0]]))


def test_gae_lambda_one_gamma_one_returns_are_reward_to_go():
    """gamma = lam = 1: the return is the reward-to-go (a reversed cumsum, summed in another order than GAE's
    recursion). float64, at most 6 rewards (|r| < 3.8) and 12 values (|V| < 2.1) per row: worst-case rounding
    ~2 gamma_17 x 47 ~ 2e-13 against 1e-12 (measured 4.4e-16)."""
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(3, 6, generator=g, dtype=torch.float64)
    values = torch.randn(3, 6, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 4, 1])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    adv, ret = gae(rewards, values, mask, gae_gamma=1.0, gae_lambda=1.0)
    kept = torch.where(mask, rewards, torch.zeros_like(rewards))
    to_go = kept.flip(-1).cumsum(-1).flip(-1)  # sum_{t' >= t} r_t'
    torch.testing.assert_close(ret, torch.where(mask, to_go, torch.zeros_like(to_go)), rtol=0, atol=1e-12)
    torch.testing.assert_close(adv, torch.where(mask, to_go - values, torch.zeros_like(to_go)), rtol=0, atol=1e-12)


def test_gae_errors_and_detached_outputs():
    x = torch.zeros(2, 3, requires_grad=True)
    m = torch.ones(2, 3, dtype=torch.bool)
    adv, ret = gae(x, x, m, 1.0, 0.95)
    assert not adv.requires_grad and not ret.requires_grad
    with pytest.raises(ObjectiveError, match=r"\(2, 3\).*\(2, 4\)"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), m, 1.0, 0.95)
    with pytest.raises(ObjectiveError, match="lam"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), m, 1.0, 1.5)
    with pytest.raises(ObjectiveError, match="bool"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), m.float(), 1.0, 0.95)
