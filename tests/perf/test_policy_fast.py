"""The policy's fused log-prob path (prefzoo.models.policy) equals the plain one, values and gradients.

Plain = the model's own forward (``completion_logits``, ``logits_to_keep``) then log-softmax and gather, written
out here in float64; fused = the body to hidden states, the output layer chunked (``linear_token_logps``), rows
sharing a prompt running it once. Float64 models, so what is compared is the computation, not the rounding.

Tolerances (tests/bounds.py). Float64 throughout (kind 1): transformers' RMSNorm, which rounds its input to float32
(a downcast in a float64 model), is kept in float64 here (tests/perf/test_fast_lora.py:float64_rms_norm; before, the
shared prompt's gradient, summed in another order, went through those float32 roundings and needed 1e-6). The
fused log-probs and entropies are float64 values rounded once to float32 (DESIGN.md): within half an ulp, u32 |x|,
of the float64 plain ones, plus the float64 sides' own gap (~1e-13; 1e-10 allowed, :data:`F64`). The values reach
-16.2, where u32 |x| = 9.7e-7: the round 1e-6 used before was 3% above it. Gradients of every LoRA weight: float64
on both sides, 1e-12 of the largest entry (measured 5.6e-15, 2026-12-06, 1 and 2 threads; before 1e-9 and 1e-6).
The policy's plain path (``fused_logps=False``) takes the log-softmax in float32 by design: kind 2,
:func:`plain_float32_bound` (measured 1.2e-6; the round 2e-6 used before sat 1.7x above it); its gradients see that
float32 softmax, p within e ~ 1.3e-4 (relative) of the float64 one, through the float64 backward: no short bound
on the terms' sum, so 1e-3 of the largest entry (~8e; measured 1.3e-7, kind 3). A wrong cache index or position
is O(1).
"""

import logging

import pytest
import torch

from prefzoo.models.body import unique_prompts
from prefzoo.models.policy import CausalLMPolicy, completion_logits
from tests.bounds import U32, probable_sum_bound
from tests.models.helpers import sequence_batch, tokenizer
from tests.models.helpers import float64_rms_norm
from tests.perf.test_fast_lora import lora_model

# rows 0/2 and 1/3 share a prompt (as DPO's chosen/rejected); row 4 is alone
PROMPTS = [[1, 100, 200, 300, 4000, 5], [1, 7], [1, 100, 200, 300, 4000, 5], [1, 7], [9, 8, 7, 6, 5, 4, 3]]
COMPLETIONS = [[400, 500, 2], [600, 700, 800, 900, 1000, 1100, 2], [31000, 2], [12, 13, 14, 2], [5, 6, 7, 8, 2]]


#: float32 outputs of float64 maths: half an ulp plus the float64 sides' gap (module docstring)
F64 = dict(rtol=U32, atol=1e-10)


@pytest.fixture(autouse=True)
def _float64_rms_norm():
    with float64_rms_norm():
        yield


@pytest.fixture(scope="module")
def model():
    return lora_model()


def plain_float32_bound(model, batch, logps, temperature=1.0) -> float:
    """The policy's plain path (log-softmax of the float64 logits in float32) against float64 maths rounded once
    (kind 2, as in tests/rollout/test_sampler_entropy.py): the log-sum-exp of V = 49,152 terms of at most 1
    (probabilistic bound, lambda = 10: 1.3e-4), the logits rounded to float32, divided by the temperature and their
    maximum subtracted (3 u32 max|z / T|), and each side's result rounded (2 u32 |log p|)."""
    with torch.no_grad():
        logits = completion_logits(model, batch)
    top = float(logits.abs().max()) / temperature
    return probable_sum_bound(logits.shape[-1], 1.0) + 3 * U32 * top + 2 * U32 * float(logps.abs().max())


def plain64(model, batch, temperature):
    """Per-token log-probs and entropies from the model's own logits, log-softmax in float64 (Shape (B, C))."""
    logits = completion_logits(model, batch).double() / temperature
    logp = torch.log_softmax(logits, -1)
    labels = batch.completion_ids.clamp(max=logits.shape[-1] - 1)
    mask = batch.completion_mask
    logps = logp.gather(-1, labels[..., None])[..., 0].masked_fill(~mask, 0.0)
    return logps, (-(logp.exp() * logp).sum(-1)).masked_fill(~mask, 0.0).detach()


class Plain64:
    def __init__(self, model):
        self.model = model

    def logps(self, batch, temperature, with_entropy):
        return plain64(self.model, batch, temperature)


def logps_and_grads(policy, batch, temperature=1.0):
    policy.model.zero_grad(set_to_none=True)
    logps, entropy = policy.logps(batch, temperature, with_entropy=True)
    # weights exactly representable in float32, so both sides differentiate the same function
    weights = ((torch.arange(logps.numel()) % 7 - 3) / 4).to(logps.dtype).view(logps.shape)
    (logps * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return logps.detach(), entropy, grads


def assert_grads_close(a, b, rel):
    assert a.keys() == b.keys() and len(a) == 2 * 7 * 2
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=rel * float(b[n].abs().max()))


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("extra_left,extra_right", [(0, 0), (2, 3)])
def test_fused_and_shared_equal_plain(model, temperature, extra_left, extra_right):
    batch = sequence_batch(PROMPTS, COMPLETIONS, extra_left=extra_left, extra_right=extra_right)
    want = logps_and_grads(Plain64(model), batch, temperature)
    policy_plain = logps_and_grads(CausalLMPolicy(model, tokenizer(), fused_logps=False), batch, temperature)
    fused = logps_and_grads(CausalLMPolicy(model, tokenizer(), share_prompts=False, head_chunk_size=3), batch,
                            temperature)
    shared = logps_and_grads(CausalLMPolicy(model, tokenizer(), head_chunk_size=5), batch, temperature)
    for got in (fused, shared):
        assert got[0].dtype == torch.float32
        torch.testing.assert_close(got[0].double(), want[0], **F64)
        torch.testing.assert_close(got[1].double(), want[1], **F64)
        assert_grads_close(got[2], want[2], 1e-12)
        assert torch.equal(got[0][~batch.completion_mask], torch.zeros(int((~batch.completion_mask).sum())))
    bound = plain_float32_bound(model, batch, want[0], temperature)
    torch.testing.assert_close(policy_plain[0].double(), want[0], rtol=0, atol=bound)
    assert_grads_close(policy_plain[2], want[2], 1e-3)
    assert float(want[0].std()) > 0.5  # values that depend on the context: the test can fail


def test_prompt_groups_are_found():
    first, inverse = unique_prompts(sequence_batch(PROMPTS, COMPLETIONS))
    assert sorted(first.tolist()) == [0, 1, 4]
    assert inverse[0] == inverse[2] and inverse[1] == inverse[3] and len(set(inverse.tolist())) == 3
    assert unique_prompts(sequence_batch(PROMPTS[:2], COMPLETIONS[:2])) is None


@pytest.mark.numerics
def test_reference_pass_runs_fused_and_its_result_can_enter_a_backward(model):
    """Fused (float64, rounded once) against plain (float32 log-softmax): :func:`plain_float32_bound` (kind 2; measured
    9.5e-7, where the round 2e-6 used before left 2x)."""
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    from prefzoo.models.reference import make_reference

    ref = make_reference(model, lora_enabled=True, adapter_loaded=False, mode="adapter_disabled")
    fused = CausalLMPolicy(model, tokenizer(), ref).ref_logps(batch)
    plain = CausalLMPolicy(model, tokenizer(), ref, fused_logps=False).ref_logps(batch)
    with model.disable_adapter():
        bound = plain_float32_bound(model, batch, fused)
    torch.testing.assert_close(fused, plain, rtol=0, atol=bound)
    assert not fused.is_inference()  # computed under inference_mode, returned as a normal tensor
    logps, _ = CausalLMPolicy(model, tokenizer(), ref).logps(batch)
    (logps * fused).sum().backward()  # multiplication saves the reference log-probs for the backward


@pytest.mark.numerics
def test_gradient_checkpointing_turns_prompt_sharing_off_and_stays_correct():
    model = lora_model()
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    want = logps_and_grads(Plain64(model), batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    got = logps_and_grads(CausalLMPolicy(model, tokenizer()), batch)
    torch.testing.assert_close(got[0].double(), want[0], **F64)
    assert_grads_close(got[2], want[2], 1e-12)


def test_models_whose_logits_are_not_head_of_body_use_the_plain_path(model, caplog):
    class SoftCapped(torch.nn.Module):  # logits = 30 tanh(z / 30), as Gemma-2: the fused path would be wrong
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.base_model = inner.get_base_model().model

        def get_output_embeddings(self):
            return self.inner.get_base_model().lm_head

        def forward(self, **kw):
            out = self.inner(**kw)
            out.logits = 30 * torch.tanh(out.logits / 30)
            return out

    wrapped = SoftCapped(model)
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    policy = CausalLMPolicy(wrapped, tokenizer())
    with caplog.at_level(logging.WARNING):
        got, _ = policy.logps(batch)
    assert "plain log-prob path" in caplog.text and policy.fused_parts(wrapped) is None
    want, _ = CausalLMPolicy(wrapped, tokenizer(), fused_logps=False).logps(batch)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same (plain) path both times: exact


#: bf16 autocast against float32 on the tiny model, LoRA A drawn with seed 0 (kind 3): measured (2026-12-06, 1 and 2
#: threads) at most 0.074 nats on a token and 0.019 on average (0.031-0.074 and 0.010-0.019 over 4 seeds); 10x
BF16_MAX, BF16_MEAN = 0.75, 0.2


@pytest.mark.numerics
def test_bf16_autocast_keeps_float32_logps_close_to_fp32():
    """compute_dtype=bfloat16 (an option): the body's matmuls in bf16 (8 significant bits), the output layer and
    log-softmax in float32. On the tiny model (random weights spread 0.2, so larger activations than a trained
    model's) the per-token log-probs stay within :data:`BF16_MAX` nats of float32, :data:`BF16_MEAN` on average
    (before: 0.15, 2x the measured 0.074, not derived: bf16 roundings through two layers have no short bound);
    bench/check_bf16.py measures it on SmolLM2."""
    torch.manual_seed(0)  # peft draws LoRA A from the global generator
    model = lora_model(torch.float32)
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    with torch.no_grad():
        fp32, _ = CausalLMPolicy(model, tokenizer()).logps(batch)
        bf16, _ = CausalLMPolicy(model, tokenizer(), compute_dtype=torch.bfloat16).logps(batch)
    assert bf16.dtype == torch.float32
    err = (bf16 - fp32)[batch.completion_mask].abs()
    assert 0 < float(err.max()) < BF16_MAX and float(err.mean()) < BF16_MEAN
