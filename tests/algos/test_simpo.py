"""Tests for the SimPO plugin (prefzoo.algos.simpo): length-normalised reward, target margin, no reference."""

import math
from types import SimpleNamespace

import pytest
import torch

from prefzoo.types import ObjectiveSettings
from prefzoo.algos.simpo import SimPO, SimPOConfig
from prefzoo.config import Config, ModelConfig, TrainerConfig, resolve_objective
from prefzoo.data.preference import PreferenceExample, collate_preferences
from prefzoo.models import reference as reference_module
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.training.setup import build_policy
from tests.algos.test_dpo import POLICY, TablePolicy, pairs
from tests.models.helpers import SPREAD, lora_settings, one_thread_fixture, plain_logps, tiny_model, tokenizer


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def simpo(beta=2.0, **cfg) -> SimPO:
    return SimPO(SimPOConfig(**cfg), ObjectiveSettings(beta=beta))


def test_defaults_are_the_papers():
    algo = SimPO(SimPOConfig(), resolve_objective(Config(algo=SimPOConfig())))
    assert algo.beta == 2.0 and algo.gamma == 1.0
    assert algo.declaration.reference is False


def test_loss_hand_values():
    """beta = 2, gamma = 0.5 * 2 = 1. Per-token log-probs: 1 -> -0.5, 2 -> -1, 3 -> -2, 4 -> -0.25.
    A: chosen (1, 2) mean -0.75, reward -1.5; rejected (3, 4) mean -1.125, reward -2.25;
       margin -1.5 + 2.25 - 1 = -0.25, loss softplus(0.25) = 0.825939.
    B: chosen (3,) mean -2, reward -4; rejected (4, 4, 1) mean -1/3, reward -2/3;
       margin -4 + 2/3 - 1 = -13/3, loss softplus(13/3) = 4.346372."""
    out = simpo().loss(TablePolicy(POLICY, ref=None), pairs())
    assert out.mask is None
    torch.testing.assert_close(out.values.detach(), torch.tensor([0.825939, 4.346372]), rtol=0, atol=1e-6)
    m = out.metrics
    assert m["rewards/chosen"] == pytest.approx((-1.5 - 4) / 2, abs=1e-6)
    assert m["rewards/rejected"] == pytest.approx((-2.25 - 2 / 3) / 2, abs=1e-6)
    assert m["rewards/margins"] == pytest.approx((0.75 - 10 / 3) / 2, abs=1e-6)  # without gamma
    assert m["rewards/accuracies"] == 0.5
    assert m["logps/chosen"] == pytest.approx((-1.5 - 2) / 2, abs=1e-6)


def test_length_counts_completion_tokens_only():
    """Longer prompts (more tokens and more left padding) change nothing: |y| is the completion's length."""
    policy = TablePolicy(POLICY, ref=None)
    short = simpo().loss(policy, pairs(prompts=((5,), (6,)))).values.detach()
    long = simpo().loss(policy, pairs(prompts=((5, 6, 7, 8, 9, 10, 11, 12), (6, 7, 8)))).values.detach()
    torch.testing.assert_close(long, short, rtol=0, atol=0)
    torch.testing.assert_close(short, torch.tensor([0.825939, 4.346372]), rtol=0, atol=1e-6)


def test_sft_term_and_label_smoothing_hand_values():
    """sft_weight 0.5 adds 0.5 * (mean NLL of chosen): A + 0.5 * 0.75, B + 0.5 * 2.
    label_smoothing 0.1 adds 0.1 * margin (see the DPO test): A - 0.025, B - 0.433333."""
    sft = simpo(sft_weight=0.5).loss(TablePolicy(POLICY, None), pairs()).values.detach()
    torch.testing.assert_close(sft, torch.tensor([0.825939 + 0.375, 4.346372 + 1.0]), rtol=0, atol=1e-6)
    ls = simpo(label_smoothing=0.1).loss(TablePolicy(POLICY, None), pairs()).values.detach()
    torch.testing.assert_close(ls, torch.tensor([0.825939 - 0.025, 4.346372 - 0.1 * 13 / 3]), rtol=0, atol=1e-6)


def test_simpo_never_touches_a_reference_and_uses_one_forward_pass():
    policy = TablePolicy(POLICY, ref=None)  # ref_logps would raise
    simpo().loss(policy, pairs())
    assert policy.logps_calls == 1


def test_implicit_reward_is_beta_times_mean_completion_logp_on_the_tiny_model():
    model = tiny_model(initializer_range=SPREAD).eval()
    policy = CausalLMPolicy(model, tokenizer())
    rows = [([1, 100, 200, 300, 400], [5, 6, 2], [7, 2]), ([9], [10, 11, 12, 13, 2], [14, 2])]
    batch = collate_preferences([PreferenceExample(*r) for r in rows], [0, 1], policy.pad_id)
    chosen, rejected = simpo(beta=2.0).implicit_rewards(policy, batch)
    for i, (p, c, r) in enumerate(rows):
        assert float(chosen[i]) == pytest.approx(2.0 * float(plain_logps(model, p, c).mean()), abs=1e-5)
        assert float(rejected[i]) == pytest.approx(2.0 * float(plain_logps(model, p, r).mean()), abs=1e-5)


@pytest.mark.parametrize("lora_on", [True, False])
def test_no_reference_model_is_loaded(monkeypatch, lora_on):
    """SimPO declares no reference: build_policy makes no copy. With LoRA the adapter-disabled model (free,
    the same object) may serve drift metrics; without LoRA there is no reference at all."""
    def no_copy(*_a, **_k):
        raise AssertionError("a reference copy was made")

    monkeypatch.setattr(reference_module, "copy", SimpleNamespace(deepcopy=no_copy))
    cfg = Config(algo=SimPOConfig(), model=ModelConfig(name="tiny", lora=lora_settings(enabled=lora_on)),
                 trainer=TrainerConfig(device="cpu"))
    algo = SimPO(cfg.algo, resolve_objective(cfg))
    built = build_policy(cfg, algo.declaration, tokenizer(), torch.device("cpu"))
    ref = built.policy.reference
    if lora_on:
        assert ref is None or (ref.kind == "adapter_disabled" and ref.module is built.model)
    else:
        assert ref is None
