"""Dropout never enters the log-probs that define the importance ratio and the KL (the hardening issue, item 1).

Before: PPO's make_experience computed the old log-probs with the model in train mode (the loop calls
model.train(); CausalLMPolicy.logps never turned dropout off), so on a tiny Llama with attention_dropout=0.1 and a
fresh LoRA adapter the first inner step logged ratio_mean 1.215, approx_kl 0.247 and a rollout KL of -0.651 nats
(negative, fed to the adaptive controller), although policy = old policy = reference there.
"""

from __future__ import annotations

import pytest
import torch

from prefzoo.models import loading

from prefzoo.algos.ppo import PPO, PPOConfig
from prefzoo.config import Config, ModelConfig, TrainerConfig, resolve_objective
from prefzoo.training.build import build_policy
from prefzoo.types import PromptBatch, SamplingParams
from tests.models.helpers import lora_settings, one_thread_fixture, tokenizer


@pytest.fixture(autouse=True)
def one_thread():
    yield from one_thread_fixture()


def ppo_with_dropout(monkeypatch, disable: bool, lora_dropout: float = 0.0):
    real = loading.load_causal_lm

    def with_attention_dropout(name, **kw):  # the tiny Llama, with attention-probability dropout 0.1
        kw["tiny_kwargs"] = {**(kw.get("tiny_kwargs") or {}), "attention_dropout": 0.1}
        return real(name, **kw)

    monkeypatch.setattr(loading, "load_causal_lm", with_attention_dropout)
    cfg = Config(algo=PPOConfig(num_samples=2), model=ModelConfig(name="tiny", disable_dropout=disable,
                                                                  lora=lora_settings(r=4, dropout=lora_dropout)),
                 trainer=TrainerConfig(device="cpu", batch_size=1))
    cfg.objective.beta = 0.05
    sampling = SamplingParams(max_new_tokens=8)
    algo = PPO(cfg.algo, resolve_objective(cfg), sampling)
    built = build_policy(cfg, algo.declaration, tokenizer(), torch.device("cpu"))
    assert built.model.training  # the loop trains in train mode
    return algo, built.policy


def first_inner_step(algo, policy):
    prompts = PromptBatch(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.bool), {})
    exp, metrics = algo.make_experience(policy, prompts, lambda samples, p: torch.zeros(len(samples)))
    out = algo.loss(policy, exp)
    mean = {k: v / n for k, (v, n) in out.token_metrics.items()}
    return metrics, mean


@pytest.mark.parametrize("disable", [True, False])
def test_old_logps_have_no_dropout_so_the_first_ratio_is_one(monkeypatch, disable):
    """Policy = old = reference at the first inner step (fresh adapter: LoRA B = 0). The rollout's no-grad passes run
    in eval mode whatever the setting, so the rollout KL is exactly 0 (not -0.651). With dropout disabled (the
    default) the update's forward is deterministic too: ratio exactly 1, approx_kl 0 (not 1.215 and 0.247).

    Exact, not close (kind 1 of tests/bounds.py, no rounding): with LoRA B = 0 the adapter adds exactly 0 to each
    layer, so policy, old policy and reference are the same arithmetic on the same weights; measured 2026-12-06 at 1
    and 2 threads: 0.0, 0.0, 1.0, 0.0 exactly (the bounds were 1e-6 and 1e-5)."""
    algo, policy = ppo_with_dropout(monkeypatch, disable)
    metrics, mean = first_inner_step(algo, policy)
    assert metrics["kl"] == 0.0
    assert metrics["kl_k3"] == 0.0
    if disable:
        assert mean["ratio_mean"] == 1.0
        assert mean["approx_kl"] == 0.0
    else:  # dropout kept on purpose (model.disable_dropout=false): only the gradient pass has it
        assert policy.model.training


def test_disable_dropout_is_the_default_and_turns_every_dropout_off(monkeypatch):
    assert ModelConfig().disable_dropout is True
    algo, policy = ppo_with_dropout(monkeypatch, True, lora_dropout=0.1)
    rates = [m.p for m in policy.model.modules() if isinstance(m, torch.nn.Dropout)]
    rates += [m.__dict__["attention_dropout"] for m in policy.model.modules() if "attention_dropout" in m.__dict__]
    assert rates and all(r == 0.0 for r in rates)
