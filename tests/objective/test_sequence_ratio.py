"""GSPO's sequence-level importance ratio (Zheng et al. 2025): sequence_log_ratio and gspo_token_log_ratio.

Tolerances (tests/bounds.py, kind 1). Everything is float64 (the functions keep the input's dtype), each value a few
operations on numbers of size <= 2 (a mean of <= 3 log-ratios, an exp): rounding ~1e-16. assert_close's float64
defaults (rtol = atol = 1e-7) and math.isclose's (rel 1e-9) are far above that, and far below what a pad that
leaks, a missing 1/|y| or a wrong clip moves (1e-2 to 1). The clip test compares within 1e-12 (a clip at 1 + 0.2
and an exp: ~1e-16). The advantages given per token are read at the same position as the (B,) ones: bitwise equal.
"""

import math

import pytest
import torch

from prefzoo.objective import ObjectiveError, clipped_surrogate_loss, gspo_token_log_ratio, sequence_log_ratio


def _padded():
    """Row 0: 3 valid tokens with log(pi/pi_old) = (0.3, -0.1, 0.4); row 1: 1 valid token with 0.2, then two pads
    holding garbage (log-ratios 5.0 and -7.0, and a NaN in old_logps) that must never enter."""
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, 3.0, -9.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.3, -1.9, -0.9], [-0.9, -2.0, float("nan")]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return logps, old, mask


def test_the_sequence_ratio_is_the_geometric_mean_over_valid_tokens_only():
    """s_0 = exp((0.3 - 0.1 + 0.4)/3) = exp(0.2); s_1 = exp(0.2 / 1) = exp(0.2) -- the pads (5.0, -7.0, NaN)
    change nothing: with them the mean of row 1 would be (0.2 + 5 - 7)/3 = -0.6 (or NaN)."""
    logps, old, mask = _padded()
    log_s = sequence_log_ratio(logps, old, mask)
    torch.testing.assert_close(log_s.detach(), torch.tensor([0.2, 0.2], dtype=torch.float64))
    assert math.isclose(float(log_s[1].detach().exp()), math.exp(0.2))


def test_the_sequence_ratio_gradient_is_one_over_length_on_valid_tokens_and_zero_on_pads():
    """d log s_i / d logps_{i,t} = 1/|y_i| on valid tokens: 1/3 on row 0, 1 on row 1's token, 0 on its pads."""
    logps, old, mask = _padded()
    sequence_log_ratio(logps, old, mask).sum().backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[1 / 3] * 3, [1.0, 0.0, 0.0]], dtype=torch.float64))


def test_a_row_without_valid_tokens_has_ratio_one():
    logps = torch.zeros(1, 2, dtype=torch.float64)
    assert sequence_log_ratio(logps, logps + 3.0, torch.zeros(1, 2, dtype=torch.bool)).tolist() == [0.0]


def test_gspo_token_ratio_has_the_sequence_value_and_the_token_gradient():
    """s_{i,t} = sg[s_i] pi_t / sg[pi_t]: its value is s_i on every valid token (exp(0.2) here), 0 in log on
    pads; d s_{i,t} / d logps_{i,t'} = s_i [t = t'] (the token's own log-prob only, scaled by s_i)."""
    logps, old, mask = _padded()
    log_st = gspo_token_log_ratio(logps, old, mask)
    torch.testing.assert_close(log_st.detach(), torch.tensor([[0.2] * 3, [0.2, 0.0, 0.0]], dtype=torch.float64))
    log_st.exp()[0, 1].backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, math.exp(0.2), 0.0], [0.0] * 3], dtype=torch.float64))


def test_gspo_and_gspo_token_have_the_same_gradient_when_the_advantage_is_per_sequence():
    """Loss GSPO: -(1/G) sum_i s_i A_i (unclipped: eps large). Its gradient in logps_{i,t} is -(1/G) s_i A_i / |y_i|.
    GSPO-token: -(1/G) sum_i (1/|y_i|) sum_t s_{i,t} A_i, gradient -(1/G) A_i s_i / |y_i| as well (Zheng et al.
    2025, sec. 4.3: "numerically identical" when A_{i,t} = A_i). A = (1.5, -2): row 0 gets -(1/2) e^0.2 1.5 / 3,
    row 1 -(1/2) e^0.2 (-2) / 1."""
    logps, old, mask = _padded()
    adv = torch.tensor([1.5, -2.0], dtype=torch.float64)
    seq_loss, _ = clipped_surrogate_loss(sequence_log_ratio(logps, old, mask)[:, None], torch.zeros(2, 1, dtype=torch.float64),
                                         adv[:, None], torch.ones(2, 1, dtype=torch.bool), 0.9, 10.0)
    (seq_loss.sum() / 2).backward()
    g_seq, logps.grad = logps.grad.clone(), None
    tok_loss, _ = clipped_surrogate_loss(gspo_token_log_ratio(logps, old, mask), torch.zeros_like(old), adv, mask, 0.9, 10.0)
    ((tok_loss.sum(-1) / mask.sum(-1)).sum() / 2).backward()
    e = math.exp(0.2)
    want = torch.tensor([[-0.5 * e * 1.5 / 3] * 3, [-0.5 * e * -2.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(g_seq, want)
    torch.testing.assert_close(logps.grad, want)


def test_shapes_are_checked():
    with pytest.raises(ObjectiveError, match="old_logps"):
        sequence_log_ratio(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3, dtype=torch.bool))


def test_the_sequence_clip_by_hand_on_a_padded_batch():
    """Row 0: log-ratios (0.2, 0.1, pad) -> GSPO's s = exp(0.15) = 1.1618 (mean), the whole ratio exp(0.3) = 1.3499
    (sum); row 1: (-0.4, pad, pad) -> s = exp(-0.4) = 0.6703 either way. Advantages (B,) = (1, -1), eps 0.2.
    Mean: row 0 unclipped (1.1618 < 1.2): loss -1.1618 on its 2 tokens; row 1: min(0.6703 * -1, 0.8 * -1) = -0.8,
    clipped: loss 0.8 on its token. Sum: row 0 min(1.3499, 1.2) = 1.2, clipped: loss -1.2. The same with the
    advantages given per token (read at each row's last valid token). Shapes that disagree are refused. In float64
    within 1e-12 (module docstring; the float32 version of this test held float32 literals within assert_close's
    defaults)."""
    from prefzoo.objective import sequence_clipped_surrogate_loss

    d = torch.float64
    mask = torch.tensor([[True, True, False], [True, False, False]])
    old = torch.zeros(2, 3, dtype=d)
    logps = torch.tensor([[0.2, 0.1, 5.0], [-0.4, 7.0, 7.0]], dtype=d)
    adv = torch.tensor([1.0, -1.0], dtype=d)
    loss, clipped = sequence_clipped_surrogate_loss(logps, old, adv, mask, 0.2, 0.2)
    s0 = math.exp(0.15)
    torch.testing.assert_close(loss, torch.tensor([[-s0, -s0, 0.0], [0.8, 0.0, 0.0]], dtype=d), rtol=0, atol=1e-12)
    assert clipped.tolist() == [[False, False, False], [True, False, False]]
    per_token = torch.where(mask, adv[:, None], 0.0)
    again, _ = sequence_clipped_surrogate_loss(logps, old, per_token, mask, 0.2, 0.2)
    assert torch.equal(again, loss)
    whole, clipped = sequence_clipped_surrogate_loss(logps, old, adv, mask, 0.2, 0.2, length_normalised=False)
    torch.testing.assert_close(whole, torch.tensor([[-1.2, -1.2, 0.0], [0.8, 0.0, 0.0]], dtype=d), rtol=0, atol=1e-12)
    assert clipped.tolist() == [[True, True, False], [True, False, False]]
    with pytest.raises(ObjectiveError, match="advantages has shape"):
        sequence_clipped_surrogate_loss(logps, old, torch.ones(3), mask, 0.2, 0.2)
