"""Sampling through prefzoo's Tinker server (issue 50, A): ``save_weights_and_get_sampling_client`` /
``create_sampling_client`` + ``sample`` on prefzoo's hf engine, and ``forward_backward_custom`` (the client's loss on
the returned log-probs, its gradient sent back as cross_entropy weights).

* ``num_samples`` sequences of at most ``max_tokens`` tokens; ``stop`` as token ids ends a sequence at (and with) the
  stop token, reason ``stop``; a sequence that runs out is ``length``; ``stop`` as a string ends it at the token that
  completes the string;
* each sampled token's log-prob is the model's (temperature 1): the training client's ``forward`` on the same tokens
  gives the same numbers within the float32 bound below; ``include_prompt_logprobs`` (and ``compute_logprobs``) gives the prompt's (None first);
* the same ``seed`` gives the same tokens; a sampler made from a saved path (``save_weights_for_sampler`` then
  ``create_sampling_client``) samples what the snapshot sampler does; a base-model sampler ignores the adapter;
* ``forward_backward_custom`` with the loss -sum(w * logp) (the SDK's own cross_entropy, written as a custom loss) moves
  the adapter exactly as the built-in cross_entropy does.

The log-prob bound (kind 2 of tests/bounds.py): the sampler's log-prob and the training pass's are two float32
computations of log softmax(z)[y] for the same weights, the decode loop (KV cache) against a full pass. The logits z
come out of the same kernels up to the attention's sums over at most P + C positions, and the log-softmax sums V =
49152 exponentials: |d logp| <= 2 gamma_V (1 + |logp|), about 6e-3 nats: loose, and the measured differences are 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from tests.bounds import gamma

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

PROMPT = [1, 504, 2682, 314, 3737, 30, 28, 31, 47]


def test_samples_their_logprobs_stops_and_seeds(service_client):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    # one step so the adapter is not the identity (B = 0 at init)
    tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                                     loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * 8})],
                        "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PROMPT)

    out = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=11), include_prompt_logprobs=True).result()
    assert len(out.sequences) == 3
    vocab = 49152
    for seq in out.sequences:
        assert 1 <= len(seq.tokens) <= 6 and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason == ("length" if len(seq.tokens) == 6 else "stop")
        full = PROMPT + seq.tokens
        train = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                        loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)})],
                           "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        sampled = torch.tensor(seq.logprobs)
        bound = 2 * gamma(vocab) * (1 + train[len(PROMPT) - 1:].abs())
        assert (sampled - train[len(PROMPT) - 1:]).abs().le(bound).all()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    prompt_train = train[:len(PROMPT) - 1]
    assert (torch.tensor(out.prompt_logprobs[1:]) - prompt_train).abs().le(2 * gamma(vocab) * (1 + prompt_train.abs())).all()

    # compute_logprobs (a one-token sample asking for the prompt's log-probs) gives the same numbers
    assert sampler.compute_logprobs(prompt).result() == out.prompt_logprobs

    again = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=11)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]

    # stop on a token id: the first sequence's third token (the same seed and num_samples: the same draws)
    stop_token = out.sequences[0].tokens[2]
    stopped = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=11, stop=[stop_token])).result()
    first = stopped.sequences[0]
    assert first.tokens == out.sequences[0].tokens[:first.tokens.index(stop_token) + 1] and first.stop_reason == "stop"
    # stop on a string: the text of the first sequence's second token
    tokenizer = tc.get_tokenizer()
    text = tokenizer.decode(out.sequences[0].tokens[:2])
    piece = tokenizer.decode(out.sequences[0].tokens[1:2]).strip() or text.strip()
    by_string = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=11, stop=piece)).result().sequences[0]
    assert piece in tokenizer.decode(by_string.tokens) and by_string.stop_reason == "stop"
    assert piece not in tokenizer.decode(by_string.tokens[:-1])

    # a sampler from a saved path samples what the snapshot does; the base model's differs
    path = tc.save_weights_for_sampler("snap").result().path
    from_path = service_client.create_sampling_client(model_path=path)
    same = from_path.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=11)).result()
    assert [s.tokens for s in same.sequences] == [s.tokens for s in out.sequences]
    base = service_client.create_sampling_client(base_model="tiny")
    base_lp = base.sample(prompt, 1, types.SamplingParams(max_tokens=1, seed=11), include_prompt_logprobs=True)
    assert base_lp.result().prompt_logprobs[1:] != out.prompt_logprobs[1:]


def test_forward_backward_custom_equals_the_built_in_cross_entropy(service_client, tinker_server):
    from safetensors.torch import load_file

    data = [types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [0.0, 0.0, 1.0, 1.0, 0.5, 1, 1, 1]})]

    def neg_weighted_ll(batch, logprobs):
        loss = sum((-lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum() for d, lp in zip(batch, logprobs))
        return loss, {"custom": float(loss)}

    states = []
    for custom in (False, True):
        tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        for _ in range(2):  # two steps: the second has B != 0, so every LoRA matrix gets a gradient
            if custom:
                out = tc.forward_backward_custom(data, neg_weighted_ll).result()
                assert "custom" in out.metrics and "surrogate_loss:sum" in out.metrics
            else:
                tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2, eps=1e-3)).result()
        path = tc.save_state(f"custom-{custom}").result().path
        states.append(load_file(str(tinker_server.server.checkpoint_folder(path)[0] / "adapter_model.safetensors")))
    # the custom route's weights are -dC/dlogp = w exactly (the loss is linear), so the two runs are the same
    # computation: equal to the bit
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_requests_sent_at_once_are_sampled_as_one_batch_with_each_ones_own_tokens(service_client, tinker_server,
                                                                                 monkeypatch):
    """The cookbook sends one ``sample`` request per prompt, all at once: the server samples them in one batch of the
    hf engine (fewer ``sample_many`` calls than requests), and each seeded request gets the tokens it gets alone.

    The tokens: a seeded request inverts the uniforms of its own seed (``prompt_uniforms``), alone or batched; what
    differs is the left padding of the shorter prompts, which changes the logits by float rounding only (masked
    positions), so a token could differ only where a uniform falls within ~1e-6 of a CDF step: the test compares them
    exactly. The log-probs: the same two float32 computations of one log-softmax as above, bound 2 gamma_V (1 + |lp|).
    """
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:], [1, 504, 2682]]
    params = [types.SamplingParams(max_tokens=6, temperature=1.0, seed=100 + i) for i in range(len(prompts))]
    alone = [sampler.sample(types.ModelInput.from_ints(p), 2, sp).result() for p, sp in zip(prompts, params)]
    calls = []
    real = tinker_server.server.host.sample_many
    monkeypatch.setattr(tinker_server.server.host, "sample_many",
                        lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    futures = [sampler.sample(types.ModelInput.from_ints(p), 2, sp) for p, sp in zip(prompts, params)]
    together = [f.result() for f in futures]
    assert sum(calls) == len(prompts) and len(calls) < len(prompts), calls
    vocab = 49152
    for a, b in zip(alone, together):
        for sa, sb in zip(a.sequences, b.sequences):
            assert sa.tokens == sb.tokens
            la, lb = torch.tensor(sa.logprobs), torch.tensor(sb.logprobs)
            assert (la - lb).abs().le(2 * gamma(vocab) * (1 + la.abs())).all()


def test_prompt_logprob_requests_sent_at_once_are_one_batch_and_each_gets_its_own(service_client, tinker_server,
                                                                                 monkeypatch):
    """``compute_logprobs`` (backend=tinker's reference pass sends one per row, all at once) and sample requests with
    prompt log-probs are batched too (one forward over the prompts, right-padded), never mixed with requests that did
    not ask for them: each gets its own prompt's log-probs, equal to its request alone within the bound above
    (2 gamma_V (1 + |lp|): the same log-softmax, the padded batch's matmuls summing in another order at most). Before:
    one request at a time; and a request asking for prompt log-probs that joined a batch without them lost them."""
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:], [1, 504, 2682]]
    alone = [sampler.compute_logprobs(types.ModelInput.from_ints(p)).result() for p in prompts]
    calls = []
    real = tinker_server.server.host.sample_many
    monkeypatch.setattr(tinker_server.server.host, "sample_many",
                        lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    params = types.SamplingParams(max_tokens=1)
    plain = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params)  # same settings, no prompt log-probs
    futures = [sampler.compute_logprobs(types.ModelInput.from_ints(p)) for p in prompts]
    together = [f.result() for f in futures]
    assert plain.result().prompt_logprobs is None
    assert sum(calls) == len(prompts) + 1 and len(calls) < len(prompts) + 1, calls
    vocab = 49152
    for p, a, b in zip(prompts, alone, together):
        assert a[0] is None and b[0] is None and len(b) == len(p)
        la, lb = torch.tensor(a[1:]), torch.tensor(b[1:])
        assert (la - lb).abs().le(2 * gamma(vocab) * (1 + la.abs())).all()
