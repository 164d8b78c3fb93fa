"""The fused output layer + log-softmax (prefzoo.objective.linear_token_logps) equals the plain computation.

Plain = ``token_logps(hidden @ W.T + b, labels, T)`` and ``token_entropy`` on the full logits, differentiated by
autograd.

Tolerances (tests/bounds.py). N = 37 positions, D = 16, V = 101; h ~ 3 N(0, 1), so logits reach |z| ~ 73 and
log-probs -83: values that vary (std > 1), so the tests can fail.

* Float64 inputs (kind 1): the fused function then computes in float64 and rounds its outputs once to float32, so
  each log-prob and entropy is within half a float32 ulp (u32 |x|, u32 = 2^-24) of the float64 plain computation,
  plus the two float64 computations' own gap (logits of 17 terms up to ~100, a log-sum-exp of 101 terms: ~1e-13;
  the 1e-10 allowed leaves 1000x). Measured: 3.7e-6 on log-probs near -83 (u32 |x| = 4.9e-6 there), 5.8e-8 on
  entropies below 2. The gradients stay float64 on both sides: 1e-10 (relative and absolute) is 1000x their gap
  (1.2e-13 measured).
* Float32 inputs (kind 2): both sides compute the logits, their log-sum-exp and the entropy in float32, in other
  orders (chunked ``linear`` with the bias against ``h @ W.T + b``; -sum p log p against lse - sum p z).
  :func:`float32_bounds` derives per-token worst-case bounds (sum_bound: the sums are short) from the terms and
  their sizes, each side against the exact value, added; 2026-12-06, at 1 and 2 threads the gaps were 0 on
  log-probs and gradients of h, 6.7e-6 on entropies (0.7% of the bound) and 1e-7 of the largest entry on the
  weight's and bias's gradients (0.06% of the bound). What the bounds still catch: a bf16 output layer
  (0.16 here), another temperature or label (O(1)).
"""

import math

import pytest
import torch

from prefzoo.objective import ObjectiveError, linear_token_logps, token_entropy, token_logps
from tests.bounds import U32, gamma

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


def float32_bounds(h, w, b, y, t, upstream):
    """Bounds on the gaps between two float32 computations of ``linear_token_logps(h, w, y, b, t)``'s outputs that
    sum in different orders (kind 2, worst case: short sums): (log-probs (N,), entropies (N,), and the gradients of
    h (N, D), w (V, D), b (V,) for the upstream gradient ``upstream``). Each side against the exact value, added.

    Per position, from the exact (float64) logits z = (h W^T + b) / t, u = u32, gamma_k = k u / (1 - k u):
    * the logits: each is a sum of D products and the bias, then divided by t (D + 2 roundings), off by at most
      gamma_{D+2} M, M = max_v (|h| |W_v| + |b_v|) / t; the log-softmax moves by at most twice the largest change
      of a logit (|d log p_y| <= |dz_y| + sum_v p_v |dz_v|);
    * the log-softmax of the logits as computed: S = sum_v exp(z_v - max z), V terms in [0, 1], S >= 1 (gamma_V), each
      exp off by 2u (one ulp) and by its argument's rounding (u |z_v - max z| <= 2u |z|max); the log (2u ln V), lse
      (u (|z|max + ln V)) and z_y - lse (u (2|z|max + ln V)) round once each. So every log p_v of one side is within
          e = 2 gamma_{D+2} M + gamma_{V+2} + u (5 |z|max + 4 ln V);
    * the entropy H = -sum_v p_v log p_v: each term off by p_v (1 + |log p_v|) e, so (1 + H) e, plus the sum's
      gamma_{V+2} H; the plain side's lse - sum_v p_v z_v besides cancels two numbers of size |z|max + ln V: the
      softmax's normalisation (gamma_V), each p_v's argument rounding (2u |z|max), the sum (gamma_V) and lse and the
      difference (3u) scale with that size;
    * a gradient entry sums V terms (of h: g (onehot - p_v) W_v / t) or N (of W and b: over the positions), each off
      by the relative error of its p_v (e, from the largest e of a position, + the sum's gamma_{max(V, N)+4}).
    """
    h64, w64 = h.detach().double(), w.detach().double()
    b64 = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.detach().double()
    (n, d), v = h.shape, w.shape[0]
    z = (h64 @ w64.T + b64) / t
    size = ((h64.abs() @ w64.abs().T + b64.abs()) / t).amax(-1)
    zmax, logv = z.abs().amax(-1), math.log(v)
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    e = 2 * gamma(d + 2) * size + gamma(v + 2) + U32 * (5 * zmax + 4 * logv)
    logp_bound = 2 * e
    entropy_bound = (2 * (1 + entropy) * e + gamma(v + 2) * entropy
                     + (2 * gamma(v) + 3 * U32 + 2 * U32 * zmax) * (zmax + logv))
    dz = upstream.double().abs()[:, None] * (torch.zeros_like(p).scatter_(-1, y[:, None], 1.0) + p) / t
    rel = 2 * (float(e.max()) + gamma(max(v, n) + 4))
    return logp_bound, entropy_bound, rel * (dz @ w64.abs()), rel * (dz.T @ h64.abs()), rel * dz.sum(0)


def assert_within(got, want, bound):
    """|got - want| <= bound, element by element (the worst ratio in the message)."""
    gap = (got.double() - want.double()).abs()
    assert bool((gap <= bound).all()), float((gap / bound).max())


def grads(out, upstream, *tensors):
    return torch.autograd.grad((out.double() * upstream.double()).sum(), [x for x in tensors if x.requires_grad])


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("weight_grad", [False, True])
def test_values_entropy_and_gradients_equal_the_plain_float64_computation(temperature, chunk, weight_grad):
    h, w, b, y, up = inputs(weight_grad=weight_grad)
    logps, entropy = linear_token_logps(h, w, y, b, temperature, chunk, with_entropy=True)
    want, want_entropy = plain64(h, w, b, y, temperature)
    assert logps.dtype == torch.float32 and entropy.dtype == torch.float32
    # float32 outputs of float64 maths: half an ulp (u32 |x|) + the float64 sides' gap (module docstring)
    torch.testing.assert_close(logps.double(), want, rtol=U32, atol=1e-10)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=U32, atol=1e-10)
    for got, ref in zip(grads(logps, up, h, w, b), grads(want, up, h, w, b)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-10, atol=1e-10)
    assert not entropy.requires_grad and want.std() > 1  # values that vary: the test can fail


@pytest.mark.numerics
def test_float32_equals_the_plain_float32_path():
    """Within :func:`float32_bounds` (kind 2): log-probs 1.8e-4 to 4.9e-4, entropies 9e-4 to 2.1e-3, gradients
    5e-4 to 1e-3 of the largest entry (the old round 2e-5 and 1e-5 of the largest entry were not derived)."""
    h, w, b, y, up = inputs(torch.float32, weight_grad=True)
    logps, entropy = linear_token_logps(h, w, y, b, 0.8, 8, with_entropy=True)
    z = (h @ w.T + b)[None]
    want, want_entropy = token_logps(z, y[None], 0.8)[0], token_entropy(z.detach(), 0.8)[0]
    logp_bound, entropy_bound, *grad_bounds = float32_bounds(h, w, b, y, 0.8, up)
    assert_within(logps, want, logp_bound)
    assert_within(entropy, want_entropy, entropy_bound)
    for got, ref, bound in zip(grads(logps, up, h, w, b), grads(want, up, h, w, b), grad_bounds):
        assert_within(got, ref, bound)


@pytest.mark.numerics
def test_bfloat16_inputs_give_float32_logps_computed_in_float32():
    """The same bf16 numbers through both sides in float32 maths: :func:`float32_bounds` on them (kind 2; measured
    0, the bound 1.5e-4 to 3.9e-4); a bf16 output layer would be off by 0.16."""
    h, w, b, y, up = inputs(torch.float32)
    hb, wb = h.detach().bfloat16().requires_grad_(True), w.bfloat16()
    logps, _ = linear_token_logps(hb, wb, y, temperature=1.0)
    assert logps.dtype == torch.float32
    want = token_logps((hb.float() @ wb.float().T)[None], y[None])[0]  # the same bf16 numbers, float32 maths
    assert_within(logps, want, float32_bounds(hb.float(), wb.float(), None, y, 1.0, up)[0])
    logps.sum().backward()
    assert hb.grad.dtype == torch.bfloat16


@pytest.mark.numerics
def test_autocast_does_not_round_the_output_layer():
    """Under bf16 autocast the fused path still computes in float32: within :func:`float32_bounds` of the plain
    float32 path (kind 2; measured 0, the bound 1.5e-4 to 3.9e-4); a bf16 output layer would be off by 0.16."""
    h, w, b, y, up = inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, _ = linear_token_logps(h, w, y, b)
    assert_within(fused, token_logps((h @ w.T + b)[None], y[None])[0], float32_bounds(h, w, b, y, 1.0, up)[0])


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


# ------------------------------------------------------------------ matmul_dtype: the output layer in bf16 / fp16
LOW_U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # unit roundoff: 8 and 11 significant bits


def low_precision_bounds(h, w, y, t, upstream, u):
    """Bounds on ``linear_token_logps(h, w, y, temperature=t, matmul_dtype=...)`` against the exact (float64) values,
    for inputs h (N, D) and w (V, D) exactly representable in the matmul dtype, whose unit roundoff is ``u``
    (:mod:`prefzoo.objective.linear_logps`' docstring describes the computation). Returns (log-probs (N,), entropies
    (N,), gradient of h (N, D) for the upstream gradient ``upstream``). Kind 2 with one low-precision rounding per
    output: every term below is derived, none measured. u32 = 2^-24, gamma_k = k u32 / (1 - k u32).

    Per position, with the exact logits z = h W^T, S_v = sum_k |h_k W_vk|, x = (z - c) / t, p = softmax(x):
    * the label logit z_y in float32 (D exact products: bf16 x bf16 and fp16 x fp16 fit float32): off by
      a = gamma_D S_y; the offset c = z_y rounded to the dtype, |c - z_y| <= u |z_y| + a. log p_y does not depend on
      c exactly (it cancels), so only the rounding of what is computed with it counts:
    * each shifted logit z_v - c: D + 1 exact terms summed in float32 (gamma_{D+1} (S_v + |c|)), then rounded once to
      the dtype (u |z_v - c|, plus u times the sum's error), then divided by t (u32): delta_v <= ((1 + u) gamma_{D+1}
      (S_v + |c|) + u |z_v - c|) / t + u32 |x_v|;
    * logsumexp of the computed x: by its convexity |LSE(x + delta) - LSE(x)| <= exp(2 max delta) sum_v p_v delta_v
      (= L), and float32's own rounding of it (float32_bounds: gamma_{V+2} + u32 (5 max|x| + 4 ln V)); the label term
      (z_y - c) / t: a / t + 2 u32 |z_y - c| / t; the difference: u32 |log p_y|.
    * the entropy: with eps_v = log p'_v - log p_v, |eps_v| <= delta_v + L + the float32 log-softmax error f,
      H' - H = -sum_v (p'_v - p_v) log p_v - sum_v p'_v eps_v, |p'_v - p_v| <= p_v (exp|eps_v| - 1); plus the float32
      sum's (1 + H) f + gamma_{V+2} H.
    * the gradient of h, g_i (onehot - p') W / t: each entry of d = onehot - p' is off by p_v (exp(|eps_v| + 2 u32) - 1)
      (+ u32 for the label's 1 - p_y), rounded to the dtype (u |d_v|); the V products with W are exact and summed
      in float32 (gamma_V sum_v |d_v| |W_vj|); the result is rounded once to the dtype (u |G_ij|), divided by t and
      scaled by g (2 u32), and rounded to h's dtype (u); a factor (1 + 4 u) covers the products of these terms.
    """
    h64, w64 = h.detach().double(), w.double()
    (n, d), v = h.shape, w.shape[0]
    z = h64 @ w64.T
    s = h64.abs() @ w64.abs().T
    z_y = z.gather(-1, y[:, None])[:, 0]
    s_y = s.gather(-1, y[:, None])[:, 0]
    a = gamma(d) * s_y
    c = z_y.abs() * u + a  # |c - z_y|, and |c| <= |z_y| + this
    c_abs = z_y.abs() + c
    shifted = (z - z_y[:, None]).abs() + c[:, None]  # >= |z_v - c|
    x = (z - z_y[:, None]) / t
    delta = ((1 + u) * gamma(d + 1) * (s + c_abs[:, None]) + u * shifted) / t + U32 * (shifted / t)
    logp = torch.log_softmax(z / t, -1)
    p = logp.exp()
    big = float(delta.max())
    lse = math.exp(2 * big) * (p * delta).sum(-1)
    xmax = (shifted / t).amax(-1)
    f = gamma(v + 2) + U32 * (5 * xmax + 4 * math.log(v))
    logp_y = logp.gather(-1, y[:, None])[:, 0]
    logp_bound = a / t + 2 * U32 * c / t + lse + f + U32 * logp_y.abs()
    eps = delta + (lse + f)[:, None]
    entropy = -(p * logp).sum(-1)
    entropy_bound = ((p * torch.expm1(eps) * logp.abs()).sum(-1) + (p * torch.exp(eps) * eps).sum(-1)
                     + (1 + entropy) * f + gamma(v + 2) * entropy)
    onehot = torch.zeros_like(p).scatter_(-1, y[:, None], 1.0)
    dd = onehot - p
    d_err = p * torch.expm1(eps + 2 * U32) + U32 * onehot
    exact = dd @ w64 / t
    g = upstream.double().abs()[:, None]
    grad_bound = (1 + 4 * u) * g * (((d_err * (1 + u) + (u + gamma(v)) * dd.abs()) @ w64.abs()) / t
                                    + (2 * u + 2 * U32) * exact.abs())
    del x
    return logp_bound, entropy_bound, grad_bound


def low_inputs(dtype, labels="sampled", seed=0):
    """The module's inputs (|z| up to ~70) rounded to ``dtype``; labels drawn from the model's own softmax (as a
    sampled completion's are) or uniformly (unlikely tokens: log-probs near -80)."""
    h, w, _, y, up = inputs(torch.float32, seed=seed)
    h, w = h.detach().to(dtype).requires_grad_(True), w.to(dtype)
    if labels == "sampled":
        g = torch.Generator().manual_seed(seed + 1)
        y = torch.multinomial(torch.softmax(h.detach().double() @ w.double().T, -1), 1, generator=g)[:, 0]
    return h, w, y, up


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("labels", ["sampled", "uniform"])
@pytest.mark.parametrize("chunk", [5, 256])
def test_low_precision_matmuls_stay_within_the_derived_bound_of_the_exact_values(dtype, temperature, labels, chunk):
    """``matmul_dtype``: log-probs, entropies and the gradient of h within :func:`low_precision_bounds` of the
    float64 computation on the same (exactly representable) numbers; and plain bf16 logits (TRL's bf16=True: the
    logits rounded to bf16, then log-softmax in float32) fall outside the log-prob bound, so the test can fail."""
    h, w, y, up = low_inputs(dtype, labels)
    logps, entropy = linear_token_logps(h, w, y, temperature=temperature, chunk_size=chunk, with_entropy=True,
                                        matmul_dtype=dtype)
    assert logps.dtype == torch.float32 and entropy.dtype == torch.float32
    logp_bound, entropy_bound, grad_bound = low_precision_bounds(h, w, y, temperature, up, LOW_U[dtype])
    want, want_entropy = plain64(h.double(), w.double(), torch.zeros(V, dtype=torch.float64), y, temperature)
    assert_within(logps, want, logp_bound)
    assert_within(entropy, want_entropy, entropy_bound)
    (got,) = torch.autograd.grad((logps.double() * up.double()).sum(), [h])
    h64 = h.detach().double().requires_grad_(True)
    (ref,) = torch.autograd.grad((plain64(h64, w.double(), torch.zeros(V, dtype=torch.float64), y, temperature)[0]
                                  * up.double()).sum(), [h64])
    assert got.dtype == dtype
    assert_within(got, ref, grad_bound)
    if dtype == torch.bfloat16 and labels == "sampled":
        plain = token_logps(((h.detach() @ w.T).float() / temperature)[None], y[None])[0]
        assert not bool(((plain.double() - want).abs() <= logp_bound).all())


@pytest.mark.numerics
def test_low_precision_reference_pass_equals_the_trained_pass_and_the_cached_weight_follows_changes():
    """The same inputs give the same log-probs with and without autograd and under inference_mode (pi_ref and the
    starting policy must agree exactly); the weight's low-precision copy is rebuilt after an in-place change."""
    h, w, y, _ = low_inputs(torch.bfloat16)
    trained, _ = linear_token_logps(h, w, y, matmul_dtype=torch.bfloat16)
    with torch.inference_mode():
        frozen, _ = linear_token_logps(h.detach(), w, y, matmul_dtype=torch.bfloat16)
    assert torch.equal(trained.detach(), frozen.clone())
    with torch.no_grad():
        w.mul_(2)
    doubled, _ = linear_token_logps(h.detach(), w, y, matmul_dtype=torch.bfloat16)
    want, _ = plain64(h.double(), w.double(), torch.zeros(V, dtype=torch.float64), y, 1.0)
    assert_within(doubled, want, low_precision_bounds(h, w, y, 1.0, torch.ones(N), LOW_U[torch.bfloat16])[0])


@pytest.mark.numerics
def test_low_precision_falls_back_to_float32_where_the_output_layer_trains_or_has_a_bias():
    """A trained weight, or a bias: the float32 computation (equal to matmul_dtype=None's, bit for bit)."""
    h, w, b, y, _ = inputs(torch.float32, weight_grad=True)
    for kwargs in (dict(bias=None), dict(bias=b.detach())):
        low, _ = linear_token_logps(h, w, y, matmul_dtype=torch.bfloat16, **kwargs)
        plain, _ = linear_token_logps(h, w, y, **kwargs)
        assert torch.equal(low, plain)
    with pytest.raises(ObjectiveError, match="matmul_dtype"):
        linear_token_logps(h, w, y, matmul_dtype=torch.float64)


def test_low_precision_rounds_float32_inputs_once_as_autocast_does():
    """Float32 hidden states and weight (autocast over float32 weights) with matmul_dtype=bf16: exactly the result for
    the same numbers rounded to bf16 first, log-probs and the gradient of h (kind 1: the same operations on the same
    numbers), so the label's logit and the others come from one set of inputs."""
    h, w, _, y, up = inputs(torch.float32)
    h = h.detach().requires_grad_(True)
    got, _ = linear_token_logps(h, w, y, matmul_dtype=torch.bfloat16)
    hb = h.detach().bfloat16().float().requires_grad_(True)
    want, _ = linear_token_logps(hb, w.bfloat16().float(), y, matmul_dtype=torch.bfloat16)
    assert torch.equal(got, want)
    (g,) = torch.autograd.grad((got * up).sum(), [h])
    (gw,) = torch.autograd.grad((want * up).sum(), [hb])
    assert torch.equal(g, gw)
