"""Gradient accumulation gives the update of one big batch (prefzoo.training accumulate_gradients).

For per-example losses (DPO) and for token-mean losses whose micro-batches hold different numbers of
completion tokens (GRPO with loss_aggregation=dapo), the gradients of ``micro_batch_size=b`` equal
those of ``micro_batch_size=2b``, and both equal a plain full-batch computation written out here.

The model runs in float64: micro-batches of different sizes are padded and grouped differently (rows that share
a prompt run it once, ``share_prompts``), which in float32 moves gradients by a few 1e-6 of rounding; in float64
the equalities below hold to 1e-6 with room to spare, and what they test is the normaliser, not the rounding.
"""

import pytest
import torch

from prefzoo.algos.base import ObjectiveSettings
from prefzoo.algos.dpo import DPO, DPOConfig
from prefzoo.algos.grpo import GRPO, GRPOConfig, GRPOExperience
from prefzoo.data.preference import PreferenceExample, collate_preferences
from prefzoo.models.lora import wrap_trainable
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.models.reference import make_reference
from prefzoo.training.loop import accumulate_gradients
from tests.models.helpers import SPREAD, lora_settings, sequence_batch, tiny_model, tokenizer

TOL = dict(rtol=0, atol=1e-6)


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
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], **TOL)


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


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


def grpo_experience() -> GRPOExperience:
    """Four sampled rows; the first micro-batch (rows 0-1) has 2 + 3 = 5 completion tokens, the second
    (rows 2-3) 7 + 6 = 13: a per-micro-batch token mean would weight their tokens 1/5 and 1/13."""
    prompts = [[1, 100, 200], [1, 100, 200], [9, 8, 7, 6], [9, 8, 7, 6]]
    completions = [[300, 2], [301, 302, 2], [303, 304, 305, 306, 307, 308, 2], [309, 310, 311, 312, 313, 2]]
    b = sequence_batch(prompts, completions)
    return GRPOExperience(b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                          prompt_index=torch.tensor([0, 0, 1, 1]), truncated=torch.zeros(4, dtype=torch.bool),
                          advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), loss_mask=b.completion_mask.clone(),
                          temperature=1.0)


def test_token_mean_loss_with_unequal_micro_batches_equals_one_batch(policy):
    """GRPO with loss_aggregation=dapo (token mean over the whole batch, Yu et al. 2025 eq. 8), beta = 0, one
    iteration (ratio = 1): the loss is -(1/N) sum_i A_i sum_t log pi(o_i,t) with N = 18 tokens in all, whose
    gradient is written out below as the plain reference."""
    exp = grpo_experience()
    algo = GRPO(GRPOConfig(loss_aggregation="dapo"), ObjectiveSettings(beta=0.0))
    assert algo.aggregation == "token_mean"
    small = grads_of(policy, lambda: accumulate_gradients(algo, policy, exp, micro_batch_size=2))
    big = grads_of(policy, lambda: accumulate_gradients(algo, policy, exp, micro_batch_size=4))

    def plain():
        logps, _ = policy.logps(exp)
        mask = exp.completion_mask
        assert int(mask.sum()) == 18
        return -(exp.advantages[:, None] * logps * mask).sum() / 18.0

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
            total = total - (part.advantages[:, None] * logps * mask).sum() / mask.sum() / 2
        return total

    assert max_diff(grads_of(policy, per_micro_mean), reference) > 1e-4


def test_sequence_mean_loss_with_unequal_micro_batches_equals_one_batch(policy):
    """GRPO's own aggregation (eq. 3): mean over each row's tokens, then over the 4 rows."""
    exp = grpo_experience()
    algo = GRPO(GRPOConfig(loss_aggregation="grpo"), ObjectiveSettings(beta=0.0))
    small = grads_of(policy, lambda: accumulate_gradients(algo, policy, exp, micro_batch_size=1))

    def plain():
        logps, _ = policy.logps(exp)
        mask = exp.completion_mask
        per_row = (logps * mask).sum(-1) / mask.sum(-1)
        return -(exp.advantages * per_row).sum() / 4

    assert_same(small, grads_of(policy, plain))


def test_accumulate_gradients_reports_the_whole_batch_loss(policy):
    exp = grpo_experience()
    algo = GRPO(GRPOConfig(loss_aggregation="dapo"), ObjectiveSettings(beta=0.0))
    a = accumulate_gradients(algo, policy, exp, micro_batch_size=1)
    b = accumulate_gradients(algo, policy, exp, micro_batch_size=4)
    policy.model.zero_grad(set_to_none=True)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["clip_fraction"] == pytest.approx(b["clip_fraction"], abs=1e-6)
