"""The toy bandit's three claims (prefzoo.lab.toy), with the plugin trained unchanged on a tabular policy.

Expected policies are the closed form pi*_beta = pi_ref exp(proxy/beta) / Z, computed here with
prefzoo.objective.optimal_policy from the bandit's tables (at beta = 0: the proxy's argmax).
Tolerance for (c): the k1-in-reward fixed point has no Monte-Carlo noise (every advantage is 0 there), so
what remains is optimisation error: measured max TV over 4 seeds <= 0.006 across the full sweep of
``python -m prefzoo.lab.toy`` (hardest at beta = 0.05, where the last 2% of mass sits on rarely sampled
responses), <= 0.001 at the betas used here; asserted < TV_TOLERANCE = 0.02 (kind 3 of tests/bounds.py; measured
again 2026-12-06: at most 7.7e-4 (beta 0.01), 26x below it; the tabular bed runs on one thread).
The other bounds: (a)'s slack of 1e-3 in "non-decreasing" covers that optimisation error where two betas land on
nearly the same point (0.01 and 0: sqrt(KL) 2.2479 and 2.2483, proxy 1.19974 and 1.19979); the reported closed-form
numbers are the same float64 formula as the independent pi* here (measured 0 apart; 1e-9 is far above float64's
~1e-15 rounding, kind 1).
"""

import torch
import pytest

from prefzoo.objective import optimal_policy
from prefzoo.lab.toy import EXPLOIT, TV_TOLERANCE, markdown_table, plot, sweep, toy_bandit
from prefzoo.lab.tabular import kl_divergence, total_variation

BETAS = (2.0, 0.2, 0.01, 0.0)


@pytest.fixture(scope="module")
def points():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {p.beta: p for p in sweep(toy_bandit(), BETAS, "grpo", replicas=4, seed=5)}
    finally:
        torch.set_num_threads(before)


def test_the_bandit_has_an_exploit():
    toy = toy_bandit()
    assert int(toy.proxy.argmax()) == EXPLOIT and float(toy.gold[0, EXPLOIT]) == 0.0
    honest = [j for j in range(8) if j != EXPLOIT]
    assert torch.equal(toy.proxy[0, honest], toy.gold[0, honest])


def test_a_gold_reward_is_an_inverted_u_in_sqrt_kl(points):
    """As beta falls, sqrt(KL) grows and the proxy rises, while gold rises (2 -> 0.2) then falls (-> 0)."""
    order = [points[b] for b in BETAS]
    assert all(a.sqrt_kl < b.sqrt_kl + 1e-3 for a, b in zip(order, order[1:]))
    assert all(a.proxy < b.proxy + 1e-3 for a, b in zip(order, order[1:]))
    peak = points[0.2]
    assert peak.gold > points[2.0].gold + 0.15  # 0.58 vs 0.35
    assert peak.gold > points[0.01].gold + 0.5  # vs 0.00
    assert peak.gold > points[0.0].gold + 0.5


@pytest.mark.parametrize("beta", [0.01, 0.0])
def test_b_the_exploit_takes_99_percent_as_beta_goes_to_zero(points, beta):
    assert points[beta].exploit_min >= 0.99


def test_c_trained_policies_match_the_closed_form(points):
    toy = toy_bandit()
    for beta, p in points.items():
        if beta > 0:
            star = optimal_policy(toy.bandit.ref_probs, toy.proxy, beta)
        else:
            star = torch.zeros(1, 8, dtype=torch.float64)
            star[0, EXPLOIT] = 1.0
        assert p.tv_max < TV_TOLERANCE, (beta, p.tv_max)
        # the reported closed-form numbers are those of this independent pi*
        assert abs(p.star_exploit - float(star[0, EXPLOIT])) < 1e-9
        assert abs(p.star_gold - float((star * toy.gold).sum())) < 1e-9
        assert abs(p.star_sqrt_kl - float(kl_divergence(star, toy.bandit.ref_probs).sqrt())) < 1e-9
        assert float(total_variation(star, star)) == 0.0


def test_plot_and_table_are_written(points, tmp_path):
    pts = [points[b] for b in BETAS]
    png = plot(toy_bandit(), pts, tmp_path / "toy.png", "grpo")
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = markdown_table(pts)
    assert len(table.splitlines()) == 2 + len(BETAS)
