"""Tests for prefzoo.objective.pairwise: every link of PAIRWISE_LOSSES on scores chosen so that the numbers are exact.

The pair used throughout: s_w = ln 3 and s_l = -ln 3 (score units: beta x nats for DPO), so that
sigma(s_w) = 3/4, sigma(s_l) = 1/4, the margin m = s_w - s_l = ln 9 and sigma(m) = 9/10, sigma(-m) = 1/10.
Every expected value below is derived from the paper's equation in the docstring (ln 0.9 = -0.1053605,
ln 0.75 = -0.2876821, ln 0.1 = -2.3025851, ln 2 = 0.6931472).
The margin-only links sigmoid / ipo / hinge keep their numbers (tests/algos/test_dpo.py).

Tolerances (tests/bounds.py, kind 1). Every score is float64 (pairwise_loss keeps the dtype): a loss is a few
logs, exps and products of numbers <= 3, rounding ~1e-16. A 7-decimal value is within half a unit of its last digit
(5e-8) of the formula; abs=1e-7 (one unit) holds it with the rounding. Values that are exact formulas in the test
(0, 1/2, 0.85, 1/9, ln 2, another link's loss) are compared within 1e-12 (1e4 times the rounding), exactly where
no rounding happens.
"""

import math

import pytest
import torch

from prefzoo.objective import PAIRWISE_LOSSES, ObjectiveError, PairScores, pairwise_loss

LN3 = math.log(3.0)


def pair(**extra) -> PairScores:
    return PairScores.from_sides(torch.tensor([LN3], dtype=torch.float64), torch.tensor([-LN3], dtype=torch.float64),
                                 **extra)


def value(loss_type, scores=None, **kw) -> float:
    return float(pairwise_loss(scores if scores is not None else pair(), loss_type, **kw))


def test_sigmoid_on_a_pair_is_the_margin_link():
    """-log sigma(ln 9) = -ln 0.9 = 0.1053605, the same from the scores and from the bare margin tensor (bitwise:
    ln 3 - (-ln 3) = 2 ln 3 exactly, then the same operations; the float32 margin of the first version was held
    within a round 1e-6)."""
    assert value("sigmoid") == pytest.approx(0.1053605, abs=1e-7)
    assert float(pairwise_loss(torch.tensor([2 * LN3], dtype=torch.float64), "sigmoid")) == value("sigmoid")


def test_robust_dpo_unbiased_loss():
    """rDPO (Chowdhury et al. 2024): ((1 - eps) L(m) - eps L(-m)) / (1 - 2 eps), L(m) = -log sigma(m).
    eps = 0.1: (0.9 * 0.1053605 - 0.1 * 2.3025851) / 0.8 = (0.0948245 - 0.2302585) / 0.8 = -0.1692926
    (negative: the de-biased loss is an unbiased estimate, not a likelihood). eps = 0 is the sigmoid loss."""
    assert value("robust", label_smoothing=0.1) == pytest.approx(-0.1692926, abs=1e-7)
    assert value("robust") == pytest.approx(value("sigmoid"), abs=1e-12)


def test_exo_pair_is_the_kl_from_the_smoothed_label():
    """EXO-pair (Ji et al. 2024, eq. 16 with K = 2): KL(Bern(sigma(m)) || Bern(1 - eps)) =
    sigma(m) (log sigma(m) - log(1 - eps)) + sigma(-m) (log sigma(-m) - log eps).
    eps = 0.1: sigma(m) = 0.9 = 1 - eps, so the KL is exactly 0.
    eps = 0.2: 0.9 ln(0.9 / 0.8) + 0.1 ln(0.1 / 0.2) = 0.1060047 - 0.0693147 = 0.0366900."""
    assert value("exo_pair", label_smoothing=0.1) == pytest.approx(0.0, abs=1e-12)
    assert value("exo_pair", label_smoothing=0.2) == pytest.approx(0.0366900, abs=1e-7)


def test_exo_pair_refuses_eps_zero():
    """log eps = -inf at eps = 0: the message says to set label_smoothing > 0 (EXO's authors use 1e-3)."""
    with pytest.raises(ObjectiveError, match="label_smoothing > 0.*1e-3"):
        value("exo_pair")


def test_nca_pair_scores_each_side():
    """NCA (Chen et al. 2024), K = 2: -log sigma(s_w) - 1/2 log sigma(-s_w) - 1/2 log sigma(-s_l)
    = -ln(3/4) - 1/2 ln(1/4) - 1/2 ln(3/4) = 0.2876821 + 0.6931472 + 0.1438410 = 1.1246703."""
    assert value("nca_pair") == pytest.approx(1.1246703, abs=1e-7)


def test_sppo_hard_regresses_each_side_to_plus_minus_a_half():
    """SPPO (Wu et al. 2024, Algorithm 1) with hard probabilities P(y_w wins) = 1, P(y_l wins) = 0:
    (rho_w - 1/(2 beta))^2 + (rho_l + 1/(2 beta))^2 with rho = s / beta.
    beta = 1: (ln 3 - 0.5)^2 + (-ln 3 + 0.5)^2 = 2 * 0.5986123^2 = 0.7166733;
    beta = 0.5 (rho = 2 s): 2 * (2 ln 3 - 1)^2 = 2 * 1.1972246^2 = 2.8666934."""
    assert value("sppo_hard", beta=1.0) == pytest.approx(0.7166733, abs=1e-7)
    assert value("sppo_hard", beta=0.5) == pytest.approx(2.8666934, abs=1e-7)


def test_apo_zero_and_apo_down():
    """APO (D'Oosterlinck et al. 2024): zero, eq. 7: 1 - sigma(s_w) + sigma(s_l) = 1 - 3/4 + 1/4 = 0.5;
    down, eq. 8: sigma(s_w) + 1 - sigma(s_w - s_l) = 3/4 + 1 - 9/10 = 0.85."""
    assert value("apo_zero") == pytest.approx(0.5, abs=1e-12)
    assert value("apo_down") == pytest.approx(0.85, abs=1e-12)


def test_bco_pair_with_a_reward_shift():
    """BCO (Jung et al. 2024): -log sigma(s_w - delta) - log sigma(-(s_l - delta)).
    delta = 0: -2 ln(3/4) = 0.5753641; delta = ln 3: -log sigma(0) - log sigma(2 ln 3) = ln 2 - ln 0.9 = 0.7985077."""
    assert value("bco_pair") == pytest.approx(0.5753641, abs=1e-7)
    assert value("bco_pair", reward_shift=LN3) == pytest.approx(0.7985077, abs=1e-7)


def test_discopop_blends_logistic_and_exponential():
    """DiscoPOP / LRML (Chris Lu et al. 2024, eq. 5), tau = 0.05: (1 - sigma(m/tau)) log(1 + e^-m) + sigma(m/tau) e^-m.
    m = ln 9: sigma(43.9) = 1 to 1e-19, so the loss is e^-m = 1/9 = 0.1111111.
    m = 0: 0.5 ln 2 + 0.5 = 0.8465736.
    m = -0.05 (m/tau = -1): 0.7310586 * log(1 + e^0.05) + 0.2689414 * e^0.05 = 0.5252361 + 0.2827303 = 0.8079664."""
    assert value("discopop") == pytest.approx(1 / 9, abs=1e-12)
    assert float(pairwise_loss(torch.tensor([0.0, -0.05], dtype=torch.float64), "discopop")[0]) == pytest.approx(
        0.8465736, abs=1e-7)
    assert float(pairwise_loss(torch.tensor([-0.05], dtype=torch.float64), "discopop")) == pytest.approx(
        0.8079664, abs=1e-7)


def test_discopop_is_finite_for_a_hugely_negative_margin():
    """m = -1000: e^-m overflows float64, but sigma(m/tau) e^-m = exp(log sigma(m/tau) - m) = exp(~-19000) = 0,
    and the logistic part is log(1 + e^1000) = 1000: the loss is 1000, not NaN (0 * inf); its slope is -1.
    float64 numbers near 1000 are 1.1e-13 apart: 1e-10 on the loss, 1e-12 on the slope (measured: both exact)."""
    m = torch.tensor([-1000.0], dtype=torch.float64, requires_grad=True)
    out = pairwise_loss(m, "discopop")
    out.sum().backward()
    assert float(out.detach()) == pytest.approx(1000.0, abs=1e-10)
    assert float(m.grad) == pytest.approx(-1.0, abs=1e-12)


def test_aot_sorts_the_policy_and_reference_margins_across_the_batch():
    """AOT paired (Melnyk et al. 2024): d = sort(policy margins) - sort(reference margins), loss -log sigma(d).
    Pair 1: policy margin 0, reference margin ln 9; pair 2: policy ln 9, reference 0. Per pair (DPO) the margins
    are -ln 9 and ln 9 (losses ln 10 = 2.3025851 and 0.1053605); sorted, both distributions are {0, ln 9}, so
    d = (0, 0) and each loss is ln 2 = 0.6931472: the policy's margins already dominate the reference's. In float64:
    d = 0 exactly, -log sigma(0) = ln 2 within 1e-12 (module docstring; the float32 version held a round 1e-6)."""
    d = torch.float64
    scores = PairScores.from_sides(torch.tensor([0.0, 0.0], dtype=d), torch.tensor([0.0, 0.0], dtype=d),
                                   policy_margin=torch.tensor([0.0, 2 * LN3], dtype=d),
                                   reference_margin=torch.tensor([2 * LN3, 0.0], dtype=d))
    torch.testing.assert_close(pairwise_loss(scores, "aot"), torch.full((2,), math.log(2), dtype=d), rtol=0, atol=1e-12)


def test_aot_unpaired_sorts_chosen_and_rejected_scores_separately():
    """AOT unpaired: d = sort(s_w) - sort(s_l). Chosen (-ln 3, ln 3), rejected (ln 3, -ln 3): paired margins
    -2 ln 3 and 2 ln 3, but both sides sort to (-ln 3, ln 3): d = 0, loss ln 2 each. With label smoothing
    eps the link is -(1 - eps) log sigma(d) - eps log sigma(-d), still ln 2 at d = 0. float64, as the test above."""
    d = torch.float64
    scores = PairScores.from_sides(torch.tensor([-LN3, LN3], dtype=d), torch.tensor([LN3, -LN3], dtype=d))
    ln2 = torch.full((2,), math.log(2), dtype=d)
    torch.testing.assert_close(pairwise_loss(scores, "aot_unpaired"), ln2, rtol=0, atol=1e-12)
    torch.testing.assert_close(pairwise_loss(scores, "aot_unpaired", label_smoothing=0.2), ln2, rtol=0, atol=1e-12)


def test_sft_is_the_chosen_mean_nll():
    """``sft`` returns the chosen completion's mean NLL it is given (0.7 nats per token), unchanged: exactly."""
    assert value("sft", pair(chosen_nll=torch.tensor([0.7], dtype=torch.float64))) == 0.7


def test_a_link_that_reads_each_side_refuses_a_bare_margin():
    for name in ("nca_pair", "sppo_hard", "apo_zero", "apo_down", "bco_pair", "aot", "aot_unpaired", "sft"):
        with pytest.raises(ObjectiveError, match=f"loss_type {name!r} reads"):
            pairwise_loss(torch.zeros(2), name, 0.1)


def test_the_table_lists_every_link_with_the_margin_links_first():
    assert list(PAIRWISE_LOSSES)[:3] == ["sigmoid", "ipo", "hinge"]
    assert {"robust", "exo_pair", "nca_pair", "sppo_hard", "apo_zero", "apo_down", "bco_pair", "discopop", "aot",
            "aot_unpaired", "sft"} <= set(PAIRWISE_LOSSES)


def test_scores_of_different_shapes_are_refused():
    with pytest.raises(ObjectiveError, match="rejected has shape"):
        PairScores.from_sides(torch.zeros(2), torch.zeros(3))
