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
    assert r.is_weights is None  # logged, not corrected (no rollout.correction.mode)


def test_no_report_without_the_option_or_without_the_merged_copy():
    """report_logps off (the default): nothing reported, no extra pass, no metric. The plain LoRA model (no copy):
    the samples are the trainer's own, nothing to compare."""
    for engine in ({"merged_copy": merged_copy}, {"merged_copy": None, "report_logps": True}):
        r = sample_and_score(policy(**engine), prompt_batch(PROMPTS), zero_reward, 2, PARAMS, need_logps=False)
        assert r.samples.sample_logps is None and r.logps is None
        assert not any(k.startswith("engine/") for k in r.metrics)


def test_top_p_rollouts_of_a_real_model_the_support_fix_gives_ratio_one():
    """The hf engine's merged copy at top_p = 0.8 reports log-probs renormalised over the nucleus, as vLLM's
    processed_logprobs do. Against the trainer's plain softmax the mean ratio pi_trainer / pi_sampler is then the
    mean nucleus mass (< 1: measured below 0.95 here, computed in this test from the trainer's full distribution);
    with the trainer renormalised over the same support (rollout.correction.match_support, the default) the ratio is
    1 to float rounding (the merge's 1e-5)."""
    from prefzoo.types import CorrectionSettings

    p = policy(merged_copy=merged_copy, report_logps=True)
    for match in (False, True):
        params = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=6,
                                correction=CorrectionSettings(match_support=match))
        p.generator.manual_seed(0)
        r = sample_and_score(p, prompt_batch(PROMPTS), zero_reward, 4, params, need_logps=False)
        mask = r.samples.completion_mask
        if not match:
            with torch.no_grad():
                from prefzoo.models.policy import completion_logits

                probs = completion_logits(p.model, r.samples).float().softmax(-1)
            ordered = probs.sort(-1, descending=True).values
            before = ordered.cumsum(-1) - ordered
            nucleus = torch.where(before < 0.8, ordered, torch.zeros(())).sum(-1)
            chosen = probs.gather(-1, r.samples.completion_ids[..., None])[..., 0]
            in_nucleus = (chosen >= ordered.gather(-1, (before < 0.8).sum(-1, keepdim=True) - 1)[..., 0])
            assert bool(in_nucleus[mask].all())
            assert r.metrics["correction/ratio_mean"] == __import__("pytest").approx(float(nucleus[mask].mean()),
                                                                                   abs=1e-4)
            assert r.metrics["correction/ratio_mean"] < 0.95
        else:
            assert abs(r.metrics["correction/ratio_mean"] - 1.0) < 1e-4
            assert r.metrics["correction/mismatch_k3"] < 1e-8


def test_a_corrected_top_p_run_trains_two_tiny_steps_from_the_command_line(tmp_path):
    """``python train.py algo=grpo rollout.log_mismatch=true rollout.top_p=0.8 rollout.top_k=20
    rollout.correction.mode=sequence_mask`` on the tiny model: exit 0, two steps, each logging the correction's metrics
    with a ratio of 1 to the merge's rounding (the support fix) and an effective sample size in (0, 1]."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.algos.hydra_runs import TINY_RUN

    root = Path(__file__).resolve().parents[2]
    args = ["algo=grpo", "rollout.log_mismatch=true", "rollout.top_p=0.8", "rollout.top_k=20",
            "rollout.correction.mode=sequence_mask", "rollout.correction.clip_min=0.5", "trainer.max_steps=2",
            "eval.before=false", "eval.after=false", *TINY_RUN, f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for s in steps:
        assert abs(s["correction/ratio_mean"] - 1.0) < 1e-4 and 0 < s["correction/ess"] <= 1.0
        assert s["correction/frac_rejected"] == 0.0
