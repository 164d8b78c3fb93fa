"""prefzoo.objective.leave_one_out_advantages: RLOO's baseline b_i = mean_{j != i} r_j (Kool et al. 2019).

Tolerances (tests/bounds.py, kind 1). The function centres in float64 and rounds to the rewards' dtype: a float32
result is the exact advantage rounded once or twice (the float64 centring, rounded to float32, then times G/(G-1)):
within 2 u32 relative (u32 = 2**-24); float64 results are compared within 1e-12 (sums of 6 rewards of size <= 2.4:
~1e-15; 1e-12 leaves 1000x).
"""

import pytest
import torch

from prefzoo.objective import ObjectiveError, group_advantages, leave_one_out_advantages
from tests.bounds import U32


def test_hand_made_group_where_every_other_member_is_equal():
    """Group [1, 3, 3, 3] (G = 4):
    i = 0: the others are all 3, b_0 = (3 + 3 + 3)/3 = 3,        A_0 = 1 - 3 = -2;
    i = 1..3: b = (1 + 3 + 3)/3 = 7/3,                          A = 3 - 7/3 = 2/3.
    Second group [0, 2, 4, 10]: b_0 = 16/3 -> A_0 = -16/3; b_1 = 14/3 -> A_1 = 2 - 14/3 = -8/3;
    b_2 = 4 -> A_2 = 0; b_3 = 2 -> A_3 = 8. (Check: A_i = G/(G-1) (r_i - mean) with mean 4: 4/3 * [-4, -2, 0, 6].)
    The centred rewards (-1.5, 0.5, -4, -2, 0, 6) are exact in float32, so only the last rounding happens: within
    2 u32 relative of the exact values (module docstring; measured 3.0e-8 relative), the 0 exact."""
    r = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0, 2.0, 4.0, 10.0])
    a = leave_one_out_advantages(r, 4)
    want = torch.tensor([-2.0, 2 / 3, 2 / 3, 2 / 3, -16 / 3, -8 / 3, 0.0, 8.0], dtype=torch.float64)
    torch.testing.assert_close(a.double(), want, rtol=2 * U32, atol=0)
    assert a.dtype == torch.float32


def test_group_of_two_is_the_difference_of_the_pair():
    """G = 2: b_1 = r_2 and b_2 = r_1, so A = (r_1 - r_2, r_2 - r_1) = (0.75, -0.75) for (1.0, 0.25)."""
    a = leave_one_out_advantages(torch.tensor([1.0, 0.25], dtype=torch.float64), 2)
    assert a.tolist() == [0.75, -0.75] and a.dtype == torch.float64


def test_a_constant_group_gets_exact_zeros_even_at_float32_rounding():
    """Eight float32 rewards of 0.35 (and a group whose members differ by one ulp): every other member is
    (numerically) equal to the sample itself, so the advantage is exactly 0, not a rounding residue."""
    r = torch.full((8,), 0.35)
    r[1] = torch.nextafter(r[0], torch.tensor(1.0))
    assert torch.equal(leave_one_out_advantages(r, 8), torch.zeros(8))


def test_it_is_the_group_centred_advantage_scaled_by_g_over_g_minus_1():
    """sum_{j != i} r_j = G mean - r_i, so r_i - (G mean - r_i)/(G-1) = G/(G-1) (r_i - mean): GRPO's
    scale_rewards="none" advantage times G/(G-1) (the reason RLOO's gradient is unbiased and GRPO's shrunk). Also
    against the definition itself, r_i - (sum_g r - r_i) / (G - 1), since the function is written as the former.
    float64, within 1e-12 (module docstring; measured 2e-16)."""
    r = torch.randn(24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = leave_one_out_advantages(r, 6)
    torch.testing.assert_close(a, group_advantages(r, 6, "none", 0.0) * 6 / 5, rtol=0, atol=1e-12)
    g = r.view(-1, 6)
    torch.testing.assert_close(a, (g - (g.sum(1, keepdim=True) - g) / 5).reshape(-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("rewards,group,needle", [
    (torch.ones(4), 1, "at least 2"),
    (torch.ones(6), 4, "not a multiple"),
    (torch.ones(2, 2), 2, "(B,)"),
    (torch.tensor([1.0, float("nan")]), 2, "NaN"),
])
def test_bad_inputs_say_what_to_fix(rewards, group, needle):
    with pytest.raises(ObjectiveError, match=None) as err:
        leave_one_out_advantages(rewards, group)
    assert needle in str(err.value)
