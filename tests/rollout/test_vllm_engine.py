"""The vLLM rollout engine on the tiny model (issue 18): ONE engine for the module, inside a GRPO Trainer.

Marker ``vllm``: run by ``make test-vllm`` in .venv-vllm (vLLM's CPU build); skipped where vLLM is not installed
(the normal venv, ``make test``). The tiny model is widened to 128 (head size 32: vLLM's CPU attention needs >= 32)
and saved to a folder the engine loads (prefzoo.training.setup.build_engine).

Tolerance (tests/bounds.py, kind 2 + 3): the engine's float32 log-probs and the trainer's recomputation differ by
each side's float32 log-softmax over V = 49,152 (the log-sum-exp's probabilistic bound, lambda = 10: lambda sqrt(V)
u32 = 1.3e-4; the log, the exp's arguments and the result: u32 (3 ln V + 2 |log p|), |log p| < 2 ln V for the
nearly uniform tiny model), twice, plus the two kernels' other summation orders: 2e-6 measured here, x10.
:data:`LOGP_TOL` = 2.9e-4 nats per token (max over tokens). Before: 1e-4, below the log-softmax's own worst case.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.bounds import U32, gamma, probable_sum_bound

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed "
                                 "(make test-vllm builds .venv-vllm with it)")]

VOCAB = 49152  # SmolLM2's tokenizer, the tiny model's
LOGP_TOL = 2 * (probable_sum_bound(VOCAB, 1.0) + U32 * 7 * math.log(VOCAB)) + 2e-5
ENGINE_RUN = ["algo=grpo", "rollout.engine=vllm", "model.tiny_hidden_size=128", "model.lora.r=8",
              "rollout.correction.mode=token_truncate",
              "rollout.correction.clip_max=2.0", "trainer.lr=0.05", "trainer.warmup_steps=0",
              "trainer.lr_schedule=constant", "algo.num_samples=4", "rollout.temperature=1.0",
              'reward.functions=["tests.algos.hydra_runs:letter_share"]', "reward=sentiment"]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A GRPO Trainer on the tiny model whose policy samples through vLLM (the module's one engine start)."""
    from prefzoo.training.loop import Trainer
    from tests.algos.hydra_runs import TINY_RUN, compose
    from tests.models.helpers import threads

    with threads(1):
        t = Trainer(compose(TINY_RUN + ENGINE_RUN), tmp_path_factory.mktemp("vllm-run"))
        yield t
    t.policy.engine.close()


def prompts(trainer, rows, seeds=None):
    from prefzoo.types import ROLLOUT_SEED_COLUMN

    batch = trainer.train_prompts.batch(list(rows), trainer.policy.pad_id)
    if seeds is not None:
        batch.columns[ROLLOUT_SEED_COLUMN] = list(seeds)
    return batch


def greedy(policy, engine, batch, tokens=8):
    from prefzoo.types import SamplingParams

    return engine.sample(policy.model, batch, 1, SamplingParams(max_new_tokens=tokens, greedy=True),
                         eos_token_ids=policy.eos_token_ids, pad_id=policy.pad_id, generator=policy.generator)


def greedy_around_grpo_steps(trainer, steps: int, tol: float):
    """Greedy answers of 4 prompts from the hf engine, then ``steps`` GRPO steps whose rollouts (the trainer's engine)
    must log the engine/trainer mismatch below ``tol`` and importance weights of 1 up to it, then greedy answers from
    the hf engine and from the trainer's engine on the trained weights: (before, after_hf, after_engine) ids."""
    from prefzoo.rollout.engine import HFEngine

    policy, hf = trainer.policy, HFEngine()
    batch = prompts(trainer, [0, 1, 2, 3])
    before = greedy(policy, hf, batch).completion_ids
    for _ in range(steps):
        out = trainer.train_step()
        trainer.step += 1
        assert out["engine/logp_diff_max"] < tol and out["engine/logp_diff_mean"] < tol
        # each weight min(exp(d), 2) with |d| < tol: within expm1(tol) of 1; the float32 mean of <= 2 x 4 x 6 tokens
        assert abs(out["correction/weight_mean"] - 1) <= math.expm1(tol) + gamma(50)
        assert out["correction/frac_rejected"] == 0.0
    return before, greedy(policy, hf, batch).completion_ids, greedy(policy, policy.engine, batch).completion_ids


def test_the_policy_samples_through_vllm(trainer):
    from prefzoo.rollout.vllm_engine import VLLMEngine

    assert isinstance(trainer.policy.engine, VLLMEngine)


def test_sampled_ids_and_logps_agree_with_the_trainers_recomputation(trainer):
    """4 samples of 2 prompts at temperature 0.7: the engine's log-prob of each of its tokens equals the trainer's
    recomputation (policy.logps at the same temperature, on the engine's ids) within LOGP_TOL; rows are right-padded
    after the completion, and a row that is not truncated ends with the EOS id."""
    from prefzoo.types import SamplingParams

    policy = trainer.policy
    s = policy.sample(prompts(trainer, [0, 1], [5, 6]), 4, SamplingParams(temperature=0.7, max_new_tokens=12))
    assert s.sample_logps is not None and s.completion_ids.shape[0] == 8
    trainer_logps = policy.logps(s, 0.7)[0].detach()
    delta = (trainer_logps - s.sample_logps)[s.completion_mask].abs()
    assert delta.max().item() < LOGP_TOL, delta.max().item()
    assert bool((s.sample_logps[s.completion_mask] < 0).all())  # real log-probs, not placeholders
    assert bool((s.completion_ids[~s.completion_mask] == policy.pad_id).all())
    lengths = s.completion_mask.sum(-1)
    for r in range(8):
        assert bool(s.truncated[r]) == (int(s.completion_ids[r, lengths[r] - 1]) not in policy.eos_token_ids)


def test_per_prompt_seeds_fix_a_prompts_samples_whatever_the_batch(trainer):
    """Prompt 3 with seed 77 gives the same 4 samples alone and beside prompt 2 (the hf engine's contract); its 4
    samples differ from each other (vLLM gives sample j the seed 77 + j)."""
    from prefzoo.types import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    alone = trainer.policy.sample(prompts(trainer, [3], [77]), 4, params)
    beside = trainer.policy.sample(prompts(trainer, [2, 3], [12, 77]), 4, params)
    assert torch.equal(alone.completion_ids, beside.completion_ids[4:, :alone.completion_ids.shape[1]])
    assert len({tuple(r) for r in alone.completion_ids.tolist()}) == 4


def test_grpo_steps_log_the_mismatch_and_the_engine_follows_every_update(trainer):
    """3 GRPO steps (lr 0.05, so that greedy answers move): each step's rollout logs the mismatch (below LOGP_TOL) and
    the IS weights (1 up to the mismatch: their mean within expm1(LOGP_TOL) of 1, the cap 2 never bites); the engine
    got one adapter per optimizer step (each sent before the next generation); and then its greedy answers equal the hf
    engine's on the same weights while differing from the answers before training (so an engine left on the old
    weights would fail)."""
    syncs = trainer.policy.engine.syncs
    before, after_hf, after_vllm = greedy_around_grpo_steps(trainer, 3, LOGP_TOL)
    assert trainer.policy.engine.syncs == syncs + 3  # steps 1, 2 before the next rollouts, step 3 before this greedy
    assert not torch.equal(after_hf, before)
    assert torch.equal(after_vllm, after_hf)


def test_base_weights_are_bit_identical_after_100_syncs(trainer):
    """100 times: the adapter changes in place and the engine samples (so it loads each new adapter). After: every
    frozen base tensor of the trainer's model is bit-identical to before (torch.equal); and with the adapter's B
    matrices zeroed (the adapter is then the identity) the engine's greedy log-probs equal the trainer's reference
    (the adapter-disabled model) within LOGP_TOL: the engine's base was not changed by the syncs either."""
    from prefzoo.types import SamplingParams

    policy = trainer.policy
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    adapter = [p for n, p in policy.model.named_parameters() if p.requires_grad]
    syncs, batch, g = policy.engine.syncs, prompts(trainer, [0]), torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    for _ in range(100):
        with torch.no_grad():
            for p in adapter:
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)
        policy.sample(batch, 1, params)
    assert policy.engine.syncs == syncs + 100
    assert all(torch.equal(p, base[n]) for n, p in policy.model.named_parameters() if not p.requires_grad)
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if p.requires_grad and "lora_B" in n:
                p.zero_()
    s = greedy(policy, policy.engine, prompts(trainer, [0, 1]), tokens=6)
    ref = policy.ref_logps(s, 1.0)
    engine_raw = s.sample_logps  # greedy: vLLM's log-probs at temperature 1 (no processing)
    assert (ref - engine_raw)[s.completion_mask].abs().max().item() < LOGP_TOL
