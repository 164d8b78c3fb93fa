"""Tests for prefzoo.models.policy: per-token log-probs of completion tokens on the tiny model.

Every expected value is an independent computation (``plain_logps``): the model run on the single,
unpadded sequence with its default positions, then log_softmax(logits / T) and a gather by hand.

The model runs in float64 here, so the only rounding left is the policy's own float32 log-softmax
(DESIGN.md: log-probs are float32): half an ulp of a value near -10 is 4.8e-7, inside the 1e-6 asked
for. (In float32 the padded and unpadded forwards differ by matmul blocking, ~2e-6 absolute, 2e-7
relative, on values near -10: ``test_float32_model_agrees_to_float32_precision``.)
"""

import pytest
import torch

from prefzoo.models.policy import CausalLMPolicy, completion_logits
from tests.models.helpers import SPREAD, plain_logps, sequence_batch, tiny_model, tokenizer

PROMPTS = [[1, 100, 200, 300, 4000, 5], [1, 7], [9, 8, 7, 6, 5, 4, 3, 2000, 1000]]
COMPLETIONS = [[400, 500, 2], [600, 700, 800, 900, 1000, 1100, 2], [31000]]
TOL = dict(rtol=0, atol=1e-6)


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


def test_logps_equal_the_plain_unpadded_computation(policy, expected):
    out = logps_of(policy, sequence_batch(PROMPTS, COMPLETIONS))
    assert out.dtype == torch.float32
    assert out.shape == (3, max(len(c) for c in COMPLETIONS))  # completion positions only, never the prompt
    for i, want in enumerate(expected):
        torch.testing.assert_close(out[i, : len(want)], want, **TOL)
    assert expected[0].std() > 0.1  # the values depend on the context: the test can fail


@pytest.mark.parametrize("extra_left,extra_right", [(3, 0), (0, 4), (5, 2)])
def test_more_left_and_right_padding_changes_nothing(policy, expected, extra_left, extra_right):
    out = logps_of(policy, sequence_batch(PROMPTS, COMPLETIONS, extra_left=extra_left, extra_right=extra_right))
    for i, want in enumerate(expected):
        torch.testing.assert_close(out[i, : len(want)], want, **TOL)


@pytest.mark.parametrize("row", [0, 1, 2])
def test_batch_composition_changes_nothing(policy, expected, row):
    """A row alone (no padding at all) and next to longer neighbours in either order."""
    alone = logps_of(policy, sequence_batch([PROMPTS[row]], [COMPLETIONS[row]]))
    torch.testing.assert_close(alone[0], expected[row], **TOL)
    order = [row] + [i for i in range(3) if i != row]
    mixed = logps_of(policy, sequence_batch([PROMPTS[i] for i in order], [COMPLETIONS[i] for i in order]))
    torch.testing.assert_close(mixed[0, : len(expected[row])], expected[row], **TOL)


def test_prompt_and_padding_are_excluded(policy, expected):
    batch = sequence_batch(PROMPTS, COMPLETIONS, extra_left=2, extra_right=3)
    out = logps_of(policy, batch)
    assert torch.equal(out[~batch.completion_mask], torch.zeros(int((~batch.completion_mask).sum())))
    # whatever ids sit under the padding, nothing changes
    scrambled = sequence_batch(PROMPTS, COMPLETIONS, extra_left=2, extra_right=3)
    scrambled.prompt_ids[~scrambled.prompt_mask] = 12345
    scrambled.completion_ids[~scrambled.completion_mask] = 23456
    torch.testing.assert_close(logps_of(policy, scrambled), out, rtol=0, atol=0)
    # the summed sequence log-prob is the sum over completion tokens only
    total = (out * batch.completion_mask).sum(-1)
    torch.testing.assert_close(total, torch.stack([e.sum() for e in expected]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_temperature_divides_the_logits(policy, model, temperature):
    out = logps_of(policy, sequence_batch(PROMPTS, COMPLETIONS), temperature)
    plain = logps_of(policy, sequence_batch(PROMPTS, COMPLETIONS))
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        torch.testing.assert_close(out[i, : len(c)], plain_logps(model, p, c, temperature), **TOL)
    assert (out - plain).abs().max() > 0.1


def test_entropy_is_that_of_the_tempered_next_token_distribution(policy, model):
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    with torch.no_grad():
        _, entropy = policy.logps(batch, 0.7, with_entropy=True)
        logits = model(input_ids=torch.tensor([PROMPTS[1] + COMPLETIONS[1]])).logits[0].float() / 0.7
    probs = logits.softmax(-1)
    want = -(probs * probs.log()).sum(-1)[len(PROMPTS[1]) - 1: len(PROMPTS[1]) - 1 + len(COMPLETIONS[1])]
    torch.testing.assert_close(entropy[1, : len(COMPLETIONS[1])], want, rtol=0, atol=1e-4)
    assert torch.equal(entropy[~batch.completion_mask], torch.zeros(int((~batch.completion_mask).sum())))


def test_logps_carry_gradients_and_chunking_changes_nothing(model):
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    a = CausalLMPolicy(model, tokenizer(), logits_chunk_size=None).logps(batch)[0]
    b = CausalLMPolicy(model, tokenizer(), logits_chunk_size=1).logps(batch)[0]
    assert a.requires_grad
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_completion_logits_never_run_the_output_layer_on_the_prompt(model):
    """Only C positions reach the output layer (logits_to_keep): (B, C, V) for a long prompt."""
    batch = sequence_batch([list(range(1, 200))], [[5, 6]])
    with torch.no_grad():
        logits = completion_logits(model, batch)
    assert logits.shape == (1, 2, model.config.vocab_size)


def test_float32_model_agrees_to_float32_precision():
    model = tiny_model(initializer_range=SPREAD).eval()
    policy = CausalLMPolicy(model, tokenizer())
    padded = logps_of(policy, sequence_batch(PROMPTS, COMPLETIONS, extra_left=3, extra_right=2))
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        torch.testing.assert_close(padded[i, : len(c)], plain_logps(model, p, c), rtol=1e-6, atol=1e-6)
