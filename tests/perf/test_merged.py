"""Sampling from a merged-weights copy (prefzoo.models.merged) is sampling from the LoRA policy.

* the copy's logits equal the LoRA model's: 1e-12 in float64 (W + s B A in another order of operations; kind 1: the
  float64 roundings, ~1e-16 of each weight, reach the logits (~8) as ~3e-14, measured 2026-12-06 at 1 and 2 threads;
  1e-12 leaves 30x. The model is float64 throughout: transformers' RMSNorm is kept in float64,
  tests/perf/test_fast_lora.py:float64_rms_norm; as shipped it rounds the states to float32, where the two paths
  part with probability 1.1e-4 per pass and then by up to ~1e-7 of the largest logit: the bound would fail);
* the base weights (= the reference policy) are bit-identical before and after merging, and the copy shares
  every tensor except the merged linear weights;
* after an optimizer step the copy re-merges (and only then);
* greedy rollouts through the policy (merged) and through the plain LoRA model pick the same tokens.
"""

import pytest
import torch

from prefzoo.types import SamplingParams
from prefzoo.models.merged import MergedCopy, can_merge, merged_copy
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.rollout.engine import HFEngine
from tests.models.helpers import prompt_batch, tokenizer
from tests.models.helpers import float64_rms_norm
from tests.perf.test_fast_lora import IDS, lora_model


@pytest.fixture(autouse=True)
def _float64_rms_norm():
    with float64_rms_norm():
        yield


def base_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


@pytest.mark.numerics
def test_merged_copy_has_the_policy_logits_and_leaves_the_base_untouched():
    model = lora_model()
    before = base_weights(model)
    assert can_merge(model)
    merged = MergedCopy(model)
    with torch.no_grad():
        want = model(input_ids=IDS).logits
        got = merged.module()(input_ids=IDS).logits
        with model.disable_adapter():
            reference = model(input_ids=IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (got - reference).abs().max() > 1e-3  # the adapter matters: the test can fail
    after = base_weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    shared = {p.data_ptr() for p in model.parameters()}
    own = [n for n, p in merged.module().named_parameters() if p.data_ptr() not in shared]
    assert len(own) == 2 * 7 and all(n.endswith("proj.weight") for n in own)  # only the 14 merged weights are new


@pytest.mark.numerics
def test_the_copy_follows_an_optimizer_step_and_merges_only_when_needed():
    model = lora_model()
    merged = MergedCopy(model)
    merged.module()
    merged.module()
    assert merged.merges == 1
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids=IDS).logits.square().mean().backward()
    opt.step()
    with torch.no_grad():
        got = merged.module()(input_ids=IDS).logits
        want = model(input_ids=IDS).logits
    assert merged.merges == 2
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.numerics
def test_greedy_rollouts_pick_the_same_tokens():
    model = lora_model()
    prompts = prompt_batch([[1, 100, 200, 300], [1, 7]])
    params = SamplingParams(max_new_tokens=12, greedy=True)
    a = CausalLMPolicy(model, tokenizer(), engine=HFEngine(merged_copy)).sample(prompts, 2, params)
    b = CausalLMPolicy(model, tokenizer(), engine=HFEngine()).sample(prompts, 2, params)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
