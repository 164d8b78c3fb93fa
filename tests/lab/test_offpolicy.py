"""The off-policy rows of the conformance table (issue 29): stale and mismatched samplers on the tabular bed.

Theory in ``prefzoo/lab/offpolicy.py``'s docstring: the expected update direction of GRPO (k2 as a loss) on samples of
a behaviour policy q is g_j = sum_y q(y) [-c w (r - E_q r) + beta v l] (1[y=j] - pi_j); with both terms weighted by
pi/q its zero is pi* at beta G/(G-1), otherwise not; staleness moves no fixed point.
"""

from __future__ import annotations

import torch

from prefzoo.lab.conformance import BETA, conformance_bandit
from prefzoo.lab.offpolicy import (SamplerPolicy, mismatch_fixed_point, offpolicy_cases, offpolicy_section,
                                   run_offpolicy_case)
from prefzoo.lab.runner import build_algorithm
from prefzoo.lab.tabular import PromptSource, TableScorer
from prefzoo.objective import optimal_policy

G, TAU = 16, 3.0
K2 = {"kl_estimator": "k2", "kl_placement": "as_loss"}


def test_fully_weighted_descent_lands_on_the_closed_form():
    """With w = v = pi/q the direction is c pi_j (...) on-policy: its zero is pi* = pi_ref exp(c r / beta) / Z at
    beta / c, c = 15/16, whatever the sampler's temperature (a check on the oracle against the closed form).

    The oracle is 6000 Adam steps in float64 (kind 3 of tests/bounds.py): measured 5.6e-17 from the closed form at 1
    and 2 threads; 1e-10 leaves ~1e6 for another build's ascent (the bound was 1e-6)."""
    bandit = conformance_bandit()
    star = optimal_policy(bandit.ref_probs, bandit.rewards, BETA * G / (G - 1))
    got = mismatch_fixed_point(bandit, BETA, G, TAU, weight_pg=True, weight_kl=True)
    assert float((got - star).abs().max()) < 1e-10


def _plugin_gradient(probs, seed):
    """The GRPO plugin's own loss gradient on the logits, on 4096 x 16 samples per prompt drawn from the sampler at
    temperature TAU, uncorrected: a Monte-Carlo estimate of g at ``probs``."""
    bandit = conformance_bandit()
    algo = build_algorithm("grpo", {"num_samples": G, "scale_rewards": "none"}, K2, BETA)
    policy = SamplerPolicy(bandit.ref_logits, init_logits=probs.log().float(), sampler_temperature=TAU, seed=seed)
    exp, _ = algo.make_experience(policy, PromptSource(bandit.num_prompts, repeats=4096).next(),
                                  TableScorer(bandit.rewards))
    out = algo.loss(policy, exp)
    ((out.values * out.mask).sum() / out.mask.sum()).backward()
    return policy.logits.grad.clone()


def test_the_uncorrected_target_is_where_the_plugins_own_gradient_vanishes():
    """At the oracle's uncorrected zero the plugin's Monte-Carlo gradient is at the noise level (the difference of
    two seeds' estimates); at pi* (beta / c), the on-policy fixed point, it is many times that: the mismatch really
    moves the plugin's fixed point, and the oracle says where to. Seen: 1.4e-4 against noise 1.7e-4, and 1.9e-3.

    The bounds (kind 4 of tests/bounds.py; the seeds are fixed, so the test is deterministic): at the zero each
    estimate is pure noise, a ~20-dimensional Gaussian vector (4 prompts x 6 logits, less one per prompt), and so is
    the difference of two independent ones over sqrt(2): their squared-norm ratio is F(20, 20), and exceeds
    2.5^2 with probability 6e-5 (Monte Carlo, 2e6 draws). At pi* the gradient is 11x the noise; 6x is its half."""
    bandit = conformance_bandit()
    oracle = mismatch_fixed_point(bandit, BETA, G, TAU, weight_pg=False, weight_kl=False)
    star = optimal_policy(bandit.ref_probs, bandit.rewards, BETA * G / (G - 1))
    noise = float((_plugin_gradient(oracle, 0) - _plugin_gradient(oracle, 1)).norm()) / 2 ** 0.5
    assert float(_plugin_gradient(oracle, 2).norm()) < 2.5 * noise
    assert float(_plugin_gradient(star, 2).norm()) > 6 * noise


def test_the_behaviour_policy_is_the_stale_table_and_its_log_probs_come_along():
    """staleness 2: after recording tables T0, T1, T2, T3 the sampler draws from T1 (two steps before the last), and
    each sample's sample_logps is log softmax(T1)[y]: the same float32 log-softmax of the same table, equal bit for
    bit (kind 1 of tests/bounds.py; measured 0; the bound was allclose's default, rtol 1e-5)."""
    bandit = conformance_bandit()
    policy = SamplerPolicy(bandit.ref_logits, staleness=2, seed=0)
    tables = [policy.logits.detach().clone()]
    for step in range(3):
        with torch.no_grad():
            policy.logits.add_(0.3 * (step + 1))
            policy.logits[:, 0] += 1.0
        policy.record()
        tables.append(policy.logits.detach().clone())
    assert torch.equal(policy.behaviour_logits(), tables[1])
    from prefzoo.lab.tabular import BED_SAMPLING

    s = policy.sample(PromptSource(bandit.num_prompts, repeats=2).next(), 4, BED_SAMPLING)
    rows = s.prompt_ids[:, -1]
    expected = torch.log_softmax(tables[1], -1)[rows, s.completion_ids[:, 0]]
    assert torch.equal(s.sample_logps[:, 0], expected)


def test_the_off_policy_rows_reach_their_targets():
    """Four seeds of each row: the mismatched rows land on their (off-pi*) zero, the fully corrected one and the
    stale ones on pi* at beta/c, k1 in the reward on pi* uncorrected; the section names both gaps."""
    bandit = conformance_bandit()
    results = [run_offpolicy_case(case, bandit, BETA, seeds=4) for case in offpolicy_cases()]
    verdicts = {r.case.label: r.verdict for r in results}
    for r in results:
        expected = "matches its target (off π*)" if r.case.target == "mismatch" else "matches π*"
        assert r.verdict == expected, verdicts
    section = offpolicy_section(results, bandit, BETA)
    assert "TRL 1.16's convention" in section and "| GRPO k2 as loss, samples 4 steps stale, uncorrected |" in section
