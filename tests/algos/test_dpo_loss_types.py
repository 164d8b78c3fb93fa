"""DPO's loss types beyond sigmoid/ipo/hinge, on the plugin: each side's score, weighted sums, BCO's running shift.

The pairs are those of tests/algos/test_dpo.py (``pairs``): with beta = 0.1 the log-ratios are
  A: rho_w = 0.5, rho_l = -0.25 (scores s = beta rho: 0.05, -0.025; margin m = 0.075)
  B: rho_w = -1,  rho_l = 2     (scores -0.1, 0.2; margin -0.3)
and the chosen completions' mean NLL is A: (0.5 + 1.0) / 2 = 0.75, B: 2.0 (tokens 1, 2 -> -0.5, -1; token 3 -> -2).
The links' own numbers on exact scores are in tests/objective/test_pairwise.py; here the plugin must hand them the
right scores (each side, each view, the batch's margins, the NLL) and combine them.

Tolerances (kind 1): those of tests/algos/test_dpo.py (its module docstring): exact log-probs, float64 links, each
loss rounded once to float32; a hand value quoted to d decimals (correctly rounded, checked against the formulas)
within half a unit of its last decimal plus 2 u32 relative (``HAND6``/``HAND7``, :func:`hand`); an exact one within
2 u32 relative. The averaged view (IPO's) divides each side's log-ratio by its length in float32: pair B's 2/3 is
rounded, so h_B = -5/3 carries u32 (2/3 + 5/3), which IPO's square multiplies by 2 |h_B - 5| (``IPO_B``, 1.9e-6).
The bco and per-loss metrics are float64 (the scores and links are): against float64 formulas (~1e-16) within 1e-15.
"""

import math

import pytest
import torch

from prefzoo.algos.dpo import DPO, DPOConfig
from prefzoo.errors import ConfigError
from prefzoo.types import ObjectiveSettings
from tests.algos.test_dpo import HAND6, HAND7, POLICY, REF, TablePolicy, hand, pairs, softplus, step_means
from tests.bounds import U32

#: IPO's square of pair B's averaged log-ratio h = -1 - 2/3, rounded in float32 (module docstring)
IPO_B = 2 * (5 + 5 / 3) * U32 * (2 / 3 + 5 / 3)


def dpo(beta=0.1, **cfg) -> DPO:
    return DPO(DPOConfig(**cfg), ObjectiveSettings(beta=beta))


def losses(algo: DPO) -> torch.Tensor:
    out = algo.loss(TablePolicy(POLICY, REF), pairs())
    assert out.mask is None and out.values.shape == (2,) and out.values.dtype == torch.float32
    return out.values.detach()


def test_sppo_hard_regresses_each_log_ratio_to_plus_minus_one_over_two_beta():
    """(rho_w - 1/(2 beta))^2 + (rho_l + 1/(2 beta))^2 with 1/(2 beta) = 5:
    A: (0.5 - 5)^2 + (-0.25 + 5)^2 = 20.25 + 22.5625 = 42.8125; B: (-1 - 5)^2 + (2 + 5)^2 = 36 + 49 = 85."""
    torch.testing.assert_close(losses(dpo(loss_type="sppo_hard")), torch.tensor([42.8125, 85.0]), rtol=2 * U32, atol=0)


def test_apo_zero_reads_each_side():
    """1 - sigma(s_w) + sigma(s_l): A: 1 - sigma(0.05) + sigma(-0.025) = 1 - 0.5124974 + 0.4937503 = 0.9812529;
    B: 1 - sigma(-0.1) + sigma(0.2) = 1 - 0.4750208 + 0.5498340 = 1.0748132."""
    torch.testing.assert_close(losses(dpo(loss_type="apo_zero")), torch.tensor([0.9812529, 1.0748132]),
                               rtol=2 * U32, atol=HAND7)


def test_robust_with_label_smoothing_as_the_flip_rate():
    """((1 - eps) softplus(-m) - eps softplus(m)) / (1 - 2 eps), eps = 0.1:
    A: (0.9 * 0.6563504 - 0.1 * 0.7313504) / 0.8 = 0.6469751; B: (0.9 * 0.8543552 - 0.1 * 0.5543552) / 0.8 = 0.8918552."""
    torch.testing.assert_close(losses(dpo(loss_type="robust", label_smoothing=0.1)),
                               torch.tensor([0.6469751, 0.8918552]), rtol=2 * U32, atol=HAND7)


def test_sft_alone_is_the_chosen_mean_nll():
    torch.testing.assert_close(losses(dpo(loss_type="sft")), torch.tensor([0.75, 2.0]), rtol=2 * U32, atol=0)


def test_weighted_sum_of_sigmoid_and_sft():
    """loss_type=[sigmoid, sft], loss_weights=[1.0, 0.5]: softplus(-m) + 0.5 NLL(chosen):
    A: 0.656350 + 0.5 * 0.75 = 1.031350; B: 0.854355 + 0.5 * 2.0 = 1.854355 (sigmoid values: tests/algos/test_dpo.py).
    Without weights each counts 1: A 0.656350 + 0.75 = 1.406350."""
    torch.testing.assert_close(losses(dpo(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])),
                               torch.tensor([1.031350, 1.854355]), rtol=2 * U32, atol=HAND6)
    assert float(losses(dpo(loss_type=["sigmoid", "sft"]))[0]) == hand(1.406350)


def test_a_sum_with_ipo_averages_only_ipos_log_ratios():
    """[ipo, sigmoid]: IPO reads each side's log-ratio averaged over its tokens (A: 0.5/2 = 0.25 and -0.25/2 = -0.125,
    h = 0.375; B: -1/1 and 2/3, h = -5/3), sigmoid the summed ones. A: (0.375 - 5)^2 + 0.656350 = 21.390625 +
    0.656350 = 22.046975; B: (-5/3 - 5)^2 + 0.854355 = 44.4444444 + 0.8543552 = 45.298800 (the old 45.298799 added
    the rounded terms; the old bound, atol 1e-4 + rtol 1e-6, let it pass). At 45 one float32 ulp is 3.8e-6: the
    2 u32 relative part of the bound, 5.4e-6, dominates here; ``IPO_B`` adds the float32 average of pair B."""
    torch.testing.assert_close(losses(dpo(loss_type=["ipo", "sigmoid"])), torch.tensor([22.046975, 45.298800]),
                               rtol=2 * U32, atol=HAND6 + IPO_B)


def test_aot_sorts_the_micro_batchs_policy_and_reference_margins():
    """Policy margins log pi(y_w) - log pi(y_l): A -1.5 + 2.25 = 0.75, B -2 + 1 = -1; reference: A -2 + 2 = 0,
    B -1 + 3 = 2. Sorted: (-1, 0.75) and (0, 2), d = (-1, -1.25), beta d = (-0.1, -0.125):
    losses softplus(0.1) = 0.7443967 and softplus(0.125) = 0.7575990 (by rank, not by pair)."""
    torch.testing.assert_close(losses(dpo(loss_type="aot")), torch.tensor([0.7443967, 0.7575990]), rtol=2 * U32,
                               atol=HAND7)


def test_bco_pair_shift_is_the_running_mean_reward_and_resumes_exactly():
    """Step 1 (no history): delta = 0, A: -log sigma(0.05) - log sigma(0.025) = 1.3491850.
    The step's mean reward over both sides, ((0.05 - 0.025)/2 + (-0.1 + 0.2)/2) / 2 = 0.03125, becomes delta after
    the step; step 2's loss of A is -log sigma(0.05 - 0.03125) - log sigma(0.03125 + 0.025) = 1.3492338.
    A second step with mean reward 0.1 over 2 rows moves delta to (2 * 0.03125 + 2 * 0.1) / 4 = 0.065625.
    state_dict / load_state_dict carry delta and its row count, so a resumed run computes the same loss.
    Losses: hand values to 7 decimals (module docstring); the shift is float64 (~1e-17): 1e-15; a resumed loss is
    the same computation, exact."""
    algo = dpo(loss_type="bco_pair")
    out = algo.loss(TablePolicy(POLICY, REF), pairs())
    assert float(out.values[0].detach()) == hand(1.3491850, 7)
    assert out.metrics["bco/batch_reward"] == pytest.approx(0.03125, abs=1e-15)
    assert out.metrics["bco/reward_shift"] == 0.0
    assert algo.after_step(dict(out.metrics), 2) == {}  # the step's own shift is logged by the loss
    assert algo.state_dict()["bco_reward_shift"] == {"mean": pytest.approx(0.03125, abs=1e-15), "rows": 2}
    second = algo.loss(TablePolicy(POLICY, REF), pairs()).values.detach()
    assert float(second[0]) == hand(1.3492338, 7)
    resumed = dpo(loss_type="bco_pair")
    resumed.load_state_dict(algo.state_dict())
    torch.testing.assert_close(resumed.loss(TablePolicy(POLICY, REF), pairs()).values.detach(), second, rtol=0, atol=0)
    algo.after_step({"bco/batch_reward": 0.1}, 2)
    assert algo.state_dict()["bco_reward_shift"] == {"mean": pytest.approx(0.065625, abs=1e-15), "rows": 4}


def test_bco_state_is_absent_from_other_loss_types_and_old_checkpoints_load():
    algo = dpo()
    assert "bco_reward_shift" not in algo.state_dict()
    bco = dpo(loss_type="bco_pair")
    bco.load_state_dict({"kl_ctl": algo.state_dict()["kl_ctl"]})  # a checkpoint written before bco_pair existed
    assert bco.state_dict()["bco_reward_shift"] == {"mean": 0.0, "rows": 0}


def test_every_new_loss_type_gives_a_finite_loss_and_gradient():
    for loss_type in ("robust", "exo_pair", "nca_pair", "sppo_hard", "apo_zero", "apo_down", "bco_pair", "discopop",
                      "aot", "aot_unpaired", "sft"):
        policy = TablePolicy(POLICY, REF)
        out = dpo(loss_type=loss_type, label_smoothing=0.1).loss(policy, pairs())
        out.values.mean().backward()
        assert torch.isfinite(out.values).all() and torch.isfinite(policy.theta.grad).all(), loss_type
        assert float(policy.theta.grad.abs().sum()) > 0, loss_type


@pytest.mark.parametrize("cfg,needle", [
    (dict(loss_type="nope"), "algo.loss_type='nope' is unknown; choose one of sigmoid, ipo, hinge, robust"),
    (dict(loss_type=["sigmoid", "nope"]), "algo.loss_type=['sigmoid', 'nope']: 'nope' is unknown"),
    (dict(loss_type=[]), "algo.loss_type=[] is empty"),
    (dict(loss_type=["sigmoid", "sigmoid"]), "lists 'sigmoid' twice"),
    (dict(loss_type="aot_pair"), "aot_pair was TRL 0.x's name for AOT on unpaired data: use algo.loss_type=aot_unpaired"),
    (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]), "algo.loss_weights has 1 entries but algo.loss_type has 2"),
    (dict(loss_type="sigmoid", loss_weights=[-1.0]), "algo.loss_weights=[-1.0]: weights must be finite and >= 0"),
    (dict(loss_type=["sigmoid", "sft"], loss_weights=[0.0, 0.0]), "algo.loss_weights=[0.0, 0.0]: at least one"),
    (dict(loss_type="exo_pair"), "algo.loss_type=exo_pair needs algo.label_smoothing > 0"),
    (dict(loss_type="discopop", discopop_tau=0.0), "algo.discopop_tau=0.0 must be > 0"),
])
def test_config_validation_names_the_key_and_the_fix(cfg, needle):
    with pytest.raises(ConfigError) as info:
        dpo(**cfg)
    assert needle in str(info.value)


def test_metrics_of_a_sum_are_the_summed_views():
    """With [ipo, sigmoid] the rewards/* metrics are beta times the SUMMED log-ratios (TRL's meaning), as with
    sigmoid alone: rewards/chosen = 0.1 * (0.5 - 1) / 2 = -0.025 (float32 beta times an exact ratio: 2 u32
    relative). The per-loss metrics and the margins are float64, against the formulas in float64: loss/ipo
    ((0.375 - 5)^2 + (-5/3 - 5)^2) / 2 = 32.917535 within pair B's float32 average, halved (``IPO_B`` / 2; measured
    1.3e-7), loss/sigmoid and the margins within 1e-15 (~1e-16). (The old bounds, 1e-4 and 1e-6, absorbed hand values
    rounded to 6 decimals.)"""
    m = step_means(dpo(loss_type=["ipo", "sigmoid"]).loss(TablePolicy(POLICY, REF), pairs()))
    assert m["rewards/chosen"] == pytest.approx(-0.025, rel=2 * U32)
    assert m["loss/ipo"] == pytest.approx(((0.375 - 5) ** 2 + (-5 / 3 - 5) ** 2) / 2, abs=IPO_B / 2 + 1e-12)
    assert m["loss/sigmoid"] == pytest.approx((softplus(-0.075) + softplus(0.3)) / 2, abs=1e-15)
    assert math.isclose(m["rewards/margins"], (0.075 - 0.3) / 2, abs_tol=1e-15)
