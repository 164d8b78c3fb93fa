"""CISPO plugin: the clipped weight keeps every token's gradient (where PPO's clip zeroes it), its settings, and a
2-step run on the tiny model through the loop.

Tolerances (tests/bounds.py, kind 1): the hand-made batch is float64 (the plugin keeps float64 through), so its
losses, gradients and weight metric equal the hand values up to a few float64 roundings of numbers below 4 (~1e-15):
``EXACT`` = 1e-12 leaves 1000x. The ratio metric is float32 by design (``ratio_statistics``): the log-ratio rounded
to float32 (u32 |log r| <= 0.7 u32), its exp (u32) and a float32 sum of 3 positive terms (gamma_2 = 2 u32): at most
4 u32 relative.
"""

from __future__ import annotations

import pytest
import torch

from prefzoo.algos.cispo import CISPO, CISPOConfig
from prefzoo.algos.grpo import GRPO, GRPOConfig
from prefzoo.errors import ConfigError
from prefzoo.objective import aggregate_loss
from prefzoo.types import Experience, ObjectiveSettings
from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN, compose
from tests.algos.test_grpo import token_mean
from tests.bounds import U32
from tests.models.helpers import one_thread_fixture

#: float64 hand values: a few roundings of numbers below 4, ~1e-15 (module docstring)
EXACT = 1e-12


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


class RowPolicy:
    reference = None

    def __init__(self, dtype=torch.float32):
        self.logp = torch.nn.Parameter(torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=dtype))

    def logps(self, batch, temperature=1.0, with_entropy=False):
        lp = self.logp.masked_fill(~batch.completion_mask, 0.0)
        return lp, (batch.completion_mask.float() if with_entropy else None)


def hand_batch(dtype=torch.float32) -> Experience:
    """One row of 3 tokens and a pad; ratios pi/pi_old = (1.5, 0.9, 0.5), advantage A = 2 on every token."""
    mask = torch.tensor([[True, True, True, False]])
    logp = RowPolicy(dtype).logp.detach()
    ratios = torch.tensor([[1.5, 0.9, 0.5, 1.0]], dtype=dtype)
    old = torch.where(mask, logp - torch.log(ratios), torch.full_like(logp, 9.0))
    return Experience(torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                      torch.ones(1, 4, dtype=torch.long), mask,
                      advantages=torch.where(mask, torch.tensor(2.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)),
                      loss_mask=mask, old_logps=old, rewards=torch.tensor([1.0]))


def test_every_token_keeps_its_gradient_with_the_clipped_weight_as_coefficient():
    """Defaults: eps_low = 1 (no lower bound), eps_high = 0.28: weights (1.28, 0.9, 0.5). Loss -w A log pi:
    values (-1.28*2*(-1.0), -0.9*2*(-2.0), -0.5*2*(-0.5)) = (2.56, 3.6, 0.5); over the 3 tokens (token mean)
    the gradient is -w A / 3 = (-0.8533, -0.6, -0.3333), nonzero on the clipped first token too. GRPO's clipped
    surrogate with the same eps_high gives that token 0 (ratio 1.5 > 1.28 with A > 0) and the others -ratio A/3.
    In float64 within ``EXACT``; the float32 ratio metric within 4 u32 relative (module docstring)."""
    f64 = torch.float64
    policy, batch, algo = RowPolicy(f64), hand_batch(f64), CISPO(CISPOConfig(), ObjectiveSettings(beta=0.0))
    out = algo.loss(policy, batch)
    torch.testing.assert_close(out.values.detach(), torch.tensor([[2.56, 3.6, 0.5, 0.0]], dtype=f64),
                               rtol=0, atol=EXACT)
    assert token_mean(out, "clip_fraction") == 1 / 3  # a count: 1 of 3 tokens
    assert token_mean(out, "weight_mean") == pytest.approx((1.28 + 0.9 + 0.5) / 3, abs=EXACT)
    assert token_mean(out, "ratio_mean") == pytest.approx((1.5 + 0.9 + 0.5) / 3, rel=4 * U32)
    aggregate_loss(out.values, out.mask, algo.declaration.aggregation, 3.0).backward()
    want = torch.tensor([[-1.28 * 2 / 3, -0.9 * 2 / 3, -0.5 * 2 / 3, 0.0]], dtype=f64)
    torch.testing.assert_close(policy.logp.grad, want, rtol=0, atol=EXACT)

    ppo_like = RowPolicy(f64)
    grpo = GRPO(GRPOConfig(clip_eps_high=0.28, loss_aggregation="dapo"), ObjectiveSettings(beta=0.0))
    g_out = grpo.loss(ppo_like, batch)
    aggregate_loss(g_out.values, g_out.mask, "token_mean", 3.0).backward()
    want = torch.tensor([[0.0, -0.9 * 2 / 3, -0.5 * 2 / 3, 0.0]], dtype=f64)
    torch.testing.assert_close(ppo_like.logp.grad, want, rtol=0, atol=EXACT)


def test_settings_declaration_and_old_log_probs():
    assert CISPO(CISPOConfig(), ObjectiveSettings(beta=0.0)).declaration.aggregation == "token_mean"
    assert CISPO(CISPOConfig(), ObjectiveSettings(beta=0.0)).stores_old_logps()  # 4 mini-batches by default
    assert not CISPO(CISPOConfig(num_minibatches=1), ObjectiveSettings(beta=0.0)).stores_old_logps()
    with pytest.raises(ConfigError, match=r"algo.is_clip_eps_low=1.5 must be in \[0, 1\]"):
        CISPO(CISPOConfig(is_clip_eps_low=1.5), ObjectiveSettings(beta=0.0))
    with pytest.raises(ConfigError, match="at least 2 completions"):  # the online family's checks run too
        CISPO(CISPOConfig(num_samples=1), ObjectiveSettings(beta=0.0))


def test_cispo_runs_two_steps_on_the_tiny_model(tmp_path):
    from prefzoo.training.loop import Trainer

    cfg = compose(["algo=cispo", "algo.num_minibatches=2", "reward=sentiment", LETTER_REWARD, "trainer.max_steps=2",
                   "trainer.lr=0.01"] + TINY_RUN)
    summary = Trainer(cfg, tmp_path).run()
    metrics = summary["final_train_metrics"]
    for key in ("reward", "reward_std", "kl", "kl_k3", "clip_fraction", "ratio_mean", "approx_kl", "entropy",
                "weight_mean"):
        assert key in metrics, key
    assert summary["steps"] == 2
