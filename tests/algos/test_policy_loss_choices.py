"""algo.policy_loss's surrogates without the ratio clip (DPPO, SAPO, DRO) for the group-sampling plugins, MaxRL's
scale_rewards=mean and objective.kl_bias_correction: each trains two tiny steps through the composed command line,
with its metrics; the bad spellings are one line before anything loads."""

from __future__ import annotations

import math

import pytest
import torch

from prefzoo.config import to_typed
from prefzoo.errors import ConfigError
from prefzoo.training.loop import Trainer
from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN, compose

# two optimizer steps per rollout, so the surrogates see a ratio other than 1 on the second mini-batch
RUN = [LETTER_REWARD, *TINY_RUN, "trainer.max_steps=2", "trainer.lr=0.05", "rollout.temperature=1.0",
       "algo.num_minibatches=2", "eval.before=false", "eval.after=false"]


@pytest.mark.parametrize("algo,loss,extra", [
    ("grpo", "dppo_tv", []), ("grpo", "dppo_kl", []), ("grpo", "sapo", []), ("grpo", "dro", []),
    ("rloo", "sapo", []), ("reinforce_pp", "dppo_tv", []), ("grpo", "vespo", []),
    ("rloo", "clipped", ["algo.clip_delta=4", "algo.off_policy_mask_threshold=0.01", "algo.top_entropy_quantile=0.2"]),
    ("grpo", "clipped", ["algo.scale_rewards=mean", "objective.beta=0.05", "objective.kl_bias_correction=true"]),
])
def test_each_choice_trains_two_tiny_steps(tmp_path, algo, loss, extra):
    summary = Trainer(compose([f"algo={algo}", f"algo.policy_loss={loss}", *RUN, *extra]), tmp_path).run()
    m = summary["final_train_metrics"]
    assert summary["steps"] == 2 and math.isfinite(m["loss"]) and 0 <= m["clip_fraction"] <= 1
    if loss == "sapo":
        assert 0 < m["gate_weight_mean"] <= 1  # 4 s (1 - s) <= 1, = 1 at ratio 1
    if loss == "vespo":
        assert 0 < m["vespo_phi_mean"]
    if "algo.top_entropy_quantile=0.2" in extra:  # about 80% of the tokens are masked (ties aside)
        assert 0.5 < m["frac_low_entropy_masked"] < 1 and 0 <= m["frac_off_policy_masked"] <= 1
    elif extra:
        assert m["kl_loss"] >= 0


def test_luspo_is_gspo_with_the_length_weighted_reduction(tmp_path):
    """``algo=gspo algo.loss_aggregation=luspo`` trains, with the sequence_sum reduction declared."""
    from prefzoo.algos import get_algorithm
    from prefzoo.config import resolve_objective

    overrides = ["algo=gspo", "algo.loss_aggregation=luspo", *RUN]
    typed = compose(overrides)
    assert get_algorithm("gspo")(typed.algo, resolve_objective(typed)).declaration.aggregation == "sequence_sum"
    summary = Trainer(compose(overrides), tmp_path).run()
    assert summary["steps"] == 2 and math.isfinite(summary["final_train_metrics"]["loss"])


def test_the_masks_drop_the_policy_term_and_keep_the_kl_term():
    """GRPO, beta = 0.1 (k3 as a loss), ``off_policy_mask_threshold`` = 0.1, one row of 3 tokens (tests.algos.test_cispo's
    hand batch: ratios pi/pi_old 1.5, 0.9, 0.5) with A = -2 and the sampler's log-probs 0.3 nats above the policy's on
    every token: d = 0.3 > 0.1 with A < 0, so the whole row's policy term is dropped and each token's loss is
    beta * k3 alone, k3(x) = e^x - x - 1 with x = log pi_ref - log pi; log pi_ref = log pi - 0.2 gives
    k3 = e^-0.2 + 0.2 - 1 = 0.0187308 per token. With the sampler's log-probs 0.05 nats above (d = 0.05) the row is
    kept: loss = -min(r A, clip(r) A) + beta k3 per token. Exact in float64 (kind 1)."""
    from prefzoo.algos.grpo import GRPO, GRPOConfig
    from prefzoo.types import ObjectiveSettings
    from tests.algos.test_cispo import RowPolicy, hand_batch

    f64 = torch.float64
    policy, batch = RowPolicy(f64), hand_batch(f64)
    lp = policy.logp.detach()
    batch.advantages = -batch.advantages
    batch.ref_logps = lp - 0.2
    algo = GRPO(GRPOConfig(off_policy_mask_threshold=0.1, epochs=2), ObjectiveSettings(beta=0.1, kl_estimator="k3", kl_placement="as_loss"))
    k3 = 0.1 * (math.exp(-0.2) + 0.2 - 1)
    batch.sample_logps = lp + 0.3
    out = algo.loss(policy, batch)
    assert out.values[0, :3].tolist() == pytest.approx([k3] * 3, abs=1e-12)
    assert out.token_metrics["frac_off_policy_masked"] == (3.0, 3.0)
    batch.sample_logps = lp + 0.05
    out = algo.loss(policy, batch)
    ppo = [-min(r * -2.0, min(max(r, 0.8), 1.2) * -2.0) for r in (1.5, 0.9, 0.5)]
    assert out.values[0, :3].tolist() == pytest.approx([v + k3 for v in ppo], abs=1e-12)
    assert out.token_metrics["frac_off_policy_masked"] == (0.0, 3.0)


def test_vespo_reads_the_samplers_weights_from_the_batch_not_the_advantages():
    """With ``algo.policy_loss=vespo`` the family leaves the advantages alone and the loss folds ``batch.is_weights``
    into w (TRL's VESPO); every other loss has them multiplied into the advantages. The hand batch's w = 1.5 * 0.9 *
    0.5 = 0.675 (A = 2 >= 0: k 2, lambda 3); with token weights (2, 1, 1), w = 1.35:
    phi(1.35) = 1.35^2 e^{3 (1 - 1.35)} = 0.6377615, so the loss of the first token (log pi = -1) is 2 phi."""
    from prefzoo.algos.grpo import GRPO, GRPOConfig
    from prefzoo.types import ObjectiveSettings
    from tests.algos.test_cispo import RowPolicy, hand_batch

    f64 = torch.float64
    assert GRPO(GRPOConfig(policy_loss="vespo"), ObjectiveSettings(beta=0.0)).loss_takes_is_weights()
    assert not GRPO(GRPOConfig(), ObjectiveSettings(beta=0.0)).loss_takes_is_weights()
    policy, batch = RowPolicy(f64), hand_batch(f64)
    batch.is_weights = torch.tensor([[2.0, 1.0, 1.0, 1.0]], dtype=f64)
    out = GRPO(GRPOConfig(policy_loss="vespo", epochs=2), ObjectiveSettings(beta=0.0)).loss(policy, batch)
    phi = 1.35 ** 2 * math.exp(3 * (1 - 1.35))
    assert phi == pytest.approx(0.6377615, abs=5e-8)
    assert out.values[0, 0].item() == pytest.approx(2 * phi, abs=1e-12)


@pytest.mark.parametrize("overrides,message", [
    (["algo=grpo", "algo.policy_loss=clip"], "spells PPO's ratio clip 'clipped'"),
    (["algo=grpo", "algo.policy_loss=ppo"], "choose one of clipped, dppo_tv, dppo_kl, sapo, dro"),
    (["algo=grpo", "algo.policy_loss=sapo", "algo.sapo_temperature_neg=0"], "algo.sapo_temperature_neg=0"),
    (["algo=grpo", "algo.policy_loss=dppo_kl", "algo.dppo_delta=-1"], "algo.dppo_delta=-1"),
    (["algo=rloo", "objective.kl_bias_correction=true"], "objective.kl_placement=in_reward"),
    (["algo=grpo", "algo.scale_rewards=median"], "none, mean"),
])
def test_bad_choices_are_one_line(overrides, message):
    from prefzoo.algos import get_algorithm

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("'", "'")) as err:
        typed = to_typed(compose([*overrides, *TINY_RUN]))
        algo = get_algorithm(typed.algo.name)
        algo.validate_settings(typed.algo, __import__("prefzoo.config", fromlist=["x"]).resolve_objective(typed))
    assert "\n" not in str(err.value)
