"""Tests for the ORPO plugin (prefzoo.algos.orpo): NLL on chosen plus lambda x the odds-ratio term, no reference.

Token log-probs are chosen so that the odds are exact: log pi(token 1) = ln(3/4) (odds 3, log odds ln 3),
log pi(token 2) = ln(1/4) (odds 1/3, log odds -ln 3), log pi(token 3) = ln(1/2) (odds 1, log odds 0).
lambda = objective.beta = 0.1 (the paper's and TRL's default).

Tolerances (tests/bounds.py, kind 1: the claims are exact). The table is float64 (:func:`table`) and ORPO keeps float64
through (its log odds are float64 already, prefzoo/objective/odds.py), so a value is its formula to a few roundings of
numbers below 20 (u64 = 1.1e-16 relative each): against a closed form (ln 3, -1.04, 0.04/3) the bound is 1e-12, over
1000x that. Against a hand value written to 7 decimals it is 1e-6: the written value is off by at most 1e-7 (one
rounding, or two for a sum of rounded terms), 10x below, and a wrong formula moves these values by 1e-3 or more. With
the former float32 table the values sat up to 9.9e-8 from the written ones and from ln 3 (measured 2026-12-06): 10x
below the 1e-6 they were all held to.
"""

import math

import pytest
import torch

from prefzoo.algos.orpo import ORPO, ORPOConfig
from prefzoo.config import Config, resolve_objective
from prefzoo.data.preference import PreferenceExample, collate_preferences
from prefzoo.errors import ConfigError
from prefzoo.types import ObjectiveSettings
from tests.algos.test_dpo import TablePolicy
from tests.models.helpers import one_thread_fixture

ODDS = {1: math.log(0.75), 2: math.log(0.25), 3: math.log(0.5)}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


def table(log_probs: dict[int, float] = ODDS) -> TablePolicy:
    """tests/algos/test_dpo.py's TablePolicy without a reference, its table in float64 and filled from the exact
    log-probs (a float32 table would round ln(3/4) before the code sees it)."""
    policy = TablePolicy({}, ref=None)
    policy.theta = torch.zeros(16, dtype=torch.float64)
    for token, value in log_probs.items():
        policy.theta[token] = value
    policy.theta.requires_grad_(True)
    return policy


def orpo(beta=0.1) -> ORPO:
    return ORPO(ORPOConfig(), ObjectiveSettings(beta=beta))


def batch(*rows):
    """rows: (chosen tokens, rejected tokens); every prompt is (9,)."""
    return collate_preferences([PreferenceExample([9], list(c), list(r)) for c, r in rows], list(range(len(rows))), 0)


def test_defaults_and_declaration():
    algo = ORPO(ORPOConfig(), resolve_objective(Config(algo=ORPOConfig())))
    assert algo.beta == 0.1
    d = algo.declaration
    assert d.reference is False and d.aggregation == "example_mean" and d.has("implicit_rewards")


def test_loss_hand_value_and_length_normalisation():
    """Pair 1: chosen (1, 1), rejected (2,); pair 2: chosen (1,), rejected (2, 2, 2): the same mean log-probs
    ln(3/4) and ln(1/4), so the same loss (length-normalised, eq. 6-7 of Hong et al. 2024):
    NLL = -ln(3/4) = 0.2876821; log OR = ln 3 - (-ln 3) = ln 9; L_OR = -log sigma(ln 9) = -ln 0.9 = 0.1053605;
    loss = 0.2876821 + 0.1 * 0.1053605 = 0.2982182."""
    out = orpo().loss(table(), batch(((1, 1), (2,)), ((1,), (2, 2, 2))))
    assert out.mask is None
    torch.testing.assert_close(out.values.detach(), torch.tensor([0.2982182, 0.2982182], dtype=torch.float64), rtol=0,
                               atol=1e-6)


def test_gradient_hand_value():
    """dL/dl_w = -1 - lambda sigma(-z) / (1 - P_w), dL/dl_l = lambda sigma(-z) / (1 - P_l) (d log odds / dl =
    1 / (1 - P)); z = ln 9, sigma(-z) = 0.1: -1 - 0.1 * 0.1 * 4 = -1.04 and 0.1 * 0.1 * 4/3 = 0.0133333.
    Chosen (1, 1) has l_w = theta_1 (the mean of two equal tokens), rejected (2,) l_l = theta_2."""
    policy = table()
    orpo().loss(policy, batch(((1, 1), (2,)))).values.sum().backward()
    assert float(policy.theta.grad[1]) == pytest.approx(-1.04, abs=1e-12)
    assert float(policy.theta.grad[2]) == pytest.approx(0.04 / 3, abs=1e-12)


def test_chosen_with_mean_log_prob_near_zero_gives_a_finite_loss_and_gradient():
    """Chosen (4,) with log pi = -1e-8 (P = 1 - 1e-8), rejected (3,) with P = 1/2: log odds 18.420681 and 0,
    loss = 1e-8 + 0.1 softplus(-18.420681) = 1e-8 + 0.1 * 1e-8 = 1.1e-8; the chosen's gradient
    -1 - 0.1 sigma(-18.420681) / 1e-8 = -1 - 0.1 = -1.1. (The naive log1p(-exp(l)) is -inf here in float32.)
    The written values drop terms of relative size 1e-8 (P = 1 - 1e-8; sigma(-z) / (1 - P) = 1 exactly, so the
    gradient's -1.1 is exact): the loss within 1e-12 (1e-4 of its size, 1e4x the dropped terms), the gradient within
    1e-12 relative (float64, over 1000x its rounding)."""
    policy = table({**ODDS, 4: -1e-8})
    out = orpo().loss(policy, batch(((4,), (3,))))
    out.values.sum().backward()
    assert float(out.values.detach()) == pytest.approx(1.1e-8, abs=1e-12)
    assert float(policy.theta.grad[4]) == pytest.approx(-1.1, rel=1e-12)


def test_rejected_with_mean_log_prob_near_zero_gives_a_finite_loss_and_gradient():
    """Chosen (3,) (P = 1/2), rejected (4,) with P = 1 - 1e-8: z = 0 - 18.420681, loss = ln 2 + 0.1 softplus(18.420681)
    = 0.6931472 + 1.8420681 = 2.5352153; the rejected's gradient lambda sigma(-z) / (1 - P_l) = 0.1 * 1 / 1e-8 = 1e7
    (huge -- ORPO's 1/(1 - P) weight -- but finite). At log-prob exactly 0 the loss stays finite too. The written 1e7
    drops terms of relative size 1e-8 (it is 1e7 P / (1 - 5e-9)): bound 1e-6 relative, 100x that."""
    policy = table({**ODDS, 4: -1e-8, 5: 0.0})
    out = orpo().loss(policy, batch(((3,), (4,)), ((3,), (5,))))
    out.values.sum().backward()
    assert float(out.values[0].detach()) == pytest.approx(2.5352153, abs=1e-6)
    assert float(policy.theta.grad[4]) == pytest.approx(1e7, rel=1e-6)
    assert torch.isfinite(out.values).all() and torch.isfinite(policy.theta.grad).all()


def test_metrics_keep_trls_meaning():
    """TRL's ORPO metrics: rewards/chosen = lambda * mean log-prob = 0.1 ln(3/4) = -0.0287682, rewards/rejected =
    0.1 ln(1/4) = -0.1386294, margins 0.1098612, accuracy 1; nll_loss 0.2876821; log_odds_ratio = mean
    log sigma(log OR) = ln 0.9 = -0.1053605; log_odds_chosen = mean log OR = ln 9 = 2.1972246;
    logps/chosen (summed, as every prefzoo plugin logs it) = 2 ln(3/4) = -0.5753641."""
    m = orpo().loss(table(), batch(((1, 1), (2,)))).metrics
    want = {"rewards/chosen": -0.0287682, "rewards/rejected": -0.1386294, "rewards/margins": 0.1098612,
            "rewards/accuracies": 1.0, "nll_loss": 0.2876821, "log_odds_ratio": -0.1053605,
            "log_odds_chosen": 2.1972246, "logps/chosen": -0.5753641, "logps/rejected": math.log(0.25)}
    for k, v in want.items():
        assert m[k] == pytest.approx(v, abs=1e-6), k


def test_never_touches_a_reference_and_uses_one_forward_pass():
    policy = table()  # ref_logps would raise
    orpo().loss(policy, batch(((1, 1), (2,))))
    assert policy.logps_calls == 1


def test_held_out_rewards_are_the_log_odds():
    """implicit_rewards: log odds of chosen and rejected, ln 3 and -ln 3 (the ranking of the mean log-probs)."""
    c, r = orpo().implicit_rewards(table(), batch(((1, 1), (2,))))
    assert float(c) == pytest.approx(math.log(3), abs=1e-12) and float(r) == pytest.approx(-math.log(3), abs=1e-12)


def test_lambda_zero_would_be_sft_on_chosen_and_is_refused_naming_algo_sft():
    """At lambda = 0 the loss is the chosen's mean NLL alone, -log 0.75 here (the nll_loss term, logged at any
    lambda), i.e. algo=sft: it used to run silently as SFT; it is now refused in one line naming algo=sft (hardening
    round 3, item 6)."""
    out = orpo(beta=0.1).loss(table(), batch(((1, 1), (2,))))
    assert out.metrics["nll_loss"] == pytest.approx(-math.log(0.75), abs=1e-12)
    with pytest.raises(ConfigError, match=r"objective.beta=0.0: ORPO needs beta > 0 .*at 0 ORPO is algo=sft"):
        orpo(beta=0.0)
