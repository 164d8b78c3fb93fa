"""The off-policy correction of a rollout drawn by a sampler other than the trainer (issue 29, item 1): truncated (TIS)
and masked (MIS, IcePop) importance weights w = pi_trainer / pi_sampler at token and sequence level, their metrics,
and the top-k / top-p support that a sampler renormalises over. Every expected value is derived by hand in the test's
docstring from the definitions (Yao et al. 2025; Liu et al. 2025; Holtzman et al. 2020), not read off the code.

Tolerances (tests/bounds.py, kind 1 in float32). correction_log_ratio and support_log_mass compute in float32 by
design, whatever the inputs' dtype, so a weight, a metric or a log-mass is a float32 computation compared with its
hand value. Every operation rounds by at most u32 = 6e-8 relative, exp and log by at most 1 ulp (2 u32: glibc's and
SLEEF's); an absolute error e in a log-ratio becomes a relative error e of its exp.

* :data:`F32`, weights and metrics: the worst chain is the sequence weight exp(ln 0.5 + ln 0.5): two log-probs
  rounded (0.69 u32 each), their sum (1.39 u32), exp (2 u32): 4.8 u32; the k3 metric, mean(r - 1 - delta) with r = 2
  and 1/2, is 4.6 u32 absolute. Bound 12 u32 (7.2e-7) relative to the largest magnitude in the chain, 2.5x the count
  (it was torch.allclose's rtol 1e-5, and rel 1e-6 / abs 1e-6 in the metrics).
* :data:`LOG_MASS`, log Z = logsumexp(kept) - logsumexp(all) of float32 logits ln p: p and its log rounded move a
  logit by <= (1 + 2 x 2.31) u32 (|ln p| <= 2.31), log Z by <= 2 (1 - Z) <= 1.2 times that, 6.7 u32; each logsumexp
  rounds x - max (1.39 u32), exp (2 u32), a sum of 4 (3 u32), log (2 x 1.39 u32) and + max (0.4 u32), 10 u32: 27 u32
  in all; bound 32 u32 = 1.9e-6 absolute (it was atol 1e-6 plus rtol 1e-5, 4.6e-6 at ln 0.7).

Measured (2026-12-06, 1 and 2 threads): every weight and metric 0 to 0.7 u32 off, the log-masses 0.47 u32.
"""

from __future__ import annotations

import math

import pytest
import torch

from prefzoo.objective import (CORRECTION_MODES, ObjectiveError, correction_metrics, correction_weights,
                               support_log_mass, support_mask)
from tests.bounds import U32

LN = math.log
NAN = float("nan")
#: a float32 weight or metric against its hand value, relative to the largest magnitude in its chain (module docstring)
F32 = 12 * U32
#: a float32 log-mass against its hand value, absolute (module docstring)
LOG_MASS = 32 * U32


def assert_weights(w, expected):
    """``w`` within :data:`F32` of ``expected``, in float64 (relative: each weight is its chain's largest value)."""
    torch.testing.assert_close(w.double(), torch.tensor(expected, dtype=torch.float64), rtol=F32, atol=0)


def _token_case():
    """One row, five positions: trainer - sampler log-ratios ln 0.25, ln 2, ln 4, (sampler NaN), (padding)."""
    trainer = torch.tensor([[LN(0.25), LN(2.0), LN(4.0), -1.0, 5.0]])
    sampler = torch.tensor([[0.0, 0.0, 0.0, NAN, NAN]])
    mask = torch.tensor([[True, True, True, True, False]])
    return trainer, sampler, mask


def test_token_truncate_clamps_each_token_into_the_band():
    """w = exp(delta) = 0.25, 2, 4; the NaN sampler log-prob counts as delta = 0 (w = 1, TRL's convention); padding
    w = 1. Band [0.5, 3]: 0.25 -> 0.5 and 4 -> 3 (both rejected), 2 and 1 kept."""
    w, rejected = correction_weights(*_token_case(), "token_truncate", clip_min=0.5, clip_max=3.0)
    assert_weights(w, [[0.5, 2.0, 3.0, 1.0, 1.0]])
    assert rejected.tolist() == [[True, False, True, False, False]]


def test_token_mask_zeroes_tokens_outside_the_band():
    """IcePop-style band [0.5, 2]: 0.25 < 0.5 -> 0, 2 is inside (the ends belong to the band) -> 2, 4 > 2 -> 0."""
    w, rejected = correction_weights(*_token_case(), "token_mask", clip_min=0.5, clip_max=2.0)
    assert_weights(w, [[0.0, 2.0, 0.0, 1.0, 1.0]])
    assert rejected.tolist() == [[True, False, True, False, False]]


def test_an_unbounded_end_is_no_bound():
    """clip_max=None: nothing is truncated from above; token_truncate without either end is the plain ratio."""
    w, rejected = correction_weights(*_token_case(), "token_truncate", clip_min=None, clip_max=None)
    assert_weights(w, [[0.25, 2.0, 4.0, 1.0, 1.0]])
    assert not rejected.any()


def _sequence_case():
    """Three rows. Row 0: ln 2 + ln 3 -> W = 6. Row 1: 2 x ln 0.5 -> W = 0.25. Row 2: ln 2 (policy), ln 100 (an
    environment's token: not counted), ln 2 (policy) -> W = 4, not 400."""
    trainer = torch.tensor([[LN(2.0), LN(3.0), 0.0], [LN(0.5), LN(0.5), 0.0], [LN(2.0), LN(100.0), LN(2.0)]])
    sampler = torch.zeros(3, 3)
    mask = torch.tensor([[True, True, False], [True, True, False], [True, False, True]])
    return trainer, sampler, mask


def test_sequence_truncate_uses_the_whole_completions_ratio_on_every_token():
    """Band [0.3, 3]: W = 6 -> 3 on row 0's tokens, 0.25 -> 0.3 on row 1's, 4 -> 3 on row 2's policy tokens; 1 at
    the padding and at the environment's token."""
    w, rejected = correction_weights(*_sequence_case(), "sequence_truncate", clip_min=0.3, clip_max=3.0)
    assert_weights(w, [[3.0, 3.0, 1.0], [0.3, 0.3, 1.0], [3.0, 1.0, 3.0]])
    assert rejected.tolist() == [[True, True, False], [True, True, False], [True, False, True]]


def test_sequence_mask_drops_whole_sequences():
    """Band [0.2, 5]: W = 6 > 5 -> row 0 dropped (0); 0.25 and 4 are inside -> kept as they are."""
    w, rejected = correction_weights(*_sequence_case(), "sequence_mask", clip_min=0.2, clip_max=5.0)
    assert_weights(w, [[0.0, 0.0, 1.0], [0.25, 0.25, 1.0], [4.0, 1.0, 4.0]])
    assert rejected.any(-1).tolist() == [True, False, False]


def test_a_matched_sampler_gets_weight_one_in_every_mode():
    """trainer == sampler: delta = 0 everywhere, w = 1 in all four modes, nothing rejected."""
    logps = torch.log(torch.tensor([[0.3, 0.6, 0.9]]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    for mode in CORRECTION_MODES:
        w, rejected = correction_weights(logps, logps.clone(), mask, mode, clip_min=0.5, clip_max=2.0)
        assert torch.equal(w, torch.ones(1, 3)) and not rejected.any()


def test_the_weights_are_detached():
    trainer = torch.tensor([[0.1, -0.2]], requires_grad=True)
    w, _ = correction_weights(trainer, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "token_truncate")
    assert not w.requires_grad


@pytest.mark.parametrize("kwargs,needle", [
    (dict(mode="token"), "mode"), (dict(mode="token_truncate", clip_max=0.0), "clip_max"),
    (dict(mode="token_mask", clip_min=2.0, clip_max=1.0), "band"),
])
def test_bad_settings_are_named(kwargs, needle):
    trainer, sampler, mask = _token_case()
    with pytest.raises(ObjectiveError, match=needle):
        correction_weights(trainer, sampler, mask, **kwargs)


def test_metrics_by_hand():
    """delta = ln 2, -ln 2 (r = 2, 0.5). k1 = mean(-delta) = 0; k3 = mean(r - 1 - delta) = ((1 - ln 2) + (-0.5 +
    ln 2)) / 2 = 0.25; the mean ratio (2 + 0.5) / 2 = 1.25. Weights (token_truncate, band [1, 3]) 2 -> 2, 0.5 -> 1:
    mean 1.5, ESS = (2 + 1)^2 / (2 (4 + 1)) = 0.9, one of two tokens rejected. k1 is exactly 0 (rounding to nearest
    is symmetric: the two float32 deltas are exact negatives); the rest within F32 of the chain's largest value, 2."""
    trainer = torch.tensor([[LN(2.0), -LN(2.0)]])
    sampler = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    w, rejected = correction_weights(trainer, sampler, mask, "token_truncate", clip_min=1.0, clip_max=3.0)
    m = correction_metrics(trainer, sampler, mask, w, rejected)
    assert m["mismatch_k1"] == 0.0
    for key, value in (("mismatch_k3", 0.25), ("ratio_mean", 1.25), ("weight_mean", 1.5), ("weight_max", 2.0),
                       ("ess", 0.9)):
        assert m[key] == pytest.approx(value, rel=0, abs=2 * F32), key
    assert m["weight_min"] == 1.0 and m["frac_rejected"] == 0.5  # the clip's bound; 1 of 2


def test_sequence_metrics_count_sequences():
    """sequence_mask, band [0.2, 5] on the three rows above: weights per sequence 0, 0.25, 4: one of three rejected;
    ESS = (4.25)^2 / (3 (0.0625 + 16)) = 18.0625 / 48.1875 = 0.37484. The float32 weights are within F32 of 0.25
    and 4 (their mean 1.4167 and the ESS move by less); 1/3 is one float32 rounding (u32 relative)."""
    trainer, sampler, mask = _sequence_case()
    w, rejected = correction_weights(trainer, sampler, mask, "sequence_mask", clip_min=0.2, clip_max=5.0)
    m = correction_metrics(trainer, sampler, mask, w, rejected, sequence_level=True)
    assert m["frac_rejected"] == pytest.approx(1 / 3, rel=F32, abs=0)
    assert m["weight_mean"] == pytest.approx(4.25 / 3, rel=0, abs=4 * F32)
    assert m["ess"] == pytest.approx(18.0625 / 48.1875, rel=0, abs=F32)


def test_monte_carlo_the_weight_turns_a_sampler_expectation_into_the_trainers():
    """The reason for the weight: E_{y ~ sampler}[w(y) f(y)] = E_{y ~ trainer}[f(y)]. Trainer [0.6, 0.3, 0.1], sampler
    [0.2, 0.3, 0.5], f = (1, 2, 3): E_trainer f = 0.6 + 0.6 + 0.3 = 1.5 exactly; 200,000 draws from the sampler,
    weighted by the untruncated per-token ratio, give it within 4 standard errors; the unweighted mean (2.3) does not.

    Kind 4: the seed is fixed and the bound is 4 standard errors (s.e. 0.0022): a correct weight fails it for 6e-5 of
    seeds (the estimate is bounded by 3, n = 200,000: normal to well within that). Measured -0.09 s.e. The mean and
    s.e. are taken in float64 (the weights' float32 rounding, F32, is 5e-4 s.e.). The unweighted mean is 0.8 = 460 s.e.
    away."""
    g = torch.Generator().manual_seed(0)
    trainer_p, sampler_p, f = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.3, 0.5]), torch.tensor([1., 2., 3.])
    y = torch.multinomial(sampler_p, 200_000, replacement=True, generator=g)
    w, _ = correction_weights(trainer_p.log()[y][None], sampler_p.log()[y][None],
                              torch.ones(1, len(y), dtype=torch.bool), "token_truncate", clip_max=None)
    estimate = w[0].double() * f[y].double()
    se = float(estimate.std() / math.sqrt(len(y)))
    assert abs(float(estimate.mean()) - 1.5) < 4 * se
    assert abs(float(f[y].mean()) - 1.5) > 0.5


# ----------------------------------------------------------------------------------------------- top-k / top-p support
PROBS = torch.tensor([0.5, 0.25, 0.125, 0.125])


def test_nucleus_support_by_hand():
    """probs 0.5, 0.25, 0.125, 0.125; mass before each token 0, 0.5, 0.75, 0.875. top_p = 0.7 keeps the tokens whose
    mass before is < 0.7: {0, 1}, mass 0.75. top_p = 1: all. top_p = 0.3: {0} (the most likely always stays)."""
    logits = PROBS.log()[None]
    assert support_mask(logits, 0.7).tolist() == [[True, True, False, False]]
    assert support_mask(logits, 1.0).all()
    assert support_mask(logits, 0.3).tolist() == [[True, False, False, False]]


def test_top_k_then_top_p_by_hand():
    """probs 0.4, 0.3, 0.2, 0.1. top_k = 2 keeps {0, 1} (mass 0.7); top_p = 0.5 then applies to the renormalised
    (4/7, 3/7): the second token's mass before is 4/7 = 0.571 >= 0.5, so only {0} is left. Log-masses within
    LOG_MASS (module docstring)."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()[None]
    assert support_mask(logits, 1.0, 2).tolist() == [[True, True, False, False]]
    assert support_mask(logits, 0.5, 2).tolist() == [[True, False, False, False]]
    labels = torch.tensor([[0, 1]])
    both = logits[:, None].expand(1, 2, 4)
    mass = support_log_mass(both, labels, top_p=1.0, top_k=2)
    torch.testing.assert_close(mass.double(), torch.tensor([[LN(0.7), LN(0.7)]], dtype=torch.float64), rtol=0,
                               atol=LOG_MASS)
    mass = support_log_mass(both, labels, top_p=0.5, top_k=2)  # {0}; label 1 is put back in: 0.4 + 0.3
    torch.testing.assert_close(mass.double(), torch.tensor([[LN(0.4), LN(0.7)]], dtype=torch.float64), rtol=0,
                               atol=LOG_MASS)


def test_support_log_mass_by_hand_with_the_temperature():
    """top_p = 0.7 over PROBS: log Z = ln 0.75 for a kept label; a label outside (token 2) is added: ln 0.875.
    At temperature 2 the logits ln p / 2 give probabilities proportional to sqrt(p): 0.7071, 0.5, 0.3536, 0.3536
    (sum 1.9142) -> 0.3694, 0.2612, 0.1847, 0.1847; mass before 0, 0.369, 0.631, 0.815: top_p = 0.7 keeps three,
    log Z = ln 0.8153 (computed here in float64). Within LOG_MASS (module docstring; temperature 2 divides exactly)."""
    logits = PROBS.log()[None, None].expand(1, 2, 4)
    labels = torch.tensor([[0, 2]])
    torch.testing.assert_close(support_log_mass(logits, labels, top_p=0.7).double(),
                               torch.tensor([[LN(0.75), LN(0.875)]], dtype=torch.float64), rtol=0, atol=LOG_MASS)
    root = PROBS.double().sqrt() / PROBS.double().sqrt().sum()
    expected = LN(float(root[:3].sum()))
    assert abs(expected - LN(0.8153)) < 1e-4  # the quoted 4 digits
    torch.testing.assert_close(support_log_mass(logits, labels, temperature=2.0, top_p=0.7).double(),
                               torch.full((1, 2), expected, dtype=torch.float64), rtol=0, atol=LOG_MASS)
    assert torch.equal(support_log_mass(logits, labels), torch.zeros(1, 2))  # no top-k, no top-p: nothing to renormalise
