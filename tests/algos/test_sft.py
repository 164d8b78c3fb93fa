"""Tests for the SFT baseline (prefzoo.algos.sft): the token-mean NLL of the chosen completions, no reference.

Pairs of tests/algos/test_dpo.py: chosen A = (1, 2) with log-probs -0.5, -1.0; chosen B = (3,) with -2.0.

Tolerances (tests/bounds.py, kind 1: the claims are exact). The table is float64 (:func:`table`) and SFT keeps float64
through, so a value is its formula to a few roundings of numbers below 3 (u64 = 1.1e-16 relative each): the bound is
1e-12, over 1000x that (0 where nothing is rounded: -log pi is the table entry negated).
"""

import pytest
import torch

from prefzoo.algos.sft import SFT, SFTConfig
from prefzoo.config import Config, resolve_objective
from prefzoo.objective import aggregate_loss
from prefzoo.training.step import accumulate_gradients
from prefzoo.types import LossTokens, ObjectiveSettings
from tests.algos.test_dpo import POLICY, TablePolicy, pairs
from tests.models.helpers import one_thread_fixture


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


def table() -> TablePolicy:
    """tests/algos/test_dpo.py's TablePolicy without a reference, its table in float64."""
    policy = TablePolicy({}, ref=None)
    policy.theta = torch.zeros(16, dtype=torch.float64)
    for token, value in POLICY.items():
        policy.theta[token] = value
    policy.theta.requires_grad_(True)
    return policy


def sft() -> SFT:
    return SFT(SFTConfig(), ObjectiveSettings(beta=0.0))


def test_declaration():
    algo = SFT(SFTConfig(), resolve_objective(Config(algo=SFTConfig())))
    d = algo.declaration
    assert algo.beta == 0.0 and d.reference is False and d.aggregation == "token_mean" and d.has("implicit_rewards")
    assert d.data == "sequences" and d.loss_tokens == LossTokens(completion_only_loss=True, assistant_only_loss=True)


def test_per_token_nll_on_chosen_and_its_token_mean():
    """Per-token losses -log pi on the chosen tokens: A 0.5, 1.0; B 2.0; the token mean (0.5 + 1 + 2) / 3 = 7/6."""
    algo = sft()
    batch = pairs().chosen  # a preference file's rows: SFT reads their prompts and chosen completions
    out = algo.loss(table(), batch)
    assert torch.equal(out.mask, batch.completion_mask)
    torch.testing.assert_close(out.values[out.mask].detach(), torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64),
                               rtol=0, atol=0)
    loss = aggregate_loss(out.values, out.mask, "token_mean", algo.normaliser(batch))
    assert float(loss) == pytest.approx(7 / 6, abs=1e-12)
    assert out.metrics["logps/completion"] == pytest.approx((-1.5 - 2.0) / 2, abs=1e-12)


@pytest.mark.numerics
def test_micro_batches_give_the_gradient_of_the_whole_batch():
    """Micro-batches of 1 pair: the normaliser is the batch's 3 tokens, not each micro-batch's, so the gradient
    is that of the token mean over all 3 tokens: d/dtheta_t = -(count of t) / 3: tokens 1, 2, 3 -> -1/3 each.
    Each gradient entry is one term per micro-batch, accumulated in another order than the whole batch's, in
    float64 (<= 2 u64 x 1/3): within 1e-12; measured 0 at 1 and 2 threads (2026-12-06)."""
    grads = []
    for size in (1, 2):
        policy = table()
        accumulate_gradients(sft(), policy, pairs().chosen, size)
        grads.append(policy.theta.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[0][1:4], torch.full((3,), -1 / 3, dtype=torch.float64), rtol=0, atol=1e-12)
    assert float(grads[0][4]) == 0.0  # rejected tokens never enter the loss


def test_held_out_rewards_are_mean_log_probs():
    """A: chosen mean -0.75, rejected (3, 4) mean -1.125; B: chosen -2, rejected (4, 4, 1) mean -1/3."""
    c, r = sft().implicit_rewards(table(), pairs())
    torch.testing.assert_close(c, torch.tensor([-0.75, -2.0], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(r, torch.tensor([-1.125, -1 / 3], dtype=torch.float64), rtol=0, atol=1e-12)
