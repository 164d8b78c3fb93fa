"""The preallocated ("static") KV cache of the decode loop (prefzoo.rollout.kv_cache) against the dynamic one.

The dynamic loop (``kv_cache="dynamic"``, ``transformers``' cache concatenated each step, finished rows dropped at
once) is the plain computation, itself checked against ``transformers``' ``generate`` and a full forward in
test_generate.py. The static loop must pick the very same tokens -- greedy, and sampled from the same uniforms
(:func:`prompt_uniforms`) or the same seeded generator -- with left-padded prompts of different lengths and rows
ending at different steps, and give the same per-token log-probs within :func:`assert_same`'s bound. Every mask
format (SDPA's bool, eager's additive float, the 2-D one for other attention implementations) and both compaction
regimes (finished rows kept in the buffers, and compacted away) are covered.

Tolerance (tests/bounds.py). Both loops run the float32 model; a row shares its matmuls and its attention buffer
with other rows (or none) in each, so the two layers sum in other orders: :data:`BODY_GAP` (kind 3). Each loop's
log-softmax over V = 49,152 (kind 2): the log-sum-exp's probabilistic bound (lambda = 10), lambda sqrt(V) u32 =
1.3e-4, the log (2 u32 ln V), the exp's arguments z_v - max z (weighted by p_v: u32 H <= u32 ln V) and the result
(2 u32 |log p|), on either side. Before: 1e-5 relative, 7x above the largest gap.
"""

import math

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from prefzoo.models.policy import CausalLMPolicy
from prefzoo.rollout import generate, kv_cache
from prefzoo.rollout.engine import HFEngine
from prefzoo.rollout.generate import prompt_uniforms, sample_completions
from prefzoo.types import ROLLOUT_SEED_COLUMN, PromptBatch, SamplingParams
from tests.bounds import U32, probable_sum_bound
from tests.models.helpers import SPREAD, pad_id, prompt_batch, tiny_model, tokenizer

PROMPTS = [[1, 100, 200, 300], [1, 7], [9, 8, 7, 6, 5, 4, 3, 2000, 1000], [42]]  # 4 lengths: left padding 0..8


@pytest.fixture(scope="module")
def model():
    m = tiny_model(initializer_range=SPREAD).eval()
    m.set_attn_implementation("sdpa")
    return m


def run(model, kv, params, eos, num_samples=1, uniforms=None, seed=None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return sample_completions(model, prompt_batch(PROMPTS), num_samples, params, eos_token_ids=eos, pad_id=pad_id(),
                              generator=generator, uniforms=uniforms, kv_cache=kv)


#: the two loops' log-probs of a token: measured at most 6.2e-6 (1.4e-6 relative; 2026-12-06, 1 and 2 threads, the
#: largest with finished rows riding along in the buffers); 10x (kind 3)
BODY_GAP = 6.2e-5


def assert_same(static, dynamic):
    """The same tokens, masks and truncation; log-probs within :data:`BODY_GAP` plus each loop's float32 log-softmax
    (module docstring)."""
    (b1, lp1), (b2, lp2) = static, dynamic
    assert torch.equal(b1.completion_ids, b2.completion_ids)
    assert torch.equal(b1.completion_mask, b2.completion_mask)
    assert torch.equal(b1.truncated, b2.truncated)
    vocab = len(tokenizer())
    each = probable_sum_bound(vocab, 1.0) + U32 * (3 * math.log(vocab) + 2 * lp2.abs())
    gap = (lp1 - lp2).abs()
    assert bool((gap <= 2 * each + BODY_GAP).all()), float(gap.max())


def ending_ids(model, params, n_rows):
    """Token ids that end rows at different steps: the dynamic loop's tokens at steps 1, 3, 5 of rows 0..2
    (EOS = those ids, so those rows stop there or earlier while the others run on)."""
    batch, _ = run(model, "dynamic", params, [tokenizer().eos_token_id], seed=0)
    ids = batch.completion_ids
    return sorted({int(ids[0, 1]), int(ids[1 % n_rows, 3]), int(ids[2 % n_rows, 5])})


@pytest.mark.numerics
@pytest.mark.parametrize("attn", ["sdpa", "eager", "2d"])
def test_greedy_tokens_and_logps_equal_the_dynamic_loop(model, attn, monkeypatch):
    """Greedy, 10 tokens, EOS = three tokens the loop emits: rows end at different steps (checked: more than two
    lengths, some truncated), and the static loop picks the same tokens with log-probs within 1e-5 relative."""
    if attn == "2d":  # the path of attention implementations that take no prebuilt 4-D mask
        monkeypatch.setattr(generate, "mask_format", lambda m: "2d")
    else:
        model.set_attn_implementation(attn)
    try:
        params = SamplingParams(max_new_tokens=10, greedy=True)
        eos = ending_ids(model, params, 4)
        dynamic = run(model, "dynamic", params, eos)
        lengths = dynamic[0].completion_mask.sum(-1).tolist()
        assert len(set(lengths)) > 1 and dynamic[0].truncated.any() and not dynamic[0].truncated.all(), lengths
        assert_same(run(model, "static", params, eos), dynamic)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.numerics
@pytest.mark.parametrize("share", [0.0, 0.25, 2.0])
@pytest.mark.parametrize("num_samples", [1, 3])
def test_sampled_tokens_under_fixed_uniforms_equal_the_dynamic_loop(model, monkeypatch, share, num_samples):
    """Temperature 0.7, top-p 0.9, uniforms from per-prompt seeds; ~10% of the vocabulary ends a row, so rows end at
    many different steps. Compaction share 0 (buffers compacted at every finished row, like the dynamic loop), 0.25
    (the default) and 2 (never: finished rows ride along to the end): the same tokens and log-probs every time."""
    monkeypatch.setattr(generate, "COMPACT_SHARE", share)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12)
    eos = list(range(3, 5000))
    uniforms = prompt_uniforms([11, 12, 13, 14], num_samples, 12)
    dynamic = run(model, "dynamic", params, eos, num_samples, uniforms)
    lengths = dynamic[0].completion_mask.sum(-1)
    assert len(set(lengths.tolist())) > 2 and dynamic[0].truncated.any() and not dynamic[0].truncated.all()
    assert_same(run(model, "static", params, eos, num_samples, uniforms), dynamic)


@pytest.mark.numerics
def test_sampled_tokens_from_a_seeded_generator_equal_the_dynamic_loop(model):
    """Without uniforms the loop draws one uniform per still-writing row per step from the generator; the static loop
    draws the same number (not one per buffer row), so the same seed gives the same samples."""
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    eos = list(range(3, 5000))
    dynamic = run(model, "dynamic", params, eos, 2, seed=5)
    assert dynamic[0].truncated.any() and not dynamic[0].truncated.all()
    assert_same(run(model, "static", params, eos, 2, seed=5), dynamic)


def test_the_buffers_are_written_in_place_not_reallocated(model, monkeypatch):
    """No EOS, 12 tokens: every layer's update writes into one and the same buffer at every step (one data pointer
    per layer over the whole rollout), and returns the filled prefix only (lengths P+1 .. P+11)."""
    seen: dict[int, set[int]] = {}
    lengths = []
    real_update = kv_cache.PreallocatedLayer.update

    def spy(self, k, v, *a, **kw):
        seen.setdefault(id(self), set()).add(self.keys.data_ptr())
        keys, values = real_update(self, k, v, *a, **kw)
        lengths.append(keys.shape[2])
        return keys, values

    monkeypatch.setattr(kv_cache.PreallocatedLayer, "update", spy)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    run(model, "static", params, [-1], 2, seed=0)
    p = prompt_batch(PROMPTS).prompt_ids.shape[1]
    assert len(seen) == model.config.num_hidden_layers
    assert all(len(ptrs) == 1 for ptrs in seen.values())
    assert sorted(set(lengths)) == list(range(p + 1, p + 12))


def test_a_sliding_window_cache_keeps_the_dynamic_path():
    """Only plain full-attention layers are preallocated: a cache with a sliding-window layer is left as it is."""
    full = DynamicCache()
    full.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    assert kv_cache.can_preallocate(full)
    sliding = DynamicCache()
    sliding.layers = [DynamicSlidingWindowLayer(sliding_window=8)]
    sliding.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    assert not kv_cache.can_preallocate(sliding)


def test_an_unknown_kv_cache_is_refused(model):
    with pytest.raises(ValueError, match="kv_cache='paged'"):
        run(model, "paged", SamplingParams(max_new_tokens=2), [-1], seed=0)


@pytest.mark.numerics
def test_the_hf_engine_decodes_with_the_static_cache_by_default(model, monkeypatch):
    """CausalLMPolicy.sample -> HFEngine -> the static loop (a PreallocatedKV is built), with the per-prompt seeds of
    the rollout; its samples equal the dynamic engine's."""
    built = []
    real_init = kv_cache.PreallocatedKV.__init__

    def spy(self, *a, **kw):
        built.append(1)
        real_init(self, *a, **kw)

    monkeypatch.setattr(kv_cache.PreallocatedKV, "__init__", spy)
    ids = prompt_batch(PROMPTS)
    prompts = PromptBatch(ids.prompt_ids, ids.prompt_mask, columns={ROLLOUT_SEED_COLUMN: [3, 4, 5, 6]})
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    static = CausalLMPolicy(model, tokenizer(), engine=HFEngine()).sample(prompts, 2, params)
    assert built == [1]
    dynamic = CausalLMPolicy(model, tokenizer(), engine=HFEngine(kv_cache="dynamic")).sample(prompts, 2, params)
    assert built == [1]
    assert torch.equal(static.completion_ids, dynamic.completion_ids)


def test_rollout_kv_cache_is_set_from_the_config_and_checked():
    """rollout.kv_cache reaches the engine; an unknown value is a ConfigError naming the key and the choices."""
    from prefzoo.cli import to_typed
    from prefzoo.errors import ConfigError
    from prefzoo.training.build import hf_engine
    from tests.test_config import composed

    typed = to_typed(composed("model=tiny", "algo=grpo"))
    assert typed.rollout.kv_cache == "static" and not typed.rollout.compile_decode and not typed.rollout.log_mismatch
    engine = hf_engine(to_typed(composed("model=tiny", "algo=grpo", "rollout.kv_cache=dynamic",
                                         "rollout.log_mismatch=true")))
    assert engine.kv_cache == "dynamic" and engine.report_logps
    with pytest.raises(ConfigError, match="rollout.kv_cache='paged'.*static, dynamic"):
        to_typed(composed("model=tiny", "algo=grpo", "rollout.kv_cache=paged"))


@pytest.mark.slow
def test_the_compiled_decode_step_gives_the_same_tokens(model):
    """rollout.compile_decode: the static loop on fixed shapes (whole buffers, finished rows kept) through
    torch.compile (about a minute to compile the tiny model on a loaded 2-core machine). Inductor fuses the
    element-wise ops, so the log-probs move by float rounding (seen: 6e-6 nats, inside :func:`assert_same`'s bound:
    another order of the same float32 log-softmax); tokens under fixed uniforms equal the
    dynamic loop's; a second rollout of the same shapes reuses the compiled step."""
    params = SamplingParams(temperature=0.7, max_new_tokens=12)
    eos = list(range(3, 5000))
    uniforms = prompt_uniforms([1, 2, 3, 4], 3, 12)
    dynamic = run(model, "dynamic", params, eos, 3, uniforms)
    assert dynamic[0].truncated.any() and not dynamic[0].truncated.all()
    compiled = sample_completions(model, prompt_batch(PROMPTS), 3, params, eos_token_ids=eos, pad_id=pad_id(),
                                  uniforms=uniforms, kv_cache="static", compile_decode=True)
    assert_same(compiled, dynamic)
    assert generate.compiled_step(model) is generate.compiled_step(model)
