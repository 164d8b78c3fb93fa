"""GRPO plugin: experience layout, importance ratio, KL placement, aggregation, and no reference at beta = 0.

Tolerances (tests/bounds.py). ``TwoTokenPolicy`` is float32 and so are the plugin's advantages and KL terms. A test
that recomputes what the plugin computes (the k3 term, the shaped rewards' group mean) compares two float32
computations of one quantity in different orders (kind 2): each is at most 8 roundings in a row on numbers no larger
than the magnitude M the test names, so they differ by at most 2 gamma_8 M (Higham's gamma, u32 = 2^-24); the sums
are of 3 or 4 terms. The group advantages are computed in float64 and rounded once to float32 (kind 1: u32
relative against the float64 hand value). Means of counts and of integer rewards are exact.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from prefzoo.algos.grpo import GRPO, GRPOConfig
from prefzoo.types import Experience, ObjectiveSettings, PromptBatch, SequenceBatch
from tests.bounds import U32, gamma


class TwoTokenPolicy:
    """A policy over completions of length <= 3 from a 5-token vocabulary: logits are a parameter table
    indexed by position, so log-probs are independent of the prompt (enough to test the plugin's maths)."""

    def __init__(self, seed: int = 0, with_reference: bool = True):
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.nn.Parameter(torch.randn(3, 5, generator=g))
        self.ref = torch.randn(3, 5, generator=g)
        self.reference = object() if with_reference else None
        self.sampled = None

    def _lp(self, table, batch, temperature):
        lp = torch.log_softmax(table / temperature, -1)  # (3, 5)
        c = batch.completion_ids.shape[1]
        out = lp[torch.arange(c)][None].expand(len(batch), c, 5).gather(-1, batch.completion_ids[..., None])[..., 0]
        return out.masked_fill(~batch.completion_mask, 0.0)

    def logps(self, batch, temperature=1.0, with_entropy=False):
        ent = None
        if with_entropy:
            p = torch.softmax(self.logits.detach() / temperature, -1)
            ent = (-(p * p.log()).sum(-1))[: batch.completion_ids.shape[1]][None].expand(len(batch), -1)
            ent = ent.masked_fill(~batch.completion_mask, 0.0)
        return self._lp(self.logits, batch, temperature), ent

    def ref_logps(self, batch, temperature=1.0):
        return self._lp(self.ref, batch, temperature).detach()

    def sample(self, prompts, n, params):
        g = torch.Generator().manual_seed(1)
        b = prompts.prompt_ids.shape[0] * n
        ids = torch.randint(0, 5, (b, 3), generator=g)
        lengths = torch.tensor([3, 2, 1, 3] * (b // 4 + 1))[:b]
        mask = torch.arange(3)[None] < lengths[:, None]
        self.sampled = SequenceBatch(prompts.prompt_ids.repeat_interleave(n, 0), prompts.prompt_mask.repeat_interleave(n, 0),
                                     ids.masked_fill(~mask, 0), mask, torch.arange(prompts.prompt_ids.shape[0]).repeat_interleave(n),
                                     lengths == 3)
        return self.sampled


def make(beta=0.0, estimator="k3", placement="as_loss", **cfg):
    return GRPO(GRPOConfig(**cfg), ObjectiveSettings(beta=beta, kl_estimator=estimator, kl_placement=placement))


PROMPTS = PromptBatch(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool), {})


def token_mean(out, key):
    """A per-token metric of a LossOutput: its (sum, count) pair divided."""
    total, count = out.token_metrics[key]
    return total / count


def fixed_scores(values):
    return lambda samples, prompts: torch.tensor(values, dtype=torch.float32)


def test_advantages_are_group_relative_and_broadcast_per_completion():
    """Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3); advantages +-0.5/(sqrt(1/3) + 1e-4) = +-0.866 (eps
    1e-4). Group [0, 0, 0, 0]: all equal -> exactly 0. Advantages are per token, (B, T): each row's value on its
    counted tokens, 0 on padding. The plugin computes them in float64 and rounds once to float32: within u32
    relative of the float64 hand value (plus ~1e-16 of float64: 2 u32). The mean reward of 0/1 rewards is exact."""
    algo = make(num_samples=4)
    exp, m = algo.make_experience(TwoTokenPolicy(), PROMPTS, fixed_scores([1, 0, 0, 1, 0, 0, 0, 0]))
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    per_row = (torch.tensor([1, -1, -1, 1], dtype=torch.float64) * expected)[:, None].expand(4, 3)
    assert exp.advantages.shape == exp.completion_mask.shape
    torch.testing.assert_close(exp.advantages[:4].double(), per_row.masked_fill(~exp.completion_mask[:4], 0.0),
                               rtol=2 * U32, atol=0)
    assert torch.equal(exp.advantages[4:], torch.zeros(4, 3))
    assert m["frac_zero_std_groups"] == 0.5
    assert m["reward"] == 0.25


def test_maxrl_takes_its_authors_eps_by_default():
    """``algo.scale_rewards=mean`` (MaxRL) with the config's default ``advantage_eps``: the authors' code divides by
    mean + 1e-6 (Tajwar et al. 2026, their verl ``compute_maxrl_outcome_advantage``), GRPO's std keeps TRL's 1e-4.
    Group [1, 0, 0, 0]: mean 1/4, A = (1 - 1/4) / (1/4 + 1e-6) = 0.75 / 0.250001 = 2.99998800005 for the right answer
    and -0.25 / 0.250001 = -0.99999600002 for the others (with 1e-4: 2.99880 and -0.99960, 4e-4 relative off).
    Group [0, 0, 0, 0]: mean 0, advantage 0. Computed in float64, rounded once to float32: within u32 relative
    (kind 1, plus float64's 1e-16: 2 u32)."""
    algo = make(num_samples=4, scale_rewards="mean")
    exp, _ = algo.make_experience(TwoTokenPolicy(), PROMPTS, fixed_scores([1, 0, 0, 0, 0, 0, 0, 0]))
    per_row = torch.tensor([2.99998800004800, *[-0.99999600001600] * 3], dtype=torch.float64)
    torch.testing.assert_close(exp.advantages[:4, 0].double(), per_row, rtol=2 * U32, atol=0)
    assert torch.equal(exp.advantages[4:], torch.zeros(4, 3))
    assert make(num_samples=4, scale_rewards="mean").cfg.advantage_eps == 1e-6  # filled in: config.yaml records it
    assert make(num_samples=4).cfg.advantage_eps == 1e-4  # the std's (the test above)


def test_single_iteration_ratio_is_exactly_one_and_loss_is_minus_advantage():
    algo = make(num_samples=4)
    policy = TwoTokenPolicy()
    exp, _ = algo.make_experience(policy, PROMPTS, fixed_scores([1, 0, 0, 1, 0, 1, 0, 0]))
    assert exp.old_logps is None
    out = algo.loss(policy, exp)
    assert token_mean(out, "ratio_mean") == 1.0
    expected = (-exp.advantages).masked_fill(~exp.completion_mask, 0.0)
    assert torch.equal(out.values, expected)


def test_multiple_iterations_store_old_logps_at_sampling_time():
    algo = make(num_samples=4, epochs=2)
    policy = TwoTokenPolicy()
    exp, _ = algo.make_experience(policy, PROMPTS, fixed_scores([1, 0, 0, 1, 0, 1, 0, 0]))
    assert torch.equal(exp.old_logps, policy.logps(exp)[0].detach())
    with torch.no_grad():
        policy.logits.add_(0.3)
        policy.logits[0, 0] += 1.0
    out = algo.loss(policy, exp)
    assert token_mean(out, "ratio_mean") != 1.0


def test_beta_zero_needs_no_reference_and_beta_positive_does():
    assert not make(beta=0.0).declaration.reference
    assert make(beta=0.04).declaration.reference


@pytest.mark.numerics
def test_kl_as_loss_adds_beta_times_k3_per_token():
    """k3(rho) = exp(-rho) - 1 + rho with rho = logps - ref_logps; the loss gains beta * k3 on counted tokens.

    Kind 2, per token (module docstring): the plugin's k3 (a series below |rho| = 0.1, expm1 above), added to -A and
    taken off again, against the test's direct float32 formula: M = |A| + beta (e^-rho + 1 + |rho|), bound 2 gamma_8 M
    (1.5e-5 at the largest |rho| here, 3.25; measured 8.9e-8 at 1 and 2 threads; the old atol 1e-6 + rtol 1e-5 was
    not derived). The test's direct form loses digits to cancellation for small rho (~2 u32), inside the bound."""
    beta = 0.5
    policy = TwoTokenPolicy()
    with_kl, without = make(beta=beta, num_samples=4), make(beta=0.0, num_samples=4)
    scores = fixed_scores([1, 0, 0, 1, 0, 1, 0, 0])
    exp, _ = with_kl.make_experience(policy, PROMPTS, scores)
    rho = policy.logps(exp)[0].detach() - exp.ref_logps
    k3 = (torch.exp(-rho) - 1 + rho).masked_fill(~exp.completion_mask, 0.0)
    diff = with_kl.loss(policy, exp).values - without.loss(policy, exp).values
    magnitude = exp.advantages.abs() + beta * (torch.exp(-rho) + 1 + rho.abs())
    gap = (diff - beta * k3).abs()
    assert bool((gap <= 2 * gamma(8) * magnitude).all()), (gap.max(), magnitude.max())


@pytest.mark.numerics
def test_kl_in_reward_shifts_rewards_before_group_normalisation():
    """In-reward k1: shaped reward = r - beta * sum_t rho_t; with scale=none the advantage is shaped - group mean.

    Kind 2 (module docstring): the plugin's float32 sum over the 3 tokens and its float64 group mean against the
    test's float32 ones; every value is at most 2 M with M = max_i (|r_i| + beta sum_t |rho_i,t|) (the centred
    reward), so the two differ by at most 2 gamma_8 (2 M)."""
    beta = 0.5
    policy = TwoTokenPolicy()
    algo = make(beta=beta, estimator="k1", placement="in_reward", num_samples=4, scale_rewards="none")
    r = torch.tensor([1, 0, 0, 1, 0, 1, 0, 0], dtype=torch.float32)
    exp, _ = algo.make_experience(policy, PROMPTS, fixed_scores(r.tolist()))
    rho = (policy.logps(exp)[0].detach() - exp.ref_logps).sum(-1)
    shaped = (r - beta * rho).view(2, 4)
    want = (shaped - shaped.mean(-1, keepdim=True)).flatten()[:, None].expand(8, 3)
    magnitude = float((r.abs() + beta * (policy.logps(exp)[0].detach() - exp.ref_logps).abs().sum(-1)).max())
    torch.testing.assert_close(exp.advantages, want.masked_fill(~exp.completion_mask, 0.0),
                               rtol=0, atol=2 * gamma(8) * 2 * magnitude)
    out = algo.loss(policy, exp)
    assert "kl_loss" not in out.token_metrics  # the KL is not also added as a loss


@pytest.mark.parametrize("aggregation,expected", [("grpo", "sequence_mean"), ("dapo", "token_mean"), ("dr_grpo", "constant")])
def test_loss_aggregation_names(aggregation, expected):
    """The declaration carries the reduction; Dr. GRPO's constant is the generation budget (max_new_tokens)."""
    d = make(loss_aggregation=aggregation).declaration
    assert d.aggregation == expected
    assert d.aggregation_constant == (64 if aggregation == "dr_grpo" else None)


def test_mask_truncated_drops_rows_without_eos():
    algo = make(num_samples=4, mask_truncated=True)
    exp, _ = algo.make_experience(TwoTokenPolicy(), PROMPTS, fixed_scores([1, 0, 0, 1, 0, 1, 0, 0]))
    assert exp.truncated.any()
    assert not exp.loss_mask[exp.truncated].any()
    assert torch.equal(exp.loss_mask[~exp.truncated], exp.completion_mask[~exp.truncated])


def test_experience_rows_select_together():
    algo = make(num_samples=4, epochs=2)
    exp, _ = algo.make_experience(TwoTokenPolicy(), PROMPTS, fixed_scores([1, 0, 0, 1, 0, 1, 0, 0]))
    sub = exp.select([5, 1])
    assert isinstance(sub, Experience)
    assert torch.equal(sub.advantages, exp.advantages[[5, 1]])
    assert torch.equal(sub.old_logps, exp.old_logps[[5, 1]])
    assert torch.equal(sub.rewards, exp.rewards[[5, 1]])


def _updated_logits(exp, num_minibatches=2, lr=5.0):
    """The logits after one training step (the loop's optimisation_step) of GRPO with ``num_minibatches``
    mini-batches in row order, SGD at ``lr``, on the rollout ``exp``; and the step's metrics."""
    from prefzoo.training.step import mean_metrics, optimisation_step

    algo, policy = make(num_samples=4, num_minibatches=num_minibatches), TwoTokenPolicy()
    opt = torch.optim.SGD([policy.logits], lr=lr)
    totals = optimisation_step(algo, policy, exp, opt, None, [policy.logits], None, permutation=lambda n: list(range(n)))
    return policy.logits.detach(), mean_metrics(totals)


def test_one_epoch_of_two_minibatches_takes_the_second_ratio_against_the_sampling_policy():
    """The defect of the copies (fails before the online family): GRPO kept log pi_old only when epochs > 1, so with
    ``num_minibatches=2`` and one epoch the second mini-batch -- sampled by the policy BEFORE the first optimizer step
    -- was trained at ratio exactly 1 (clip_fraction 0, approx_kl 0).

    Rollout: 2 prompts x G = 4, rewards [1, 0, 0, 1 | 1, 1, 0, 0] (both groups informative), mini-batches in row
    order (prompt 0's group, then prompt 1's). The policy's logits are shared by every row (per position), and SGD at
    lr 5 moves them by O(1) in the first optimizer step, so on the second mini-batch pi_theta1 / pi_sampling leaves
    [0.8, 1.2]. Checked against what this test builds itself:
    (1) the update equals the one on the same rollout with log pi at sampling time stored by hand before any step;
    (2) clip_fraction is (tokens of the second mini-batch whose ratio at theta_1 is past the clip on its advantage's
        side) / (tokens of both mini-batches), computed here from theta_1 -- and it is > 0, as is approx_kl;
    (3) the update at ratio 1 (old_logps removed: the defect) is a different one.
    """
    from prefzoo.training.step import accumulate_gradients

    sampler = TwoTokenPolicy()
    exp, _ = make(num_samples=4, num_minibatches=2).make_experience(sampler, PROMPTS, fixed_scores([1, 0, 0, 1, 1, 1, 0, 0]))
    assert exp.old_logps is not None
    by_hand = dataclasses.replace(exp, old_logps=sampler.logps(exp)[0].detach())
    logits, metrics = _updated_logits(exp)
    torch.testing.assert_close(logits, _updated_logits(by_hand)[0], rtol=0, atol=0)

    theta_1 = TwoTokenPolicy()  # the first optimizer step alone (prompt 0's group, on-policy: ratio 1)
    opt = torch.optim.SGD([theta_1.logits], lr=5.0)
    accumulate_gradients(make(num_samples=4), theta_1, exp.select([0, 1, 2, 3]), 4)
    opt.step()
    second = exp.select([4, 5, 6, 7])
    ratio = torch.exp(theta_1.logps(second)[0].detach() - by_hand.old_logps[4:])
    adv, mask = second.advantages, second.completion_mask
    past = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    expected = float((past & mask).sum()) / float(exp.completion_mask.sum())
    assert expected > 0 and metrics["clip_fraction"] == expected  # counts over counts: exact
    assert metrics["approx_kl"] > 1e-3 and metrics["ratio_mean"] != 1.0

    at_ratio_one, _ = _updated_logits(dataclasses.replace(exp, old_logps=None))
    assert (at_ratio_one - logits).abs().max() > 1e-2
