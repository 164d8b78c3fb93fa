"""Objective conformance: does each algorithm plugin reach pi* = pi_ref exp(r/beta) / Z ?

Run ``python -m prefzoo.lab.conformance`` (= ``prefzoo conformance``; a few minutes on 2 CPU cores): it prints the
table; ``--out docs/conformance.md`` writes the project's page (nothing is written by default). Every registered
plugin that the table knows (GRPO, PPO, RLOO, REINFORCE++, GSPO, CISPO, Online DPO, DPO, SimPO, ORPO, SFT, KTO,
best-of-n) is trained, unchanged, on the tabular test bed of :mod:`prefzoo.lab.tabular` until it stops moving, with
several seeds; the learned policy is compared with pi* (total variation and KL(pi || pi*), per prompt and on average,
with the Monte-Carlo error over seeds) and with the fixed point that theory predicts for that case.

The bed (:func:`conformance_bandit`): P = 4 prompts x K = 6 single-token responses, beta = 0.5.
Prompt 0: generic; prompt 1: the best response is rare under pi_ref (4%); prompt 2: two responses tie for
the best reward; prompt 3: uniform pi_ref, evenly spaced rewards.

Seeds. The S seeds run side by side in ONE vectorised run on S stacked copies of the bed
(:meth:`TabularBandit.tile`): replica s of prompt p is its own row of the logits table, with its own
samples (or its own preference pairs). Adam is element-wise and nothing is clipped, so the replicas are
independent runs; the only coupling is through batch-global statistics that do not move a fixed point
(PPO's advantage whitening, a global scale). The Monte-Carlo error (``±``) is the standard error over the
S replicas of the prompt-averaged distance.

Theory (the target column): each case's fixed point, derived in :mod:`prefzoo.lab.oracles`.

Verdict: with pi_bar the seed-mean policy and d the typical TV distance of one seed from pi_bar (the
Monte-Carlo spread), pure noise puts pi_bar about d / sqrt(S) from where the runs go; a case MATCHES its
target when TV(pi_bar, target) <= tol = 3 d / sqrt(S) + 0.002 (0.002: an optimisation floor), and is OFF
pi* when TV(pi_bar, pi*) > tol. Rows marked "report" show their target without asserting it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from prefzoo.algos import REGISTRY, get_algorithm
from prefzoo.lab.oracles import (argmax_policy, best_of_n_policy, chosen_distribution, grpo_group_std_target,
                                 in_reward_fixed_point, kto_population_optimum, maxrl_fixed_point,
                                 pair_loss_population_optimum,
                                 simpo_population_optimum)
from prefzoo.lab.runner import build_algorithm, sample_best_of_n, train_replicas
from prefzoo.lab.tabular import TabularBandit, kl_divergence, preference_pairs, total_variation
from prefzoo.objective import optimal_policy, regularised_optimum

BETA = 0.5
DEFAULT_SEEDS = 8
SAMPLES_PER_PROMPT = 1024  # online: responses per prompt per replica per step
PAIRS_PER_PROMPT = 10000  # offline: preference pairs per prompt per replica
GROUP = 16  # GRPO's G (and PPO's num_samples)


def conformance_bandit() -> TabularBandit:
    """The 4-prompt x 6-response bed (see the module docstring for each prompt's role)."""
    ref_logits = [[0.0, 0.5, 1.0, 0.2, -0.5, -1.0],
                  [1.0, 0.8, 0.4, 0.0, -0.5, -1.0],
                  [0.3, -0.2, 0.8, 0.0, -0.6, 0.4],
                  [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    rewards = [[0.1, 0.3, 0.0, 0.5, 0.7, 0.25],
               [0.0, 0.15, 0.25, 0.4, 0.6, 1.0],
               [0.5, 0.5, 0.15, 0.0, 0.3, 0.1],
               [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]]
    return TabularBandit(torch.tensor(ref_logits), torch.tensor(rewards), name="conformance")


# ------------------------------------------------------------------------------------------------ cases
@dataclass
class Case:
    """One row of the table: a plugin with its settings, and what theory says it converges to.

    Attributes:
        label: the row's name.
        algo: registry name of the plugin (``None``: best-of-n, which trains nothing).
        config: overrides of the plugin's typed config.
        objective: fields of :class:`~prefzoo.types.ObjectiveSettings` (beta defaults to BETA).
        theory: the expected fixed point, in words.
        target: (bandit) -> expected policy, Shape (P, K); None: nothing to compare with.
        claim: "target" (must match ``target``), or "report" (shown, not asserted).
        steps / lr: training length and Adam's starting learning rate.
        bon_n: best-of-n's n (algo None).
    """

    label: str
    algo: str | None
    config: dict = field(default_factory=dict)
    objective: dict = field(default_factory=dict)
    theory: str = ""
    target: Callable[[TabularBandit], Tensor] | None = None
    claim: str = "target"
    steps: int = 400
    lr: float = 0.05
    bon_n: int = 0


def default_cases(beta: float = BETA, group: int = GROUP) -> list[Case]:
    """The table's rows. PPO rows appear only when a plugin called ``ppo`` is registered."""
    c = group / (group - 1)
    grpo = dict(num_samples=group, scale_rewards="none")
    in_reward_theory = {"k1": "pi*", "k2": "local max of E r - beta D_f2, f2' = k2(log u) (numeric)",
                        "k3": "none: E r - beta (KL - forward KL) is unbounded; collapses"}

    def in_reward(name, algo, config, k, **kw):
        if k == "k3":
            return Case(name, algo, config, dict(kl_estimator=k, kl_placement="in_reward"), in_reward_theory[k],
                        None, claim="report", **kw)
        return Case(name, algo, config, dict(kl_estimator=k, kl_placement="in_reward"), in_reward_theory[k],
                    lambda b: in_reward_fixed_point(b, beta, k), **kw)

    cases: list[Case] = []
    if "ppo" in REGISTRY:
        # 4 epochs per rollout (PPO's default was 4 when the table was measured; the fixed point does not depend on it)
        cases += [in_reward(f"PPO {k} in reward", "ppo", dict(num_samples=group, epochs=4), k, steps=150)
                  for k in ("k1", "k2", "k3")]
    # k2 in the reward: the responses it drops die slowly (their logits fall ~linearly): train longer
    cases += [in_reward(f"GRPO {k} in reward", "grpo", grpo, k, steps=800 if k == "k2" else 400)
              for k in ("k1", "k2", "k3")]
    cases += [
        Case("GRPO k1 as loss", "grpo", grpo, dict(kl_estimator="k1", kl_placement="as_loss"),
             "no regularisation: argmax of r (reached only as logits -> inf)", argmax_policy, claim="report"),
        Case("GRPO k2 as loss", "grpo", grpo, dict(kl_estimator="k2", kl_placement="as_loss"),
             f"pi* at beta G/(G-1) = {beta * c:.4g}",
             lambda b: optimal_policy(b.ref_probs, b.rewards, beta * c)),
        Case("GRPO k2 as loss, G=4", "grpo", dict(grpo, num_samples=4),
             dict(kl_estimator="k2", kl_placement="as_loss"), f"pi* at beta 4/3 = {beta * 4 / 3:.4g}",
             lambda b: optimal_policy(b.ref_probs, b.rewards, beta * 4 / 3), steps=300),
        Case("GRPO k3 as loss", "grpo", grpo, dict(kl_estimator="k3", kl_placement="as_loss"),
             f"forward-KL optimum at beta G/(G-1) = {beta * c:.4g}",
             lambda b: regularised_optimum(b.ref_probs, b.rewards, beta * c, "forward_kl")),
        Case("GRPO paper defaults (group std, k3 as loss)", "grpo", dict(num_samples=group),
             dict(kl_estimator="k3", kl_placement="as_loss"),
             "~ forward-KL optimum at beta sigma_pi(r) G/(G-1) (approximate)",
             lambda b: grpo_group_std_target(b, beta, group), claim="report"),
    ]
    cases += zoo_online_cases(beta, group)
    cases += zoo_2026_cases(beta, group)
    cases += distillation_cases(beta)
    offline = dict(steps=150, lr=0.2)
    for div in ("reverse_kl", "forward_kl", "js", "alpha"):
        cases.append(Case(
            f"DPO {div}" + (" (alpha=0.5)" if div == "alpha" else ""), "dpo", {}, dict(divergence=div, alpha=0.5),
            "pi*" if div == "reverse_kl" else f"{div} optimum (Wang et al. 2024)",
            lambda b, div=div: regularised_optimum(b.ref_probs, b.rewards, beta, div), **offline))
    cases += [
        Case("SimPO gamma=0", "simpo", dict(gamma_beta_ratio=0.0), {},
             "softmax(r/beta): pi* of a UNIFORM reference",
             lambda b: optimal_policy(torch.full_like(b.ref_probs, 1 / b.num_responses), b.rewards, beta), **offline),
        Case("SimPO gamma/beta=0.5", "simpo", dict(gamma_beta_ratio=0.5), {},
             "population minimiser of its loss (numeric)",
             lambda b: simpo_population_optimum(b, beta, 0.5 * beta), **offline),
    ]
    cases += offline_loss_cases(beta)
    cases.append(Case("KTO (pairs as unpaired rows)", "kto", {}, {},
                      "infimum of its population loss: net-rejected responses -> 0, z0 = 0 (numeric)",
                      lambda b: kto_population_optimum(b, beta), claim="report", **offline))
    for n in (2, 4, 16):
        cases.append(Case(f"best-of-{n}", None, theory=f"analytic best-of-{n} of pi_ref",
                          target=lambda b, n=n: best_of_n_policy(b, n), bon_n=n))
    return cases


def zoo_online_cases(beta: float = BETA, group: int = GROUP) -> list[Case]:
    """RLOO, REINFORCE++, GSPO, CISPO, Online DPO (the fixed points are derived in each plugin's docstring).

    k1 in the reward: every shaped reward of a prompt is equal at pi*, so every advantage is exactly 0 there
    whatever the baseline, the normalisation, the clip or the importance weight: pi* is a fixed point of all of
    them. The baselines differ as a LOSS term or a reward-only baseline comes in: RLOO's leave-one-out baseline
    leaves the reward's gradient unscaled (k2 as a loss: pi* at beta itself), whereas a group mean that contains
    r_i shrinks it by (G-1)/G -- REINFORCE++-baseline subtracts it from r but not from the KL penalty, CISPO (as
    GRPO) from r but not from the KL loss: both land on pi* at beta G/(G-1). GSPO and CISPO run with 4
    mini-batches per rollout so that their ratios leave 1 (GSPO at the paper's clip 3e-4/4e-4 clips ~70% of the
    sequences in the first steps; CISPO at eps 0.02 clips ~75% of the weights), on single-token responses, where
    GSPO's sequence ratio is the token ratio (its length normalisation is not exercised). Online DPO's pairs are
    two samples of the current policy: with a Bradley-Terry judge (scale 1) pi* zeroes every pair's expected
    gradient; ranking by the reward gives deterministic labels and no finite fixed point.
    """
    k1r = dict(kl_estimator="k1", kl_placement="in_reward")
    k2l = dict(kl_estimator="k2", kl_placement="as_loss")
    star = lambda b: optimal_policy(b.ref_probs, b.rewards, beta)  # noqa: E731
    shifted = lambda b: optimal_policy(b.ref_probs, b.rewards, beta * 4 / 3)  # noqa: E731
    grouped = dict(num_samples=group, scale_rewards="none")
    return [
        Case("RLOO k1 in reward", "rloo", dict(num_samples=group), k1r, "pi*", star),
        Case("RLOO k2 as loss, G=4", "rloo", dict(num_samples=4), k2l,
             "pi* at beta itself (leave-one-out: no G/(G-1))", star, steps=300),
        Case("REINFORCE++ k1 in reward", "reinforce_pp", dict(num_samples=group), k1r, "pi*", star),
        Case("REINFORCE++ baseline=group, G=4", "reinforce_pp", dict(num_samples=4, baseline="group"), k1r,
             f"pi* at beta 4/3 = {beta * 4 / 3:.4g} (group mean on r, not on the KL)", shifted, steps=300),
        Case("GSPO k1 in reward, 4 mini-batches", "gspo", grouped, k1r, "pi*", star),
        Case("GSPO-token k1 in reward, 4 mini-batches", "gspo", dict(grouped, importance_sampling_level="sequence_token"),
             k1r, "pi*", star),
        Case("CISPO k1 in reward, eps 0.02, 4 mini-batches", "cispo",
             dict(grouped, is_clip_eps_low=0.02, is_clip_eps_high=0.02), k1r, "pi* (weights move steps, not fixed points)",
             star),
        Case("CISPO k2 as loss, G=4", "cispo", dict(num_samples=4, scale_rewards="none"), k2l,
             f"pi* at beta 4/3 = {beta * 4 / 3:.4g} (GRPO's group mean)", shifted, steps=300),
        Case("Online DPO, Bradley-Terry judge", "online_dpo", dict(judge="bradley_terry"), {},
             "pi* (every pair's expected gradient vanishes there)", star),
        Case("Online DPO, reward judge (ties dropped)", "online_dpo", {}, {},
             "none: deterministic labels push margins to infinity; towards the argmax of r", argmax_policy,
             claim="report"),
    ]


def zoo_2026_cases(beta: float = BETA, group: int = GROUP) -> list[Case]:
    """The surrogates without the ratio clip (``algo.policy_loss``), MaxRL's advantage and the bias-corrected KL.

    DPPO, SAPO and DRO with k1 in the reward and 4 mini-batches per rollout (their ratios leave 1): at pi* every
    shaped reward of a prompt is equal, every advantage 0, and each loss's gradient 0 whatever its mask, gate or
    penalty (DRO's penalty is 0 at delta = 0 and its gradient -(A - beta delta) vanishes with A = 0 and delta = 0):
    pi* is their fixed point, as it is the clip's. k3 as a loss with ``kl_bias_correction``: the term's expected
    gradient is the reverse KL's (:func:`prefzoo.objective.kl_loss`), so the fixed point moves from the forward-KL
    optimum (the plain k3 row above) to pi* at beta G/(G-1). MaxRL: :func:`~prefzoo.lab.oracles.maxrl_fixed_point`,
    the exact population fixed point (every group of G enumerated: the random 1/mean included). VESPO, the two-sided
    clip, the off-policy sequence mask and LUSPO: with every advantage 0 at pi*, each one's gradient is 0 there too,
    so pi* stays their fixed point (the bed shows the options do not move it; what they change is the path, on the
    later mini-batches; LUSPO's length weight is 1 for the bed's one-token responses). The high-entropy token mask
    is reported, not asserted: it drops whole prompts here (see its row)."""
    c = group / (group - 1)
    k1r = dict(kl_estimator="k1", kl_placement="in_reward")
    star = lambda b: optimal_policy(b.ref_probs, b.rewards, beta)  # noqa: E731
    grouped = dict(num_samples=group, scale_rewards="none", num_minibatches=4)
    cases = [Case(f"GRPO {loss} k1 in reward, 4 mini-batches", "grpo", dict(grouped, policy_loss=loss), k1r, "pi*",
                  star) for loss in ("dppo_tv", "dppo_kl", "sapo", "dro", "vespo")]
    options = {"two-sided clip (clip_delta 1.5)": dict(clip_delta=1.5),
               "off-policy sequence mask (0.05)": dict(off_policy_mask_threshold=0.05)}
    cases += [Case(f"GRPO {name}, k1 in reward, 4 mini-batches", "grpo", dict(grouped, **extra), k1r, "pi*", star)
              for name, extra in options.items()]
    cases += [Case("GRPO high-entropy tokens (top_entropy_quantile 0.2), k1 in reward, 4 mini-batches", "grpo",
                   dict(grouped, top_entropy_quantile=0.2), k1r,
                   "pi* only for the prompts whose tokens reach the batch's top 20% of entropies; here a prompt's "
                   "samples share one entropy (one-token responses), so whole prompts are in or out, and a prompt "
                   "that never ranks high never moves", star, claim="report")]
    cases += [Case("GSPO loss_aggregation=luspo, k1 in reward, 4 mini-batches", "gspo",
                   dict(grouped, loss_aggregation="luspo"), k1r, "pi*", star)]
    cases += [
        Case("GRPO k3 as loss, bias-corrected", "grpo", dict(num_samples=group, scale_rewards="none"),
             dict(kl_estimator="k3", kl_placement="as_loss", kl_bias_correction=True),
             f"pi* at beta G/(G-1) = {beta * c:.4g} (the reverse KL's gradient)",
             lambda b: optimal_policy(b.ref_probs, b.rewards, beta * c)),
        Case("GRPO MaxRL (scale_rewards=mean), k2 as loss, G=4", "grpo", dict(num_samples=4, scale_rewards="mean"),
             dict(kl_estimator="k2", kl_placement="as_loss"),
             "the population fixed point of (r - m)/m over every group of 4 (exact enumeration)",
             lambda b: maxrl_fixed_point(b, beta, 4), steps=300),
    ]
    return cases


def distillation_cases(beta: float = BETA) -> list[Case]:
    """On-policy distillation (``algo=distill``, the JSD; ``algo=teacher_reward``, the rows ``distill teacher_reward``)
    toward the teacher pi_T = pi* of the bandit at ``beta``: with
    r = beta log pi_T / pi_ref the objective's optimum is pi_T itself (:mod:`prefzoo.objective.distillation`), and each
    loss's unique minimiser over a table that can represent pi_T is pi_T: the JSD of any beta in [0, 1] is 0 only at
    S = T; the teacher's per-token reward is -KL(pi || pi_T) in expectation. With objective.beta = b (k1 in the
    reward) on top, the maximiser of -KL(pi || pi_T) - b KL(pi || pi_ref) is pi ~ pi_T^(1/(1+b)) pi_ref^(b/(1+b)).
    Objective beta 0 (the plugin's default) for the rest."""
    star = lambda b: optimal_policy(b.ref_probs, b.rewards, beta)  # noqa: E731
    none = dict(beta=0.0)
    cases = [Case(f"distill jsd, jsd_beta={jb:g}", "distill", dict(teacher="table", jsd_beta=jb), none,
                  "pi_T (= pi* at beta)", star, lr=0.1, steps=150) for jb in (0.0, 0.5, 1.0)]
    anchor = 0.5

    def mixture(b):
        log_t, log_ref = torch.log(star(b)), torch.log(b.ref_probs)
        return torch.softmax((log_t + anchor * log_ref) / (1 + anchor), dim=-1)

    cases += [
        Case("distill teacher_reward", "teacher_reward", dict(teacher="table"), none,
             "pi_T (= pi* at beta)", star, lr=0.1),
        Case(f"distill teacher_reward + KL to pi_ref (b={anchor:g}, k1 in reward)", "teacher_reward",
             dict(teacher="table"),
             dict(beta=anchor, kl_estimator="k1", kl_placement="in_reward"),
             f"pi_T^(1/(1+b)) pi_ref^(b/(1+b)), b = {anchor:g}", mixture, lr=0.1),
    ]
    return cases


def _log_odds(logp: Tensor) -> Tensor:
    return logp - torch.log(-torch.expm1(logp))


def offline_loss_cases(beta: float = BETA) -> list[Case]:
    """DPO's other loss types, ORPO and SFT. Their targets are population minimisers of each loss written here from
    its paper (:func:`~prefzoo.lab.oracles.pair_loss_population_optimum`; rho = log pi/pi_ref, m = beta (rho_w -
    rho_l)), or the chosen distribution (SFT); none of them is pi*."""
    offline = dict(steps=150, lr=0.2)
    eps, c = 0.1, 1 / (2 * beta)

    def optimum(loss):
        return lambda b: pair_loss_population_optimum(b, loss)

    def margin(rw, rl):
        return beta * (rw - rl)

    return [
        Case("DPO robust eps=0.1", "dpo", dict(loss_type="robust", label_smoothing=eps), {},
             "population minimiser: sigma(m) fits (p - eps)/(1 - 2 eps), sharper than pi* (numeric)",
             optimum(lambda lw, ll, rw, rl: ((1 - eps) * F.softplus(-margin(rw, rl))
                                             - eps * F.softplus(margin(rw, rl))) / (1 - 2 * eps)), **offline),
        Case("DPO sppo_hard", "dpo", dict(loss_type="sppo_hard"), {},
             "population minimiser of (rho_w - 1/2b)^2 + (rho_l + 1/2b)^2 (numeric)",
             optimum(lambda lw, ll, rw, rl: (rw - c) ** 2 + (rl + c) ** 2), **offline),
        Case("DPO nca_pair", "dpo", dict(loss_type="nca_pair"), {},
             "population minimiser of the NCA pair loss (numeric)",
             optimum(lambda lw, ll, rw, rl: F.softplus(-beta * rw) + 0.5 * F.softplus(beta * rw)
                     + 0.5 * F.softplus(beta * rl)), **offline),
        Case("DPO discopop", "dpo", dict(loss_type="discopop"), {},
             "population minimiser of the LRML loss, tau = 0.05 (numeric; non-convex)",
             optimum(lambda lw, ll, rw, rl: (1 - torch.sigmoid(margin(rw, rl) / 0.05)) * F.softplus(-margin(rw, rl))
                     + torch.sigmoid(margin(rw, rl) / 0.05) * torch.exp(-margin(rw, rl))), claim="report", **offline),
        Case("DPO apo_zero", "dpo", dict(loss_type="apo_zero"), {},
             "infimum on the boundary: net losers -> 0 (numeric, where L-BFGS stops)",
             optimum(lambda lw, ll, rw, rl: 1 - torch.sigmoid(beta * rw) + torch.sigmoid(beta * rl)), claim="report",
             **offline),
        Case("DPO bco_pair", "dpo", dict(loss_type="bco_pair"), {}, "no closed form (running reward shift)", None,
             claim="report", **offline),
        Case("DPO sigmoid + 0.5 sft", "dpo", dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]), {},
             "population minimiser of -log sigma(m) - 0.5 log pi(y_w) (numeric)",
             optimum(lambda lw, ll, rw, rl: F.softplus(-margin(rw, rl)) - 0.5 * lw), **offline),
        Case("SFT on chosen", "sft", {}, {}, "the distribution of the chosen response", chosen_distribution,
             **offline),
    ] + [
        Case(f"ORPO lambda={lam:g}", "orpo", {}, dict(beta=lam),
             f"population minimiser of -log pi(y_w) + {lam:g} L_OR (numeric)",
             optimum(lambda lw, ll, rw, rl, lam=lam: -lw + lam * F.softplus(-(_log_odds(lw) - _log_odds(ll)))),
             **offline)
        for lam in (0.1, 1.0)]


# ------------------------------------------------------------------------------------------------ runs
@dataclass
class CaseResult:
    """A case's learned policies and distances. S = seeds, P = prompts, K = responses."""

    case: Case
    probs: Tensor  # (S, P, K)
    star: Tensor  # (P, K)
    target: Tensor | None  # (P, K)
    best: Tensor  # (P, K) bool, the responses of maximal reward
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def seeds(self) -> int:
        return self.probs.shape[0]

    @property
    def tv_star(self) -> Tensor:
        """TV(pi_s, pi*), Shape (S, P)."""
        return total_variation(self.probs, self.star)

    @property
    def kl_star(self) -> Tensor:
        """KL(pi_s || pi*), Shape (S, P), nats."""
        return kl_divergence(self.probs, self.star.expand_as(self.probs))

    @property
    def tv_target(self) -> Tensor | None:
        return None if self.target is None else total_variation(self.probs, self.target)

    @property
    def mean_policy(self) -> Tensor:
        return self.probs.mean(0)

    def argmax_mass(self) -> float:
        """Mass on the best-reward responses, averaged over prompts and seeds."""
        return float((self.probs * self.best).sum(-1).mean())

    def entropy(self) -> float:
        """Mean entropy of the learned policies (nats), over prompts and seeds."""
        p = self.probs
        return float(-(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1).mean())

    def noise(self) -> float:
        """Typical per-seed TV distance to the seeds' own mean (prompt-averaged), corrected for the mean
        being estimated: the Monte-Carlo spread of one run, whatever the target."""
        s = self.seeds
        return float(total_variation(self.probs, self.mean_policy).mean()) * math.sqrt(s / (s - 1))

    def tolerance(self) -> float:
        """3 noise / sqrt(S) + 0.002: what TV(pi_bar, X) can reach by chance if X is where the runs go
        (noise shrinks as 1/sqrt(S) in the mean), plus an optimisation floor."""
        return 3.0 * self.noise() / math.sqrt(self.seeds) + 0.002

    def bias_target(self) -> float | None:
        """TV(pi_bar, target), averaged over prompts."""
        return None if self.target is None else float(total_variation(self.mean_policy, self.target).mean())

    def bias_star(self) -> float:
        """TV(pi_bar, pi*), averaged over prompts."""
        return float(total_variation(self.mean_policy, self.star).mean())

    def matches_target(self) -> bool | None:
        b = self.bias_target()
        return None if b is None else b <= self.tolerance()

    def off_star(self) -> bool:
        return self.bias_star() > self.tolerance()

    def verdict(self) -> str:
        star = "off pi*" if self.off_star() else "= pi*"
        m = self.matches_target()
        if m is None:
            return f"no target; {star}"
        if self.case.claim == "report":
            return f"{'near' if m else 'not at'} target (not asserted); {star}"
        return f"{'matches target' if m else 'DISAGREES with target'}; {star}"


def _stats(x: Tensor) -> tuple[float, float]:
    """Mean over seeds of the prompt average, and its standard error over seeds. x: (S, P)."""
    per_seed = x.mean(-1)
    se = float(per_seed.std(unbiased=True)) / math.sqrt(len(per_seed)) if len(per_seed) > 1 else float("nan")
    return float(per_seed.mean()), se


def run_case(case: Case, bandit: TabularBandit, seeds: int = DEFAULT_SEEDS, seed: int = 0, beta: float = BETA,
             pairs=None, steps: int | None = None, samples_per_prompt: int = SAMPLES_PER_PROMPT) -> CaseResult:
    """Train (or, for best-of-n, sample) one case and measure it.

    ``steps`` overrides the case's training length; ``pairs`` (offline plugins) must be pairs of
    ``bandit.tile(seeds)``; ``samples_per_prompt``: online responses per prompt and replica per step.
    """
    t0 = time.perf_counter()
    star = optimal_policy(bandit.ref_probs, bandit.rewards, beta)
    extra: dict = {}
    if case.algo is None:
        probs = sample_best_of_n(bandit, case.bon_n, 50000, seeds, seed)
        bon = best_of_n_policy(bandit, case.bon_n)
        extra["kl_ref_exact"] = kl_divergence(bon, bandit.ref_probs)
        extra["kl_ref_formula"] = math.log(case.bon_n) - (case.bon_n - 1) / case.bon_n
    else:
        algo = build_algorithm(case.algo, case.config, case.objective, beta)
        policy = train_replicas(algo, bandit, seeds, seed, steps or case.steps, case.lr, pairs=pairs,
                                samples_per_prompt=samples_per_prompt, pairs_per_prompt=PAIRS_PER_PROMPT,
                                teacher=star if algo.declaration.teacher is not None else None)
        probs = policy.probs().view(seeds, bandit.num_prompts, bandit.num_responses)
    target = case.target(bandit) if case.target is not None else None
    best = bandit.rewards == bandit.rewards.amax(-1, keepdim=True)
    return CaseResult(case, probs, star, target, best, time.perf_counter() - t0, extra)


def run_all(cases: list[Case], bandit: TabularBandit, seeds: int = DEFAULT_SEEDS, seed: int = 0,
            beta: float = BETA, log: Callable[[str], None] | None = print) -> list[CaseResult]:
    """Run every case (the DPO/SimPO rows share one set of preference pairs per replica)."""
    pairs = None
    results = []
    for case in cases:
        if case.algo is not None and not build_algorithm(case.algo, case.config, case.objective, beta).declaration.online \
                and pairs is None:
            pairs = preference_pairs(bandit.tile(seeds), PAIRS_PER_PROMPT, torch.Generator().manual_seed(seed + 1))
        res = run_case(case, bandit, seeds, seed, beta, pairs=pairs)
        results.append(res)
        if log:
            log(f"  {case.label:<44s} {res.seconds:6.1f} s  {res.verdict()}")
    return results


# ------------------------------------------------------------------------------------------------ report
def _pm(mean: float, se: float, digits: int = 4) -> str:
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def summary_table(results: list[CaseResult]) -> str:
    """The main markdown table (one row per case)."""
    head = ("| case | theory: fixed point | TV(π, π*) | KL(π ‖ π*) nats | TV(π̄, π*) | TV(π, target) | "
            "TV(π̄, target) | tol | P(argmax r) | H(π) | verdict |")
    lines = [head, "|" + "---|" * 11]
    for res in results:
        tv, kl = _stats(res.tv_star), _stats(res.kl_star)
        tvt = _stats(res.tv_target) if res.target is not None else None
        lines.append("| " + " | ".join([
            res.case.label, res.case.theory, _pm(*tv), _pm(*kl), f"{res.bias_star():.4f}",
            _pm(*tvt) if tvt else "—", f"{res.bias_target():.4f}" if tvt else "—", f"{res.tolerance():.4f}",
            f"{res.argmax_mass():.3f}", f"{res.entropy():.3f}", res.verdict()]) + " |")
    return "\n".join(lines)


def per_prompt_table(results: list[CaseResult]) -> str:
    """TV(pi, pi*) and KL(pi || pi*) for each prompt: mean ± standard error over seeds."""
    p = results[0].probs.shape[1]
    head = ("| case | " + " | ".join(f"TV p{i}" for i in range(p)) + " | "
            + " | ".join(f"KL p{i}" for i in range(p)) + " |")
    lines = [head, "|" + "---|" * (1 + 2 * p)]
    s = math.sqrt(results[0].seeds)
    for res in results:
        tv, kl = res.tv_star, res.kl_star
        cells = [f"{float(tv[:, i].mean()):.4f} ± {float(tv[:, i].std()) / s:.4f}" for i in range(p)]
        cells += [f"{float(kl[:, i].mean()):.4f} ± {float(kl[:, i].std()) / s:.4f}" for i in range(p)]
        lines.append(f"| {res.case.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_of_n_table(results: list[CaseResult]) -> str:
    """Best-of-n: exact KL(pi_bon || pi_ref) per prompt against the formula log n - (n-1)/n."""
    bon = [r for r in results if r.case.algo is None]
    if not bon:
        return ""
    p = bon[0].probs.shape[1]
    lines = ["| n | log n - (n-1)/n | " + " | ".join(f"exact KL p{i}" for i in range(p)) + " |",
             "|" + "---|" * (2 + p)]
    for r in bon:
        lines.append(f"| {r.case.bon_n} | {r.extra['kl_ref_formula']:.4f} | "
                     + " | ".join(f"{float(v):.4f}" for v in r.extra["kl_ref_exact"]) + " |")
    return "\n".join(lines)


def bandit_table(bandit: TabularBandit, beta: float) -> str:
    star = optimal_policy(bandit.ref_probs, bandit.rewards, beta)
    lines = ["| prompt | π_ref | r | π* |", "|---|---|---|---|"]
    fmt = lambda t: "(" + ", ".join(f"{float(v):.3f}" for v in t) + ")"  # noqa: E731
    for i in range(bandit.num_prompts):
        lines.append(f"| {i} | {fmt(bandit.ref_probs[i])} | {fmt(bandit.rewards[i])} | {fmt(star[i])} |")
    return "\n".join(lines)


def _entropy(p: Tensor) -> float:
    return float(-(p * p.log()).sum(-1).mean())


#: the closing section of the document: what each row of the summary shows, and why
READING = """## Reading the table

- **k1 in the reward** (PPO, GRPO) reaches π*: the expected update is the gradient of E r − β KL(π ‖ π_ref).
  At π* the shaped reward r − β log(π/π_ref) is the same for every response, so every advantage is 0 and
  the runs stop moving exactly there (no Monte-Carlo noise at all).
- **k2 as a loss** has the reverse-KL gradient, but GRPO's advantage r_i − mean(group) includes r_i and
  shrinks the reward's gradient by (G−1)/G while a KL *loss* is not shrunk: GRPO-as-loss regularises with
  β·G/(G−1). The runs sit on π* at that β (G = 16: 0.5333; G = 4: 0.6667), not at β. The KL estimator is
  right; the shift comes from the group baseline (a leave-one-out baseline, RLOO, would remove it). In the
  reward the penalty is shrunk together with the reward, so the fixed point does not move.
- **k3 as a loss** (GRPO's default) follows the gradient of the FORWARD KL(π_ref ‖ π): the runs land on
  `regularised_optimum(..., "forward_kl")` (at β·G/(G−1)), measurably off π*.
- **k1 as a loss** has zero expected gradient: no regularisation, the policy climbs to the argmax of r.
- **k2 and k3 in the reward** are not "slightly biased": the update is the gradient of
  E r − β Σ π_ref f_k(π/π_ref) with f_k′(u) = k(log u), and f_k is concave for u < 1, so responses that fall
  below their reference probability are pushed to 0 (k2: a stable, path-dependent support collapse that the
  numeric ascent predicts; k3: E r − β(KL − forward KL), unbounded, keeps collapsing as long as it trains —
  seeds drop responses at different times, hence its larger spread).
- **The paper's GRPO** (group-std advantages, k3 as loss) divides the reward's gradient by the group's reward
  std σ ≈ 0.1–0.3 here: the effective β is about β·σ·G/(G−1), so it lands far from π*_β, near the argmax.
- **RLOO** (leave-one-out baseline) needs no rescaling: b_i does not contain r_i, so the update is the
  gradient itself; k2 as a loss lands on π* at β, where GRPO's group mean lands at β·G/(G−1).
- **REINFORCE++** (token-level k1 in the reward, reward-to-go, batch normalisation) reaches π*: the batch mean
  is a baseline and the batch std scales reward and penalty alike. **REINFORCE++-baseline** subtracts the
  group mean from r but not from the KL penalty: the reward's gradient shrinks by (G−1)/G, the penalty's does
  not, and it lands on π* at β·G/(G−1) (G = 4: 0.6667), measurably off π*_β.
- **GSPO / GSPO-token / CISPO** with k1 in the reward reach π* despite clipping most sequences (GSPO's
  3e-4/4e-4) or weights (CISPO at 0.02) in the first steps: at π* every advantage is 0, so the clip and the
  importance weight change how fast the runs get there, not where. CISPO's KL loss shifts β by G/(G−1) exactly
  as GRPO's does. The bed's responses are single tokens: GSPO's length normalisation is not exercised here.
- **Online DPO** on pairs of its own samples reaches π* with a Bradley-Terry judge (like DPO on pairs of π_ref:
  π* zeroes every pair's expected gradient, whatever distribution the pairs come from). Ranking the two samples by
  the reward is a deterministic judge: the untied pairs' margins grow without bound and the policy heads for the
  best-reward responses (the row shows how far it got in its budget; ties are dropped).
- **f-DPO** on Bradley-Terry pairs (scale 1) reaches, for each f, the maximiser of E r − β D_f(π ‖ π_ref)
  (Wang et al. 2024): π* for reverse KL, the divergence's own optimum otherwise. The Monte-Carlo error comes
  from the finite pairs (label noise) and grows with the flatness of the link (JS is the noisiest).
- **SimPO** ignores π_ref: with γ = 0 it lands on softmax(r/β) (π* of a uniform reference); the margin γ
  moves it further (to the population minimiser of its loss).
- **DPO's other loss types** each reach the population minimiser of their own loss, and none of them π* on
  clean Bradley-Terry pairs: rDPO (ε = 0.1) de-noises flips that did not happen, so σ(m) fits (p − ε)/(1 − 2ε)
  and over-sharpens (its 1/(1 − 2ε) weights also amplify the label noise: the widest spread of the matched rows);
  SPPO-hard regresses each side's log-ratio to ±1/(2β); NCA and the sum with 0.5·NLL are pulled toward the
  chosen distribution. APO-zero's infimum is on the boundary (responses that lose more often than they win go
  to 0): shown, not asserted. DiscoPOP's loss is not convex: the seeds spread widely around their mean, no fixed
  point is claimed. bco_pair's running reward shift has no closed-form target (reported).
- **SFT** on chosen completions lands on the distribution of the chosen response; **ORPO** with λ = 0.1 stays
  near it, λ = 1 moves away from it toward the preferred responses; both ignore π_ref.
- **KTO** trains on the pairs split into shuffled unpaired rows (chosen desirable, rejected undesirable). Its
  population loss has no interior minimiser: a row's loss is λ_D (1 − σ(β(ρ − z0))) or λ_U σ(β(ρ − z0)), so every
  response rejected more often than chosen (weighted) lowers the loss as its probability goes to 0, and z0 (the
  mismatched log-ratios' mean) then falls below 0 and is clamped at 0 (149 of 150 steps in a 2-seed check). The target
  is that infimum (net-rejected responses at 0, the others maximising Σ d·σ(β log π/π_ref)); the runs head there and
  land near it, far from π*. Not asserted as a fixed point (the pushed-down responses' gradients fade like
  (π/π_ref)^β, so a longer run gets closer). With z0 = 0 and λ_D = λ_U = 1 a pair's two rows add up to APO-zero's
  loss 1 − σ(βρ_w) + σ(βρ_l): the KTO row repeats the apo_zero row (to 4 digits here), whose target is the same
  infimum.
"""


def report(results: list[CaseResult], bandit: TabularBandit, beta: float, seeds: int, command: str,
           seconds: float) -> str:
    """The whole markdown document."""
    star = optimal_policy(bandit.ref_probs, bandit.rewards, beta)
    skipped = "" if "ppo" in REGISTRY else ("\nPPO rows are missing: no plugin called `ppo` was registered when this "
                                             "was generated; they appear automatically once it is.\n")
    return f"""# Objective conformance: which fixed point does each algorithm reach?

Generated by `{command}` in {seconds:.0f} s ({seeds} seeds, torch {torch.__version__}, 1 thread).
Every plugin runs unchanged on the tabular test bed (`prefzoo/lab/tabular.py`) through the training loop's
optimisation step; the theory is in the docstring of `prefzoo/lab/oracles.py`, the method in `prefzoo/lab/conformance.py`.
{skipped}
## The bed (β = {beta})

{bandit_table(bandit, beta)}

## Summary

π is a learned policy (one per seed; "±" is the standard error over seeds of the prompt average), π̄ the
mean over seeds (its distance to a target is the systematic error, noise shrinks as 1/√S), target the fixed
point that theory predicts for the case. A case matches its target when TV(π̄, target) ≤ tol =
3·d/√S + 0.002, d = the mean TV of one seed from π̄ (its Monte-Carlo spread); it is off π* when
TV(π̄, π*) > tol. "not asserted" rows show a target that theory only approximates. P(argmax r) is the mass on the
best-reward responses and H(π) the entropy in nats (both averaged over prompts and seeds; π* has
H = {_entropy(star):.3f}, π_ref {_entropy(bandit.ref_probs):.3f}).

{summary_table(results)}

## Per prompt (distance to π*, mean ± standard error over seeds)

{per_prompt_table(results)}

## Best-of-n: KL to the reference

The exact KL(π_bon ‖ π_ref) against the formula log n − (n−1)/n (Stiennon et al. 2020): the formula is an
upper bound, reached only when π_ref has no atoms (continuous rewards). With finitely many responses the
KL is smaller even when all rewards differ (prompts 0, 1, 3), and much smaller with ties (prompt 2).

{best_of_n_table(results)}

{READING}"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefzoo.lab.conformance", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="where to write the markdown page (default: none, it is printed; "
                                                  "the project's page: --out docs/conformance.md)")
    parser.add_argument("--only", default="", help="comma-separated substrings: run the matching rows only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny tensors: 1 is fastest)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    bandit = conformance_bandit()
    cases = default_cases()
    if args.only:
        keys = [k.strip().lower() for k in args.only.split(",") if k.strip()]
        cases = [c for c in cases if any(k in c.label.lower() for k in keys)]
    print(f"[conformance] {len(cases)} cases, {args.seeds} seeds, beta={BETA}; plugins: {', '.join(sorted(REGISTRY))}")
    results = run_all(cases, bandit, args.seeds, args.seed)
    from prefzoo.lab.turns import run_turn_case, turn_bed, turn_cases, turn_section

    turns = turn_cases()
    if args.only:
        turns = [c for c in turns if any(k in c.label.lower() for k in keys)]
    bed = turn_bed()
    turn_results = []
    for case in turns:
        turn_results.append(run_turn_case(case, bed, BETA, args.seeds, args.seed))
        print(f"[conformance] {case.label}: {turn_results[-1].verdict} ({turn_results[-1].seconds:.0f} s)")
    from prefzoo.lab.offpolicy import offpolicy_cases, offpolicy_section, run_offpolicy_case

    off = offpolicy_cases()
    if args.only:
        off = [c for c in off if any(k in c.label.lower() for k in keys)]
    off_results = []
    for case in off:
        off_results.append(run_offpolicy_case(case, bandit, BETA, args.seeds, args.seed))
        print(f"[conformance] {case.label}: {off_results[-1].verdict} ({off_results[-1].seconds:.0f} s)")
    seconds = time.perf_counter() - started
    command = "python -m prefzoo.lab.conformance" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    doc = report(results, bandit, BETA, args.seeds, command, seconds)
    if turn_results:
        doc += "\n" + turn_section(turn_results, bed, BETA)
    if off_results:
        doc += "\n" + offpolicy_section(off_results, bandit, BETA)
    print(doc)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(doc)
        print(f"[conformance] wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
