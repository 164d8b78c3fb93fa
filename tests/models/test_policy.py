"""Tests for prefzoo.models.policy: per-token log-probs of completion tokens on the tiny model.

Every expected value is an independent computation (``plain_logps``): the model run on the single,
unpadded sequence with its default positions, then log_softmax(logits / T) and a gather by hand.

Tolerances (tests/bounds.py). The model runs in float64 here (kind 1), throughout: transformers' RMSNorm, which
rounds its input to float32, is kept in float64 (tests/perf/test_fast_lora.py:float64_rms_norm; as shipped, the
padded and unpadded passes' states, ~1e-16 apart, round to different float32 numbers with probability ~1e-4 per
pass here, which moves a log-prob by up to ~1e-6). So the two float64 passes differ by ~1e-15; the policy returns
its float64 log-probs rounded once to float32 (DESIGN.md: log-probs are float32), and so does ``plain_logps``: two
float64 values that close round to the same float32 or to neighbours, one ulp apart, at most 2^-23 |x|
(:data:`TOL`). The values reach -17 at temperature 0.7, where an ulp is 1.9e-6: the round 1e-6 used before sat
inside one ulp. Measured, 2026-12-06, at 1 and 2 threads: 0 everywhere. The float32 model
(``test_float32_model_agrees_to_float32_precision``) differs by more: see there.
"""

import pytest
import torch

from prefzoo.models.policy import CausalLMPolicy, completion_logits
from tests.bounds import U32, probable_sum_bound
from tests.models.helpers import SPREAD, plain_logps, sequence_batch, tiny_model, tokenizer
from tests.models.helpers import float64_rms_norm

PROMPTS = [[1, 100, 200, 300, 4000, 5], [1, 7], [9, 8, 7, 6, 5, 4, 3, 2000, 1000]]
COMPLETIONS = [[400, 500, 2], [600, 700, 800, 900, 1000, 1100, 2], [31000]]
#: two float64 log-probs ~1e-15 apart, each rounded once to float32: equal or one ulp apart (module docstring)
TOL = dict(rtol=2 * U32, atol=0)
#: the float32 model's padded fused logits against the unpadded forward's: 5.8e-6 measured (2026-12-06, 1 and 2
#: threads, this file's batch: two decoder layers and the output layer summed in other orders, no short derivation);
#: the bound is 10x that (kind 3)
FLOAT32_LOGIT_GAP = 6e-5


@pytest.fixture(scope="module", autouse=True)
def _float64_rms_norm():
    """Before the module's other fixtures (the expected values): the float64 model is float64 throughout."""
    with float64_rms_norm():
        yield


@pytest.fixture(scope="module")
def model():
    return tiny_model(initializer_range=SPREAD).double().eval()


@pytest.fixture(scope="module")
def policy(model):
    return CausalLMPolicy(model, tokenizer())


@pytest.fixture(scope="module")
def expected(model):
    return [plain_logps(model, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]


def logps_of(policy, batch, temperature=1.0):
    with torch.no_grad():
        return policy.logps(batch, temperature)[0]


@pytest.mark.numerics
def test_logps_equal_the_plain_unpadded_computation(policy, expected):
    out = logps_of(policy, sequence_batch(PROMPTS, COMPLETIONS))
    assert out.dtype == torch.float32
    assert out.shape == (3, max(len(c) for c in COMPLETIONS))  # completion positions only, never the prompt
    for i, want in enumerate(expected):
        torch.testing.assert_close(out[i, : len(want)], want, **TOL)
    assert expected[0].std() > 0.1  # the values depend on the context: the test can fail


@pytest.mark.numerics
@pytest.mark.parametrize("extra_left,extra_right", [(3, 0), (0, 4), (5, 2)])
def test_more_left_and_right_padding_changes_nothing(policy, expected, extra_left, extra_right):
    out = logps_of(policy, sequence_batch(PROMPTS, COMPLETIONS, extra_left=extra_left, extra_right=extra_right))
    for i, want in enumerate(expected):
        torch.testing.assert_close(out[i, : len(want)], want, **TOL)


@pytest.mark.numerics
@pytest.mark.parametrize("row", [0, 1, 2])
def test_batch_composition_changes_nothing(policy, expected, row):
    """A row alone (no padding at all) and next to longer neighbours in either order."""
    alone = logps_of(policy, sequence_batch([PROMPTS[row]], [COMPLETIONS[row]]))
    torch.testing.assert_close(alone[0], expected[row], **TOL)
    order = [row] + [i for i in range(3) if i != row]
    mixed = logps_of(policy, sequence_batch([PROMPTS[i] for i in order], [COMPLETIONS[i] for i in order]))
    torch.testing.assert_close(mixed[0, : len(expected[row])], expected[row], **TOL)


@pytest.mark.numerics
def test_prompt_and_padding_are_excluded(policy, expected):
    batch = sequence_batch(PROMPTS, COMPLETIONS, extra_left=2, extra_right=3)
    out = logps_of(policy, batch)
    assert torch.equal(out[~batch.completion_mask], torch.zeros(int((~batch.completion_mask).sum())))
    # whatever ids sit under the padding, nothing changes
    scrambled = sequence_batch(PROMPTS, COMPLETIONS, extra_left=2, extra_right=3)
    scrambled.prompt_ids[~scrambled.prompt_mask] = 12345
    scrambled.completion_ids[~scrambled.completion_mask] = 23456
    torch.testing.assert_close(logps_of(policy, scrambled), out, rtol=0, atol=0)
    # the summed sequence log-prob is the sum over completion tokens only: summed in float64, the terms of the two
    # sides are at most an ulp apart each (TOL), so the sums by at most 2^-23 sum |x| (plus ~1e-14)
    total = (out.double() * batch.completion_mask).sum(-1)
    want = torch.stack([e.double().sum() for e in expected])
    bound = 2 * U32 * torch.stack([e.double().abs().sum() for e in expected]) + 1e-12
    assert bool(((total - want).abs() <= bound).all()), (total - want, bound)


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_temperature_divides_the_logits(policy, model, temperature):
    out = logps_of(policy, sequence_batch(PROMPTS, COMPLETIONS), temperature)
    plain = logps_of(policy, sequence_batch(PROMPTS, COMPLETIONS))
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        torch.testing.assert_close(out[i, : len(c)], plain_logps(model, p, c, temperature), **TOL)
    assert (out - plain).abs().max() > 0.1


@pytest.mark.numerics
def test_entropy_is_that_of_the_tempered_next_token_distribution(policy, model):
    """The entropy, by hand in float64 on the unpadded sequence, rounded once to float32: within one ulp (:data:`TOL`;
    4.7e-7 from the float64 value, 2026-12-06; the old 1e-4 compared with a float32 entropy of 49,152 terms, 1.9e-6
    away)."""
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    with torch.no_grad():
        _, entropy = policy.logps(batch, 0.7, with_entropy=True)
        logits = model(input_ids=torch.tensor([PROMPTS[1] + COMPLETIONS[1]])).logits[0] / 0.7
    logp = logits.log_softmax(-1)
    want = -(logp.exp() * logp).sum(-1)[len(PROMPTS[1]) - 1: len(PROMPTS[1]) - 1 + len(COMPLETIONS[1])]
    torch.testing.assert_close(entropy[1, : len(COMPLETIONS[1])], want.float(), **TOL)
    assert torch.equal(entropy[~batch.completion_mask], torch.zeros(int((~batch.completion_mask).sum())))


@pytest.mark.numerics
def test_logps_carry_gradients_and_chunking_changes_nothing(model):
    """Both paths, whole and one position per chunk. The fused path (``head_chunk_size``) computes in float64 and
    rounds once: one ulp (:data:`TOL`). The plain path (``logits_chunk_size``; before, the test set it on the fused
    path, which ignores it, so it compared a computation with itself) takes the log-softmax of the same logits in
    float32: two log-sum-exps of V = 49,152 terms of at most 1 (probabilistic bound, lambda = 10: 1.3e-4 each) and
    roundings of values up to max|z| and |log p| (kind 2). Measured: 0."""
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    a = CausalLMPolicy(model, tokenizer(), head_chunk_size=None).logps(batch)[0]
    b = CausalLMPolicy(model, tokenizer(), head_chunk_size=1).logps(batch)[0]
    assert a.requires_grad
    torch.testing.assert_close(a, b, **TOL)
    plain = [CausalLMPolicy(model, tokenizer(), fused_logps=False, logits_chunk_size=c).logps(batch)[0].detach()
             for c in (None, 1)]
    with torch.no_grad():
        logits = completion_logits(model, batch)
    vocab, max_logit = logits.shape[-1], float(logits.abs().max())
    bound = 2 * (probable_sum_bound(vocab, 1.0) + 2 * U32 * max_logit + U32 * float(plain[0].abs().max()))
    torch.testing.assert_close(plain[1], plain[0], rtol=0, atol=bound)


def test_completion_logits_never_run_the_output_layer_on_the_prompt(model):
    """Only C positions reach the output layer (logits_to_keep): (B, C, V) for a long prompt."""
    batch = sequence_batch([list(range(1, 200))], [[5, 6]])
    with torch.no_grad():
        logits = completion_logits(model, batch)
    assert logits.shape == (1, 2, model.config.vocab_size)


@pytest.mark.numerics
def test_float32_model_agrees_to_float32_precision():
    """The float32 model, padded (the fused path: logits and log-softmax in float32) against ``plain_logps``
    (unpadded; the log-softmax of its float32 logits in float64). Log-softmax moves by at most twice the largest
    change of a logit: 2 :data:`FLOAT32_LOGIT_GAP` (kind 3); the fused float32 log-sum-exp of V = 49,152 terms of at
    most 1, probabilistic bound (lambda = 10), the logits rounded (2u max|z|) and the result (u |log p|) (kind 2).
    About 2.6e-4 in all; measured 2.9e-6 (2026-12-06, 1 and 2 threads; the old rtol = atol = 1e-6 allowed 1.6e-5).
    A wrong position or mask moves log-probs by O(1)."""
    model = tiny_model(initializer_range=SPREAD).eval()
    policy = CausalLMPolicy(model, tokenizer())
    batch = sequence_batch(PROMPTS, COMPLETIONS, extra_left=3, extra_right=2)
    padded = logps_of(policy, batch)
    with torch.no_grad():
        max_logit = float(completion_logits(model, batch).abs().max())
    bound = (2 * FLOAT32_LOGIT_GAP + probable_sum_bound(model.config.vocab_size, 1.0) + 2 * U32 * max_logit
             + U32 * float(padded.abs().max()))
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        torch.testing.assert_close(padded[i, : len(c)], plain_logps(model, p, c), rtol=0, atol=bound)


def test_seeded_samples_from_the_given_generator_and_restores_the_policy_s_own(model):
    """``policy.seeded(g)``: inside, the samples are those of ``g`` (two policies seeded alike draw the same); after,
    even when the block raises, the policy's own generator is back and its stream untouched."""
    from prefzoo.rollout.engine import HFEngine
    from prefzoo.types import SamplingParams
    from tests.models.helpers import prompt_batch

    own = torch.Generator().manual_seed(1)
    policy = CausalLMPolicy(model, tokenizer(), engine=HFEngine(), generator=own)
    prompts = prompt_batch(PROMPTS[:2])
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    with policy.seeded(torch.Generator().manual_seed(7)):
        first = policy.sample(prompts, 2, params)
    with pytest.raises(RuntimeError, match="boom"), policy.seeded(torch.Generator().manual_seed(7)):
        again = policy.sample(prompts, 2, params)
        raise RuntimeError("boom")
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert policy.generator is own and torch.equal(own.get_state(), torch.Generator().manual_seed(1).get_state())
