"""The policy-loss options TRL 1.16 / verl 0.9.1 have: INTELLECT-2's two-sided clip, VESPO's kernel, DeepSeek-V3.2's
off-policy sequence mask, the high-entropy token mask, LUSPO's length-weighted reduction and DPPO's two thresholds.
Each against values derived by hand in the test's docstring from the papers' formulas (not from the code).

Tolerances (tests/bounds.py, kind 1). Everything is float64 and compared with the hand formula evaluated in Python
(math) on the same inputs: each value is a handful of operations (a log, an exp, a product of <= 3 factors, a sum of
<= 5 terms) on numbers <= 30, so the rounding is ~1e-14 relative at most; 1e-12 leaves 100x. Masks and counts are
exact (compared with ==). The docstrings' printed decimals are for the reader; the assertions use the formulas.
"""

from __future__ import annotations

import math

import pytest
import torch

from prefzoo.objective import (ObjectiveError, aggregate_loss, clipped_surrogate_loss, dppo_loss, high_entropy_mask,
                               loss_normaliser, off_policy_sequence_mask, vespo_loss)

F64 = torch.float64
EXACT = 1e-12


def _rows(log_ratios, logp=-0.7):
    """logps (every token log p = ``logp``, with grad) and old_logps = logps - log_ratio, float64."""
    lr = torch.tensor(log_ratios, dtype=F64)
    logps = torch.full_like(lr, logp).requires_grad_(True)
    return logps, (logps.detach() - lr)


# ---------------------------------------------------------------------------------------------- two-sided clip
def test_two_sided_clip_caps_the_unclipped_ratio_for_negative_advantages():
    """eps 0.2 both sides, delta = 1.5. objective = min(min(r, 1.5) A, clip(r, 0.8, 1.2) A), loss = -objective:
    a. r = 2.0, A = -1: min(-1.5, -1.2) = -1.5, the capped branch, a constant: loss 1.5, gradient 0, counted clipped
       (PPO without delta: min(-2.0, -1.2) = -2.0, loss 2.0 and d loss / d log p = -A r = 2.0);
    b. r = 1.3, A = -1: 1.3 < delta: min(-1.3, -1.2) = -1.3: loss 1.3, gradient -A r = 1.3, not clipped;
    c. r = 2.0, A = +1: min(1.5, 1.2) = 1.2, PPO's clip: loss -1.2, gradient 0, clipped;
    d. r = 0.5, A = +1: min(0.5, 0.8) = 0.5: loss -0.5, gradient -A r = -0.5;
    e. a padded position (mask False): loss 0, not clipped."""
    logps, old = _rows([[math.log(2.0), math.log(1.3), math.log(2.0), math.log(0.5), math.log(2.0)]])
    a = torch.tensor([[-1.0, -1.0, 1.0, 1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, True, False]])
    loss, clipped = clipped_surrogate_loss(logps, old, a, mask, 0.2, 0.2, ratio_max=1.5)
    assert loss[0].tolist() == pytest.approx([1.5, 1.3, -1.2, -0.5, 0.0], abs=EXACT)
    assert clipped[0].tolist() == [True, False, True, False, False]
    loss.sum().backward()
    assert logps.grad[0].tolist() == pytest.approx([0.0, 1.3, 0.0, -0.5, 0.0], abs=EXACT)
    plain, _ = clipped_surrogate_loss(logps.detach(), old, a, mask, 0.2, 0.2)
    assert plain[0, 0].item() == pytest.approx(2.0, abs=EXACT)  # what the cap removes
    with pytest.raises(ObjectiveError, match="ratio_max must be > 1.0"):
        clipped_surrogate_loss(logps, old, a, mask, 0.2, 0.2, ratio_max=1.0)


# ------------------------------------------------------------------------------------------------------- VESPO
def _phi(w, k, lam):
    return w ** k * math.exp(lam * (1 - w))


def test_vespo_weights_each_sequence_by_the_gamma_kernel_of_its_importance_weight():
    """phi(w) = w^k e^{lambda (1 - w)}, (k, lambda) = (2, 3) for A >= 0 and (3, 2) for A < 0; loss -phi A log p with
    log p = -0.7 on every token; w = the PRODUCT of the row's token ratios over its counted tokens.
    Row 1: ratios 1.2, 0.9 -> w = 1.08, A = +1: phi = 1.08^2 e^{-0.24} = 0.9175227; per token loss 0.7 phi,
           d loss / d log p = -phi.
    Row 2: ratios 2, 1.5 and a padded token (ratio 100, not counted) -> w = 3, A = -1: phi = 27 e^{-4} = 0.4945222 <
           1/2 (counted in ``below_half``); loss -0.7 phi per token, gradient +phi.
    Row 3: ratios 1, 1 (the first pass) -> w = 1, phi = 1 for either sign: REINFORCE, gradient -A = -0.5.
    Row 4: a token log-ratio of 30 is clamped to 20 (TRL and the authors), log w = 20 -> phi = exp(3 + 40 - 3 e^20)
           underflows to exactly 0: no NaN, no gradient."""
    lr = [[math.log(1.2), math.log(0.9), 0.0], [math.log(2.0), math.log(1.5), math.log(100.0)], [0.0, 0.0, 0.0],
          [30.0, 0.0, 0.0]]
    logps, old = _rows(lr)
    a = torch.tensor([1.0, -1.0, 0.5, 1.0], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, True, False], [True, True, False], [True, True, False]])
    loss, phi, below = vespo_loss(logps, old, a, mask)
    phis = [_phi(1.08, 2, 3), _phi(3.0, 3, 2), 1.0, 0.0]
    assert phis[0] == pytest.approx(0.9175227, abs=5e-8) and phis[1] == pytest.approx(0.4945222, abs=5e-8)
    for i, (p, adv) in enumerate(zip(phis, a.tolist())):
        assert loss[i].tolist() == pytest.approx([-p * adv * -0.7] * 2 + [0.0], abs=EXACT)
        assert phi[i].tolist() == pytest.approx([p, p, 0.0], abs=EXACT)
    assert below[:, 0].tolist() == [False, True, False, True]
    loss.sum().backward()
    assert logps.grad[:, 0].tolist() == pytest.approx([-phis[0], phis[1], -0.5, 0.0], abs=EXACT)
    assert not torch.isnan(logps.grad).any()


def test_vespo_folds_the_samplers_token_weights_into_w():
    """Row 1 of the test above with the sampler correction's token weights (0.5, 1.0) (pi_old / pi_sampler): w =
    1.08 * 0.5 = 0.54, phi = 0.54^2 e^{3 * 0.46} = 1.1590813 (the kernel rises above 1 below its peak w = k / lambda
    = 2/3). A weight at a padded position (0.001) does not count."""
    logps, old = _rows([[math.log(1.2), math.log(0.9), 0.0]])
    mask = torch.tensor([[True, True, False]])
    w_is = torch.tensor([[0.5, 1.0, 0.001]], dtype=F64)
    _, phi, _ = vespo_loss(logps, old, torch.tensor([1.0], dtype=F64), mask, is_weights=w_is)
    assert _phi(0.54, 2, 3) == pytest.approx(1.1590813, abs=5e-8)
    assert phi[0, 0].item() == pytest.approx(_phi(0.54, 2, 3), abs=EXACT)
    with pytest.raises(ObjectiveError, match="lambda_neg must be > 0"):
        vespo_loss(logps, old, torch.tensor([1.0], dtype=F64), mask, lambda_neg=0.0)


# ------------------------------------------------------------------------------------------- off-policy mask
def test_off_policy_sequence_mask_drops_only_negative_advantage_sequences_far_from_the_sampler():
    """threshold 0.1 nats per token; d_i = mean over counted tokens of log pi_sampling - log pi_theta:
    row 1, A = -1: differences (0.3, 0.1) -> d = 0.2 > 0.1: dropped;
    row 2, A = -1: (0.05, 0.05) and a padded token with 5.0 -> d = 0.05 (not 1.7): kept;
    row 3, A = +1: (1, 1) -> d = 1 but A >= 0: kept;
    row 4, A = -1: (NaN, 0.3): the engine could not score a token, it counts 0 (TRL) -> d = 0.15: dropped;
    row 5, A = 0: (1, 1): kept (A >= 0)."""
    logps = torch.full((5, 3), -1.0, dtype=F64)
    diff = torch.tensor([[0.3, 0.1, 0.0], [0.05, 0.05, 5.0], [1.0, 1.0, 0.0], [float("nan"), 0.3, 0.0],
                         [1.0, 1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, False]] * 5)
    keep, d = off_policy_sequence_mask(logps, logps + diff, torch.tensor([-1.0, -1.0, 1.0, -1.0, 0.0], dtype=F64),
                                       mask, 0.1)
    assert d.tolist() == pytest.approx([0.2, 0.05, 1.0, 0.15, 1.0], abs=EXACT)
    assert keep[:, 0].tolist() == [False, True, True, False, True]
    assert not keep[:, 2].any()  # padding is never kept
    assert (keep[:, 0] == keep[:, 1]).all()  # a whole sequence


# -------------------------------------------------------------------------------------------- high-entropy mask
def test_high_entropy_mask_keeps_the_top_quantile_of_the_counted_tokens():
    """Counted entropies {0.1, 0.5, 0.9, 1.3, 2.0} (two rows) and two padded positions holding 5.0, which must not
    enter the quantile. torch.quantile interpolates linearly between order statistics (TRL's call too):
    rho = 0.2: tau = q(0.8), position 0.8 * 4 = 3.2 -> 1.3 + 0.2 * (2.0 - 1.3) = 1.44: only 2.0 kept;
    rho = 0.5: tau = q(0.5) = 0.9: 0.9, 1.3, 2.0 kept (H >= tau);
    rho = 0: tau = the max: 2.0 only; rho = 1: every counted token."""
    entropy = torch.tensor([[0.1, 1.3, 5.0], [2.0, 0.9, 0.5]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    entropy[1, 2] = 0.5
    expect = {0.2: [[False, False, False], [True, False, False]], 0.5: [[False, True, False], [True, True, False]],
              0.0: [[False, False, False], [True, False, False]], 1.0: mask.tolist()}
    for rho, want in expect.items():
        assert high_entropy_mask(entropy, mask, rho).tolist() == want, rho
    with pytest.raises(ObjectiveError, match="quantile must be >= 0.0 and <= 1.0"):
        high_entropy_mask(entropy, mask, 1.5)


# -------------------------------------------------------------------------------------------------------- LUSPO
def test_sequence_sum_weights_each_sequences_loss_by_its_length():
    """LUSPO: a sequence loss l_i put on each of its |y_i| tokens, summed per sequence, averaged over sequences:
    (1/B) sum_i |y_i| l_i. l = (2, 4) on rows of 3 and 1 counted tokens: (3 * 2 + 1 * 4) / 2 = 5; GSPO's
    sequence_mean gives (2 + 4) / 2 = 3. The normaliser of a micro-batch is its number of rows (B = 2), so two
    micro-batches of one row each give the same total: 6/2 + 4/2 = 5."""
    values = torch.tensor([[2.0, 2.0, 2.0], [4.0, 7.0, 7.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert loss_normaliser(mask, "sequence_sum") == 2.0
    assert aggregate_loss(values, mask, "sequence_sum", 2.0).item() == pytest.approx(5.0, abs=EXACT)
    assert aggregate_loss(values, mask, "sequence_mean", 2.0).item() == pytest.approx(3.0, abs=EXACT)
    split = sum(aggregate_loss(values[i:i + 1], mask[i:i + 1], "sequence_sum", 2.0).item() for i in range(2))
    assert split == pytest.approx(5.0, abs=EXACT)


# ------------------------------------------------------------------------------------------ DPPO's two thresholds
def test_dppo_thresholds_apply_to_their_own_sign():
    """TV, delta_low = 0.1 (A < 0), delta_high = 0.3 (A > 0). q = 0.5:
    p = 0.38, A = -1: p - q = -0.12 < -0.1: dropped (with one delta 0.3 it would be kept);
    p = 0.75, A = +1: p - q = 0.25 <= 0.3: kept (with one delta 0.1 it would be dropped)."""
    logps = torch.tensor([[math.log(0.38), math.log(0.75)]], dtype=F64)
    old = torch.full_like(logps, math.log(0.5))
    a = torch.tensor([[-1.0, 1.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert dppo_loss(logps, old, a, mask, "tv", 0.1, 0.3)[1][0].tolist() == [True, False]
    assert dppo_loss(logps, old, a, mask, "tv", 0.3, 0.3)[1][0].tolist() == [False, False]
    assert dppo_loss(logps, old, a, mask, "tv", 0.1, 0.1)[1][0].tolist() == [True, True]
