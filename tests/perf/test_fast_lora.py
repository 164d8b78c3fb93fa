"""The fused LoRA linear layer (prefzoo.models.fast_lora) equals peft's forward and backward.

The same peft model is run with its LoRA layers switched to the fused path and back; outputs and the gradients
of every LoRA weight and of the input agree to 1e-12 in float64 (the same maths in another operation order)
and to 1e-5 relative to the largest entry in float32.
"""

import copy

import pytest
import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear

from prefzoo.models.fast_lora import disable_fast_lora, enable_fast_lora, lora_linear
from prefzoo.models.lora import wrap_trainable
from tests.models.helpers import SPREAD, lora_settings, tiny_model

IDS = torch.tensor([[1, 17, 400, 9000, 23, 5], [5, 6, 7, 8, 9, 10]])


def lora_model(dtype=torch.float64, **lora):
    model = wrap_trainable(tiny_model(initializer_range=SPREAD).to(dtype), lora_settings(**lora), quantized=False,
                           adapter_path=None, gradient_checkpointing=False)
    with torch.no_grad():  # non-zero B: the adapter changes the output
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    return model


def run(model):
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(IDS).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds).logits
    (logits.double() * torch.linspace(-1, 1, logits.shape[-1], dtype=torch.float64)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), embeds.grad.clone(), grads


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fused_forward_and_backward_equal_peft(dtype, tol):
    model = lora_model(dtype)
    plain = run(model)
    assert enable_fast_lora(model) == 2 * 7
    fused = run(model)
    scale = lambda t: tol * float(t.abs().max())  # noqa: E731
    torch.testing.assert_close(fused[0], plain[0], rtol=0, atol=scale(plain[0]))
    torch.testing.assert_close(fused[1], plain[1], rtol=0, atol=scale(plain[1]))
    assert fused[2].keys() == plain[2].keys() and len(plain[2]) == 2 * 7 * 2
    for n in plain[2]:
        torch.testing.assert_close(fused[2][n], plain[2][n], rtol=0, atol=scale(plain[2][n]))
    assert disable_fast_lora(model) == 2 * 7
    assert all(type(m) is PeftLoraLinear for m in model.modules() if isinstance(m, PeftLoraLinear))


def test_the_function_itself_with_a_bias_and_every_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)
    a = torch.randn(3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    bb = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: lora_linear(*t, 0.7), (x, w, b, a, bb))


def test_falls_back_to_peft_where_the_fused_path_would_differ():
    model = lora_model()
    enable_fast_lora(model)
    with torch.no_grad():
        with model.disable_adapter():  # adapter off: the base model
            off = model(input_ids=IDS).logits
        disable_fast_lora(model)
        with model.disable_adapter():
            want = model(input_ids=IDS).logits
    torch.testing.assert_close(off, want, rtol=0, atol=0)
    dropout = lora_model(dropout=0.5)
    enable_fast_lora(dropout)
    layer = next(m for m in dropout.modules() if isinstance(m, PeftLoraLinear))
    dropout.train()
    from prefzoo.models.fast_lora import _fused_arguments

    assert _fused_arguments(layer, torch.zeros(1, layer.in_features, dtype=torch.float64)) is None
    dropout.eval()  # dropout is the identity in eval mode: fused again
    assert _fused_arguments(layer, torch.zeros(1, layer.in_features, dtype=torch.float64)) is not None


def test_deepcopy_keeps_the_fused_class_and_its_own_weights():
    model = lora_model()
    enable_fast_lora(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(clone(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=0)
        for n, p in clone.named_parameters():
            if "lora_B" in n:
                p.zero_()
        assert (clone(input_ids=IDS).logits - model(input_ids=IDS).logits).abs().max() > 1e-3



def test_bf16_base_with_float32_adapter_takes_the_fused_path_and_returns_float32_gradients():
    """model.dtype=bfloat16: frozen base weights in bf16, the LoRA matrices float32 (peft upcasts them,
    ``autocast_adapter_dtype``). The fused path then runs the low-rank term in bf16 on copies of A and B and hands
    their gradients back in float32, as autocast would compute them; peft's forward instead casts x to float32, adds
    the term in float32 and rounds the sum to bf16 once.

    One layer (q_proj of layer 0, 64 -> 64, r = 4, B ~ N(0, 0.3): a low-rank term as large as the base's), x and the
    upstream gradient dy random bf16 (6 rows). The two paths differ by the bf16 roundings the fused one adds, each a
    relative 2^-8 = 3.9e-3 at most (unit roundoff u): output: A, B and x A^T rounded (3u); dx: B, dy B and its
    product with A (3u); dA: B, dy B, the product (3u); dB: x A^T and the product (2u). Errors of a sum of n
    products relative to its largest entry stay about u (random signs), so 4u = 1.6e-2 of the largest entry bounds
    each with a margin. Measured: output 2.1e-3, dx 4.7e-3, dA 3.1e-3, dB 3.7e-3 of the largest entry. Before the
    fix the fused path refused mixed dtypes (``_fused_arguments`` gave None: peft's path ran)."""
    from prefzoo.models.fast_lora import _fused_arguments

    model = lora_model(torch.bfloat16)
    layer = next(m for m in model.modules() if isinstance(m, PeftLoraLinear))
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert layer.base_layer.weight.dtype == torch.bfloat16 and a.dtype == b.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(6, layer.in_features, generator=g).bfloat16()
    dy = torch.randn(6, layer.out_features, generator=g).bfloat16()

    def one_layer():
        x = x0.clone().requires_grad_(True)
        a.grad = b.grad = None
        y = layer(x)
        y.backward(dy)
        return y.detach().float(), x.grad.float(), a.grad.clone(), b.grad.clone()

    plain = one_layer()
    enable_fast_lora(model)
    assert _fused_arguments(layer, x0) is not None
    fused = one_layer()
    assert fused[2].dtype == fused[3].dtype == torch.float32
    for got, want in zip(fused, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=1.6e-2 * float(want.abs().max()))
