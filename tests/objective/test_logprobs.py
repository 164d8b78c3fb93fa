"""Tests for prefzoo.objective.logprobs: gathered log-probs, entropy, masked statistics.

Tolerances (tests/bounds.py). token_logps and token_entropy always compute in float32 (DESIGN.md), whatever the
logits' dtype, so their comparisons with a plain log_softmax (another float32 computation, summed in another order)
are kind 2: the bound is derived per position by :func:`_softmax_bounds` from the logits x (after the temperature,
V = vocabulary size), first order in u32 = 2**-24, each libm exp/log counted as 1 ulp (2 u32 relative):

* S = sum_v exp(x_v - max x) (V terms >= 0, S >= 1): relative error e_S = gamma_{V-1} (the sum, any order:
  tests.bounds.sum_bound) + u32 span (rounding x_v - max x, span = max x - min x) + 2 u32 (exp);
* lse = max x + log S: d_lse = e_S + 2 u32 log V (log S <= log V) + u32 |lse|;
* a probability p_v = exp(x_v - lse) (or exp(x_v - max)/S): relative e_p = d_lse + u32 (span + log V) + 2 u32;
* a log-prob, x_y - lse or (x_y - max) - log S: d_logp = d_lse + u32 (span + |log p_y|);
* the entropy as the code takes it, lse - sum_v p_v x_v: d_H = d_lse + (e_p + u32 + gamma_{V-1}) sum_v p_v |x_v|
  + u32 H; as -sum_v p_v log p_v from a float32 softmax: e_p (1 + H) + (3 u32 + gamma_{V-1}) H;
* the entropy's gradient -p_j (x_j - E_p x) / tau (autograd adds p_j from the lse and takes p_j off again from the
  product): d_g = p_j [2 e_p + 2 u32 + (e_p + 5 u32) |x_j - E_p x| + (e_p + u32 + gamma_{V-1}) sum_v p_v |x_v|] / tau.

Two float32 computations differ by at most the sum of their two bounds. At V = 11 and logits 3 randn (span 4 to
15, |log p| up to 12) a log-prob gets 1.9e-6 to 3.7e-6 each; the plain log_softmax differs from token_logps by
9.5e-7 at 1 and 2 threads (measured 2026-12-06: 0.12 to 0.17 of the bound), which is where the round 1e-6 this file
had sat (a 1.05x margin). What the bounds still catch: another temperature, label, position or chunk boundary
moves a log-prob or an entropy by 1e-2 to 1.
masked_whiten keeps its statistics in float64 and rounds once to float32 at the end (u32 relative per element); the
masked sums and means of small integers below are exact in float32.
"""

import math

import pytest
import torch

from prefzoo.objective import (
    ObjectiveError,
    masked_logps,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    mean_logps,
    sequence_logps,
    token_entropy,
    token_logps,
)
from tests.bounds import U32, U64, sum_bound
from tests.objective.two_ranks import run_on_two_ranks


def _random_batch(seed, B=3, T=7, V=11, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(B, T, V, generator=g)).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    return logits, labels


def _reference_logps(logits, labels, temperature=1.0):
    """Independent reference: the full log-softmax then a gather (what we avoid materialising)."""
    full = torch.log_softmax(logits.float() / temperature, dim=-1)
    return full.gather(-1, labels[..., None]).squeeze(-1)


def _softmax_bounds(x, u=U32):
    """Per position of the float logits ``x`` (..., V) (after the temperature; -inf allowed), in float64: the exact
    probabilities p, lse, span = max - min of the finite entries, and the first-order error bounds d_lse and e_p of
    one softmax stage with unit roundoff ``u`` (module docstring)."""
    x = x.double()
    v = x.shape[-1]
    span = x.amax(-1) - torch.where(torch.isfinite(x), x, torch.inf).amin(-1)
    lse = torch.logsumexp(x, -1)
    p = torch.softmax(x, -1)
    e_sum = sum_bound(v, 1.0, u) + u * span + 2 * u
    d_lse = e_sum + 2 * u * math.log(v) + u * lse.abs()
    e_p = d_lse + u * (span + math.log(v)) + 2 * u
    return p, lse, span, d_lse, e_p


def _logp_bound(x, logps):
    """Bound on |a - b| of two float32 log-softmax-and-gather computations of ``logps`` from the float32 logits
    ``x``: twice d_logp (module docstring)."""
    _, _, span, d_lse, _ = _softmax_bounds(x)
    return 2 * (d_lse + U32 * (span + logps.double().abs()))


def _entropy_bound(x):
    """Bound on one float32 token_entropy of logits ``x`` (d_H, module docstring), per position."""
    p, _, _, d_lse, e_p = _softmax_bounds(x)
    abs_px = (p * torch.where(p > 0, x.double(), 0.0).abs()).sum(-1)
    h = -(p * torch.where(p > 0, p.log(), 0.0)).sum(-1)
    return d_lse + (e_p + U32 + sum_bound(x.shape[-1], 1.0)) * abs_px + U32 * h


def _assert_within(a, b, bound):
    """|a - b| <= bound elementwise (float64), with the worst ratio in the message."""
    gap = (a.double() - b.double()).abs()
    ratio = gap / bound
    assert bool((gap <= bound).all()), (float(gap.max()), float(ratio.max()))


@pytest.mark.numerics
def test_token_logps_matches_log_softmax_gather_float32():
    """Against the plain log_softmax and gather, within _logp_bound (kind 2, module docstring)."""
    logits, labels = _random_batch(0)
    out = token_logps(logits, labels)
    assert out.dtype == torch.float32 and out.shape == labels.shape
    ref = _reference_logps(logits, labels)
    _assert_within(out, ref, _logp_bound(logits, ref))


@pytest.mark.numerics
def test_token_logps_bf16_input_gives_float32_output():
    """bf16 logits are upcast before the softmax: the result equals the float32 computation on
    the (already rounded) bf16 values, not a bf16-precision result (within _logp_bound of the float32 stage; a bf16
    softmax would be off by ~2**-8 relative, 1e-2 nats and more)."""
    logits, labels = _random_batch(1, dtype=torch.bfloat16)
    out = token_logps(logits, labels)
    assert out.dtype == torch.float32
    ref = _reference_logps(logits, labels)
    _assert_within(out, ref, _logp_bound(logits.float(), ref))


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [0.5, 0.7, 2.0])
def test_token_logps_temperature(temperature):
    """Both sides divide the float32 logits by the temperature the same way (the same x); the softmax stage is
    within _logp_bound."""
    logits, labels = _random_batch(2)
    out = token_logps(logits, labels, temperature=temperature)
    ref = torch.log_softmax(logits / temperature, dim=-1).gather(-1, labels[..., None])[..., 0]
    _assert_within(out, ref, _logp_bound(logits / temperature, ref))
    # and temperature really changes the answer (so the test above could fail)
    assert (out - token_logps(logits, labels)).abs().max() > 1e-2


@pytest.mark.numerics
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 100])
def test_token_logps_chunked_equals_unchunked(chunk_size):
    """Each position's log-sum-exp runs over the same V logits in a chunk as in the whole; the reduction order may
    still differ with the tensor's shape, so the bound is _logp_bound (measured: bitwise equal, 1 and 2 threads)."""
    logits, labels = _random_batch(3)
    whole = token_logps(logits, labels, temperature=0.9)
    chunked = token_logps(logits, labels, temperature=0.9, chunk_size=chunk_size)
    _assert_within(chunked, whole, _logp_bound(logits / 0.9, whole))


@pytest.mark.numerics
def test_token_logps_gradient_matches_finite_differences():
    """The function upcasts to float32, so its gradient d logp_y / d z_j = [j = y] - p_j (float32) is compared with
    central differences (h = 1e-5) of a float64 reference, within the sum of:
    * the float32 gradient: p_j = exp(x_j - lse) from the lse's backward, relative error e_p, and 1 - p_j rounded
      (u32): e_p p_j + u32;
    * the float64 logits rounded to float32 (u32 |z|) move p_j by p_j u32 (|z_j| + sum_v p_v |z_v|);
    * the differences: truncation h^2/6 max|f^(3)| with |f^(3)| = p (1 - p) |1 - 2p| <= 1/(6 sqrt 3) (one logit moves
      one position), and rounding 2 eps_f / (2h), eps_f the float64 error of f (the sum of 6 log-probs: d_logp with
      u64 per position, and the sum, 2 gamma_5 sum |log p|)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3), generator=g)
    out = token_logps(logits, labels, chunk_size=2).sum()
    (grad,) = torch.autograd.grad(out, logits)
    h = 1e-5
    fd = torch.zeros_like(logits)
    base = logits.detach()
    for idx in range(base.numel()):
        e = torch.zeros(base.numel(), dtype=torch.float64)
        e[idx] = h
        e = e.view_as(base)
        plus = _reference_logps_f64(base + e, labels).sum()
        minus = _reference_logps_f64(base - e, labels).sum()
        fd.view(-1)[idx] = (plus - minus) / (2 * h)
    p, _, span64, d_lse64, _ = _softmax_bounds(base, U64)
    _, _, _, _, e_p = _softmax_bounds(base.float())
    logp = _reference_logps_f64(base, labels)
    eps_f = float((d_lse64 + U64 * (span64 + logp.abs())).sum()) + 2 * sum_bound(6, float(logp.abs().sum()), U64)
    fd_error = h * h / 6 / (6 * math.sqrt(3)) + eps_f / h
    input_rounding = p * U32 * (base.abs() + (p * base.abs()).sum(-1, keepdim=True))
    bound = e_p[..., None] * p + U32 + input_rounding + fd_error
    _assert_within(grad, fd, bound)


def _reference_logps_f64(logits, labels):
    return torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]


@pytest.mark.numerics
def test_token_logps_accepts_invalid_labels_at_masked_positions():
    """-100 and ids >= V are replaced before the gather (no IndexError); valid positions are
    unaffected (within _logp_bound of the plain log_softmax)."""
    logits, labels = _random_batch(5)
    bad = labels.clone()
    bad[0, 0] = -100
    bad[1, 2] = 11  # == V, out of range
    out = token_logps(logits, bad)
    keep = torch.ones_like(labels, dtype=torch.bool)
    keep[0, 0] = keep[1, 2] = False
    ref = _reference_logps(logits, labels)
    _assert_within(out[keep], ref[keep], _logp_bound(logits, ref)[keep])
    assert torch.isfinite(out).all()


@pytest.mark.numerics
def test_masked_logps_is_exactly_zero_where_masked_and_ignores_garbage():
    """Exact zeros where masked; elsewhere the plain log_softmax of the clean logits within _logp_bound."""
    logits, labels = _random_batch(6)
    mask = torch.rand(labels.shape, generator=torch.Generator().manual_seed(0)) > 0.4
    garbage = logits.clone()
    garbage[~mask] = float("nan")  # NaN logits at padded positions must not leak
    labels_bad = torch.where(mask, labels, torch.full_like(labels, -100))
    out = masked_logps(garbage, labels_bad, mask)
    assert (out[~mask] == 0.0).all()
    ref = _reference_logps(logits, labels)
    _assert_within(out[mask], ref[mask], _logp_bound(logits, ref)[mask])


def test_sequence_and_mean_logps_hand_example():
    """Rows: [-1, -2, -3] all counted -> sum -6, mean -2;
    [-0.5, 7, 9] with only the first counted -> sum -0.5, mean -0.5 (7 and 9 are padding);
    a row with no counted token -> 0 and 0 (not NaN). Small integers and halves: exact in float32."""
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 7.0, 9.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    assert torch.equal(sequence_logps(logps, mask), torch.tensor([-6.0, -0.5, 0.0]))
    assert torch.equal(mean_logps(logps, mask), torch.tensor([-2.0, -0.5, 0.0]))


def test_entropy_three_way_hand_value():
    """p = (1/2, 1/4, 1/4): H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2 = 1.0397207708 nats.
    The same distribution reached as softmax(2 log p / 2) at temperature 2 gives the same H;
    a uniform distribution over 5 gives ln 5; logits (0, 0, -inf) give ln 2 without NaN.
    Bound: d_H of the float32 stage (module docstring), plus, for logits = float32 log p (1 ulp: x_v (1 + 2 u32)),
    how far that rounding moves H: sum_v p_v |x_v - E_p x| 2 u32 |x_v| (dH/dx_v = -p_v (x_v - E_p x));
    2 log p / 2 is exact, zeros and -inf are exact. Bounds 1.4e-6, 7.4e-7 and 4.5e-7 (the old round 1e-6 was below
    the first); measured 3e-8 at most."""
    p = torch.tensor([0.5, 0.25, 0.25])
    logits = torch.log(p).view(1, 1, 3)
    x = logits.double()
    mean_x = (p.double() * x).sum()
    rounding = float((p.double() * (x - mean_x).abs() * 2 * U32 * x.abs()).sum())
    expected = 1.5 * math.log(2.0)
    assert abs(float(token_entropy(logits)) - expected) <= float(_entropy_bound(logits)) + rounding
    assert abs(float(token_entropy(2 * logits, temperature=2.0)) - expected) <= float(_entropy_bound(logits)) + rounding
    uniform = torch.zeros(1, 1, 5)
    assert abs(float(token_entropy(uniform)) - math.log(5)) <= float(_entropy_bound(uniform))
    banned = torch.tensor([[[0.0, 0.0, float("-inf")]]])
    assert abs(float(token_entropy(banned)) - math.log(2)) <= float(_entropy_bound(banned))


@pytest.mark.numerics
def test_entropy_has_a_finite_gradient_where_a_logit_is_minus_infinity():
    """Hardening round 3, item 10 (failed before: the gradient was NaN on every logit of a position with a banned
    token, since 0 * (-inf) = NaN in the backward of p * x). dH/dx_j = -p_j (x_j - E_p[x]) (differentiate
    H = logsumexp(x) - sum_v p_v x_v), so a banned token (p_j = 0) gets gradient 0 and the others exactly what the
    same logits without the banned entry give: x = (0.3, -1.2, -inf, 2.0) against (0.3, -1.2, 2.0), at temperature
    1 and 0.7. The two sum 4 and 3 entries (one of them an exact 0) in possibly different orders: entropies within
    d_H of each, gradients (and the hand formula, itself a float32 computation) within 2 d_g (module docstring)."""
    for temperature in (1.0, 0.7):
        banned = torch.tensor([[[0.3, -1.2, float("-inf"), 2.0]]], requires_grad=True)
        kept = torch.tensor([[[0.3, -1.2, 2.0]]], requires_grad=True)
        h_banned, h_kept = token_entropy(banned, temperature), token_entropy(kept, temperature)
        h_banned.sum().backward()
        h_kept.sum().backward()
        assert torch.isfinite(banned.grad).all(), banned.grad
        x = kept.detach()[0, 0] / temperature  # the hand formula, divided by T once more by the chain rule
        p, _, _, _, e_p = _softmax_bounds(x)
        abs_px = float((p * x.double().abs()).sum())
        dev = (x.double() - (p * x.double()).sum()).abs()
        d_g = p * (2 * e_p + 2 * U32 + (e_p + 5 * U32) * dev + (e_p + U32 + sum_bound(4, 1.0)) * abs_px) / temperature
        d_h = _entropy_bound(banned.detach() / temperature) + _entropy_bound(x.view(1, 1, 3))
        _assert_within(h_banned, h_kept, d_h)
        _assert_within(banned.grad[0, 0, [0, 1, 3]], kept.grad[0, 0], 2 * d_g)
        assert banned.grad[0, 0, 2] == 0.0
        q = torch.softmax(x, -1)
        _assert_within(kept.grad[0, 0], -q * (x - (q * x).sum()) / temperature, 2 * d_g)


@pytest.mark.numerics
def test_entropy_chunked_and_bf16():
    """bf16 logits upcast exactly; token_entropy (lse - sum p x) against -sum p log p of a float32 softmax within
    d_H + e_p (1 + H) + (3 u32 + gamma_{V-1}) H, and chunked against whole within 2 d_H (module docstring;
    measured 6.6e-7 and 0, at 1 and 2 threads)."""
    logits, _ = _random_batch(7, dtype=torch.bfloat16)
    x = logits.float()
    p = torch.softmax(x, -1)
    ref = -(p * torch.log(p)).sum(-1)
    out = token_entropy(logits, chunk_size=3)
    assert out.dtype == torch.float32
    _, _, _, _, e_p = _softmax_bounds(x)
    h = ref.double()
    _assert_within(out, ref, _entropy_bound(x) + e_p * (1 + h) + (3 * U32 + sum_bound(x.shape[-1], 1.0)) * h)
    _assert_within(out, token_entropy(logits), 2 * _entropy_bound(x))


def test_masked_sum_mean_var_hand_values():
    """values [1, 2, 3, 100] with the 100 masked: sum 6, mean 2, population variance
    ((-1)^2 + 0 + 1^2)/3 = 2/3, unbiased 2/2 = 1. Per-row: [[1, 2], [3, 100]] with mask
    [[T, T], [T, F]] -> row sums [3, 3], row means [1.5, 3]. Everything is exact in float32 but the division by 3:
    2/3 to 2 u32 relative (a division, or a product with a rounded reciprocal), and the unbiased one that times 3/2,
    rounded once more: 3 u32 (the old 1e-7 on it sat below that worst case, 1.8e-7)."""
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    assert float(masked_sum(values, mask)) == 6.0
    assert float(masked_mean(values, mask)) == 2.0
    assert abs(float(masked_var(values, mask)) - 2 / 3) <= 2 * U32 * 2 / 3
    assert abs(float(masked_var(values, mask, unbiased=True)) - 1.0) <= 3 * U32
    v2, m2 = values.view(2, 2), mask.view(2, 2)
    assert torch.equal(masked_sum(v2, m2, dim=1), torch.tensor([3.0, 3.0]))
    assert torch.equal(masked_mean(v2, m2, dim=1), torch.tensor([1.5, 3.0]))
    empty = torch.zeros(2, 2, dtype=torch.bool)
    assert float(masked_mean(v2, empty)) == 0.0
    with pytest.raises(ObjectiveError, match="at least 2"):
        masked_var(values, torch.tensor([True, False, False, False]), unbiased=True)


def _whiten_inputs(seed=8):
    g = torch.Generator().manual_seed(seed)
    values = 5.0 + 3.0 * torch.randn(4, 6, generator=g)
    lengths = torch.tensor([6, 2, 4, 1])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    return values, mask


def test_whiten_mean_zero_var_one_over_valid_tokens_and_zero_elsewhere():
    """The float64 whitened values z (mean 0, variance var / (var + eps), eps = 1e-8) are rounded once to float32,
    z_i (1 + d_i) with |d_i| <= u32: the mean moves by at most u32 mean|z|, the variance by 2 u32 mean z^2 = 2 u32
    (first order), plus eps / var and the float64 sums (~1e-15; 1e-12 allowed). Measured 4e-9 and 2e-8."""
    values, mask = _whiten_inputs()
    out = masked_whiten(values, mask)
    valid = out[mask].double()
    var = float(values[mask].double().var(unbiased=False))
    assert abs(float(valid.mean())) <= U32 * float(valid.abs().mean()) + 1e-12
    assert abs(float(valid.var(unbiased=False)) - 1.0) <= 2 * U32 + 1e-8 / var + 1e-12
    assert (out[~mask] == 0).all()


def test_whiten_ignores_padding_values():
    """The padded values are replaced by 0 before any sum: the same float64 sums in the same order, so the results
    are bitwise equal."""
    values, mask = _whiten_inputs()
    changed = values.clone()
    changed[~mask] = torch.tensor([1e6, -3.0, float("nan")]).repeat(20)[: int((~mask).sum())]
    assert torch.equal(masked_whiten(changed, mask), masked_whiten(values, mask))
    # and the whitening is NOT the same as whitening everything (the test could fail)
    assert (masked_whiten(values, torch.ones_like(mask))[mask] - masked_whiten(values, mask)[mask]
            ).abs().max() > 1e-2


def test_whiten_without_mean_shift_keeps_mean():
    """out = (v - mean) / sqrt(var + eps) + mean in float64, rounded once to float32: each element within u32 of
    the same formula in float64 (2 u32 allowed: the float64 sums differ by ~1e-15), the mean within u32 mean|out|."""
    values, mask = _whiten_inputs()
    out = masked_whiten(values, mask, shift_mean=False)
    v = values[mask].double()
    mean = v.mean()
    var = v.var(unbiased=False)
    assert abs(float(out[mask].double().mean() - mean)) <= U32 * float(out[mask].double().abs().mean()) + 1e-12
    expected = (v - mean) / torch.sqrt(var + 1e-8) + mean
    torch.testing.assert_close(out[mask].double(), expected, rtol=2 * U32, atol=0)


@pytest.mark.numerics
def test_whiten_all_reduce_two_ranks_equals_whole_batch():
    """Simulate two data-parallel ranks with threads: each whitens its half of the batch and
    the all_reduce hook sums the two ranks' tensors (a barrier pairs the calls). Both halves
    must equal the corresponding rows of whitening the whole batch at once, and differ from
    whitening each half alone. The statistics are float64 sums of 13 terms split 6 + 7 (sum_bound with u64: ~1e-15
    relative), each output rounded once to float32: within 2 u32 + 1e-12 relative (padding exactly 0 in both)."""
    values, mask = _whiten_inputs()
    whole = masked_whiten(values, mask)
    halves = [(values[:1], mask[:1]), (values[1:], mask[1:])]  # 6 tokens vs 7 tokens

    results, calls = run_on_two_ranks(lambda rank, all_reduce: masked_whiten(*halves[rank], all_reduce=all_reduce))
    assert calls[0] == calls[1] >= 1
    torch.testing.assert_close(torch.cat(results), whole, rtol=2 * U32 + 1e-12, atol=0)
    local = masked_whiten(*halves[1])
    assert (local - whole[1:]).abs().max() > 1e-2


def test_errors_name_shapes_and_fixes():
    logits, labels = _random_batch(9)
    with pytest.raises(ObjectiveError, match=r"\(3, 6\).*\(3, 7, 11\)"):
        token_logps(logits, labels[:, :6])
    with pytest.raises(ObjectiveError, match="bool"):
        masked_logps(logits, labels, torch.ones_like(labels))
    with pytest.raises(ObjectiveError, match="temperature"):
        token_logps(logits, labels, temperature=0.0)
    with pytest.raises(ObjectiveError, match="chunk_size"):
        token_logps(logits, labels, chunk_size=0)
    with pytest.raises(ObjectiveError, match="no position"):
        masked_whiten(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool))
