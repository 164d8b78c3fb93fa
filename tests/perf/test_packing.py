"""Padding-free batches (prefzoo.models.packing, ``model.fast.padding_free``) equal the padded passes, per row.

What is compared: the same tiny Llama (fp32, LoRA with non-zero B so the adapter matters, weights spread 0.2 so the
log-probs depend on the context) run on the padded layout -- itself tested against a float64 plain computation in
test_policy_fast.py -- and on the packed one. A wrong position, a leaked attention
link between rows or a wrong gather index changes values by O(1): the tests also check that they depend on the
context (``std > 0.5``), and that the packed forward really read only the real tokens (the embedding's input).

Tolerances (tests/bounds.py). The two layouts run the float32 body in other orders (the attention over a packed row
or a padded block, the shared prompt's gradient summed once or per row): no short derivation, so :data:`REL`
relative to the largest entry (kind 3) bounds logits, gradients, losses and metrics. Log-probs and entropies add
what can be derived: each side's float32 log-softmax over V = 49,152 (:func:`close_logps`, kind 2, as in
tests/rollout/test_sampler_entropy.py).

Before the change (padded only), the DPO batch of pairs_batch() -- prompts of 6 and 2 tokens, completions of 3 vs
200 and 4 vs 9 tokens -- went through the body as a (4, 206) block: 824 positions for 232 real tokens; the packed
pass reads (1, 224) (the prompts once per pair: 6 + 3 + 200 + 2 + 4 + 9).
"""

from __future__ import annotations

import pytest
import torch

from prefzoo.models import loading

from prefzoo.algos import get_algorithm
from prefzoo.config import Config, FastPathConfig, ModelConfig, TrainerConfig, resolve_objective
from prefzoo.data.preference import PreferenceExample, collate_preferences
from prefzoo.models.attention import use_gqa_attention
from prefzoo.models.packing import (PACKED_SDPA, pack_batch, packed_forward_kwargs, packing_mode,
                                    use_packed_attention)
from prefzoo.models.policy import CausalLMPolicy, completion_logits, packed_completion_logits
from prefzoo.training.step import accumulate_gradients
from tests.bounds import U32, probable_sum_bound
from tests.models.helpers import SPREAD, lora_settings, sequence_batch, tiny_model, tokenizer
from tests.perf.test_fast_lora import lora_model

#: measured 2026-12-06 (2 seeds, 1 and 2 threads): at most 4.2e-6 of the largest entry (DPO's LoRA gradients), 2.3e-6
#: on log-probs and entropies, 7.7e-7 of the largest metric (the reward model's); 12x the largest (kind 3). The round
#: 1e-5 used before sat 2.4x above it.
REL = 5e-5


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pairs_batch(extra: list[PreferenceExample] = ()):
    """Pair 0: a 6-token prompt, chosen of 3 tokens vs rejected of 200; pair 1: a 2-token prompt, 4 vs 9."""
    examples = [PreferenceExample(ids(6, 0), ids(3, 1), ids(200, 2)), PreferenceExample(ids(2, 3), ids(4, 4), ids(9, 5)),
                *extra]
    return collate_preferences(examples, list(range(len(examples))), tokenizer().pad_token_id)


def close(got: torch.Tensor, want: torch.Tensor, rel: float = REL):
    torch.testing.assert_close(got, want, rtol=0, atol=rel * float(want.abs().max()))


def close_logps(got: torch.Tensor, want: torch.Tensor, model, batch, entropy: bool = False):
    """Log-probs (or entropies) of the two layouts: :data:`REL` of the largest (the bodies, kind 3) plus, on either
    side, the float32 log-softmax of the logits z (kind 2, probabilistic bound, lambda = 10): the log-sum-exp of V terms
    of at most 1 (lambda sqrt(V) u32 = 1.3e-4), z and z - max z rounded (2 u32 max|z|), the result (u32 |log p|); an
    entropy -sum_v p_v log p_v moves by that times (1 + H), plus its own sum's lambda sqrt(V) u32 H."""
    with torch.no_grad():
        logits = completion_logits(model, batch)
    vocab, top = logits.shape[-1], float(want.abs().max())
    logp_bound = probable_sum_bound(vocab, 1.0) + 2 * U32 * float(logits.abs().max()) + U32 * top
    if entropy:
        logp_bound = logp_bound * (1 + top) + probable_sum_bound(vocab, top)
    torch.testing.assert_close(got, want, rtol=0, atol=REL * top + 2 * logp_bound)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def close_grads(a: dict, b: dict):
    assert a.keys() == b.keys() and a
    for n in a:
        close(a[n], b[n])


class InputSpy:
    """Records the shape of every input that enters the model's embedding layer inside the ``with`` block."""

    def __init__(self, model):
        self.model, self.shapes = model, []

    def __enter__(self):
        hook = lambda m, args, out: self.shapes.append(tuple(args[0].shape))  # noqa: E731
        self.handle = self.model.get_input_embeddings().register_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def ready(policy: CausalLMPolicy, module=None) -> CausalLMPolicy:
    """The policy with its one-off fused-path check (a 5-token forward) done, so a spy sees only the passes."""
    policy.fused_parts(module if module is not None else policy.model)
    return policy


# --------------------------------------------------------------------------------------------------- layout
def test_pack_layout_by_hand():
    """Rows 0 and 2 share the prompt [11, 12, 13]; row 1 has [21, 22]; row 3 has no counted token (left out).

    Packed: [11 12 13 | 31 32 | 51] [21 22 | 41 42 43]; positions restart per group: 0 1 2 | 3 4 | 3, 0 1 | 2 3 4.
    Predicting positions (row-major over the counted tokens): row 0's 31 <- 13 (packed 2), 32 <- 31 (3); row 1's
    41 <- 22 (7), 42 <- 41 (8), 43 <- 42 (9); row 2's 51 <- 13 (2). The first group's mask: the prompt causal, 31/32
    see the prompt and themselves causally, 51 the prompt and itself (not 31, 32); the second group is causal."""
    batch = sequence_batch([[11, 12, 13], [21, 22], [11, 12, 13], [7]], [[31, 32], [41, 42, 43], [51], [99]])
    batch.completion_mask[3] = False
    packed = pack_batch(batch)
    assert packed.input_ids.tolist() == [[11, 12, 13, 31, 32, 51, 21, 22, 41, 42, 43]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4]]
    assert packed.source.tolist() == [2, 3, 7, 8, 9, 2]
    (s0, s1) = packed.segments
    assert (s0.start, s0.end, s1.start, s1.end, s1.mask) == (0, 6, 6, 11, None)
    assert s0.mask.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                                      [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 1]]
    alone = pack_batch(batch, share_prompts=False)  # every row its own causal segment
    assert alone.input_ids.tolist() == [[11, 12, 13, 31, 32, 21, 22, 41, 42, 43, 11, 12, 13, 51]]
    assert [(s.start, s.end, s.mask) for s in alone.segments] == [(0, 5, None), (5, 10, None), (10, 14, None)]


def test_pack_layout_of_completions_with_uncounted_tokens_by_hand():
    """SFT on a conversation: row 0's completion [31, 32, 33, 34] counts 31 and 34 (32, 33: a user turn, attended to,
    not trained on); row 1 (prompt [21]) counts [41, 42]. Packed: [11 12 | 31 32 33 34] [21 | 41 42], every completion
    token once; predicting positions of the counted tokens only: 31 <- 12 (packed 1), 34 <- 33 (4); 41 <- 21 (6),
    42 <- 41 (7)."""
    batch = sequence_batch([[11, 12], [21]], [[31, 32, 33, 34], [41, 42]])
    batch.token_mask = batch.completion_mask.clone()
    batch.completion_mask[0, 1:3] = False
    packed = pack_batch(batch)
    assert packed.input_ids.tolist() == [[11, 12, 31, 32, 33, 34, 21, 41, 42]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2]]
    assert packed.source.tolist() == [1, 4, 6, 7]
    assert [(s.start, s.end, s.mask) for s in packed.segments] == [(0, 6, None), (6, 9, None)]
    batch.completion_mask[1, 0] = True
    batch.token_mask[1, 0] = False  # a counted token the pass would not attend to: no layout
    assert pack_batch(batch) is None


def test_layouts_the_packed_pass_cannot_reproduce_are_refused():
    """A hole in a completion mask, or a row with counted completion tokens but no prompt token: None (padded)."""
    batch = sequence_batch([[1, 2], [3]], [[4, 5, 6], [7]])
    batch.completion_mask[0, 1] = False
    assert pack_batch(batch) is None
    batch = sequence_batch([[1, 2], [3]], [[4, 5, 6], [7]])
    batch.prompt_mask[1] = False
    assert pack_batch(batch) is None


# ---------------------------------------------------------------------------------------- the policy passes
@pytest.fixture(scope="module")
def model():
    m = lora_model(torch.float32)
    use_gqa_attention(m)
    assert use_packed_attention(m) and packing_mode(m) == "segments"
    return m


def policy_logps(policy, batch):
    policy.model.zero_grad(set_to_none=True)
    logps, entropy = policy.logps(batch, 0.7, with_entropy=True)
    weights = ((torch.arange(logps.numel()) % 7 - 3) / 4).view(logps.shape)
    (logps * weights).sum().backward()
    return logps.detach(), entropy, grads(policy.model)


@pytest.mark.numerics
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("share", [True, False])
def test_logps_entropies_and_lora_gradients_equal_padded(model, fused, share):
    """Per-token log-probs, entropies and every LoRA gradient of the stacked pairs (3 vs 200 tokens), packed = padded;
    0 on padding. The packed body forward reads exactly the real tokens: (1, 224) with shared prompts (6 + 3 + 200 +
    2 + 4 + 9), (1, 232) without (each row its prompt); the padded one read (4, 206)."""
    both = pairs_batch().stacked(tokenizer().pad_token_id)
    want = policy_logps(CausalLMPolicy(model, tokenizer(), fused_logps=fused, share_prompts=share), both)
    policy = ready(CausalLMPolicy(model, tokenizer(), fused_logps=fused, share_prompts=share, padding_free=True))
    with InputSpy(model) as spy:
        got = policy_logps(policy, both)
    assert spy.shapes == [(1, 224 if share else 232)]
    for g, w, is_entropy in zip(got[:2], want[:2], (False, True)):
        close_logps(g, w, model, both, is_entropy)
        assert torch.equal(g[~both.completion_mask], torch.zeros(int((~both.completion_mask).sum())))
    close_grads(got[2], want[2])
    assert float(want[0][both.completion_mask].std()) > 0.5


@pytest.mark.numerics
def test_a_single_row_pack_equals_padded(model):
    """One row (one causal segment, no mask at all) and an SFT-style batch of chosen rows only."""
    one = pairs_batch().chosen.select([0])
    want = policy_logps(CausalLMPolicy(model, tokenizer()), one)
    got = policy_logps(CausalLMPolicy(model, tokenizer(), padding_free=True), one)
    close_logps(got[0], want[0], model, one)
    close_grads(got[2], want[2])


@pytest.mark.numerics
def test_reference_logps_adapter_disabled_are_packed_and_equal(model):
    """pi_ref = the adapter-disabled model: packed = padded, and it differs from the policy's (the adapter is on)."""
    from prefzoo.models.reference import make_reference

    ref = make_reference(model, lora_enabled=True, adapter_loaded=False, mode="adapter_disabled")
    both = pairs_batch().stacked(tokenizer().pad_token_id)
    want = CausalLMPolicy(model, tokenizer(), ref).ref_logps(both)
    policy = ready(CausalLMPolicy(model, tokenizer(), ref, padding_free=True))
    with InputSpy(model) as spy:
        got = policy.ref_logps(both)
    assert spy.shapes == [(1, 224)]
    with model.disable_adapter():
        close_logps(got, want, model, both)
    assert not got.is_inference()
    policy, _ = CausalLMPolicy(model, tokenizer(), ref, padding_free=True).logps(both)
    assert float((policy.detach() - got).abs().max()) > 0.1


@pytest.mark.numerics
def test_transformers_packed_position_ids_path_equals_padded():
    """The flash-attention route (``positions``): ``transformers``' own packed-sequence detection from restarting
    position ids, here on plain SDPA (its N x N block mask), equals the padded logits: the layout is right for it."""
    m = tiny_model(initializer_range=SPREAD).eval()
    both = pairs_batch().stacked(tokenizer().pad_token_id)
    with torch.no_grad():
        want = completion_logits(m, both)[both.completion_mask]
        got = packed_completion_logits(m, both, "positions", share_prompts=True)  # positions: never shared
    close(got, want)
    assert pack_batch(both, share_prompts=False).input_ids.shape == (1, 232)
    assert "attention_mask" not in packed_forward_kwargs(pack_batch(both, False), "positions")


def test_models_the_segments_would_change_are_not_switched():
    from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from prefzoo.models.loading import tiny_llama_config

    sliding = MistralForCausalLM(MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, sliding_window=8))
    assert not use_packed_attention(sliding) and packing_mode(sliding) is None
    eager = LlamaForCausalLM(tiny_llama_config(100, num_kv_heads=4))
    eager.set_attn_implementation("eager")
    assert not use_packed_attention(eager)
    plain = LlamaForCausalLM(tiny_llama_config(100, num_kv_heads=4))  # no grouped heads: plain sdpa, switched too
    assert use_packed_attention(plain) and plain.config._attn_implementation == PACKED_SDPA


def test_decoding_and_padded_passes_are_unchanged_by_the_packed_attention():
    """Calls without segments go to the implementation the model had: generate() gives the same tokens."""
    m = tiny_model(initializer_range=SPREAD).eval()
    prompt = torch.tensor([[1, 17, 400, 9000, 23]])
    with torch.no_grad():
        a = m.generate(prompt, max_new_tokens=6, do_sample=False)
        assert use_packed_attention(m)
        b = m.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


@pytest.mark.numerics
def test_gradient_checkpointing_with_packing_equals_padded():
    m = lora_model(torch.float32)
    both = pairs_batch().stacked(tokenizer().pad_token_id)
    want = policy_logps(CausalLMPolicy(m, tokenizer()), both)
    use_packed_attention(m)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.enable_input_require_grads()
    m.train()
    got = policy_logps(CausalLMPolicy(m, tokenizer(), padding_free=True), both)
    close_logps(got[0], want[0], m, both)
    close_grads(got[2], want[2])


# ------------------------------------------------------------------------- the plugins, through build_policy
def built(monkeypatch, algo_name: str, padding_free: bool, like=None, **algo_kwargs):
    import prefzoo.training.build as build

    real = loading.load_causal_lm

    def spread(name, **kw):  # the tiny Llama with weights spread 0.2 (context-dependent log-probs)
        kw["tiny_kwargs"] = {**(kw.get("tiny_kwargs") or {}), "initializer_range": SPREAD}
        return real(name, **kw)

    monkeypatch.setattr(loading, "load_causal_lm", spread)
    cls = get_algorithm(algo_name)
    cfg = Config(algo=cls.config_class(**algo_kwargs),
                 model=ModelConfig(name="tiny", lora=lora_settings(),
                                   fast=FastPathConfig(padding_free=padding_free)),
                 trainer=TrainerConfig(device="cpu", batch_size=3))
    algo = cls(cfg.algo, resolve_objective(cfg))
    b = build.build_policy(cfg, algo.declaration, tokenizer(), torch.device("cpu"))
    with torch.no_grad():  # non-zero LoRA B: the adapter changes the policy
        for n, p in b.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    if like is not None:  # peft draws LoRA A from the global generator: copy every weight of the other build
        b.model.load_state_dict(like.model.state_dict())
        if like.policy.value_model is not None:
            b.policy.value_model.head.load_state_dict(like.policy.value_model.head.state_dict())
    return algo, b


def step(algo, b, batch, micro: int):
    b.model.zero_grad(set_to_none=True)
    if b.policy.value_model is not None:
        b.policy.value_model.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(algo, b.policy, batch, micro)
    g = grads(b.model)
    if b.policy.value_model is not None:
        g.update({f"value.{n}": t for n, t in grads(b.policy.value_model).items()})
    return metrics, g


CASES = [("dpo", {}), ("dpo", {"loss_type": "ipo"}), ("dpo", {"loss_type": ["sigmoid", "sft"]}), ("simpo", {}),
         ("orpo", {}), ("sft", {}), ("rm", {})]


@pytest.mark.numerics
@pytest.mark.parametrize("algo_name,kwargs", CASES, ids=[f"{a}-{k.get('loss_type', '')}" for a, k in CASES])
def test_plugin_losses_metrics_and_gradients_equal_padded(monkeypatch, algo_name, kwargs):
    """Every offline plugin's loss, metrics and LoRA (and reward-head) gradients: packed = padded, on 3 pairs (3 vs
    200 tokens among them) in micro-batches of 2 (a pack of 2 pairs, then one of 1). The packed setup is really on:
    the policy packs, the model runs the packed attention (the reward model's value passes too).

    Metrics to :data:`REL` of the largest one: they are differences of sequence log-probs (a 200-token sum is about
    -1000 nats, where a float32 ulp is 6e-5), so a metric like ``rewards/rejected`` = beta (logp - ref logp) carries
    that rounding in either layout (4.8e-5 apart here, 7.7e-7 of the largest metric at most)."""
    batch = pairs_batch([PreferenceExample(ids(6, 0), ids(30, 6), ids(1, 7))])  # pair 0's prompt again
    algo, padded = built(monkeypatch, algo_name, False, **kwargs)
    if algo.declaration.data == "sequences":  # SFT: the pairs' chosen sides, as it reads a preference file
        batch = batch.chosen
    want_m, want_g = step(algo, padded, batch, 2)
    algo, packed = built(monkeypatch, algo_name, True, like=padded, **kwargs)
    assert packed.policy.padding_free and not padded.policy.padding_free
    assert packing_mode(packed.model) == "segments"
    if algo_name == "rm":
        assert packed.policy.value_model.padding_free
    ready(packed.policy)
    with InputSpy(packed.model) as spy:
        got_m, got_g = step(algo, packed, batch, 2)
    assert spy.shapes and all(shape[0] == 1 for shape in spy.shapes)  # every pass one packed row
    assert got_m.keys() == want_m.keys()
    scale = max(1.0, *(abs(v) for v, _ in want_m.values()))  # the largest metric: logps/* (sums of ~200 tokens)
    for k in want_m:
        assert got_m[k][1] == want_m[k][1]
        assert abs(got_m[k][0] - want_m[k][0]) <= REL * scale, (k, got_m[k][0], want_m[k][0])
    close_grads(got_g, want_g)


@pytest.mark.numerics
def test_micro_batching_is_unaffected_by_packing(monkeypatch):
    """DPO, packed: micro-batches of 1, 2 and 3 pairs give the gradient of the whole batch (as padded)."""
    batch = pairs_batch([PreferenceExample(ids(5, 8), ids(12, 9), ids(2, 10))])
    algo, b = built(monkeypatch, "dpo", True)
    results = [step(algo, b, batch, micro) for micro in (1, 2, 3)]
    for m, g in results[:2]:
        close_grads(g, results[2][1])
        close(torch.tensor(m["loss"][0]), torch.tensor(results[2][0]["loss"][0]))


def test_online_plugins_keep_padded_passes(monkeypatch):
    algo, b = built(monkeypatch, "grpo", True)
    assert not b.policy.padding_free


@pytest.mark.numerics
def test_sft_on_conversations_packed_equals_padded(monkeypatch):
    """SFT's loss, metric and LoRA gradients on supervised rows whose completions hold tokens without a loss (a
    two-turn conversation: its user turn is attended to, not trained on; algo.assistant_only_loss, the default), a
    one-turn conversation and a text row, in micro-batches of 2: packed = padded, within the file's bounds (REL of the
    largest, kind 3, as every plugin above), and every pass is one packed row that holds every completion token once.
    Before packing read token_mask, such a batch ran padded."""
    import datasets

    from prefzoo.data.sft import collate_sft, tokenize_sft
    from prefzoo.types import LossTokens
    from tests.data.test_sft import TALK

    rows = [{"messages": TALK}, {"messages": [{"role": "user", "content": "2 + 3?"}, {"role": "assistant",
                                                                                          "content": "5"}]}]
    examples = tokenize_sft(datasets.Dataset.from_list(rows), tokenizer(), LossTokens(True, True), 256, 128)
    examples += tokenize_sft(datasets.Dataset.from_list([{"text": "The sky is blue today."}]), tokenizer(),
                             LossTokens(True, True), 256, 128)
    batch = collate_sft(examples, tokenizer().pad_token_id)
    assert batch.token_mask is not None and bool((batch.token_mask & ~batch.completion_mask).any())
    algo, padded = built(monkeypatch, "sft", False)
    want_m, want_g = step(algo, padded, batch, 2)
    algo, packed = built(monkeypatch, "sft", True, like=padded)
    ready(packed.policy)
    with InputSpy(packed.model) as spy:
        got_m, got_g = step(algo, packed, batch, 2)
    real = [int(batch.select(part).prompt_mask.sum() + batch.select(part).token_mask.sum()) for part in ([0, 1], [2])]
    assert spy.shapes == [(1, real[0]), (1, real[1])]
    scale = max(1.0, *(abs(v) for v, _ in want_m.values()))
    for k in want_m:
        assert got_m[k][1] == want_m[k][1]
        assert abs(got_m[k][0] - want_m[k][0]) <= REL * scale, (k, got_m[k][0], want_m[k][0])
    close_grads(got_g, want_g)
