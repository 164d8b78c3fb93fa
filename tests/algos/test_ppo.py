"""PPO plugin: per-token reward layout, GAE on a hand-computed rollout, whitening, clipping, adaptive beta,
and a tiny end-to-end run through the shared training loop.

The hand cases use a scripted policy whose log-probs, reference log-probs and values are fixed tables, so
every expected number below is derived in the docstrings, not by the code under test.

Tolerances (tests/bounds.py, kind 1: the hand cases are exact). The tables are float64 and the rollout's and the loss's
arithmetic keeps float64 but in three places that round to float32 by design: the values (``old_values.float()``
in prefzoo/algos/ppo.py), the drift metrics (kl, kl_k3: prefzoo/objective/kl.py) and the ratio statistics
(ratio_mean, approx_kl: prefzoo/objective/surrogate.py). So:

* advantages and returns: the values' rounding, <= u32 x 0.4 = 2.4e-8 each, enters an advantage with total weight
  <= 2 (V_t itself, and gamma (1 - lambda) / (1 - gamma lambda) <= 1 for the later ones) and a return with <= 1:
  <= 4.8e-8; whitening (std 0.75) at most doubles it. Bound 1e-6, 10x; measured <= 1.7e-8 (2026-12-06).
* explained variance, 1 - Var[R - V] / Var[R] = 0.0043: the cancellation amplifies its inputs' errors, by
  sum |dEV/dR_i| = 5.2 and sum |dEV/dV_i| = 2.6 here: <= 1.9e-7; measured 2.1e-9. Bound 1e-6 absolute (it was 1e-5
  relative, 4.3e-8: inside that worst case, and 1.6x the 2.65e-8 measured with the former float32 tables).
* the float32 metrics, from log-ratios that are differences of two log-probs rounded to float32 (|log pi| <= 2.2):
  kl, summed over <= 3 tokens and averaged over 2 rows, <= 9.4 u32 = 5.6e-7, bound 1e-6; kl_k3, the same through
  expm1(-r) + r, < 3e-6, bound 1e-5; ratio_mean 1.5 and approx_kl 0.5 - log 1.5 = 0.095, one float32 exp or expm1
  (1 ulp) per token and a float32 sum of 5, <= 6e-7, bound 1e-6. Measured <= 7.2e-8 (2026-12-06).
* everything else is float64 (within 1e-12: a few roundings of numbers below 3, u64 = 1.1e-16 each) or exact: means
  of binary fractions (0.25, 2.5, 0.5, 2.0), counts (3/5), a copy (kl_spent), the reward placed by one float32
  addition that the expected value repeats.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from prefzoo.types import ObjectiveSettings, PromptBatch, SequenceBatch
from prefzoo.algos.ppo import PPO, PPOConfig
from prefzoo.objective import add_sequence_reward
from prefzoo.types import Experience
from prefzoo.objective import ObjectiveError
from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN, compose
from tests.models.helpers import one_thread_fixture

GARBAGE = 7.0  # written on padding wherever a tensor may hold anything there


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


class ScriptedPolicy:
    """Two completions, lengths 3 and 2 (padded to 4). Fixed per-token tables:

        log pi_old - log pi_ref = rho:  row 0 [0.5, -0.2, 0.1 | pad], row 1 [1.0, 0.0 | pad, pad]
        values V_old:                   row 0 [0.1, 0.2, 0.3 | pad], row 1 [0.4, -0.1 | pad, pad]

    ``logps`` returns the trainable table ``self.logp`` (0 on padding, as the protocol says); values and
    reference log-probs carry GARBAGE on padding to show it never leaks. Row 1 is truncated (no EOS). float64.
    """

    def __init__(self):
        f64 = dict(dtype=torch.float64)  # the tables in float64 (module docstring, Tolerances)
        self.mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
        self.logp = torch.nn.Parameter(torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -1.2, 0.0, 0.0]], **f64))
        rho = torch.tensor([[0.5, -0.2, 0.1, 0.0], [1.0, 0.0, 0.0, 0.0]], **f64)
        self.ref = torch.where(self.mask, self.logp.detach() - rho, torch.full_like(rho, GARBAGE))
        self.value_table = torch.nn.Parameter(torch.tensor([[0.1, 0.2, 0.3, GARBAGE], [0.4, -0.1, GARBAGE, GARBAGE]],
                                                           **f64))
        self.reference = object()

    def sample(self, prompts, n, params):
        b = prompts.prompt_ids.shape[0] * n
        assert b == 2
        return SequenceBatch(prompts.prompt_ids, prompts.prompt_mask, torch.tensor([[5, 6, 2, 0], [7, 8, 0, 0]]),
                             self.mask.clone(), torch.arange(2), torch.tensor([False, True]))

    def logps(self, batch, temperature=1.0, with_entropy=False):
        lp = self.logp.masked_fill(~batch.completion_mask, 0.0)
        return lp, (torch.full_like(lp, 2.0).masked_fill(~batch.completion_mask, 0.0) if with_entropy else None)

    def ref_logps(self, batch, temperature=1.0):
        return self.ref.clone()

    def values(self, batch):
        return self.value_table * 1.0

    def logps_and_values(self, batch, temperature=1.0, with_entropy=False):
        return (*self.logps(batch, temperature, with_entropy), self.values(batch))


PROMPTS = PromptBatch(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool), {})
SCORES = lambda samples, prompts: torch.tensor([1.0, -0.5])  # noqa: E731


def make(beta=0.1, controller="fixed", target=None, horizon=10000, placement="in_reward", **cfg) -> PPO:
    objective = ObjectiveSettings(beta=beta, kl_estimator="k1", kl_placement=placement, kl_controller=controller,
                                  kl_target=target, kl_horizon=horizon)
    return PPO(PPOConfig(**cfg), objective)


def token_mean(out, key):
    """A per-token metric of a LossOutput: its (sum, count) pair divided."""
    total, count = out.token_metrics[key]
    return total / count


def experience(algo, policy=None):
    return algo.make_experience(policy or ScriptedPolicy(), PROMPTS, SCORES)


# ------------------------------------------------------------------------- reward layout


def test_sequence_reward_lands_on_the_last_real_token_of_each_row():
    """Rows of lengths 3, 1, 4 and 0: the reward goes to columns 2, 0, 3 and nowhere; padding keeps its value."""
    base = torch.arange(16, dtype=torch.float32).view(4, 4) / 100
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    out = add_sequence_reward(base, torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    expected = base.clone()
    expected[0, 2] += 1.0
    expected[1, 0] += 2.0
    expected[2, 3] += 3.0
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # the same float32 additions: exact
    # a hole in the mask: the last True position still gets it
    hole = torch.tensor([[True, False, True, False]])
    torch.testing.assert_close(add_sequence_reward(torch.zeros(1, 4), torch.tensor([5.0]), hole),
                               torch.tensor([[0.0, 0.0, 5.0, 0.0]]), rtol=0, atol=0)
    with pytest.raises(ObjectiveError):
        add_sequence_reward(torch.zeros(2, 4), torch.zeros(3), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ObjectiveError):
        add_sequence_reward(torch.zeros(1, 4), torch.zeros(1), torch.ones(1, 4))


def test_rollout_rewards_advantages_and_returns_by_hand():
    """beta = 0.1, k1: KL rewards -0.1 rho = row 0 [-0.05, 0.02, -0.01], row 1 [-0.1, 0.0]; scores 1.0 and -0.5
    land on the last real token: r~ = row 0 [-0.05, 0.02, 0.99], row 1 [-0.1, -0.5].

    GAE, gamma = 1, lambda = 0.95, V = 0 after the last token:
      row 0: d2 = 0.99 - 0.3 = 0.69,          A2 = 0.69
             d1 = 0.02 + 0.3 - 0.2 = 0.12,    A1 = 0.12 + 0.95 * 0.69 = 0.7755
             d0 = -0.05 + 0.2 - 0.1 = 0.05,   A0 = 0.05 + 0.95 * 0.7755 = 0.786725
      row 1: d1 = -0.5 + 0.1 = -0.4,          A1 = -0.4
             d0 = -0.1 - 0.1 - 0.4 = -0.6,    A0 = -0.6 - 0.95 * 0.4 = -0.98
    returns = A + V: row 0 [0.886725, 0.9755, 0.99], row 1 [-0.58, -0.5]; padding exactly 0.
    """
    exp, metrics = experience(make(whiten_advantages=False))
    assert isinstance(exp, Experience)
    torch.testing.assert_close(exp.advantages, torch.tensor([[0.786725, 0.7755, 0.69, 0.0], [-0.98, -0.4, 0.0, 0.0]],
                                                            dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(exp.returns, torch.tensor([[0.886725, 0.9755, 0.99, 0.0], [-0.58, -0.5, 0.0, 0.0]],
                                                         dtype=torch.float64), rtol=0, atol=1e-6)
    # metrics: score mean 0.25; KL k1 per sequence 0.4 and 1.0 -> 0.7; non-score reward -0.1 * 0.7
    assert metrics["reward"] == 0.25  # (1 - 0.5) / 2: exact
    assert metrics["kl"] == pytest.approx(0.7, abs=1e-6)
    k3 = lambda r: math.exp(-r) - 1 + r  # noqa: E731
    assert metrics["kl_k3"] == pytest.approx((k3(0.5) + k3(-0.2) + k3(0.1) + k3(1.0)) / 2, abs=1e-5)
    assert metrics["non_score_reward"] == pytest.approx(-0.07, abs=1e-12)
    assert metrics["reward_total"] == pytest.approx((0.96 - 0.6) / 2, abs=1e-12)
    assert metrics["completion_length"] == 2.5 and metrics["frac_truncated"] == 0.5 and metrics["entropy"] == 2.0
    returns = [0.886725, 0.9755, 0.99, -0.58, -0.5]
    values = [0.1, 0.2, 0.3, 0.4, -0.1]
    ev = 1 - statistics.pvariance([r - v for r, v in zip(returns, values)]) / statistics.pvariance(returns)
    assert metrics["explained_variance"] == pytest.approx(ev, abs=1e-6)


def test_missing_eos_penalty_and_entropy_bonus_are_rewards():
    """beta = 0, missing_eos_penalty = 1, entropy_coef = 0.1: row 1 (truncated) scores -0.5 - 1 = -1.5; every token
    earns -0.1 log pi_old: row 0 [0.1, 0.2, 0.05], row 1 [0.03, 0.12]. With V as above, lambda = 1 and gamma = 1 the
    return is the reward-to-go: row 0 [0.1 + 0.2 + 1.05, 0.2 + 1.05, 1.05] = [1.35, 1.25, 1.05],
    row 1 [0.03 - 1.38, -1.38] = [-1.35, -1.38]."""
    exp, metrics = experience(make(beta=0.0, missing_eos_penalty=1.0, entropy_coef=0.1, gae_lambda=1.0, whiten_advantages=False))
    torch.testing.assert_close(exp.returns, torch.tensor([[1.35, 1.25, 1.05, 0.0], [-1.35, -1.38, 0.0, 0.0]],
                                                         dtype=torch.float64), rtol=0, atol=1e-6)
    assert metrics["non_score_reward"] == 0.0
    assert metrics["entropy_bonus"] == pytest.approx((0.35 + 0.15) / 2, abs=1e-12)


def test_whitening_uses_valid_tokens_only():
    """Whitened advantages = (A - mean) / std over the 5 valid tokens (population std); padding stays 0 and its
    (garbage) values do not move the statistics."""
    raw = [0.786725, 0.7755, 0.69, -0.98, -0.4]
    mean, std = statistics.fmean(raw), statistics.pstdev(raw)
    exp, _ = experience(make())
    expected = torch.tensor([[(a - mean) / std for a in raw[:3]] + [0.0],
                             [(a - mean) / std for a in raw[3:]] + [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(exp.advantages, expected, rtol=0, atol=1e-6)
    policy = ScriptedPolicy()
    with torch.no_grad():
        policy.value_table[1, 3] = -100.0
    torch.testing.assert_close(experience(make(), policy)[0].advantages, expected, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------ the loss


def test_value_loss_clipping_by_hand():
    """Policy ratio 1 and advantages 0 (policy loss 0), vf_coef 0.5, value clip 0.2, returns 1 everywhere,
    old values 0. New values row 0 [0.5, 0.1, -0.5]: token 0 moved 0.5 > 0.2, so V_clip = 0.2 and
    max((0.5-1)^2, (0.2-1)^2) = 0.64 (clipped, no gradient); token 1: (0.1-1)^2 = 0.81 either way (not clipped);
    token 2: V_clip = -0.2, (-0.5-1)^2 = 2.25 > (-0.2-1)^2 = 1.44 (unclipped branch, gradient V - R = -1.5).
    Per-token loss = 0.5 * 0.5 * [0.64, 0.81, 2.25]; value clip fraction 1/3 (row 1 is padding); gradient
    d loss / d V = vf_coef (V - R) = [0, 0.5 * -0.9, 0.5 * -1.5] (0 where the clipped branch wins)."""
    policy = ScriptedPolicy()
    batch, _ = experience(make(), policy)
    batch.advantages = torch.zeros_like(batch.advantages)
    batch.old_values = torch.zeros(2, 4, dtype=torch.float64)
    batch.returns = torch.ones(2, 4, dtype=torch.float64)
    batch.completion_mask = torch.tensor([[True, True, True, False], [False] * 4])
    with torch.no_grad():
        policy.value_table.copy_(torch.tensor([[0.5, 0.1, -0.5, GARBAGE], [GARBAGE] * 4], dtype=torch.float64))
    algo = make(vf_coef=0.5, value_clip_eps=0.2)
    out = algo.loss(policy, batch)
    torch.testing.assert_close(out.values, torch.tensor([[0.16, 0.2025, 0.5625, 0.0], [0.0] * 4], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert token_mean(out, "value_clip_fraction") == 1 / 3  # counts: exact
    assert token_mean(out, "value_loss") == pytest.approx(0.5 * (0.64 + 0.81 + 2.25) / 3, abs=1e-12)
    assert token_mean(out, "policy_loss") == 0.0 and token_mean(out, "clip_fraction") == 0.0
    out.values.sum().backward()
    torch.testing.assert_close(policy.value_table.grad, torch.tensor([[0.0, 0.5 * -0.9, 0.5 * -1.5, 0.0], [0.0] * 4],
                                                                     dtype=torch.float64), rtol=0, atol=1e-12)


def test_policy_clip_and_approx_kl_by_hand():
    """After an update the new log-probs exceed the old by log 1.5 on every token (ratio 1.5 > 1 + 0.2): tokens with
    A > 0 are clipped (loss -1.2 A, no gradient), tokens with A < 0 are not (loss -1.5 A). approx KL(old || new) per
    token = ratio - 1 - log ratio = 0.5 - log 1.5."""
    policy = ScriptedPolicy()
    batch, _ = experience(make(whiten_advantages=False), policy)
    with torch.no_grad():
        policy.logp.add_(math.log(1.5))
    out = make().loss(policy, batch)
    a = batch.advantages
    expected_pg = torch.where(a > 0, -1.2 * a, -1.5 * a).masked_fill(~batch.completion_mask, 0.0)
    assert token_mean(out, "clip_fraction") == 3 / 5  # row 0 all positive, row 1 negative (counts: exact)
    assert token_mean(out, "policy_loss") == pytest.approx(float(expected_pg.sum() / 5), abs=1e-12)
    assert token_mean(out, "approx_kl") == pytest.approx(0.5 - math.log(1.5), abs=1e-6)
    assert token_mean(out, "ratio_mean") == pytest.approx(1.5, abs=1e-6)


def test_kl_as_loss_moves_the_penalty_out_of_the_reward():
    exp, metrics = experience(make(placement="as_loss", whiten_advantages=False))
    assert metrics["non_score_reward"] == 0.0
    # without the penalty, row 1's rewards are [0, -0.5]: A1 = -0.4, A0 = 0 - 0.1 - 0.4 + 0.95 * -0.4 = -0.88
    torch.testing.assert_close(exp.advantages[1, :2], torch.tensor([-0.88, -0.4], dtype=torch.float64), rtol=0,
                               atol=1e-6)
    out = make(placement="as_loss").loss(ScriptedPolicy(), exp)
    assert token_mean(out, "kl_loss") == pytest.approx((0.5 - 0.2 + 0.1 + 1.0) / 5, abs=1e-12)


def test_adaptive_beta_follows_the_kl():
    """Ziegler et al. 2019: e = clip(KL / target - 1, -0.2, 0.2); beta <- beta (1 + e n / horizon).
    KL 2.0, target 1.0 -> e = 0.2; n = 5, horizon 10 -> beta = 0.05 * 1.1 = 0.055; then KL 0.9 -> e = -0.1,
    beta = 0.055 * (1 - 0.05) = 0.05225. A fixed controller does not move. (Python floats: a few roundings of
    u64 = 1.1e-16 relative; bound 1e-12 relative.)"""
    algo = make(beta=0.05, controller="adaptive", target=1.0, horizon=10)
    assert algo.after_step({"kl": 2.0}, 5)["beta_used"] == 0.05
    assert algo.beta == pytest.approx(0.055, rel=1e-12)
    algo.after_step({"kl": 0.9}, 5)
    assert algo.beta == pytest.approx(0.05225, rel=1e-12)
    fixed = make(beta=0.05)
    fixed.after_step({"kl": 2.0}, 5)
    assert fixed.beta == 0.05


# ---------------------------------------------------------------------- end to end (tiny)


def test_ppo_runs_end_to_end_through_the_loop(tmp_path):
    """algo=ppo reward=sentiment on the tiny model picks the sentiment prompts, trains both adapters and the head,
    logs every metric of issue 5, and checkpoints only the value model's own weights. (VADER scores the tiny model's
    random text 0 almost always, so the reward here is the share of letters: non-zero advantages at once.)"""
    from prefzoo.training.loop import Trainer

    cfg = compose(["algo=ppo", "reward=sentiment", LETTER_REWARD, "trainer.max_steps=2", "algo.epochs=2", "algo.num_minibatches=2",
                   "trainer.micro_batch_size=1", "trainer.lr=0.01"] + TINY_RUN)
    assert cfg.data.name == "sentiment"
    trainer = Trainer(cfg, tmp_path)
    assert "review" in trainer.train_prompts.texts[0]
    value = trainer.policy.value_model
    head0 = value.head.weight.detach().clone()
    adapter0 = [p.detach().clone() for p in value.adapter_params]
    policy0 = [p.detach().clone() for n, p in trainer.model.named_parameters() if ".default." in n]
    summary = trainer.run()
    metrics = summary["final_train_metrics"]
    for key in ("reward", "non_score_reward", "kl", "kl_k3", "beta", "entropy", "policy_loss", "value_loss",
                "value_clip_fraction", "clip_fraction", "approx_kl", "explained_variance", "completion_length"):
        assert key in metrics, key
    # the KL spent so far is this step's rollout KL (what objective.kl_budget compares), reported in the summary
    assert summary["kl_spent"] == metrics["kl"]  # a copy: exact
    assert summary["steps"] == 2 and summary["beta"] == 0.05
    assert not torch.equal(value.head.weight, head0)
    assert any(not torch.equal(p, q) for p, q in zip(value.adapter_params, adapter0))
    assert any(not torch.equal(p, q) for p, q in zip(
        [p for n, p in trainer.model.named_parameters() if ".default." in n], policy0))
    state = torch.load(next((tmp_path / "checkpoints").glob("step-*")) / "trainer_state.pt", weights_only=False)
    assert set(state["value_model"]) == {"head.weight", "head.bias"} | {
        f"adapter_params.{i}" for i in range(len(value.adapter_params))}
    assert (tmp_path / "eval_after.json").is_file()
