"""REINFORCE++ plugin: token-level k1 in the reward, reward-to-go, global batch normalisation (and under two
processes), the group-baseline variant, and a 2-step run on the tiny model through the loop.

The hand cases use PPO's scripted policy (tests/algos/test_ppo.py): two completions of lengths 3 and 2 with
log pi_old - log pi_ref = rho = [0.5, -0.2, 0.1 | pad] and [1.0, 0.0 | pad, pad], rewards (1.0, -0.5).

Tolerances (tests/bounds.py, kind 1: the hand cases are exact). The scripted policy's tables are float64 and so is
REINFORCE++'s arithmetic (a few roundings of numbers below 3, whitening included, u64 = 1.1e-16 relative each; the 1e-8
of the whitening's sqrt(var + 1e-8) is in :func:`whitened` too): bound 1e-12, over 1000x. Two results are float32 by
design: the advantages, rounded once at the end (prefzoo/algos/online.py), <= u32 x 1.3 = 7.7e-8, bound 1e-6, 13x
(measured <= 4.4e-8, 2026-12-06); the drift metric kl (prefzoo/objective/kl.py), float32 log-ratios summed over <= 3
tokens and averaged over 2 rows, <= 5.6e-7 (tests/algos/test_ppo.py), bound 1e-6. The docstrings' 4-decimal
values are checked against :func:`whitened` within 1e-4 (one 4-decimal rounding, <= 5e-5).
"""

from __future__ import annotations

import math

import pytest
import torch

from prefzoo.algos.reinforce_pp import ReinforcePP, ReinforcePPConfig
from prefzoo.errors import ConfigError
from prefzoo.types import ObjectiveSettings, PromptBatch, SequenceBatch, StepContext
from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN, compose
from tests.algos.test_ppo import PROMPTS, SCORES, ScriptedPolicy, token_mean
from tests.models.helpers import one_thread_fixture


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


class OnePromptTwoSamples(ScriptedPolicy):
    """The same two completions, as a group of G = 2 answers to ONE prompt."""

    def sample(self, prompts, n, params):
        assert prompts.prompt_ids.shape[0] * n == 2
        return SequenceBatch(prompts.prompt_ids.repeat_interleave(n, 0), prompts.prompt_mask.repeat_interleave(n, 0),
                             torch.tensor([[5, 6, 2, 0], [7, 8, 0, 0]]), self.mask.clone(), torch.zeros(2, dtype=torch.long),
                             torch.tensor([False, True]))


ONE_PROMPT = PromptBatch(torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), {})


def make(beta=0.1, placement="in_reward", **cfg):
    return ReinforcePP(ReinforcePPConfig(**cfg), ObjectiveSettings(beta=beta, kl_estimator="k1", kl_placement=placement))


def whitened(values):
    """(v - mean) / sqrt(var + 1e-8), population variance, by hand."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_token_kl_reward_to_go_and_batch_normalisation_by_hand():
    """beta = 0.1, k1: per-token penalties -0.1 rho = [-0.05, 0.02, -0.01] and [-0.1, 0.0]; the rewards land on
    the last tokens: r~ = [-0.05, 0.02, 0.99] and [-0.1, -0.5]. Reward-to-go (gamma = 1): [0.96, 1.01, 0.99] and
    [-0.6, -0.5]. Over the 5 valid tokens: mean 1.86/5 = 0.372, population variance 2.83988/5 = 0.567976, so
    A = (G - 0.372)/sqrt(0.567976): [0.7802, 0.8466, 0.8200 | -1.2897, -1.1571]; 0 on padding."""
    exp, m = make(num_samples=1).make_experience(ScriptedPolicy(), PROMPTS, SCORES)
    want = whitened([0.96, 1.01, 0.99, -0.6, -0.5])
    assert want[0] == pytest.approx(0.7802, abs=1e-4) and want[3] == pytest.approx(-1.2897, abs=1e-4)
    expected = torch.tensor([want[:3] + [0.0], want[3:] + [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(exp.advantages.double(), expected, rtol=0, atol=1e-6)
    assert m["non_score_reward"] == pytest.approx((-0.04 - 0.1) / 2, abs=1e-12)
    assert m["return_std"] == pytest.approx(math.sqrt(0.567976), rel=1e-12)
    assert m["kl"] == pytest.approx((0.4 + 1.0) / 2, abs=1e-6)


def test_group_baseline_subtracts_the_group_mean_from_r_only():
    """One prompt, G = 2, rewards (1.0, -0.5): group mean 0.25, so r becomes (0.75, -0.75); the penalties stay.
    r~ = [-0.05, 0.02, 0.74] and [-0.1, -0.75]; reward-to-go [0.71, 0.76, 0.74] and [-0.85, -0.75]; then the
    same batch normalisation (mean 0.61/5 = 0.122)."""
    exp, _ = make(num_samples=2, baseline="group").make_experience(OnePromptTwoSamples(), ONE_PROMPT, SCORES)
    want = whitened([0.71, 0.76, 0.74, -0.85, -0.75])
    torch.testing.assert_close(exp.advantages.double(), torch.tensor([want[:3] + [0.0], want[3:] + [0.0, 0.0]],
                                                                     dtype=torch.float64), rtol=0, atol=1e-6)


def test_the_normalisation_is_global_under_data_parallelism():
    """Two processes holding one completion each must get the advantages of the whole batch: an all-reduce that
    adds the other process's statistics (row 1's returns [-0.6, -0.5], from the hand case above) makes row 0's
    advantages equal to its share of the 5-token whitening."""
    algo = make(num_samples=1)
    other = torch.tensor([-0.6, -0.5], dtype=torch.float64)
    calls = []

    def all_reduce(t):  # process 1's contribution: [sum, count], then the squared deviations from the global mean
        calls.append(t.clone())
        if len(calls) == 1:
            return t + torch.tensor([float(other.sum()), 2.0], dtype=t.dtype)
        mean = float((calls[0][0] + other.sum()) / (calls[0][1] + 2))
        return t + ((other - mean) ** 2).sum().reshape(1)


    class RowZero(ScriptedPolicy):
        def __init__(self):
            super().__init__()
            self.mask, self.logp, self.ref = self.mask[:1], torch.nn.Parameter(self.logp.detach()[:1]), self.ref[:1]

        def sample(self, prompts, n, params):
            return SequenceBatch(prompts.prompt_ids, prompts.prompt_mask, torch.tensor([[5, 6, 2, 0]]),
                                 self.mask.clone(), torch.zeros(1, dtype=torch.long), torch.tensor([False]))

    one = PromptBatch(torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), {})
    exp, _ = algo.make_experience(RowZero(), one, lambda s, p: torch.tensor([1.0]), StepContext(all_reduce=all_reduce))
    want = torch.tensor(whitened([0.96, 1.01, 0.99, -0.6, -0.5])[:3], dtype=torch.float64)
    torch.testing.assert_close(exp.advantages[0, :3].double(), want, rtol=0, atol=1e-6)
    assert len(calls) == 2


def test_loss_is_the_clipped_surrogate_and_the_kl_can_move_to_the_loss():
    """One optimizer step: ratio exactly 1, loss = -A per token. As a loss (k1 here): the reward keeps only r,
    and kl_loss is the token mean of rho over the 5 tokens, (0.5 - 0.2 + 0.1 + 1.0 + 0.0)/5 = 0.28."""
    algo = make(num_samples=1)
    exp, _ = algo.make_experience(ScriptedPolicy(), PROMPTS, SCORES)
    out = algo.loss(ScriptedPolicy(), exp)
    torch.testing.assert_close(out.values.detach(), -exp.advantages.double(), rtol=0, atol=0)  # ratio exp(0) = 1: exact
    assert token_mean(out, "ratio_mean") == 1.0 and token_mean(out, "clip_fraction") == 0.0
    as_loss = make(num_samples=1, placement="as_loss")
    exp2, m2 = as_loss.make_experience(ScriptedPolicy(), PROMPTS, SCORES)
    assert m2["non_score_reward"] == 0.0
    assert token_mean(as_loss.loss(ScriptedPolicy(), exp2), "kl_loss") == pytest.approx(0.28, abs=1e-12)


def test_settings_it_refuses_and_its_declaration():
    with pytest.raises(ConfigError, match="algo.num_samples=1: must be >= 1, and >= 2 with algo.baseline=group"):
        make(num_samples=1, baseline="group")
    with pytest.raises(ConfigError, match="algo.baseline='mean'"):
        make(baseline="mean")
    d = make().declaration
    assert d.aggregation == "token_mean" and d.reference and d.online and d.num_samples == 4
    assert ReinforcePPConfig().default_beta == 0.01


def test_reinforce_pp_runs_two_steps_on_the_tiny_model(tmp_path):
    from prefzoo.training.loop import Trainer

    cfg = compose(["algo=reinforce_pp", "algo.baseline=group", "reward=sentiment", LETTER_REWARD, "trainer.max_steps=2",
                   "trainer.lr=0.01"] + TINY_RUN)
    summary = Trainer(cfg, tmp_path).run()
    metrics = summary["final_train_metrics"]
    for key in ("reward", "reward_std", "kl", "kl_k3", "clip_fraction", "ratio_mean", "approx_kl", "entropy",
                "non_score_reward", "return_std"):
        assert key in metrics, key
    assert summary["steps"] == 2
