"""The generalised JSD of on-policy distillation (GKD, Agarwal et al. 2024; TRL 1.16's convention at the ends) and the
teacher's log-ratio reward, checked against values computed by hand with ``math`` on probability tables, closed-form
gradients and the unchunked formula.

Tolerances (tests/bounds.py). generalized_jsd and chunked_generalized_jsd keep float64, so every divergence check runs
in float64 (kind 1) within 1e-12. Two computations here differ in the order of sums of <= 13 terms (over the
vocabulary, or over the 11 positions in the output layer's gradient) whose absolute values add up to <= 16.3
(p |log p - log q| both ways; <= 11 for the gradients), after logits that are 5-term dot products (<= 7.7): worst case
2 gamma_12 x 16.3 = 4.3e-14 plus the logits' ~1e-14, below 1e-13 (10x); measured <= 8.9e-15 (2026-12-06, 1 and 2
threads). A value quoted by hand to 6 decimals (<= 5e-7 off) is checked within 1e-6. teacher_log_ratio_rewards is
float32 by design (its own bound).
"""

from __future__ import annotations

import math

import pytest
import torch

from prefzoo.objective import (ObjectiveError, TokenLogits, chunked_generalized_jsd, generalized_jsd,
                               teacher_log_ratio_rewards)
from tests.bounds import U32


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


# the student S = (0.5, 0.5) (logits 0, 0) and the teacher T = (0.8, 0.2) (logits log 4, 0)
S, T = (0.5, 0.5), (0.8, 0.2)
S_LOGITS = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
T_LOGITS = torch.tensor([[math.log(4.0), 0.0]], dtype=torch.float64)


def test_the_ends_are_the_two_kls_and_the_middle_is_the_mixture_jsd():
    """beta = 0: KL(T || S) = 0.8 ln 1.6 + 0.2 ln 0.4 = 0.192745; beta = 1: KL(S || T) = 0.5 ln(5/8) + 0.5 ln 2.5 =
    0.223144; beta = 0.5: M = (0.65, 0.35), 0.5 KL(T || M) + 0.5 KL(S || M) = 0.5 (0.054188 + 0.047155) = 0.050672
    (the standard JSD, <= ln 2); beta = 0.25: M = 0.25 T + 0.75 S = (0.575, 0.425), 0.25 KL(T || M) + 0.75 KL(S || M)."""
    assert kl(T, S) == pytest.approx(0.192745, abs=1e-6)
    assert kl(S, T) == pytest.approx(0.223144, abs=1e-6)
    assert float(generalized_jsd(S_LOGITS, T_LOGITS, 0.0)) == pytest.approx(kl(T, S), abs=1e-12)
    assert float(generalized_jsd(S_LOGITS, T_LOGITS, 1.0)) == pytest.approx(kl(S, T), abs=1e-12)
    m = (0.65, 0.35)
    assert float(generalized_jsd(S_LOGITS, T_LOGITS, 0.5)) == pytest.approx(0.5 * kl(T, m) + 0.5 * kl(S, m), abs=1e-12)
    assert float(generalized_jsd(S_LOGITS, T_LOGITS, 0.5)) == pytest.approx(0.050672, abs=1e-6)
    m = (0.575, 0.425)
    assert float(generalized_jsd(S_LOGITS, T_LOGITS, 0.25)) == pytest.approx(0.25 * kl(T, m) + 0.75 * kl(S, m), abs=1e-12)


def test_the_half_jsd_is_symmetric_and_every_divergence_is_zero_at_the_teacher():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(generalized_jsd(a, b, 0.5), generalized_jsd(b, a, 0.5), rtol=0, atol=1e-12)
    assert bool((generalized_jsd(a, b, 0.5) <= math.log(2)).all())
    for beta in (0.0, 0.3, 1.0):
        assert generalized_jsd(a, a.clone(), beta).abs().max() < 1e-12
        assert bool((generalized_jsd(a, b, beta) > 0).all())


def test_the_gradients_are_the_two_kls_closed_forms():
    """d KL(T || S) / d z_S = S - T; d KL(S || T) / d z_S = S (log S - log T - KL(S || T)) (softmax calculus)."""
    g = torch.Generator().manual_seed(1)
    z_t = torch.randn(3, 6, generator=g, dtype=torch.float64)
    z_s = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    s, t = torch.softmax(z_s.detach(), -1), torch.softmax(z_t, -1)
    generalized_jsd(z_s, z_t, 0.0).sum().backward()
    torch.testing.assert_close(z_s.grad, s - t, rtol=0, atol=1e-12)
    z_s.grad = None
    generalized_jsd(z_s, z_t, 1.0).sum().backward()
    reverse = (s * (s.log() - t.log())).sum(-1, keepdim=True)
    torch.testing.assert_close(z_s.grad, s * (s.log() - t.log() - reverse), rtol=0, atol=1e-12)
    assert z_t.grad is None


def test_the_temperature_divides_both_logits():
    """At tau = 2 the divergence is that of z / 2 on both sides (TRL: the temperature softens both distributions)."""
    assert float(generalized_jsd(S_LOGITS, T_LOGITS, 0.0, temperature=2.0)) == pytest.approx(
        kl((2 / 3, 1 / 3), S), abs=1e-12)  # softmax(log 4 / 2, 0) = (2/3, 1/3)


def test_a_zero_probability_token_contributes_nothing():
    """A teacher that rules a token out (logit -inf): forward KL sums only where T > 0; reverse KL is infinite there."""
    t = torch.tensor([[0.0, float("-inf")]], dtype=torch.float64)
    assert float(generalized_jsd(S_LOGITS, t, 0.0)) == pytest.approx(math.log(2.0), abs=1e-12)  # KL((1, 0) || S)
    assert math.isinf(float(generalized_jsd(S_LOGITS, t, 1.0)))


def _sides(n=11, v=13, d_s=4, d_t=6, seed=2):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(n, d_s, generator=g, dtype=torch.float64, requires_grad=True)
    w_s = torch.randn(v, d_s, generator=g, dtype=torch.float64, requires_grad=True)
    b_s = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    h_t, w_t = torch.randn(n, d_t, generator=g, dtype=torch.float64), torch.randn(v, d_t, generator=g, dtype=torch.float64)
    return h_s, w_s, b_s, h_t, w_t


@pytest.mark.numerics
@pytest.mark.parametrize("chunk", [1, 3, 50])
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_the_chunked_divergence_equals_the_full_one_with_its_gradients(chunk, beta):
    """A teacher of another width (d 6 against the student's 4): only the vocabulary must match. Chunked against
    whole, in float64 within 1e-12 (module docstring: worst case < 1e-13; measured 4.4e-15 on the values, 8.9e-15 on
    the gradients)."""
    h_s, w_s, b_s, h_t, w_t = _sides()
    full = generalized_jsd(h_s @ w_s.T + b_s, h_t @ w_t.T, beta, temperature=0.7)
    grads = torch.autograd.grad(full.sum(), (h_s, w_s, b_s))
    chunked = chunked_generalized_jsd(TokenLogits(h_s, w_s, b_s), TokenLogits(h_t, w_t), beta, 0.7, chunk)
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-12)
    for got, want in zip(torch.autograd.grad(chunked.sum(), (h_s, w_s, b_s)), grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    logits = (h_s @ w_s.T + b_s)
    from_logits = chunked_generalized_jsd(TokenLogits(logits=logits), TokenLogits(h_t, w_t), beta, 0.7, chunk)
    torch.testing.assert_close(from_logits, full, rtol=0, atol=1e-12)


@pytest.mark.numerics
@pytest.mark.parametrize("beta", [0.0, 0.7, 1.0])
def test_a_frozen_output_layer_takes_the_gradient_in_the_forward(beta):
    """LoRA's case (the output layer frozen): the hidden states' gradient, computed in the forward from the closed
    forms (S - T; S (log S - log T - KL); (1 - beta) S (log S - log M - KL(S || M))), equals autograd's of the full
    formula, under an upstream gradient that is not all ones. float64 within 1e-12 (module docstring; measured
    8.9e-16)."""
    h_s, w_s, b_s, h_t, w_t = _sides()
    w_s, b_s = w_s.detach(), b_s.detach()
    up = torch.linspace(0.5, 2.0, h_s.shape[0], dtype=torch.float64)
    full = generalized_jsd(h_s @ w_s.T + b_s, h_t @ w_t.T, beta, temperature=1.3)
    (want,) = torch.autograd.grad((full * up).sum(), (h_s,))
    chunked = chunked_generalized_jsd(TokenLogits(h_s, w_s, b_s), TokenLogits(h_t, w_t), beta, 1.3, 4)
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-12)
    (got,) = torch.autograd.grad((chunked * up).sum(), (h_s,))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_chunked_backward_never_keeps_all_positions_logits():
    """With 64 positions, V = 500 and chunks of 8, no tensor the backward keeps is bigger than one chunk's logits
    (8 x 500), while the unchunked formula keeps (64 x 500) ones."""
    n, v, chunk = 64, 500, 8
    h_s, w_s, b_s, h_t, w_t = _sides(n=n, v=v)
    sizes = []

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        chunked_generalized_jsd(TokenLogits(h_s, w_s, b_s), TokenLogits(h_t, w_t), 0.5, 1.0, chunk).sum()
    assert max(sizes) <= max(chunk * v, w_s.numel())
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):  # a frozen output layer: only (N, d) is kept
        chunked_generalized_jsd(TokenLogits(h_s, w_s.detach(), b_s.detach()), TokenLogits(h_t, w_t), 0.5, 1.0,
                                chunk).sum()
    assert max(sizes) <= h_s.numel()
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        generalized_jsd(h_s @ w_s.T + b_s, h_t @ w_t.T, 0.5).sum()
    assert max(sizes) >= n * v


def test_bad_inputs_are_one_line_errors():
    h_s, w_s, b_s, h_t, w_t = _sides()
    with pytest.raises(ObjectiveError, match="same positions and vocabulary"):
        chunked_generalized_jsd(TokenLogits(h_s, w_s), TokenLogits(h_t, w_t[:5]), 0.5)
    with pytest.raises(ObjectiveError, match="beta must be"):
        generalized_jsd(S_LOGITS, T_LOGITS, 1.5)
    with pytest.raises(ObjectiveError, match="either states and weight"):
        TokenLogits()
    with pytest.raises(ObjectiveError, match="states must be"):
        TokenLogits(h_s, w_t)


def test_the_teacher_reward_sums_to_minus_the_reverse_kl_in_expectation():
    """r_t = log pi_T(y_t) - log pi(y_t); on one token, E_{y~pi}[r] = -KL(pi || pi_T) exactly: with pi = S and
    pi_T = T, -0.223144. Masked positions are 0.

    The bound (kind 1, float32 by design): the probabilities 0.5, 0.8, 0.2 rounded to float32 and their logs (1 ulp)
    move each log-prob by <= u32 (1 + 2 |log p|); each difference rounds once more (u32 |r|), the sum once (u32 x
    0.22): <= 5.1 u32 on the sum, <= 3.3 u32 on r = ln 1.6 = 0.47. Bounds 8 u32 (4.8e-7; it was 1e-6) and 4 u32
    (2.4e-7; it was rel 1e-6, 4.7e-7); measured 0.06 and 0.6 u32."""
    logp_s, logp_t = torch.log(torch.tensor([[0.5], [0.5]])), torch.log(torch.tensor([[0.8], [0.2]]))
    r = teacher_log_ratio_rewards(logp_t, logp_s, torch.ones(2, 1, dtype=torch.bool))
    assert float((0.5 * r).sum()) == pytest.approx(-kl(S, T), rel=0, abs=8 * U32)
    masked = teacher_log_ratio_rewards(logp_t, logp_s, torch.tensor([[True], [False]]))
    assert masked.tolist() == [[pytest.approx(math.log(1.6), rel=0, abs=4 * U32)], [0.0]]
