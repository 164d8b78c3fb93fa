"""A rollout engine's own log-probs (issue 18): the mismatch is logged and, with ``rollout.is_correction_cap``, the
truncated importance-sampling weights min(pi_trainer_old / pi_engine, C) scale every online plugin's advantages.

No vLLM here: a policy whose samples carry ``sample_logps`` = the trainer's log-probs minus a known per-token
offset stands in for an engine whose numerics differ from the trainer's.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from prefzoo.algos.grpo import GRPO, GRPOConfig
from prefzoo.algos.reinforce_pp import ReinforcePP, ReinforcePPConfig
from prefzoo.algos.rloo import RLOO, RLOOConfig
from prefzoo.objective import ObjectiveError, sampler_mismatch, truncated_is_weights
from prefzoo.types import ObjectiveSettings, SamplingParams, SequenceBatch
from tests.algos.test_grpo import PROMPTS, TwoTokenPolicy, fixed_scores

#: the engine's log-prob of each token is the trainer's minus OFFSET[t] (t = completion position)
OFFSET = torch.tensor([0.5, -0.25, 2.0])


class EnginePolicy(TwoTokenPolicy):
    """TwoTokenPolicy's samples, with the engine's log-probs log pi_trainer - OFFSET[t] on counted tokens."""

    def sample(self, prompts, n, params):
        s = super().sample(prompts, n, params)
        trainer = self.logps(s, params.temperature)[0].detach()
        engine = (trainer - OFFSET[None, :s.completion_ids.shape[1]]).masked_fill(~s.completion_mask, 0.0)
        self.sampled = dataclasses.replace(s, sample_logps=engine)
        return self.sampled


def _plugins(cap):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3, is_correction_cap=cap)
    objective = ObjectiveSettings(beta=0.0, kl_estimator="k3", kl_placement="as_loss")
    return [GRPO(GRPOConfig(num_samples=4), objective, sampling), RLOO(RLOOConfig(num_samples=4), objective, sampling),
            ReinforcePP(ReinforcePPConfig(num_samples=4), objective, sampling)]


SCORES = [1, 0, 0, 1, 0, 1, 1, 0]


@pytest.mark.parametrize("index", range(3), ids=["grpo", "rloo", "reinforce_pp"])
def test_mismatch_is_logged_and_capped_weights_scale_the_advantages(index):
    """delta_t = log pi_trainer - log pi_engine = OFFSET[t] on each counted token, so the logged mean |delta| is the
    token mean of |OFFSET| over the counted positions and the max is 2.0 (position 2, counted in rows of length 3);
    with C = 3 the weights are min(exp(OFFSET[t]), 3) = (e^0.5, e^-0.25, 3): the corrected advantages are the
    uncorrected ones (the same plugin without a cap, same samples) times those."""
    plain, corrected = _plugins(None)[index], _plugins(3.0)[index]
    exp0, m0 = plain.make_experience(EnginePolicy(), PROMPTS, fixed_scores(SCORES))
    exp1, m1 = corrected.make_experience(EnginePolicy(), PROMPTS, fixed_scores(SCORES))
    mask = exp0.completion_mask
    expected_mean = float((OFFSET.abs()[None, :] * mask).sum() / mask.sum())
    for m in (m0, m1):
        assert m["engine/logp_diff_mean"] == pytest.approx(expected_mean, abs=1e-6)
        assert m["engine/logp_diff_max"] == pytest.approx(2.0, abs=1e-6)
    assert "engine/is_weight_mean" not in m0
    weights = torch.tensor([math.exp(0.5), math.exp(-0.25), 3.0])[None, :].expand_as(exp0.advantages)
    assert torch.allclose(exp1.advantages, exp0.advantages * weights, atol=1e-6)
    assert bool((exp0.advantages != 0).any())  # (a test that could fail: some advantage is not 0)
    assert m1["engine/is_weight_capped"] == pytest.approx(float(mask[:, 2].sum() / mask.sum()))


def test_the_hf_engine_reports_no_mismatch():
    """Samples without ``sample_logps`` (the hf engine: the trainer's own model): no engine metrics, no weights."""
    exp, m = _plugins(3.0)[0].make_experience(TwoTokenPolicy(), PROMPTS, fixed_scores(SCORES))
    assert not any(k.startswith("engine/") for k in m)
    assert exp.old_logps is None  # and no extra pass was needed for one epoch


def test_truncated_weights_by_hand():
    """exp(old - engine) capped at C, 1 on padding: old - engine = [ln 2, -ln 4, ln 10] -> [2, 0.25, C=3]."""
    old = torch.tensor([[math.log(2.0), -math.log(4.0), math.log(10.0), 0.0]])
    engine = torch.zeros(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    w = truncated_is_weights(old, engine, mask, 3.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.25, 3.0, 1.0]]))
    assert sampler_mismatch(old, engine, mask)["logp_diff_max"] == pytest.approx(math.log(10.0))
    with pytest.raises(ObjectiveError, match="cap"):
        truncated_is_weights(old, engine, mask, 0.0)


def test_sequence_batches_keep_the_engine_logps_when_concatenated():
    """SequenceBatch.cat right-pads sample_logps with 0 like the completions; select keeps rows."""
    a = SequenceBatch(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool),
                      torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                      sample_logps=torch.tensor([[-1.0]]))
    b = dataclasses.replace(a, completion_ids=torch.ones(1, 2, dtype=torch.long),
                            completion_mask=torch.ones(1, 2, dtype=torch.bool), sample_logps=torch.tensor([[-2.0, -3.0]]))
    both = SequenceBatch.cat([a, b])
    assert torch.equal(both.sample_logps, torch.tensor([[-1.0, 0.0], [-2.0, -3.0]]))
    assert torch.equal(both.select([1]).sample_logps, torch.tensor([[-2.0, -3.0]]))
