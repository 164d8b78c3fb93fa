"""Gradient accumulation gives the update of one big batch (prefzoo.training accumulate_gradients).

For per-example losses (DPO) and for token-mean losses whose micro-batches hold different numbers of
completion tokens (GRPO with loss_aggregation=dapo), the gradients of ``micro_batch_size=b`` equal
those of ``micro_batch_size=2b``, and both equal a plain full-batch computation written out here.

Tolerances (kind 3 of tests/bounds.py, :data:`GRAD_REL`). The model runs in float64, but not all of it: the
log-probs come out in float32 (DESIGN.md), the loss stage runs in float32, and HF Llama computes its RoPE tables in
float32 (positions that move with the padding of another batch shape round differently). Too long a path to bound
term by term, so measured (2026-12-06, 1 and 2 threads alike): ||g_a - g_b|| / ||g_b|| per LoRA tensor at most
2.0e-16 for DPO and DAPO (their float32 stages round alike), 1.2e-7 for GRPO's sequence mean (one-row micro-batches
against the padded batch). GRAD_REL = 2e-6 is 17x the largest. What the tests catch is O(0.1) relative: a
micro-batch's own token mean weights its tokens 1/5 or 1/13 instead of 1/18. (The bound was 1e-6 absolute per
element, on gradients up to 0.74, with no derivation.)
"""

import pytest
import torch

from prefzoo.types import ObjectiveSettings
from prefzoo.algos.dpo import DPO, DPOConfig
from prefzoo.algos.grpo import GRPO, GRPOConfig
from prefzoo.data.preference import PreferenceExample, collate_preferences
from prefzoo.models.lora import wrap_trainable
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.models.reference import make_reference
from prefzoo.training.loop import accumulate_gradients, global_pairs
from prefzoo.training.step import mean_metrics
from prefzoo.types import Experience
from tests.bounds import U32, relative_difference, sum_bound
from tests.models.helpers import SPREAD, lora_settings, sequence_batch, tiny_model, tokenizer

#: the per-tensor relative gap of two computations of one gradient (module docstring): 17x the largest measured
GRAD_REL = 2e-6


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    model = wrap_trainable(tiny_model(initializer_range=SPREAD).double(), lora_settings(), quantized=False,
                           adapter_path=None, gradient_checkpointing=False)
    with torch.no_grad():  # non-zero B, so that every LoRA weight has a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(n)))
    return CausalLMPolicy(model, tokenizer(), make_reference(model, lora_enabled=True, adapter_loaded=False,
                                                             mode="auto"))


def grads_of(policy, fn) -> dict[str, torch.Tensor]:
    policy.model.zero_grad(set_to_none=True)
    out = fn()
    if isinstance(out, torch.Tensor):
        out.backward()
    return {n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def assert_same(a: dict, b: dict) -> None:
    """Every gradient tensor of ``a`` within GRAD_REL of ``b``'s, relative to its size (tests.bounds)."""
    assert a.keys() == b.keys()
    gaps = {n: relative_difference(a[n], b[n]) for n in a}
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] <= GRAD_REL, (worst, gaps[worst])


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.numerics
def test_dpo_two_micro_batches_equal_one_batch(policy):
    rows = [([1, 100, 200], [300, 400, 2], [500, 2]), ([1, 7, 8, 9, 10, 11], [12, 2], [13, 14, 15, 16, 2]),
            ([42], [43, 44, 45, 46, 47, 48, 2], [49, 2]), ([5, 6], [7, 2], [8, 9, 10, 2])]
    batch = collate_preferences([PreferenceExample(*r) for r in rows], [0, 1, 2, 3], policy.pad_id)
    algo = DPO(DPOConfig(), ObjectiveSettings(beta=0.1))
    small = grads_of(policy, lambda: accumulate_gradients(algo, policy, batch, micro_batch_size=2))
    big = grads_of(policy, lambda: accumulate_gradients(algo, policy, batch, micro_batch_size=4))
    plain = grads_of(policy, lambda: algo.loss(policy, batch).values.mean())  # the plain mean over 4 pairs
    assert_same(small, big)
    assert_same(small, plain)
    assert max(float(g.abs().max()) for g in plain.values()) > 1e-3


def grpo_experience() -> Experience:
    """Four sampled rows; the first micro-batch (rows 0-1) has 2 + 3 = 5 completion tokens, the second
    (rows 2-3) 7 + 6 = 13: a per-micro-batch token mean would weight their tokens 1/5 and 1/13."""
    prompts = [[1, 100, 200], [1, 100, 200], [9, 8, 7, 6], [9, 8, 7, 6]]
    completions = [[300, 2], [301, 302, 2], [303, 304, 305, 306, 307, 308, 2], [309, 310, 311, 312, 313, 2]]
    b = sequence_batch(prompts, completions)
    per_row = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return Experience(b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                      prompt_index=torch.tensor([0, 0, 1, 1]), truncated=torch.zeros(4, dtype=torch.bool),
                      advantages=(per_row[:, None] * b.completion_mask), loss_mask=b.completion_mask.clone())


@pytest.mark.numerics
def test_token_mean_loss_with_unequal_micro_batches_equals_one_batch(policy):
    """GRPO with loss_aggregation=dapo (token mean over the whole batch, Yu et al. 2025 eq. 8), beta = 0, one
    iteration (ratio = 1): the loss is -(1/N) sum_i A_i sum_t log pi(o_i,t) with N = 18 tokens in all, whose
    gradient is written out below as the plain reference."""
    exp = grpo_experience()
    algo = GRPO(GRPOConfig(loss_aggregation="dapo"), ObjectiveSettings(beta=0.0))
    assert algo.declaration.aggregation == "token_mean"
    small = grads_of(policy, lambda: accumulate_gradients(algo, policy, exp, micro_batch_size=2))
    big = grads_of(policy, lambda: accumulate_gradients(algo, policy, exp, micro_batch_size=4))

    def plain():
        logps, _ = policy.logps(exp)
        mask = exp.completion_mask
        assert int(mask.sum()) == 18
        return -(exp.advantages * logps * mask).sum() / 18.0

    reference = grads_of(policy, plain)
    assert_same(small, big)
    assert_same(small, reference)

    # the test has teeth: averaging each micro-batch's own token mean gives another gradient
    def per_micro_mean():
        total = 0.0
        for rows in ([0, 1], [2, 3]):
            part = exp.select(rows)
            logps, _ = policy.logps(part)
            mask = part.completion_mask
            total = total - (part.advantages * logps * mask).sum() / mask.sum() / 2
        return total

    assert max_diff(grads_of(policy, per_micro_mean), reference) > 1e-4


@pytest.mark.numerics
def test_sequence_mean_loss_with_unequal_micro_batches_equals_one_batch(policy):
    """GRPO's own aggregation (eq. 3): mean over each row's tokens, then over the 4 rows (the largest measured gap of
    the module, 1.2e-7 relative: one-row micro-batches against the padded batch)."""
    exp = grpo_experience()
    algo = GRPO(GRPOConfig(loss_aggregation="grpo"), ObjectiveSettings(beta=0.0))
    small = grads_of(policy, lambda: accumulate_gradients(algo, policy, exp, micro_batch_size=1))

    def plain():
        logps, _ = policy.logps(exp)
        mask = exp.completion_mask
        per_row = (logps * mask).sum(-1) / mask.sum(-1)
        return -(exp.advantages[:, 0] * per_row).sum() / 4

    assert_same(small, grads_of(policy, plain))


@pytest.mark.numerics
def test_accumulate_gradients_reports_the_whole_batch_loss(policy):
    """The loss -(1/18) sum_t A_t log p_t is a float32 sum of 18 terms (4 micro-batch sums added in float64, or one):
    in any order within sum_bound(18 + 2, S) of the exact value, S = sum_t |A_t log p_t| / 18 (the division and
    the negation: 2 more roundings), plus 2 u32 S where a log-prob rounds from float64 to the neighbouring float32;
    twice that between the two. Measured 5.6e-9 on a loss of 0.028, against a bound of 1.7e-5 (S = 7.3). The clip
    fraction is a ratio of token counts (0 clipped here, ratio = 1): exactly equal. (The log-probs of the two
    batchings differ by the network's float32 stages too, ~1e-7 relative, ~1e-6 of S: inside the bound.)"""
    exp = grpo_experience()
    algo = GRPO(GRPOConfig(loss_aggregation="dapo"), ObjectiveSettings(beta=0.0))
    a = accumulate_gradients(algo, policy, exp, micro_batch_size=1)
    b = accumulate_gradients(algo, policy, exp, micro_batch_size=4)
    policy.model.zero_grad(set_to_none=True)
    a, b = mean_metrics(a), mean_metrics(b)
    with torch.no_grad():
        s = float((exp.advantages * policy.logps(exp)[0]).abs().sum()) / 18
    assert abs(a["loss"] - b["loss"]) <= 2 * (sum_bound(20, s) + U32 * s)
    assert a["clip_fraction"] == b["clip_fraction"] == 0.0


class FixedRatioPolicy:
    """Two rows: A with 4 completion tokens at log pi - log pi_ref = 0.1 each, B with 1 token at 0.6."""

    reference, tractable_logps, analytic_kl = True, True, None

    def __init__(self):
        self.theta = torch.zeros((), requires_grad=True)

    def logps(self, batch, temperature=1.0, with_entropy=False):
        ref = self.ref_logps(batch)
        rho = torch.where(batch.prompt_ids[:, -1:] == 1, torch.tensor(0.1), torch.tensor(0.6))
        out = (ref + rho + self.theta).masked_fill(~batch.completion_mask, 0.0)
        return out, (torch.zeros_like(out) if with_entropy else None)

    def ref_logps(self, batch, temperature=1.0):
        return torch.full(batch.completion_mask.shape, -1.0).masked_fill(~batch.completion_mask, 0.0)


@pytest.mark.numerics
def test_per_token_metrics_do_not_change_with_micro_batch_size_or_process_count():
    """The hardening issue's case: one GRPO step, beta 0.1, k1 as a loss, loss_aggregation=dapo; row A has 4 tokens
    with log pi - log pi_ref = 0.1 each, row B 1 token with 0.6. The logged kl_loss is the token mean
    (4 x 0.1 + 0.6) / 5 = 0.2 -- with one micro-batch, with micro_batch_size=1 (was 0.35: the mean of the two
    rows' means, (0.1 + 0.6) / 2), and with two processes holding one row each (the pairs added over processes).

    The bound, float32 against the hand value: each token's k1 = (log pi_ref + rho) - log pi_ref (|log pi_ref| = 1,
    rho <= 0.6, itself rounded) is within 3 u32 (1 + 0.6) of rho; the sum of 5 such terms (<= 1 in all) and the
    division by 5 add sum_bound(5 + 1, 1) / 5 + u32 0.2. 3.6e-7 in all; measured 2.4e-8 (0.1 is not a float32)."""
    b = sequence_batch([[1], [2]], [[5, 5, 5, 5], [6]])
    policy = FixedRatioPolicy()
    exp = Experience(b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                     truncated=torch.zeros(2, dtype=torch.bool), advantages=torch.zeros(b.completion_mask.shape),
                     loss_mask=b.completion_mask.clone(), ref_logps=policy.ref_logps(b))
    algo = GRPO(GRPOConfig(loss_aggregation="dapo"), ObjectiveSettings(beta=0.1, kl_estimator="k1",
                                                                       kl_placement="as_loss"))
    one = mean_metrics(accumulate_gradients(algo, policy, exp, micro_batch_size=2))
    micro = mean_metrics(accumulate_gradients(algo, policy, exp, micro_batch_size=1))
    ranks = [accumulate_gradients(algo, policy, exp.select([r]), micro_batch_size=1) for r in (0, 1)]
    two = mean_metrics(global_pairs(ranks))
    bound = 3 * U32 * 1.6 + sum_bound(6, 1.0) / 5 + U32 * 0.2
    for m in (one, micro, two):
        assert abs(m["kl_loss"] - 0.2) <= bound
