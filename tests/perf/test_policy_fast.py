"""The policy's fused log-prob path (prefzoo.models.policy) equals the plain one, values and gradients.

Plain = the model's own forward (``completion_logits``, ``logits_to_keep``) then log-softmax and gather, written
out here in float64; fused = the body to hidden states, the output layer chunked (``linear_token_logps``), rows
sharing a prompt running it once. Float64 models, so what is compared is the computation, not the rounding:
log-probs agree to float32 output rounding, and gradients of every LoRA weight to 1e-9 (relative to the largest
entry) without prompt sharing. With prompt sharing the backward sums the shared prompt's gradient in another
order, and Llama's RMSNorm computes in float32 even in a float64 model (transformers upcasts to float32, which
here is a downcast): 1e-6 then, still far below any real error (a wrong cache index or position is O(1)). The policy's plain path itself (``fused_logps=False``, log-softmax in float32 by design) agrees
to float32 rounding: 2e-6 on log-probs, 1e-3 of the largest gradient entry.
"""

import logging

import pytest
import torch

from prefzoo.models.policy import CausalLMPolicy, completion_logits, unique_prompts
from tests.models.helpers import sequence_batch, tokenizer
from tests.perf.test_fast_lora import lora_model

# rows 0/2 and 1/3 share a prompt (as DPO's chosen/rejected); row 4 is alone
PROMPTS = [[1, 100, 200, 300, 4000, 5], [1, 7], [1, 100, 200, 300, 4000, 5], [1, 7], [9, 8, 7, 6, 5, 4, 3]]
COMPLETIONS = [[400, 500, 2], [600, 700, 800, 900, 1000, 1100, 2], [31000, 2], [12, 13, 14, 2], [5, 6, 7, 8, 2]]


@pytest.fixture(scope="module")
def model():
    return lora_model()


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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("extra_left,extra_right", [(0, 0), (2, 3)])
def test_fused_and_shared_equal_plain(model, temperature, extra_left, extra_right):
    batch = sequence_batch(PROMPTS, COMPLETIONS, extra_left=extra_left, extra_right=extra_right)
    want = logps_and_grads(Plain64(model), batch, temperature)
    policy_plain = logps_and_grads(CausalLMPolicy(model, tokenizer(), fused_logps=False), batch, temperature)
    fused = logps_and_grads(CausalLMPolicy(model, tokenizer(), share_prompts=False, head_chunk_size=3), batch,
                            temperature)
    shared = logps_and_grads(CausalLMPolicy(model, tokenizer(), head_chunk_size=5), batch, temperature)
    for got, grad_tol in ((fused, 1e-9), (shared, 1e-6)):
        assert got[0].dtype == torch.float32
        # float32 output of float64 maths: half an ulp of values near -10 is 4.8e-7
        torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1].double(), want[1], rtol=0, atol=1e-6)
        assert_grads_close(got[2], want[2], grad_tol)
        assert torch.equal(got[0][~batch.completion_mask], torch.zeros(int((~batch.completion_mask).sum())))
    torch.testing.assert_close(policy_plain[0].double(), want[0], rtol=0, atol=2e-6)
    assert_grads_close(policy_plain[2], want[2], 1e-3)
    assert float(want[0].std()) > 0.5  # values that depend on the context: the test can fail


def test_prompt_groups_are_found():
    first, inverse = unique_prompts(sequence_batch(PROMPTS, COMPLETIONS))
    assert sorted(first.tolist()) == [0, 1, 4]
    assert inverse[0] == inverse[2] and inverse[1] == inverse[3] and len(set(inverse.tolist())) == 3
    assert unique_prompts(sequence_batch(PROMPTS[:2], COMPLETIONS[:2])) is None


def test_reference_pass_runs_fused_and_its_result_can_enter_a_backward(model):
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    from prefzoo.models.reference import make_reference

    ref = make_reference(model, lora_enabled=True, adapter_loaded=False, mode="adapter_disabled")
    fused = CausalLMPolicy(model, tokenizer(), ref).ref_logps(batch)
    plain = CausalLMPolicy(model, tokenizer(), ref, fused_logps=False).ref_logps(batch)
    torch.testing.assert_close(fused, plain, rtol=0, atol=2e-6)
    assert not fused.is_inference()  # computed under inference_mode, returned as a normal tensor
    logps, _ = CausalLMPolicy(model, tokenizer(), ref).logps(batch)
    (logps * fused).sum().backward()  # multiplication saves the reference log-probs for the backward


def test_gradient_checkpointing_turns_prompt_sharing_off_and_stays_correct():
    model = lora_model()
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    want = logps_and_grads(Plain64(model), batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    got = logps_and_grads(CausalLMPolicy(model, tokenizer()), batch)
    torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=1e-6)
    assert_grads_close(got[2], want[2], 1e-9)


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
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bf16_autocast_keeps_float32_logps_close_to_fp32():
    """compute_dtype=bfloat16 (an option): the body's matmuls in bf16 (8 significant bits), the output layer and
    log-softmax in float32. On the tiny model (random weights spread 0.2, so larger activations than a trained
    model's) the per-token log-probs stay within 0.15 nats of float32; bench/check_bf16.py measures
    it on SmolLM2."""
    model = lora_model(torch.float32)
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    with torch.no_grad():
        fp32, _ = CausalLMPolicy(model, tokenizer()).logps(batch)
        bf16, _ = CausalLMPolicy(model, tokenizer(), compute_dtype=torch.bfloat16).logps(batch)
    assert bf16.dtype == torch.float32
    err = (bf16 - fp32)[batch.completion_mask].abs()
    assert 0 < float(err.max()) < 0.15
