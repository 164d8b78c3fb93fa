"""Tests for prefzoo.rollout.generate: the KV-cache decode loop, its log-probs, EOS handling, the samplers.

The fast path (one prefill, cached decode, finished rows dropped from the cache) is checked against
plain computations: transformers' own ``generate`` for greedy tokens, a full forward of the finished
sequences (``CausalLMPolicy.logps``) for the sampling-time log-probs, and exact distributions for the
samplers.

Tolerances (tests/bounds.py). Where the sampler's log-probs are compared, the model runs in float64 (``model64``), so
the two computations share their logits to ~1e-14 and differ by the sampler's float32 stage (DESIGN.md: log-probs
in float32), derived in :func:`sampler_bound` (kind 2, as in tests/rollout/test_sampler_entropy.py). In the float32
model the KV-cached decode and the full pass also sum the two layers in other orders, which has no short
derivation: 3.8e-6 measured against the round 1e-5 used before. The samplers' chi-square bounds are the 0.1%
critical values (kind 4): a random seed fails one in a thousand; the seeds are fixed.
"""

import math


import pytest
import torch

from prefzoo.types import SamplingParams
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.types import position_ids_from_mask
from prefzoo.rollout.engine import HFEngine
from prefzoo.rollout.generate import filter_support, sample_completions, sample_from
from tests.bounds import U32, gamma, probable_sum_bound
from tests.models.helpers import SPREAD, pad_id, prompt_batch, tiny_model, tokenizer

PROMPTS = [[1, 100, 200, 300], [1, 7], [9, 8, 7, 6, 5, 4, 3, 2000, 1000], [42]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(initializer_range=SPREAD).eval()


@pytest.fixture(scope="module")
def model64():
    """The same tiny model in float64: the sampler's float32 stage is then the only rounding that matters."""
    return tiny_model(initializer_range=SPREAD).double().eval()


def sampler_bound(scaled_logits: torch.Tensor, logps: torch.Tensor, support: int | None = None) -> float:
    """How far the sampler's float32 log-prob of a token may lie from float64 maths rounded once (kind 2).

    ``scaled_logits``: the float64 logits over the temperature z / T that the log-softmax normalises (only the
    kept ones for a cut support of ``support`` tokens; None: the whole vocabulary); ``logps``: the log-probs compared.
    The sampler rounds z to float32 and divides by T (2 u32 |z / T|: the log-softmax moves by at most twice the largest
    change of a logit), subtracts the maximum (2 u32 max|z / T|), sums exp over the support (the whole vocabulary,
    V = 49,152 terms of at most 1: probabilistic bound, lambda = 10, lambda sqrt(V) u32 = 1.3e-4; a cut support of
    K terms: worst case gamma_{K+1} with the exp's own ulp), takes the log (2 u32 ln K) and rounds the result; the
    other side rounds its result once (2 u32 |log p| for both)."""
    top = float(scaled_logits.abs().max())
    if support is None:
        lse = probable_sum_bound(scaled_logits.shape[-1], 1.0)
    else:
        lse = gamma(support + 1) + 2 * U32 * math.log(support)
    return lse + 6 * U32 * top + 2 * U32 * float(logps.abs().max())


def hf_greedy(model, prompts, max_new_tokens, eos):
    """transformers' generate(do_sample=False) completions, each cut after its first EOS."""
    batch = prompt_batch(prompts)
    with torch.no_grad():
        out = model.generate(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask.long(), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad_id(),
                             num_beams=1, top_k=None, top_p=None, temperature=None)
    rows = []
    for row in out[:, batch.prompt_ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def ours(model, prompts, params, eos, num_samples=1, generator=None):
    batch, logps = sample_completions(model, prompt_batch(prompts), num_samples, params, eos_token_ids=eos,
                                      pad_id=pad_id(), generator=generator)
    rows = [ids[mask].tolist() for ids, mask in zip(batch.completion_ids, batch.completion_mask)]
    return batch, logps, rows


def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]


def test_greedy_equals_transformers_generate_with_left_padded_prompts(model):
    eos = [tokenizer().eos_token_id]
    params = SamplingParams(max_new_tokens=10, greedy=True)
    batch, _, rows = ours(model, PROMPTS, params, eos)
    want = hf_greedy(model, PROMPTS, 10, eos)
    assert rows == want
    assert len(set(want[0])) > 3  # the tiny model does not just repeat one token: the test can fail
    assert batch.truncated.tolist() == [True] * 4  # no EOS within 10 tokens (random model)
    assert batch.prompt_index.tolist() == [0, 1, 2, 3]


def test_greedy_eos_ends_rows_at_different_steps_like_generate(model):
    """Make two tokens the greedy path emits into 'EOS': rows stop there (EOS included, padded and
    masked after it), the others run to max_new_tokens and are marked truncated; transformers agrees."""
    params = SamplingParams(max_new_tokens=10, greedy=True)
    _, _, free = ours(model, PROMPTS, params, [tokenizer().eos_token_id])
    eos = [free[0][2], free[2][5]]  # row 0 ends at step 3, row 2 at step 6 (unless an earlier hit)
    batch, logps, rows = ours(model, PROMPTS, params, eos)
    assert rows == hf_greedy(model, PROMPTS, 10, eos)
    lengths = batch.completion_mask.sum(-1).tolist()
    for row, n, trunc in zip(rows, lengths, batch.truncated.tolist()):
        assert n == len(row)
        assert trunc == (row[-1] not in eos)
        assert trunc == (n == 10)
    assert lengths[0] <= 3 and rows[0][-1] in eos
    assert batch.completion_ids.shape[1] == max(lengths)
    pad_region = ~batch.completion_mask
    assert (batch.completion_ids[pad_region] == pad_id()).all()
    assert (logps[pad_region] == 0).all()
    # masks are contiguous from the start: True then False
    for m in batch.completion_mask:
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()


def test_all_rows_finishing_early_shortens_the_batch(model):
    params = SamplingParams(max_new_tokens=10, greedy=True)
    _, _, free = ours(model, PROMPTS, params, [tokenizer().eos_token_id])
    eos = sorted({row[1] for row in free})  # every row's 2nd greedy token (or an earlier one)
    batch, _, _ = ours(model, PROMPTS, params, eos)
    assert batch.completion_ids.shape[1] <= 2
    assert not batch.truncated.any()


@pytest.mark.numerics
@pytest.mark.parametrize("num_samples", [1, 3])
def test_sampling_logps_equal_recomputed_policy_logps(model64, num_samples):
    """The log-prob each token had when it was sampled (temperature 0.7, KV cache, rows dropped from the
    cache as they finish) equals CausalLMPolicy.logps of the finished batch at the same temperature.
    Float64 model, within :func:`sampler_bound` (~1.4e-4; measured 9.5e-7, 2026-12-06, 1 and 2 threads)."""
    params = SamplingParams(temperature=0.7, max_new_tokens=8)
    eos = list(range(3, 7000))  # ~15% of the vocabulary ends a row: rows finish at different steps
    gen = torch.Generator().manual_seed(0)
    batch, sample_logps, _ = ours(model64, PROMPTS, params, eos, num_samples, gen)
    lengths = batch.completion_mask.sum(-1)
    assert len(set(lengths.tolist())) > 2 and batch.truncated.any() and not batch.truncated.all()
    assert batch.prompt_index.tolist() == [i for i in range(4) for _ in range(num_samples)]
    policy = CausalLMPolicy(model64, tokenizer())
    with torch.no_grad():
        recomputed, _ = policy.logps(batch, temperature=0.7)
        logits = model64(input_ids=torch.cat([batch.prompt_ids, batch.completion_ids], 1),
                         attention_mask=batch.attention_mask()).logits
    bound = sampler_bound(logits / 0.7, recomputed[batch.completion_mask])
    torch.testing.assert_close(sample_logps, recomputed, rtol=0, atol=bound)
    assert sample_logps.dtype == torch.float32


def test_sampling_is_reproducible_with_a_seeded_generator(model):
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    eos = [tokenizer().eos_token_id]
    a = ours(model, PROMPTS, params, eos, 2, torch.Generator().manual_seed(3))[2]
    b = ours(model, PROMPTS, params, eos, 2, torch.Generator().manual_seed(3))[2]
    c = ours(model, PROMPTS, params, eos, 2, torch.Generator().manual_seed(4))[2]
    assert a == b and a != c


def test_policy_sample_restores_training_mode(model):
    policy = CausalLMPolicy(model, tokenizer(), generator=torch.Generator().manual_seed(0), engine=HFEngine())
    model.train()
    try:
        out = policy.sample(prompt_batch(PROMPTS[:2]), 2, SamplingParams(max_new_tokens=3))
        assert model.training and len(out) == 4
    finally:
        model.eval()


# ------------------------------------------------------------------------------------------- samplers


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = n * probs
    keep = probs > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sample_from_matches_the_distribution():
    """40,000 seeded draws from p = (0.1, 0, 0.2, 0.3, 0.4): chi-square with 3 degrees of freedom is below
    16.27 (the 0.1% critical value), and the zero-probability entry is never drawn."""
    probs = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4])
    n = 40_000
    draws = sample_from(probs.expand(n, 5), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[1] == 0
    assert chi_square(counts, probs.double()) < 16.27
    # and a wrong distribution is rejected by the same statistic (the test has power)
    assert chi_square(counts, torch.tensor([0.2, 0.0, 0.2, 0.3, 0.3], dtype=torch.float64)) > 100


def test_sample_from_accepts_unnormalised_rows():
    probs = torch.tensor([[2.0, 0.0, 6.0]]).expand(20_000, 3)
    counts = torch.bincount(sample_from(probs, torch.Generator().manual_seed(1)), minlength=3).double()
    assert counts[1] == 0
    assert chi_square(counts, torch.tensor([0.25, 0.0, 0.75], dtype=torch.float64)) < 10.83  # 1 dof, 0.1%


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0**-24])
def test_sample_from_never_draws_a_zero_probability_token_at_the_ends_of_the_uniform(monkeypatch, u):
    """Inverse-CDF sampling must map u in [0, 1) onto tokens with p > 0 only. torch.rand can return
    exactly 0 (probability 2^-24 per draw in float32, i.e. every ~16M decoded tokens): with
    p = (0, 0.5, 0.5, 0) the draw must be 1 then, not the filtered-out token 0; and the largest u must
    give token 2, not the trailing zero-probability token 3."""
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]])
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full_like(real_rand(*a, **k), u))
    got = sample_from(probs).tolist()
    assert got == ([1, 2] if u == 0.0 else [2, 2])


def test_filter_support_keeps_the_nucleus_hand_example():
    """p = (0.05, 0.5, 0.15, 0.3). Sorted: 0.5, 0.3, 0.15, 0.05 with mass before each 0, 0.5, 0.8, 0.95.
    top_p=0.75 keeps the smallest set reaching 0.75: {0.5, 0.3} (tokens 1 and 3); top_p=0.9 adds 0.15
    (token 2); top_p=0.3 keeps only the most likely token; top_p=1 keeps all."""
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    kept = lambda p: torch.isfinite(filter_support(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.75) == [False, True, False, True]
    assert kept(0.9) == [False, True, True, True]
    assert kept(0.3) == [False, True, False, False]
    assert kept(1.0) == [True, True, True, True]
    # kept logits are unchanged, so the softmax renormalises the nucleus: 0.5/0.8, 0.3/0.8. Float32 against the hand
    # value (kind 2, worst case): the inputs and their log round (u32 (1 + 2 |x|), |x| <= 1.2: 3.4 u32 per logit, 6.8
    # u32 after the softmax), x - max, exp, the 2-term sum and the division (5 u32): within 12 u32 = 7.2e-7 relative,
    # 4.5e-7 on 0.625; 1e-6 holds (measured 0)
    torch.testing.assert_close(filter_support(logits, 0.75).softmax(-1)[0],
                               torch.tensor([0.0, 0.625, 0.0, 0.375]), rtol=0, atol=1e-6)


def test_filter_support_rows_are_independent():
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.7, 0.1, 0.1, 0.1]]).log()
    kept = torch.isfinite(filter_support(logits, 0.6))
    assert kept.tolist() == [[False, True, False, True], [True, False, False, False]]


def test_top_p_then_sample_from_draws_from_the_renormalised_nucleus():
    """p = (0.05, 0.5, 0.15, 0.3), top_p = 0.75: the nucleus is tokens 1 and 3, renormalised to
    (0.625, 0.375). 20,000 seeded draws: nothing outside it, chi-square (1 dof) below 10.83 (0.1%)."""
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log().expand(20_000, 4)
    draws = sample_from(filter_support(logits, 0.75).softmax(-1), torch.Generator().manual_seed(2))
    counts = torch.bincount(draws, minlength=4).double()
    assert counts[0] == 0 and counts[2] == 0
    assert chi_square(counts, torch.tensor([0.0, 0.625, 0.0, 0.375], dtype=torch.float64)) < 10.83


@pytest.mark.numerics
def test_top_p_sampling_in_the_decode_loop(model64):
    """Through sample_completions (temperature 0.3, top_p 0.8, 64 samples of one prompt): every first
    token lies in the nucleus of softmax(logits / 0.3), more than one of its tokens is drawn, and the
    reported log-prob is that of the distribution it was drawn from: the tempered one renormalised over the nucleus,
    log p(y) - log Z with Z = the nucleus's mass under softmax(logits / 0.3) (vLLM's processed_logprobs).
    The nucleus as the sampler finds it (float32 logits); the log-probs by hand in float64, within
    :func:`sampler_bound` over the K = 8 kept tokens (9.3e-6 at |z / 0.3| ~ 23; measured 1.4e-6, 2026-12-06. Before:
    float32 by hand within 1e-5, 2.2x above its gap of 4.5e-6)."""
    prompt = [[1, 100, 200, 300]]
    with torch.no_grad():
        z = model64(input_ids=torch.tensor(prompt)).logits[0, -1]
    logits = z.float() / 0.3  # what the sampler filters
    nucleus = torch.isfinite(filter_support(logits[None], 0.8))[0]
    assert 3 <= int(nucleus.sum()) <= 30
    params = SamplingParams(temperature=0.3, top_p=0.8, max_new_tokens=1)
    batch, logps, _ = ours(model64, prompt, params, [tokenizer().eos_token_id], 64, torch.Generator().manual_seed(0))
    first = batch.completion_ids[:, 0]
    assert nucleus[first].all()
    assert len(set(first.tolist())) > 1
    exact = z / 0.3
    mass = exact.softmax(-1)[nucleus].sum()
    assert float(mass) < 0.95  # (the renormalisation is visible)
    want = exact.log_softmax(-1)[first] - mass.log()
    bound = sampler_bound(exact[nucleus], want, int(nucleus.sum()))
    torch.testing.assert_close(logps[:, 0].double(), want, rtol=0, atol=bound)


@pytest.mark.numerics
def test_top_k_sampling_in_the_decode_loop(model64):
    """top_k = 3 (temperature 1, top_p 1, 64 samples of one prompt): every first token is one of the 3 largest logits,
    more than one of them is drawn, and the reported log-prob is log p(y) - log(mass of the 3), p the plain softmax.
    By hand in float64, within :func:`sampler_bound` over the 3 (kind 2: 2.9e-6, measured 1.4e-7; before: float32
    within 1e-5, measured 9.5e-7)."""
    prompt = [[1, 100, 200, 300]]
    with torch.no_grad():
        z = model64(input_ids=torch.tensor(prompt)).logits[0, -1]
    top = z.float().topk(3).indices
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=1)
    batch, logps, _ = ours(model64, prompt, params, [tokenizer().eos_token_id], 64, torch.Generator().manual_seed(0))
    first = batch.completion_ids[:, 0]
    assert all(int(t) in top.tolist() for t in first) and len(set(first.tolist())) > 1
    mass = z.softmax(-1)[top].sum()
    want = z.log_softmax(-1)[first] - mass.log()
    torch.testing.assert_close(logps[:, 0].double(), want, rtol=0, atol=sampler_bound(z[top], want, 3))
