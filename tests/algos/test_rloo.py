"""RLOO plugin: leave-one-out advantages of the rollout, the KL in the sequence reward, REINFORCE vs the clipped
surrogate, the settings it refuses, and a 2-step run on the tiny model through the loop.

Tolerances (tests/bounds.py, kind 1: the hand cases are exact). The stub policies' tables are float64 here
(:func:`float64_policy`; tests/algos/test_cispo.py's row policy and ratios rebuilt in float64) and RLOO keeps float64 through (the KL
penalty, the loss, the gradients: a few roundings of numbers below 10, u64 = 1.1e-16 relative each; bound 1e-12), but
for the advantages, computed in float64 and rounded ONCE to float32 (prefzoo/algos/online.py): <= u32 |A| (|A| <= 3),
1.8e-7, bound 1e-6, and the expected ones built from 0/1 rewards as float32 tensors are rounded alike (2 u32 apart at
most). Means of counts and of 0/1 rewards (3/8, ratio_mean 1 = exp(0)) are exact.
"""

from __future__ import annotations

import pytest
import torch

from prefzoo.algos.rloo import RLOO, RLOOConfig
from prefzoo.errors import ConfigError
from prefzoo.objective import aggregate_loss
from prefzoo.types import ObjectiveSettings
from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN, compose
from tests.algos.test_grpo import PROMPTS, TwoTokenPolicy, fixed_scores, token_mean
from tests.models.helpers import one_thread_fixture


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


def float64_policy() -> TwoTokenPolicy:
    """tests/algos/test_grpo.py's TwoTokenPolicy (the same random tables) in float64."""
    policy = TwoTokenPolicy()
    policy.logits = torch.nn.Parameter(policy.logits.detach().double())
    policy.ref = policy.ref.double()
    return policy


def make(beta=0.0, estimator="k1", placement="in_reward", **cfg):
    return RLOO(RLOOConfig(**cfg), ObjectiveSettings(beta=beta, kl_estimator=estimator, kl_placement=placement))


def test_leave_one_out_advantages_of_a_rollout_by_hand():
    """beta = 0. Group 1 [1, 0, 0, 1]: a 1's baseline is the mean of (0, 0, 1) = 1/3 -> A = 2/3; a 0's is the mean
    of (1, 0, 1) = 2/3 -> A = -2/3. Group 2 [0, 0, 0, 1]: each 0 sees (0, 0, 1) -> A = -1/3; the 1 sees only
    zeros -> A = 1. Every counted token of a row carries its A (rows have 3, 2, 1, 3 tokens), padding 0."""
    exp, m = make(num_samples=4).make_experience(float64_policy(), PROMPTS, fixed_scores([1, 0, 0, 1, 0, 0, 0, 1]))
    per_row = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, -1 / 3, -1 / 3, -1 / 3, 1.0])
    want = per_row[:, None].expand(8, 3).masked_fill(~exp.completion_mask, 0.0)
    torch.testing.assert_close(exp.advantages, want, rtol=0, atol=1e-6)
    assert exp.old_logps is None and m["reward"] == 3 / 8 and m["non_score_reward"] == 0.0


def test_the_kl_enters_the_sequence_reward_before_the_baseline():
    """k1 in the reward: R_i = r_i - beta sum_t (log pi - log pi_ref)_t, then A_i = R_i - (sum_group R - R_i)/3,
    computed here with plain Python loops from the policy's own log-probs."""
    beta, policy = 0.5, float64_policy()
    r = [1, 0, 0, 1, 0, 1, 0, 0]
    exp, m = make(beta=beta, num_samples=4).make_experience(policy, PROMPTS, fixed_scores(r))
    rho = (policy.logps(exp)[0].detach() - exp.ref_logps).sum(-1).tolist()
    shaped = [r[i] - beta * rho[i] for i in range(8)]
    want = []
    for i in range(8):
        g = shaped[4 * (i // 4): 4 * (i // 4) + 4]
        want.append(shaped[i] - (sum(g) - shaped[i]) / 3)
    got = exp.advantages[torch.arange(8), 0]  # every row has a first token
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)
    assert m["non_score_reward"] == pytest.approx(-beta * sum(rho) / 8, abs=1e-12)
    assert "kl_loss" not in make(beta=beta, num_samples=4).loss(policy, exp).token_metrics


def test_reinforce_loss_is_minus_advantage_times_log_prob_and_has_the_clipped_surrogates_gradient():
    """REINFORCE: loss_t = -A log pi_t (value and gradient). With one optimizer step the clipped surrogate's ratio
    is exactly 1, so its gradient is -A grad log pi too: the two reductions (mean per sequence) give the same
    gradient on the logits table, and the clipped one has clip_fraction 0 and ratio_mean 1."""
    policy = float64_policy()
    scores = fixed_scores([1, 0, 0, 1, 0, 1, 0, 0])
    grads = {}
    for loss_name in ("reinforce", "clipped"):
        algo = make(num_samples=4, policy_loss=loss_name)
        exp, _ = algo.make_experience(policy, PROMPTS, scores)
        out = algo.loss(policy, exp)
        if loss_name == "reinforce":
            logps = policy.logps(exp)[0].detach()
            torch.testing.assert_close(out.values.detach(), (-exp.advantages * logps).masked_fill(~exp.loss_mask, 0.0),
                                       rtol=0, atol=1e-12)
        else:
            assert token_mean(out, "clip_fraction") == 0.0 and token_mean(out, "ratio_mean") == 1.0
        policy.logits.grad = None
        aggregate_loss(out.values, out.mask, "sequence_mean", float(len(exp))).backward()
        grads[loss_name] = policy.logits.grad.clone()
    torch.testing.assert_close(grads["reinforce"], grads["clipped"], rtol=0, atol=1e-12)
    assert grads["reinforce"].abs().sum() > 0


def test_several_optimizer_steps_need_the_clipped_surrogate_and_store_old_logps():
    with pytest.raises(ConfigError, match="algo.policy_loss=reinforce with algo.epochs=2"):
        make(epochs=2)
    with pytest.raises(ConfigError, match="at least 2 completions"):
        make(num_samples=1)
    algo = make(policy_loss="clipped", num_minibatches=2)
    policy = float64_policy()
    exp, _ = algo.make_experience(policy, PROMPTS, fixed_scores([1, 0, 0, 1, 0, 1, 0, 0]))
    assert torch.equal(exp.old_logps, policy.logps(exp)[0].detach())


@pytest.mark.parametrize("aggregation,expected", [("grpo", "sequence_mean"), ("dapo", "token_mean"), ("dr_grpo", "constant")])
def test_declaration(aggregation, expected):
    """The reference exists exactly when beta > 0 (default 0.05, as TRL's RLOO)."""
    d = make(beta=0.05, loss_aggregation=aggregation).declaration
    assert d.aggregation == expected and d.reference and d.online and d.num_samples == 4
    assert not make(beta=0.0).declaration.reference
    assert RLOOConfig().default_beta == 0.05 and RLOOConfig().default_kl_placement == "in_reward"


def test_rloo_runs_two_steps_on_the_tiny_model(tmp_path):
    """algo=rloo through the training loop (k1 in the reward: a reference, the KL metrics). REINFORCE keeps no old
    log-probs: its ratio is exp(0) = 1 exactly."""
    from prefzoo.training.loop import Trainer

    cfg = compose(["algo=rloo", "reward=sentiment", LETTER_REWARD, "trainer.max_steps=2", "trainer.lr=0.01"] + TINY_RUN)
    summary = Trainer(cfg, tmp_path).run()
    metrics = summary["final_train_metrics"]
    for key in ("reward", "reward_std", "kl", "kl_k3", "clip_fraction", "ratio_mean", "approx_kl", "entropy"):
        assert key in metrics, key
    assert summary["steps"] == 2 and metrics["ratio_mean"] == 1.0


@pytest.mark.parametrize("advantage", [2.0, -2.0])
def test_clipped_sequence_clips_the_whole_completions_ratio_as_trl_does(advantage):
    """``policy_loss=clipped_sequence`` (TRL 1.16's RLOO): one ratio per completion, s = pi(y)/pi_old(y), the PRODUCT
    of the token ratios (1.5, 0.9, 0.5) = 0.675, clipped once at eps 0.2 ([0.8, 1.2]).
    A = +2: min(0.675 * 2, 0.8 * 2) = 1.35, unclipped: loss -1.35 on each of the 3 tokens (the sequence mean is
    TRL's per-sequence loss) and d loss / d log pi_t = -A s = -1.35 on EVERY token (the whole sequence is one
    action; ``clipped`` per token would zero the first token, ratio 1.5 > 1.2, and give the others -A r_t / 3).
    A = -2: min(0.675 * -2, 0.8 * -2) = -1.6, the clipped term: loss 1.6 and no gradient at all, clip_fraction 1."""
    from tests.algos.test_cispo import RowPolicy, hand_batch

    policy, batch = RowPolicy(), hand_batch()
    policy.logp = torch.nn.Parameter(policy.logp.detach().double())  # the same row in float64
    ratios = torch.tensor([[1.5, 0.9, 0.5, 1.0]], dtype=torch.float64)
    batch.old_logps = torch.where(batch.completion_mask, policy.logp.detach() - torch.log(ratios), 9.0)
    batch.advantages = torch.where(batch.loss_mask, advantage, 0.0)
    algo = RLOO(RLOOConfig(policy_loss="clipped_sequence", num_minibatches=2), ObjectiveSettings(beta=0.0))
    out = algo.loss(policy, batch)
    clipped = advantage < 0
    want = 1.6 if clipped else -1.35
    f64 = dict(dtype=torch.float64)
    torch.testing.assert_close(out.values.detach(), torch.tensor([[want, want, want, 0.0]], **f64), rtol=0, atol=1e-12)
    aggregate_loss(out.values, out.mask, algo.declaration.aggregation, 1.0).backward()
    grad = 0.0 if clipped else -1.35
    torch.testing.assert_close(policy.logp.grad, torch.tensor([[grad, grad, grad, 0.0]], **f64), rtol=0, atol=1e-12)
    assert token_mean(out, "clip_fraction") == (1.0 if clipped else 0.0)
    assert token_mean(out, "ratio_mean") == pytest.approx(0.675, abs=1e-12)
