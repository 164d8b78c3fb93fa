"""Grouped-query SDPA without the K/V copy (prefzoo.models.attention) equals transformers' SDPA path.

Bit-identical on this CPU; asserted to 1e-12 of the largest entry in float64 (values and gradients), padded batches
included. Tolerance (kind 1): float64 throughout (transformers' RMSNorm patched to stay float64,
tests/perf/test_fast_lora.py:float64_rms_norm), the two paths differ at most by float64 rounding of sums of a few
hundred terms, ~1e-15 of the largest entry; 1e-12 leaves 1000x. Before: 1e-12 absolute on gradients up to 1.3e3
(a float64 ulp there is 2.3e-13), and the norms' float32 rounding could part the paths by ~1e-7. Measured 0
(2026-12-06, 1 and 2 threads).
"""

import pytest
import torch

from prefzoo.models.attention import GQA_SDPA, use_gqa_attention
from tests.models.helpers import SPREAD, tiny_model
from tests.models.helpers import float64_rms_norm

IDS = torch.tensor([[1, 17, 400, 9000, 23, 5, 9], [5, 6, 7, 8, 9, 10, 11]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])


@pytest.fixture(autouse=True)
def _float64_rms_norm():
    with float64_rms_norm():
        yield


def close(got, want):
    """Within 1e-12 of the largest entry (module docstring)."""
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))


def run(model):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=IDS, attention_mask=MASK).logits
    (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.numerics
def test_gqa_attention_equals_sdpa_values_and_gradients():
    model = tiny_model(initializer_range=SPREAD).double()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    want = run(model)
    assert use_gqa_attention(model) and model.config._attn_implementation == GQA_SDPA
    got = run(model)
    close(got[0], want[0])
    for n in want[1]:
        close(got[1][n], want[1][n])


@pytest.mark.numerics
def test_decoding_with_a_cache_is_unchanged():
    model = tiny_model(initializer_range=SPREAD).double().eval()
    with torch.no_grad():
        a = model.generate(IDS[:1], max_new_tokens=5, do_sample=False)
        use_gqa_attention(model)
        b = model.generate(IDS[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)


def test_models_without_grouped_heads_are_left_alone():
    from transformers import LlamaForCausalLM

    from prefzoo.models.loading import tiny_llama_config

    model = LlamaForCausalLM(tiny_llama_config(1000, num_kv_heads=4))
    assert not use_gqa_attention(model) and model.config._attn_implementation == "sdpa"
