"""The sampler's own log-probs and entropies (``SamplingParams.report_entropy``, issue 32 item 3): the held-out
evaluation takes them from the decode loop instead of a pass of the policy over its samples.

Checked against independent values: a hand-computed entropy of a top-p support; the policy's log-prob pass with
entropies (the fused output-layer path, another computation) on the sampler's tokens; and the evaluation's KL and
entropy with and without the shortcut.
"""

import math

import pytest
import torch

from prefzoo.models.merged import merged_copy
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.rollout.engine import HFEngine
from prefzoo.rollout.generate import _choose
from prefzoo.types import SamplingParams
from tests.models.helpers import prompt_batch, tokenizer
from tests.perf.test_fast_lora import lora_model

PROMPTS = [[1, 100, 200, 300], [1, 7], [9, 8, 7, 6, 5]]


def test_the_entropy_of_the_distribution_a_token_is_drawn_from_by_hand():
    """p = (0.5, 0.3, 0.2). Temperature 1, no cut: H = -(0.5 ln 0.5 + 0.3 ln 0.3 + 0.2 ln 0.2) = 1.029653 nats.
    top_p 0.7 keeps {0.5, 0.3} (their mass 0.8 reaches 0.7), renormalised (0.625, 0.375):
    H = -(0.625 ln 0.625 + 0.375 ln 0.375) = 0.661563. Greedy: the plain softmax's, 1.029653."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    u = torch.tensor([0.1])
    full = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    cut = -(0.625 * math.log(0.625) + 0.375 * math.log(0.375))
    for params, want in [(SamplingParams(report_entropy=True), full), (SamplingParams(top_p=0.7, report_entropy=True), cut),
                         (SamplingParams(greedy=True, report_entropy=True), full)]:
        token, logp, entropy = _choose(logits, params, None, u)
        assert entropy.item() == pytest.approx(want, abs=1e-6)
    assert _choose(logits, SamplingParams(), None, u)[2] is None  # not asked: not computed


@pytest.mark.parametrize("merged", [True, False])
def test_the_samplers_log_probs_and_entropies_are_the_policys(merged):
    """A LoRA policy (tiny model) samples 3 prompts x 3 at temperature 1 with report_entropy: the sampler's log-prob of
    each token and the entropy of each step equal the policy's pass over the same tokens (policy.logps with
    with_entropy) within 1e-5 nats -- from the merged copy (float32 rounding of W + sBA) and from the model itself.
    A sampler in another dtype (exact=False) reports neither: the evaluation then runs the pass."""
    model = lora_model(dtype=torch.float32)
    engine = HFEngine(merged_copy if merged else None)
    policy = CausalLMPolicy(model, tokenizer(), engine=engine, generator=torch.Generator().manual_seed(0))
    s = policy.sample(prompt_batch(PROMPTS), 3, SamplingParams(temperature=1.0, max_new_tokens=8, report_entropy=True))
    assert s.sample_logps is not None and s.sample_entropy is not None
    with torch.no_grad():
        logps, entropy = policy.logps(s, with_entropy=True)
    mask = s.completion_mask
    gap_logps = (logps - s.sample_logps)[mask].abs().max().item()
    gap_entropy = (entropy - s.sample_entropy)[mask].abs().max().item()
    assert gap_logps < 1e-5 and gap_entropy < 1e-5, (gap_logps, gap_entropy)
    assert bool((s.sample_entropy[mask] > 0).all()) and bool((s.sample_entropy[~mask] == 0).all())
    engine.exact = False
    s = policy.sample(prompt_batch(PROMPTS), 3, SamplingParams(temperature=1.0, max_new_tokens=8, report_entropy=True))
    assert s.sample_entropy is None


def test_the_evaluation_gives_the_same_kl_and_entropy_with_the_samplers_values(tmp_path):
    """eval.sampler_logps=true. A GRPO Trainer on the tiny model, 2 steps at a large learning rate on a reward with
    spread (the share of letters in the answer: the tiny model never answers arithmetic right), so that KL > 0: the
    held-out evaluation's
    kl_k1, kl_k3 and entropy from the sampler's values equal those of the policy's pass on the same samples
    (exact=False forces the pass; the same seeded samples) within 1e-5."""
    from prefzoo.training.loop import Trainer
    from tests.algos.hydra_runs import TINY_RUN, compose

    trainer = Trainer(compose(TINY_RUN + ["algo=grpo", "trainer.lr=0.05", "trainer.warmup_steps=0", "reward=sentiment",
                                          'reward.functions=["tests.algos.hydra_runs:letter_share"]',
                                          "eval.diversity_prompts=2", "eval.diversity_samples=3",
                                          "eval.sampler_logps=true"]), tmp_path)
    for _ in range(2):
        trainer.train_step()
        trainer.step += 1
    fast = trainer.evaluator.policy_metrics()
    trainer.policy.engine.exact = False
    slow = trainer.evaluator.policy_metrics()
    assert fast["kl_k1"] > 1e-3
    for key in ("kl_k1", "kl_k3", "entropy"):
        assert fast[key] == pytest.approx(slow[key], abs=1e-5), key
    assert fast["sample_reward"] == slow["sample_reward"] and fast["completion_length"] == slow["completion_length"]


def test_off_by_default_the_evaluation_runs_the_policys_pass(tmp_path):
    """eval.sampler_logps=false (the default): the samples come back without the sampler's values, so KL and entropy
    are the policy pass's (exactly 0 KL for the untrained LoRA policy, whose adapter-off reference is the same
    arithmetic)."""
    from prefzoo.training.loop import Trainer
    from tests.algos.hydra_runs import TINY_RUN, compose

    trainer = Trainer(compose(TINY_RUN + ["algo=grpo"]), tmp_path)
    assert trainer.cfg.eval.sampler_logps is False
    assert trainer.evaluator.policy_metrics()["kl_k1"] == 0.0
