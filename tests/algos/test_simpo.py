"""Tests for the SimPO plugin (prefzoo.algos.simpo): length-normalised reward, target margin, no reference.

Tolerances (tests/bounds.py, kind 1: the hand cases are exact). The table is float64 (:func:`table`) and SimPO keeps
float64 through, so a value is its formula to a few roundings of numbers below 5 (u64 = 1.1e-16 relative each): against
an exact fraction the bound is 1e-12, over 1000x that. Against a hand value written to 7 decimals it is 1e-6: the
written value is off by at most 5e-8, 20x below, and a wrong margin or length moves these values by 1e-2 or more.
Before (2026-12-06): a float32 table and 6-decimal values, 4.346372 against a float32 loss of 4.3463712, 9.5e-7 apart
within a bound of 1e-6 (the written value's rounding, 3.1e-7, its float32 rounding and the loss's own 1.1 ulps).
"""

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
from prefzoo.training.build import build_policy
from tests.algos.test_dpo import POLICY, TablePolicy, pairs
from tests.models.helpers import SPREAD, lora_settings, one_thread_fixture, plain_logps, tiny_model, tokenizer


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def table() -> TablePolicy:
    """tests/algos/test_dpo.py's TablePolicy without a reference, its table in float64."""
    policy = TablePolicy({}, ref=None)
    policy.theta = torch.zeros(16, dtype=torch.float64)
    for token, value in POLICY.items():
        policy.theta[token] = value
    policy.theta.requires_grad_(True)
    return policy


def simpo(beta=2.0, **cfg) -> SimPO:
    return SimPO(SimPOConfig(**cfg), ObjectiveSettings(beta=beta))


def test_defaults_are_the_papers():
    algo = SimPO(SimPOConfig(), resolve_objective(Config(algo=SimPOConfig())))
    assert algo.beta == 2.0 and algo.gamma == 1.0
    assert algo.declaration.reference is False


def test_loss_hand_values():
    """beta = 2, gamma = 0.5 * 2 = 1. Per-token log-probs: 1 -> -0.5, 2 -> -1, 3 -> -2, 4 -> -0.25.
    A: chosen (1, 2) mean -0.75, reward -1.5; rejected (3, 4) mean -1.125, reward -2.25;
       margin -1.5 + 2.25 - 1 = -0.25, loss softplus(0.25) = 0.8259394.
    B: chosen (3,) mean -2, reward -4; rejected (4, 4, 1) mean -1/3, reward -2/3;
       margin -4 + 2/3 - 1 = -13/3, loss softplus(13/3) = 4.3463717."""
    out = simpo().loss(table(), pairs())
    assert out.mask is None
    torch.testing.assert_close(out.values.detach(), torch.tensor([0.8259394, 4.3463717], dtype=torch.float64), rtol=0,
                               atol=1e-6)
    m = out.metrics
    assert m["rewards/chosen"] == pytest.approx((-1.5 - 4) / 2, abs=1e-12)
    assert m["rewards/rejected"] == pytest.approx((-2.25 - 2 / 3) / 2, abs=1e-12)
    assert m["rewards/margins"] == pytest.approx((0.75 - 10 / 3) / 2, abs=1e-12)  # without gamma
    assert m["rewards/accuracies"] == 0.5
    assert m["logps/chosen"] == pytest.approx((-1.5 - 2) / 2, abs=1e-12)


def test_length_counts_completion_tokens_only():
    """Longer prompts (more tokens and more left padding) change nothing: |y| is the completion's length. Exactly:
    the stub reads the completions alone, so both batches do the same arithmetic."""
    policy = table()
    short = simpo().loss(policy, pairs(prompts=((5,), (6,)))).values.detach()
    long = simpo().loss(policy, pairs(prompts=((5, 6, 7, 8, 9, 10, 11, 12), (6, 7, 8)))).values.detach()
    torch.testing.assert_close(long, short, rtol=0, atol=0)
    torch.testing.assert_close(short, torch.tensor([0.8259394, 4.3463717], dtype=torch.float64), rtol=0, atol=1e-6)


def test_sft_term_and_label_smoothing_hand_values():
    """sft_weight 0.5 adds 0.5 * (mean NLL of chosen): A + 0.5 * 0.75, B + 0.5 * 2.
    label_smoothing 0.1 adds 0.1 * margin (see the DPO test): A - 0.025, B - 0.433333."""
    sft = simpo(sft_weight=0.5).loss(table(), pairs()).values.detach()
    torch.testing.assert_close(sft, torch.tensor([0.8259394 + 0.375, 4.3463717 + 1.0], dtype=torch.float64), rtol=0,
                               atol=1e-6)
    ls = simpo(label_smoothing=0.1).loss(table(), pairs()).values.detach()
    torch.testing.assert_close(ls, torch.tensor([0.8259394 - 0.025, 4.3463717 - 0.1 * 13 / 3], dtype=torch.float64),
                               rtol=0, atol=1e-6)


def test_simpo_never_touches_a_reference_and_uses_one_forward_pass():
    policy = table()  # ref_logps would raise
    simpo().loss(policy, pairs())
    assert policy.logps_calls == 1


@pytest.mark.numerics
def test_implicit_reward_is_beta_times_mean_completion_logp_on_the_tiny_model():
    """The implicit reward of each side of a padded batch of pairs is beta times the mean log-prob of its completion,
    by hand on the row alone (tests/models/helpers.py plain_logps: unpadded, log-softmax in float64).

    The bound, derived (tests/bounds.py, kind 2). The model runs in float64, so the batch's pass and the lone row's
    agree to ~1e-13; each side then rounds every log-prob x_t to float32 (<= u32 |x_t|) and takes a float32 mean of
    the n <= 5 of them (n - 1 additions and a division: sum_bound(n + 1, S) / n, S = sum_t |x_t|), times beta = 2:
    2 (2 u32 S + 2 sum_bound(n + 1, S)) / n, 8.6e-6 to 1.7e-5 here (|x_t| ~ 12 nats). Measured 0 at 1 and 2 threads
    (2026-12-06). The float32 model of the first version held the rewards (20 to 24) to 1e-5, 5 float32 ulps, with
    two float32 passes of different shapes in between. What the bound still catches: another token, position or
    length moves a reward by 0.1 or more."""
    from tests.bounds import U32, sum_bound

    model = tiny_model(initializer_range=SPREAD).double().eval()
    policy = CausalLMPolicy(model, tokenizer())
    rows = [([1, 100, 200, 300, 400], [5, 6, 2], [7, 2]), ([9], [10, 11, 12, 13, 2], [14, 2])]
    batch = collate_preferences([PreferenceExample(*r) for r in rows], [0, 1], policy.pad_id)
    chosen, rejected = simpo(beta=2.0).implicit_rewards(policy, batch)
    for i, (p, c, r) in enumerate(rows):
        for got, completion in ((chosen[i], c), (rejected[i], r)):
            logps = plain_logps(model, p, completion)
            n, total = len(completion), float(logps.abs().sum())
            bound = 2.0 * (2 * U32 * total + 2 * sum_bound(n + 1, total)) / n
            gap = abs(float(got) - 2.0 * float(logps.mean()))
            assert gap <= bound, (i, gap, bound)


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
