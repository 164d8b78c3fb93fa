"""The fused output layer + log-softmax (prefzoo.objective.linear_token_logps) equals the plain computation.

Plain = ``token_logps(hidden @ W.T + b, labels, T)`` and ``token_entropy`` on the full logits, differentiated by
autograd. Tolerances: in float64 both sides agree to 1e-12 (the plain side is run in float64 by hand here, since
``token_logps`` rounds to float32); in float32 to 2e-5 absolute on values of magnitude ~10 (a few ulps of
float32's 1.2e-7 relative precision, from a different summation order), gradients to 1e-5 relative to their
largest entry.
"""

import pytest
import torch

from prefzoo.objective import ObjectiveError, linear_token_logps, token_entropy, token_logps

N, D, V = 37, 16, 101


def inputs(dtype=torch.float64, weight_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (3 * torch.randn(N, D, generator=g, dtype=dtype)).requires_grad_(True)
    w = torch.randn(V, D, generator=g, dtype=dtype).requires_grad_(weight_grad)
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_(weight_grad)
    y = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(N, generator=g, dtype=torch.float32)
    return h, w, b, y, upstream


def plain64(h, w, b, y, t):
    """log softmax((h W^T + b) / t)[y] and the entropy, in float64, by autograd."""
    z = (h.double() @ w.double().T + b.double()) / t
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def grads(out, upstream, *tensors):
    return torch.autograd.grad((out.double() * upstream.double()).sum(), [x for x in tensors if x.requires_grad])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("weight_grad", [False, True])
def test_values_entropy_and_gradients_equal_the_plain_float64_computation(temperature, chunk, weight_grad):
    h, w, b, y, up = inputs(weight_grad=weight_grad)
    logps, entropy = linear_token_logps(h, w, y, b, temperature, chunk, with_entropy=True)
    want, want_entropy = plain64(h, w, b, y, temperature)
    assert logps.dtype == torch.float32 and entropy.dtype == torch.float32
    torch.testing.assert_close(logps.double(), want, rtol=0, atol=2e-5)  # float32 output of float64 maths
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=0, atol=2e-5)
    for got, ref in zip(grads(logps, up, h, w, b), grads(want, up, h, w, b)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-10, atol=1e-10)
    assert not entropy.requires_grad and want.std() > 1  # values that vary: the test can fail


def test_float32_equals_the_plain_float32_path():
    h, w, b, y, up = inputs(torch.float32, weight_grad=True)
    logps, entropy = linear_token_logps(h, w, y, b, 0.8, 8, with_entropy=True)
    z = (h @ w.T + b)[None]
    want, want_entropy = token_logps(z, y[None], 0.8)[0], token_entropy(z.detach(), 0.8)[0]
    torch.testing.assert_close(logps, want, rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=2e-5)
    for got, ref in zip(grads(logps, up, h, w, b), grads(want, up, h, w, b)):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def test_bfloat16_inputs_give_float32_logps_computed_in_float32():
    h, w, b, y, _ = inputs(torch.float32)
    hb, wb = h.detach().bfloat16().requires_grad_(True), w.bfloat16()
    logps, _ = linear_token_logps(hb, wb, y, temperature=1.0)
    assert logps.dtype == torch.float32
    want = token_logps((hb.float() @ wb.float().T)[None], y[None])[0]  # the same bf16 numbers, float32 maths
    torch.testing.assert_close(logps, want, rtol=0, atol=2e-5)
    logps.sum().backward()
    assert hb.grad.dtype == torch.bfloat16


def test_autocast_does_not_round_the_output_layer():
    h, w, b, y, _ = inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, _ = linear_token_logps(h, w, y, b)
    torch.testing.assert_close(fused, token_logps((h @ w.T + b)[None], y[None])[0], rtol=0, atol=2e-5)


def test_no_grad_and_empty_inputs():
    h, w, b, y, _ = inputs(torch.float32)
    with torch.no_grad():
        out, ent = linear_token_logps(h, w, y, b)
    assert not out.requires_grad and ent is None
    empty, _ = linear_token_logps(h[:0], w, y[:0])
    assert empty.shape == (0,)


@pytest.mark.parametrize("bad", [
    dict(labels=torch.tensor([V] * N)), dict(labels=torch.full((N,), -100)), dict(chunk_size=0),
    dict(temperature=0.0), dict(labels=torch.zeros(N - 1, dtype=torch.long)), dict(labels=torch.zeros(N)),
])
def test_bad_input_raises_a_typed_error(bad):
    h, w, b, y, _ = inputs(torch.float32)
    kwargs = dict(hidden=h, weight=w, labels=y, bias=b) | bad
    with pytest.raises(ObjectiveError):
        linear_token_logps(**kwargs)
