"""The hf engine's rollout/trainer log-prob mismatch (``rollout.log_mismatch``), logged as for vLLM.

Sampling from the merged-weights copy (W + s B A, rounded once) is sampling from other weights than the trainer's
LoRA model (x W + s (x A) B): with ``report_logps`` the engine returns the log-probs it sampled with, and
:func:`prefzoo.algos.online.sample_and_score` logs ``engine/logp_diff_{mean,max,signed}`` against the trainer's
recomputation, as it does for vLLM. Before: the hf engine never reported them (``sample_logps`` None: no metric).
"""

import torch

from prefzoo.algos.online import sample_and_score
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.models.merged import merged_copy
from prefzoo.rollout.engine import HFEngine
from prefzoo.types import SamplingParams
from tests.models.helpers import prompt_batch, tokenizer
from tests.perf.test_fast_lora import lora_model

PROMPTS = [[1, 100, 200, 300], [1, 7], [9, 8, 7, 6, 5]]
PARAMS = SamplingParams(temperature=0.8, max_new_tokens=6)


def policy(**engine):
    model = lora_model(dtype=torch.float32)
    return CausalLMPolicy(model, tokenizer(), engine=HFEngine(**engine), generator=torch.Generator().manual_seed(0))


def zero_reward(samples, prompts):
    return torch.zeros(len(samples))


def test_merged_rollouts_report_their_logps_and_the_mismatch_is_logged():
    """The metric equals the mean |log pi_trainer - log pi_rollout| over the counted tokens computed here from the two
    log-probs; float32 rounding of the merge keeps it below 1e-5 nats (seen: mean 1.9e-6, max 5.7e-6), and it is not
    zero (the two weights do differ by rounding: the metric measures something)."""
    p = policy(merged_copy=merged_copy, report_logps=True)
    r = sample_and_score(p, prompt_batch(PROMPTS), zero_reward, 2, PARAMS, need_logps=False)
    sampled, mask = r.samples.sample_logps, r.samples.completion_mask
    assert sampled is not None and r.logps is not None
    delta = (r.logps - sampled)[mask]
    assert r.metrics["engine/logp_diff_mean"] == delta.abs().mean().item()
    assert r.metrics["engine/logp_diff_max"] == delta.abs().max().item()
    assert 0 < r.metrics["engine/logp_diff_max"] < 1e-5
    assert r.is_weights is None  # logged, not corrected (no rollout.is_correction_cap)


def test_no_report_without_the_option_or_without_the_merged_copy():
    """report_logps off (the default): nothing reported, no extra pass, no metric. The plain LoRA model (no copy):
    the samples are the trainer's own, nothing to compare."""
    for engine in ({"merged_copy": merged_copy}, {"merged_copy": None, "report_logps": True}):
        r = sample_and_score(policy(**engine), prompt_batch(PROMPTS), zero_reward, 2, PARAMS, need_logps=False)
        assert r.samples.sample_logps is None and r.logps is None
        assert not any(k.startswith("engine/") for k in r.metrics)
