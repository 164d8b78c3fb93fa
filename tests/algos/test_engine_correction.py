"""A rollout engine's own log-probs (issue 18): the mismatch is logged and, with
``rollout.correction.mode=token_truncate``, the truncated importance-sampling weights min(pi_trainer_old / pi_engine, C)
scale every online plugin's advantages.

No vLLM here: a policy whose samples carry ``sample_logps`` = the trainer's log-probs minus a known per-token
offset stands in for an engine whose numerics differ from the trainer's.

Tolerances (tests/bounds.py). The policies are float32 tables over 5 tokens and the correction is computed in float32
by design; the tests compare it with float64 hand values (kind 1) or with their own float32 recomputation (kind 2,
marked ``numerics``). Every value is a float32 expression of at most k roundings in a row on numbers no larger than
M, so it is within gamma_k M of its exact value (Higham 2002, Lemma 3.1); a mean of n values adds gamma_n of the
mean. The recurring one: the engine's log-prob fl(lp - O) and the difference lp - fl(lp - O) are 2 roundings of
numbers no larger than L + 2 (L = the largest |log-prob| of the rows, |O| <= 2), so delta = O within
gamma_2 (L + 2) = 7.4e-7 nats (L = 4.2). The sums are of at most 24 terms: no thread count changes their order.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from prefzoo.algos.grpo import GRPO, GRPOConfig
from prefzoo.algos.reinforce_pp import ReinforcePP, ReinforcePPConfig
from prefzoo.algos.rloo import RLOO, RLOOConfig
from prefzoo.errors import ConfigError
from prefzoo.objective import ObjectiveError, correction_weights, sampler_mismatch
from prefzoo.types import CorrectionSettings, ObjectiveSettings, SamplingParams, SequenceBatch
from tests.algos.test_grpo import PROMPTS, TwoTokenPolicy, fixed_scores
from tests.bounds import U32, gamma

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
    mode = None if cap is None else "token_truncate"
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3,
                              correction=CorrectionSettings(mode=mode, clip_max=cap))
    objective = ObjectiveSettings(beta=0.0, kl_estimator="k3", kl_placement="as_loss")
    return [GRPO(GRPOConfig(num_samples=4), objective, sampling), RLOO(RLOOConfig(num_samples=4), objective, sampling),
            ReinforcePP(ReinforcePPConfig(num_samples=4), objective, sampling)]


SCORES = [1, 0, 0, 1, 0, 1, 1, 0]


def delta_bound(batch) -> float:
    """How far log pi_trainer - log pi_engine (float32) may be from OFFSET: gamma_2 (L + 2), L the largest |log-prob|
    of ``batch``'s tokens under EnginePolicy (module docstring)."""
    return gamma(2) * (float(EnginePolicy().logps(batch)[0].detach().abs().max()) + 2.0)


@pytest.mark.numerics
@pytest.mark.parametrize("index", range(3), ids=["grpo", "rloo", "reinforce_pp"])
def test_mismatch_is_logged_and_capped_weights_scale_the_advantages(index):
    """delta_t = log pi_trainer - log pi_engine = OFFSET[t] on each counted token, so the logged mean |delta| is the
    token mean of |OFFSET| over the counted positions and the max is 2.0 (position 2, counted in rows of length 3);
    with C = 3 the weights are min(exp(OFFSET[t]), 3) = (e^0.5, e^-0.25, 3): the corrected advantages are the
    uncorrected ones (the same plugin without a cap, same samples) times those.

    Bounds (module docstring): each delta within d = gamma_2 (L + 2) of OFFSET; the mean of n |delta| adds
    gamma_n x 2 (the test's mean of the dyadic |OFFSET| is exact but for its division, u32 x 2); the weight
    exp(delta) is within d + u32 relative of exp(OFFSET), and the two products and the float32 literal add 3 u32.
    Measured gaps: 0 at 1 and 2 threads (old bounds 1e-6, and allclose's default rtol 1e-5: not derived). The
    rejected share is a count over a count, exact."""
    plain, corrected = _plugins(None)[index], _plugins(3.0)[index]
    exp0, m0 = plain.make_experience(EnginePolicy(), PROMPTS, fixed_scores(SCORES))
    exp1, m1 = corrected.make_experience(EnginePolicy(), PROMPTS, fixed_scores(SCORES))
    mask = exp0.completion_mask
    n, d = int(mask.sum()), delta_bound(exp0)
    expected_mean = float((OFFSET.abs()[None, :] * mask).sum() / mask.sum())
    for m in (m0, m1):
        assert m["engine/logp_diff_mean"] == pytest.approx(expected_mean, abs=d + gamma(n) * 2.0 + U32 * 2.0)
        assert m["engine/logp_diff_max"] == pytest.approx(2.0, abs=d)
    assert "correction/weight_mean" not in m0
    weights = torch.tensor([math.exp(0.5), math.exp(-0.25), 3.0])[None, :].expand_as(exp0.advantages)
    torch.testing.assert_close(exp1.advantages, exp0.advantages * weights, rtol=d + 4 * U32, atol=0)
    assert bool((exp0.advantages != 0).any())  # (a test that could fail: some advantage is not 0)
    assert m1["correction/frac_rejected"] == float(mask[:, 2].sum() / mask.sum())


def test_the_hf_engine_reports_no_mismatch():
    """Samples without ``sample_logps`` (the hf engine: the trainer's own model): no engine metrics, no weights; a
    correction mode asked for such samples is an error naming the key, not a run silently uncorrected."""
    exp, m = _plugins(None)[0].make_experience(TwoTokenPolicy(), PROMPTS, fixed_scores(SCORES))
    assert not any(k.startswith(("engine/", "correction/")) for k in m)
    assert exp.old_logps is None  # and no extra pass was needed for one epoch
    with pytest.raises(ConfigError, match="rollout.correction.mode=token_truncate needs a sampler that reports"):
        _plugins(3.0)[0].make_experience(TwoTokenPolicy(), PROMPTS, fixed_scores(SCORES))


def test_truncated_weights_by_hand():
    """exp(old - engine) capped at C, 1 on padding: old - engine = [ln 2, -ln 4, ln 10] -> [2, 0.25, C=3].
    Kind 1: the logs are rounded to float32 (u32 |ln w| <= 1.4 u32 absolute, so relative in w) and exponentiated
    (u32): 3 u32 relative; the cap is exact; the largest |delta| is float32(ln 10), within u32 relative."""
    old = torch.tensor([[math.log(2.0), -math.log(4.0), math.log(10.0), 0.0]])
    engine = torch.zeros(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    w, _ = correction_weights(old, engine, mask, "token_truncate", clip_max=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.25, 3.0, 1.0]]), rtol=3 * U32, atol=0)
    assert sampler_mismatch(old, engine, mask)["logp_diff_max"] == pytest.approx(math.log(10.0), rel=U32)
    with pytest.raises(ObjectiveError, match="clip_max"):
        correction_weights(old, engine, mask, "token_truncate", clip_max=0.0)


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


# ------------------------------------------------------------------------------- top-p support fix, bypass (issue 29)
NUCLEUS_PROBS = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])


class KnownNucleusPolicy(TwoTokenPolicy):
    """A policy with a known next-token distribution, the same at every position: 0.5, 0.25, 0.125, 0.0625, 0.0625. Its
    sampler draws from the top-p nucleus and reports log-probs renormalised over it (vLLM's processed_logprobs); the
    trainer's log-probs are the plain softmax's."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(NUCLEUS_PROBS.log()[None].repeat(3, 1))

    def sample(self, prompts, n, params):
        from prefzoo.objective import support_mask

        s = super().sample(prompts, n, params)
        keep = support_mask(NUCLEUS_PROBS.log()[None], params.top_p)[0]
        kept = torch.nonzero(keep)[:, 0]
        ids = kept[torch.arange(s.completion_ids.numel()).remainder(len(kept))].view_as(s.completion_ids)
        renormalised = (NUCLEUS_PROBS[ids] / NUCLEUS_PROBS[keep].sum()).log()
        self.sampled = dataclasses.replace(s, completion_ids=ids.masked_fill(~s.completion_mask, 0),
                                           sample_logps=renormalised.masked_fill(~s.completion_mask, 0.0))
        return self.sampled

    def support_log_mass(self, batch, temperature, top_p, top_k):
        from prefzoo.objective import support_log_mass

        logits = self.logits.detach()[None, : batch.completion_ids.shape[1]].expand(len(batch), -1, -1)
        return support_log_mass(logits, batch.completion_ids, temperature, top_p, top_k).masked_fill(
            ~batch.completion_mask, 0.0)


def _grpo(top_p=0.7, **correction):
    sampling = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=3, correction=CorrectionSettings(**correction))
    return GRPO(GRPOConfig(num_samples=4), ObjectiveSettings(beta=0.0, kl_estimator="k3", kl_placement="as_loss"),
                sampling)


@pytest.mark.numerics
def test_top_p_biases_the_ratio_and_the_support_fix_removes_it():
    """top_p = 0.7 over (0.5, 0.25, 0.125, 0.0625, 0.0625): the mass before each token is 0, 0.5, 0.75, ..., so the
    nucleus is {0, 1}, mass Z = 0.75. The sampler's log-prob of a kept token
    is log(p / Z), the trainer's log p: their ratio is Z = 0.75 on EVERY token though the weights are the same
    (TRL measured 0.896 at top_p = 0.8 on a real model). Renormalising the trainer's over the same support
    (match_support) gives exactly 1; the token_truncate weights follow: 0.75 without the fix, 1 with it.

    Bound (module docstring): each float32 log-prob (the log-softmax of 5 logits, or its renormalisation over the
    support, or log(p / Z)) is at most 12 roundings of numbers no larger than M = 2 ln 16 + 1 = 6.5 nats (the logits,
    their spread, the log-sum-exp): the log-ratio within 2 gamma_12 M = 9.3e-6, the ratio (<= 1) within that plus
    u32 relative, and the mean over n tokens adds gamma_n: 1.0e-5 in all. Measured: 6e-8 at most at 1 and 2 threads
    (the old 1e-6 was not derived; a worst case is 10 times it)."""
    log_ratio = 2 * gamma(12) * (2 * math.log(16.0) + 1)
    for match, expected in ((False, 0.75), (True, 1.0)):
        exp, m = _grpo(match_support=match).make_experience(KnownNucleusPolicy(), PROMPTS, fixed_scores(SCORES))
        bound = log_ratio + U32 + gamma(int(exp.completion_mask.sum()))
        assert m["correction/ratio_mean"] == pytest.approx(expected, abs=bound)
        assert m["correction/mismatch_k1"] == pytest.approx(-math.log(expected), abs=bound)
        exp, m = _grpo(match_support=match, mode="token_truncate").make_experience(
            KnownNucleusPolicy(), PROMPTS, fixed_scores(SCORES))
        assert m["correction/weight_mean"] == pytest.approx(expected, abs=bound)
        assert m["correction/weight_min"] == pytest.approx(expected, abs=bound)


@pytest.mark.numerics
def test_bypass_uses_the_samplers_log_probs_as_pi_old():
    """rollout.correction.bypass: no recomputation; the experience's old log-probs are the sampler's (here, top_p = 1:
    the trainer's minus OFFSET), so the first update's ratio pi_theta / pi_old is exp(OFFSET[t]) per token, the
    ratio of the update to the sampler; no separate weight, no mismatch measured.

    Bound (module docstring, relative): each ratio within gamma_2 (L + 2) + u32 of exp(OFFSET[t]); the plugin's and
    the test's float32 means of n positive terms add gamma_(n+1) each (the old rtol 1e-5 was not derived)."""
    plugin = _grpo(top_p=1.0, bypass=True)
    policy = EnginePolicy()
    exp, m = plugin.make_experience(policy, PROMPTS, fixed_scores(SCORES))
    assert torch.equal(exp.old_logps, policy.sampled.sample_logps)
    assert not any(k.startswith(("engine/", "correction/")) for k in m)
    out = plugin.loss(policy, exp)
    mask = exp.completion_mask
    expected = float((OFFSET.exp()[None, :] * mask).sum() / mask.sum())
    total, count = out.token_metrics["ratio_mean"]
    n = int(mask.sum())
    assert total / count == pytest.approx(expected, rel=delta_bound(exp) + U32 + 2 * gamma(n + 1))


@pytest.mark.numerics
def test_the_weights_also_weight_the_kl_loss_term():
    """k2 as a loss with beta = 0.1 and token_truncate (cap 3): per token the loss is the weighted surrogate plus
    beta k2; with ``weight_kl`` (the default) the KL term is w beta k2 (w = e^0.5, e^-0.25, 3 by position, as
    above), without it beta k2 (TRL's convention). The difference of the two per-token losses is therefore
    beta (w - 1) k2, k2 = (log pi - log pi_ref)^2 / 2 computed here from the policy's two tables.

    Bound per token (module docstring): both losses add the same float32 surrogate to their KL term, so their
    difference carries the roundings of two additions and one subtraction, at most 4 of the losses' size
    (gamma_4 (|weighted| + |plain|)), plus the weight's own error times its term, beta k2 w (gamma_2 (L + 2) + 4 u32),
    and k2's (2 roundings, gamma_2 beta k2 (w + 1)). The old atol 1e-6 + rtol 1e-5 was not derived."""
    objective = ObjectiveSettings(beta=0.1, kl_estimator="k2", kl_placement="as_loss")
    outs = []
    for weight_kl in (True, False):
        sampling = SamplingParams(temperature=1.0, max_new_tokens=3, correction=CorrectionSettings(
            mode="token_truncate", clip_max=3.0, weight_kl=weight_kl))
        plugin = GRPO(GRPOConfig(num_samples=4), objective, sampling)
        policy = EnginePolicy()
        exp, _ = plugin.make_experience(policy, PROMPTS, fixed_scores(SCORES))
        assert (exp.sample_weights is not None) == weight_kl
        outs.append((plugin.loss(policy, exp).values.detach(), exp, policy))
    (weighted, exp, policy), (plain, _, _) = outs
    mask = exp.completion_mask
    k2 = 0.5 * (policy.logps(exp)[0].detach() - policy.ref_logps(exp)) ** 2
    w = torch.tensor([math.exp(0.5), math.exp(-0.25), 3.0])[None, :].expand_as(k2)
    expected = torch.where(mask, 0.1 * (w - 1) * k2, torch.zeros(()))
    bound = (gamma(4) * (weighted.abs() + plain.abs()) + 0.1 * k2 * w * (delta_bound(exp) + 4 * U32)
             + gamma(2) * 0.1 * k2 * (w + 1))
    gap = ((weighted - plain) * mask - expected).abs()
    assert bool((gap <= bound).all()), (gap.max(), bound.min())
    assert float(expected.abs().max()) > 1e-3  # (the check can fail: the KL term is not negligible)
