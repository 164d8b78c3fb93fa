"""GSPO plugin: the sequence ratio and its clip on a padded hand-made batch, GSPO-token's equal value and gradient,
old log-probs stored across mini-batches, and a 2-step run on the tiny model through the loop.

Tolerances (tests/bounds.py, kind 1): the hand-made batch is float64 (the plugin keeps float64 through; in float32
the log-ratios of 1e-4 carry a rounding of u32 x 0.3 ~ 2e-8, 1e-4 of themselves), so its losses, gradients and
ratio metric equal the hand values up to a few float64 roundings of numbers below 2 (~1e-15): ``EXACT`` = 1e-12
leaves 1000x. A ratio of exactly 1 (the log-probs against their own detached copy) gives exactly -A: no rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from prefzoo.algos.gspo import GSPO, GSPOConfig
from prefzoo.errors import ConfigError
from prefzoo.objective import aggregate_loss
from prefzoo.types import Experience, ObjectiveSettings
from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN, compose
from tests.algos.test_grpo import PROMPTS, TwoTokenPolicy, fixed_scores, token_mean
from tests.models.helpers import one_thread_fixture

GARBAGE = 50.0
#: float64 hand values: a few roundings of numbers below 2, ~1e-15 (module docstring)
EXACT = 1e-12
F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


class TablePolicy:
    """log pi is a trainable (2, 4) float64 table, 0 on padding; entropy 1 per token."""

    reference = None

    def __init__(self):
        self.logp = torch.nn.Parameter(torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -1.2, 0.0, 0.0]], dtype=F64))

    def logps(self, batch, temperature=1.0, with_entropy=False):
        lp = self.logp.masked_fill(~batch.completion_mask, 0.0)
        return lp, (batch.completion_mask.float() if with_entropy else None)


def hand_batch() -> Experience:
    """Row 0: 3 tokens, log(pi/pi_old) = (0.3, -0.1, 0.4), so s_0 = exp(0.2) = 1.2214, advantage +1.5.
    Row 1: 2 tokens, log(pi/pi_old) = (2e-4, 1e-4), so s_1 = exp(1.5e-4), advantage -1; its two pads hold old
    log-probs of GARBAGE = 50 (if they entered, s_1 would be exp((3e-4 - 2*50)/4) ~ e^-25)."""
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    logp = TablePolicy().logp.detach()
    delta = torch.tensor([[0.3, -0.1, 0.4, 0.0], [2e-4, 1e-4, 0.0, 0.0]], dtype=F64)
    old = torch.where(mask, logp - delta, torch.full_like(logp, GARBAGE))
    adv = torch.where(mask, torch.tensor([[1.5], [-1.0]], dtype=F64), torch.zeros((), dtype=F64))
    ids = torch.ones(2, 4, dtype=torch.long)
    return Experience(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool), ids, mask,
                      advantages=adv, loss_mask=mask, old_logps=old, rewards=torch.tensor([1.0, 0.0]))


def make(level="sequence", beta=0.0, **cfg):
    return GSPO(GSPOConfig(importance_sampling_level=level, **cfg), ObjectiveSettings(beta=beta))


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_sequence_ratio_clip_on_a_padded_batch_by_hand(level):
    """The paper's clip [1 - 3e-4, 1 + 4e-4]. Row 0: s_0 = 1.2214 > 1.0004 with A = +1.5 > 0: clipped, loss
    -1.0004 * 1.5 = -1.5006 on each of its 3 tokens, no gradient. Row 1: s_1 = exp(1.5e-4) = 1.00015 inside, loss
    -s_1 * (-1) = 1.00015 on its 2 tokens. Per-sequence mean over 2 sequences: its gradient on row 1's log-probs is
    (1/2) * d(-s_1 A_1)/d logp = (1/2) * s_1 * (1/2) = 0.250038 per token (GSPO: d s_1 / d logp_t = s_1/|y_1|;
    GSPO-token: s_1 per token, then the mean over the 2 tokens) -- the same for both levels.
    clip_fraction = 3 of 5 tokens, sequence_clip_fraction 1/2; ratio_mean = (3 * 1.2214 + 2 * 1.00015)/5.
    Float64, within ``EXACT`` (module docstring); the fractions are counts, exact."""
    policy, batch, algo = TablePolicy(), hand_batch(), make(level)
    out = algo.loss(policy, batch)
    s1 = math.exp(1.5e-4)
    want = torch.tensor([[-1.0004 * 1.5] * 3 + [0.0], [s1, s1, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(out.values.detach(), want, rtol=0, atol=EXACT)
    assert token_mean(out, "clip_fraction") == 3 / 5
    assert out.metrics["sequence_clip_fraction"] == 0.5
    assert token_mean(out, "ratio_mean") == pytest.approx((3 * math.exp(0.2) + 2 * s1) / 5, abs=EXACT)
    aggregate_loss(out.values, out.mask, algo.declaration.aggregation, 2.0).backward()
    want = torch.tensor([[0.0] * 4, [s1 / 4, s1 / 4, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(policy.logp.grad, want, rtol=0, atol=EXACT)


def test_one_optimizer_step_has_ratio_one_and_several_store_the_sampling_log_probs():
    """Default: 4 mini-batches per rollout (the paper), so log pi_old is kept; epochs = num_minibatches = 1: none
    is kept and the loss uses logps.detach(): every s_i is exactly 1 and the loss is -A_i on each token."""
    policy = TwoTokenPolicy()
    scores = fixed_scores([1, 0, 0, 1, 0, 1, 0, 0])
    exp, _ = make().make_experience(policy, PROMPTS, scores)
    assert torch.equal(exp.old_logps, policy.logps(exp)[0].detach())
    single = make(num_minibatches=1)
    exp1, _ = single.make_experience(policy, PROMPTS, scores)
    assert exp1.old_logps is None
    out = single.loss(policy, exp1)
    assert token_mean(out, "ratio_mean") == 1.0
    torch.testing.assert_close(out.values.detach(), (-exp1.advantages).masked_fill(~exp1.loss_mask, 0.0),
                               rtol=0, atol=0)  # s_i = exp(0) = 1 exactly: no rounding


def test_declaration_and_refused_settings():
    d = make().declaration
    assert d.aggregation == "sequence_mean" and d.num_minibatches == 4 and not d.reference
    assert (GSPOConfig().clip_eps_low, GSPOConfig().clip_eps_high) == (3e-4, 4e-4)
    with pytest.raises(ConfigError, match="algo.importance_sampling_level='token'"):
        make("token")


def test_gspo_runs_two_steps_on_the_tiny_model(tmp_path):
    from prefzoo.training.loop import Trainer

    cfg = compose(["algo=gspo", "algo.num_minibatches=2", "reward=sentiment", LETTER_REWARD, "trainer.max_steps=2",
                   "trainer.lr=0.01"] + TINY_RUN)
    summary = Trainer(cfg, tmp_path).run()
    metrics = summary["final_train_metrics"]
    for key in ("reward", "reward_std", "kl", "kl_k3", "clip_fraction", "ratio_mean", "approx_kl", "entropy",
                "sequence_clip_fraction"):
        assert key in metrics, key
    assert summary["steps"] == 2
