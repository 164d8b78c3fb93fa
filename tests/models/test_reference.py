"""Tests for prefzoo.models.reference: which network serves as pi_ref, and that it stays the starting policy.

The key property (issue 2): after an optimizer step that changes the trainable weights, the reference
log-probs of a fixed batch are unchanged while the policy's have changed. Expected reference values
come from an independently built model with the same seed (the starting policy), not from the code
under test.

Tolerances (tests/bounds.py, kind 1). The models run in float64 (:func:`start_model`; the claim is an identity),
throughout (transformers' RMSNorm kept in float64: tests/perf/test_fast_lora.py:float64_rms_norm, see
tests/models/test_policy.py), so the reference pass (padded) and ``plain_logps`` (unpadded) are float64 log-probs
~1e-15 apart, each rounded once to float32: equal or one float32 ulp apart, 2^-23 |x|. Before: a float32 model
within 1e-5, ten times the 9.5e-7 measured, not derived. The reference after a step is the same arithmetic on the
same weights as before it: equal exactly (before: within 1e-6, so a drift below that could not fail). Measured,
2026-12-06, at 1 and 2 threads: 0 and 0.
"""

import pytest
import torch

from prefzoo.errors import ConfigError, ModelError
from prefzoo.models.lora import wrap_trainable
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.models.reference import make_reference
from tests.bounds import U32
from tests.models.helpers import SPREAD, lora_settings, plain_logps, sequence_batch, tiny_model, tokenizer
from tests.models.helpers import float64_rms_norm

PROMPTS = [[1, 100, 200, 300], [1, 7]]
COMPLETIONS = [[400, 500, 2], [600, 700, 800, 900, 2]]


@pytest.fixture(autouse=True)
def _float64_rms_norm():
    with float64_rms_norm():
        yield


def start_model():
    """The starting policy's network: the tiny model, weights spread 0.2, in float64 (module docstring)."""
    return tiny_model(initializer_range=SPREAD).double()


def start_logps(model_factory) -> list[torch.Tensor]:
    """Per-token log-probs of the fixed batch under a fresh copy of the starting policy (by hand)."""
    model = model_factory()
    return [plain_logps(model, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]


def rows(logps: torch.Tensor) -> list[torch.Tensor]:
    return [logps[i, : len(c)] for i, c in enumerate(COMPLETIONS)]


def train_one_step(policy: CausalLMPolicy, lr: float = 0.5) -> None:
    """One SGD step that raises the log-likelihood of the fixed batch (changes every trainable weight used)."""
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    for _ in range(2):  # the first step only moves LoRA B (A gets no gradient while B = 0)
        opt.zero_grad()
        logps, _ = policy.logps(batch)
        (-logps.sum()).backward()
        opt.step()


def check_reference_is_frozen_start(policy: CausalLMPolicy, expected: list[torch.Tensor]) -> None:
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    ref_before = policy.ref_logps(batch)
    for got, want in zip(rows(ref_before), expected):
        torch.testing.assert_close(got, want, rtol=2 * U32, atol=0)  # one float32 ulp (module docstring)
    with torch.no_grad():
        policy_before = policy.logps(batch)[0]
    train_one_step(policy)
    ref_after = policy.ref_logps(batch)
    with torch.no_grad():
        policy_after = policy.logps(batch)[0]
    assert (policy_after - policy_before).abs().max() > 1e-2, "the step did not change the policy: test is void"
    torch.testing.assert_close(ref_after, ref_before, rtol=0, atol=0)  # the same arithmetic: exact
    assert not ref_after.requires_grad


def lora_model(**lora):
    torch.manual_seed(0)
    return wrap_trainable(start_model(), lora_settings(**lora), quantized=False,
                          adapter_path=None, gradient_checkpointing=False)


@pytest.mark.numerics
def test_lora_reference_is_the_same_model_with_the_adapter_disabled():
    model = lora_model()
    ref = make_reference(model, lora_enabled=True, adapter_loaded=False, mode="auto")
    assert ref.kind == "adapter_disabled"
    assert ref.module is model  # no second copy in memory
    policy = CausalLMPolicy(model, tokenizer(), ref)
    check_reference_is_frozen_start(policy, start_logps(start_model))


def test_reference_restores_training_mode():
    model = lora_model(dropout=0.5)
    policy = CausalLMPolicy(model, tokenizer(), make_reference(model, lora_enabled=True, adapter_loaded=False,
                                                               mode="auto"))
    model.train()
    batch = sequence_batch(PROMPTS, COMPLETIONS)
    a, b = policy.ref_logps(batch), policy.ref_logps(batch)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # no dropout in the reference
    assert model.training


@pytest.mark.numerics
def test_modules_to_save_auto_takes_a_frozen_copy_and_adapter_disabled_refuses():
    model = lora_model(modules_to_save=["lm_head"])
    with pytest.raises(ConfigError, match="adapter_disabled.*lm_head.*model.reference=copy"):
        make_reference(model, lora_enabled=True, adapter_loaded=False, mode="adapter_disabled")
    ref = make_reference(model, lora_enabled=True, adapter_loaded=False, mode="auto")
    assert ref.kind == "copy" and ref.module is not model
    assert not ref.module.training
    assert not any(p.requires_grad for p in ref.module.parameters())
    policy_ptrs = {p.data_ptr() for p in model.parameters()}
    assert not any(p.data_ptr() in policy_ptrs for p in ref.module.parameters()), "the copy shares storage"
    policy = CausalLMPolicy(model, tokenizer(), ref)
    check_reference_is_frozen_start(policy, start_logps(start_model))


def trained_adapter(tmp_path):
    """Save an adapter whose B is non-zero (an 'already trained' adapter); return (path, its policy)."""
    model = lora_model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(n)))
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter", model


@pytest.mark.numerics
def test_loaded_adapter_reference_is_a_copy_of_the_loaded_policy(tmp_path):
    path, trained = trained_adapter(tmp_path)
    expected = [plain_logps(trained, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    base_only = start_logps(start_model)
    assert (expected[0] - base_only[0]).abs().max() > 1e-2  # the loaded adapter matters

    model = wrap_trainable(start_model(), lora_settings(), quantized=False,
                           adapter_path=str(path), gradient_checkpointing=False)
    assert any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    with pytest.raises(ConfigError, match="loaded already trained"):
        make_reference(model, lora_enabled=True, adapter_loaded=True, mode="adapter_disabled")
    ref = make_reference(model, lora_enabled=True, adapter_loaded=True, mode="auto")
    assert ref.kind == "copy"
    check_reference_is_frozen_start(CausalLMPolicy(model, tokenizer(), ref), expected)


@pytest.mark.numerics
def test_full_fine_tuning_reference_is_a_frozen_copy_in_eval_mode():
    model = wrap_trainable(start_model(), lora_settings(enabled=False), quantized=False,
                           adapter_path=None, gradient_checkpointing=False)
    model.train()
    with pytest.raises(ConfigError, match="LoRA is off"):
        make_reference(model, lora_enabled=False, adapter_loaded=False, mode="adapter_disabled")
    ref = make_reference(model, lora_enabled=False, adapter_loaded=False, mode="auto")
    assert ref.kind == "copy" and ref.module is not model
    assert not ref.module.training and model.training
    assert not any(p.requires_grad for p in ref.module.parameters())
    policy = CausalLMPolicy(model, tokenizer(), ref)
    check_reference_is_frozen_start(policy, start_logps(start_model))


def test_no_reference_means_ref_logps_refuses():
    policy = CausalLMPolicy(tiny_model(), tokenizer(), reference=None)
    with pytest.raises(ModelError, match="no reference"):
        policy.ref_logps(sequence_batch(PROMPTS, COMPLETIONS))


@pytest.mark.numerics
def test_trainable_base_weights_force_a_copy_because_disabling_the_adapter_would_drift():
    """With a base weight trainable outside the adapter (here the tied embeddings / lm_head), the
    adapter-disabled network moves with training: auto mode must (and does) take a frozen copy."""
    model = lora_model()
    model.base_model.model.model.embed_tokens.weight.requires_grad_(True)
    expected = start_logps(start_model)
    ref = make_reference(model, lora_enabled=True, adapter_loaded=False, mode="auto")
    assert ref.kind == "copy"
    check_reference_is_frozen_start(CausalLMPolicy(model, tokenizer(), ref), expected)
    # why: the same model with the adapter merely disabled is no longer the starting policy
    with model.disable_adapter():
        drifted = [plain_logps(model, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert (drifted[0] - expected[0]).abs().max() > 1e-3


@pytest.mark.numerics
def test_base_reference_anchors_a_loaded_adapter_to_the_weights_before_it(tmp_path):
    """model.reference=base (note 000 sec. 6a's "anchor to the pretrained model"; TRL's default for a peft model
    loaded with a trained adapter): pi_ref is the base network without the adapter, not the loaded policy. Its
    log-probs are those of an independently built base model, they differ from the loaded policy's (so the
    KL starts above 0), and they stay put when the policy trains."""
    path, trained = trained_adapter(tmp_path)
    base_only = start_logps(start_model)
    loaded = [plain_logps(trained, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert (loaded[0] - base_only[0]).abs().max() > 1e-2  # the anchor is not the starting policy
    model = wrap_trainable(start_model(), lora_settings(), quantized=False,
                           adapter_path=str(path), gradient_checkpointing=False)
    ref = make_reference(model, lora_enabled=True, adapter_loaded=True, mode="base")
    assert ref.kind == "adapter_disabled" and ref.module is model
    check_reference_is_frozen_start(CausalLMPolicy(model, tokenizer(), ref), base_only)


def test_base_reference_refuses_what_the_adapter_cannot_switch_off():
    with pytest.raises(ConfigError, match="model.reference=base.*LoRA is off"):
        make_reference(wrap_trainable(start_model(), lora_settings(enabled=False),
                                      quantized=False, adapter_path=None, gradient_checkpointing=False),
                       lora_enabled=False, adapter_loaded=False, mode="base")
    with pytest.raises(ConfigError, match="model.reference=base.*lm_head"):
        make_reference(lora_model(modules_to_save=["lm_head"]), lora_enabled=True, adapter_loaded=False, mode="base")
