"""The fused LoRA linear layer (prefzoo.models.fast_lora) equals peft's forward and backward.

The same peft model is run with its LoRA layers switched to the fused path and back; outputs and the gradients
of every LoRA weight and of the input agree to 1e-12 of the largest entry in float64 (the same maths in another
operation order) and to :data:`FLOAT32_REL` of it in float32.

Tolerances (tests/bounds.py). Float64 (kind 1): with :func:`float64_rms_norm` the model is float64 throughout, so the
two paths differ by float64 rounding, ~1e-15 of the largest entry (sums of at most a few hundred terms); 1e-12
leaves 1000x. Measured 0 (the same products in the same order, 2026-12-06, 1 and 2 threads). Float32 (kind 3): the
backward through two layers and the output layer in another order has no short derivation: :data:`FLOAT32_REL`.
"""

import copy

import pytest
import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear

from prefzoo.models.fast_lora import disable_fast_lora, enable_fast_lora, lora_linear
from prefzoo.models.lora import wrap_trainable
from tests.bounds import UBF16, gamma
from tests.models.helpers import SPREAD, float64_rms_norm, lora_settings, tiny_model

IDS = torch.tensor([[1, 17, 400, 9000, 23, 5], [5, 6, 7, 8, 9, 10]])
#: the float32 gradients' gap, relative to each tensor's largest entry: measured at most 1.3e-6 (2026-12-06, 8 draws
#: of the global generator peft draws LoRA A from, 1 and 2 threads); 23x that (kind 3). Before: 1e-5, 7.6x.
FLOAT32_REL = 3e-5


@pytest.fixture(autouse=True)
def _float64_rms_norm():
    """This module's float64 models are float64 throughout (:func:`float64_rms_norm`)."""
    with float64_rms_norm():
        yield


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


@pytest.mark.numerics
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, FLOAT32_REL)])
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
    # gradcheck's defaults (eps 1e-6, atol 1e-5, rtol 1e-3; kind 1): the function is linear in each input, so the
    # central difference is exact but for float64 rounding, ~|y| u64 / eps ~ 1e-9: 1e4x below atol
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
    torch.testing.assert_close(off, want, rtol=0, atol=0)  # peft's own path both times: exact
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
        torch.testing.assert_close(clone(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=0)  # a copy
        for n, p in clone.named_parameters():
            if "lora_B" in n:
                p.zero_()
        assert (clone(input_ids=IDS).logits - model(input_ids=IDS).logits).abs().max() > 1e-3



@pytest.mark.numerics
def test_bf16_base_with_float32_adapter_takes_the_fused_path_and_returns_float32_gradients():
    """model.dtype=bfloat16: frozen base weights in bf16, the LoRA matrices float32 (peft upcasts them,
    ``autocast_adapter_dtype``). The fused path then runs the low-rank term in bf16 on copies of A and B and hands
    their gradients back in float32, as autocast would compute them; peft's forward instead casts x to float32, adds
    the term in float32 and rounds the sum to bf16 once.

    One layer (q_proj of layer 0, 64 -> 64, r = 4, B ~ N(0, 0.3): a low-rank term as large as the base's), x and the
    upstream gradient dy random bf16 (6 rows). The base part (x W^T, dy W) is the same bf16 operation on both sides;
    the two differ by the bf16 roundings (unit roundoff u = 2^-8) on the low-rank term's path, per entry (kind 2):
    fused, A and B, the r-wide product (x A^T or dy B), the outer product if the bf16 matmul rounds it before the
    add, the scaling by s (dA, dB); peft, its float32 term's rounding to bf16 (dx): at most 5, so gamma_6(u) times
    the term's magnitude M (s (|x| |A|^T) |B|^T for the output, s (|dy| |B|) |A| for dx, s (|dy| |B|)^T |x| for dA,
    s |dy|^T (|x| |A|^T) for dB; the float32 accumulations inside, n u32 < 1e-5 relative, are in the sixth); plus
    each side's rounding of the sum, 2u |entry|. Measured (2026-12-06, 1 and 2 threads, 4 draws of A): at most 19%.
    Before: 4u of the largest entry, from "errors relative to the largest entry stay about u" (not a bound), 2.8x
    above the dx gap measured. Before the fix the fused path refused mixed dtypes (``_fused_arguments`` gave None:
    peft's path ran)."""
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
    s = abs(layer.scaling["default"])
    x64, dy64 = x0.double().abs(), dy.double().abs()
    a64, b64 = a.detach().double().abs(), b.detach().double().abs()
    magnitudes = (s * (x64 @ a64.T) @ b64.T, s * (dy64 @ b64) @ a64,  # output, dx
                  s * (dy64 @ b64).T @ x64, s * dy64.T @ (x64 @ a64.T))  # dA, dB
    for got, want, size in zip(fused, plain, magnitudes):
        bound = gamma(6, UBF16) * size + 2 * UBF16 * want.double().abs()
        gap = (got.double() - want.double()).abs()
        assert bool((gap <= bound).all()), float((gap / bound).max())
