"""The sampler is not the trainer, on the tabular bed: stale and mismatched samplers, with and without the correction
(issue 29).

**The samplers.** :class:`SamplerPolicy` is the bed's tabular policy whose rollouts come from a BEHAVIOUR policy and
carry its log-probs (``sample_logps``), as a rollout engine's do: either the policy as it was ``staleness`` optimizer
steps ago (asynchronous rollouts with bounded staleness), or the current policy at another temperature
``sampler_temperature`` (a persistent mismatch: an engine whose distribution differs from the trainer's, exaggerated
so that it shows). The plugin recomputes log pi_old itself and, with ``rollout.correction.mode``, weights by
w = pi_old / pi_behaviour (:func:`prefzoo.objective.correction_weights`).

**Theory** (GRPO with the group-mean baseline, scale none, G samples, c = (G-1)/G; one update per rollout; k2 as a
loss, whose on-policy fixed point is pi* at beta / c). With q the behaviour policy, l = log pi/pi_ref, and the
per-sample loss -A(y) log pi(y) + beta v(y) k2(l(y)), where the advantage's expectation given y is c (r(y) - E_q r),
the expected descent direction on the logits of prompt x is, for each response j,

    g_j = sum_y q(y) [ -c w(y) (r(y) - E_q r) + beta v(y) l(y) ] (1[y = j] - pi_j)

with w the weight of the policy-gradient term and v that of the KL term (1: uncorrected; pi/q: corrected).

- Staleness: at a fixed point the policy stops moving, so the behaviour policy of k steps ago IS the policy: q = pi
  there, and every fixed point of the on-policy iteration is one of the delayed iteration, corrected or not. Bounded
  staleness changes the path and the stability, not where it ends: both stale rows target pi* at beta / c.
- A persistent mismatch (q = softmax(theta / tau), tau != 1): uncorrected (w = v = 1) the zero of g is not pi*
  (:func:`mismatch_fixed_point`); correcting the policy-gradient term only (w = pi/q, v = 1: TRL 1.16's convention,
  ``rollout.correction.weight_kl=false``) still leaves the KL term's gradient under q, so the fixed point is still
  off; weighting both (v = pi/q, prefzoo's default) makes g the on-policy direction: pi* at beta / c.
- With the KL in the REWARD (k1) every shaped reward is equal at pi*, so every advantage is 0 there whatever the
  sampler: a mismatch cannot move that fixed point (a row checks it, uncorrected).

The numeric targets come from deterministic descent on g itself (Adam, float64), from the bed's reference; they do
not use the plugins' code.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from prefzoo.lab.tabular import TabularBandit, TabularPolicy
from prefzoo.objective import optimal_policy
from prefzoo.types import PromptBatch, SamplingParams, SequenceBatch

__all__ = ["SamplerPolicy", "OffPolicyCase", "offpolicy_cases", "mismatch_fixed_point", "run_offpolicy_case",
           "offpolicy_section"]


class SamplerPolicy(TabularPolicy):
    """A tabular policy whose samples come from a behaviour policy and carry its log-probs (see the module docstring).

    Args:
        staleness: draw from the logits as they were this many optimizer steps ago (0: the current ones). The
            training driver calls :meth:`record` after every step.
        sampler_temperature: draw from softmax(logits / tau) (1: the trainer's own distribution).
    Other arguments as :class:`~prefzoo.lab.tabular.TabularPolicy`.
    """

    def __init__(self, ref_logits: Tensor, *, staleness: int = 0, sampler_temperature: float = 1.0, **kwargs):
        super().__init__(ref_logits, **kwargs)
        self.staleness = int(staleness)
        self.sampler_temperature = float(sampler_temperature)
        self.history: deque[Tensor] = deque(maxlen=self.staleness + 1)
        self.record()

    def record(self) -> None:
        """Remember the current logits (called after every optimizer step)."""
        self.history.append(self.logits.detach().clone())

    def behaviour_logits(self) -> Tensor:
        """The behaviour policy's logits, Shape (P, K): the oldest of the last ``staleness + 1`` recorded tables, at
        ``sampler_temperature``."""
        return self.history[0] / self.sampler_temperature

    @torch.no_grad()
    def sample(self, prompts: PromptBatch, num_samples: int, params: SamplingParams) -> SequenceBatch:
        rows = self._rows(prompts.prompt_ids)
        n = int(num_samples)
        table = torch.log_softmax(self.behaviour_logits().float() / params.temperature, -1)  # (P, K)
        ids = torch.multinomial(table[rows].exp(), n, replacement=True, generator=self.generator)
        b = len(rows)
        flat = ids.reshape(b * n, 1).long()
        return SequenceBatch(
            prompt_ids=prompts.prompt_ids.repeat_interleave(n, dim=0),
            prompt_mask=prompts.prompt_mask.repeat_interleave(n, dim=0),
            completion_ids=flat, completion_mask=torch.ones(b * n, 1, dtype=torch.bool),
            prompt_index=torch.arange(b).repeat_interleave(n), truncated=torch.zeros(b * n, dtype=torch.bool),
            sample_logps=table[rows.repeat_interleave(n), flat[:, 0]][:, None])


def mismatch_fixed_point(bandit: TabularBandit, beta: float, group: int, tau: float, weight_pg: bool,
                         weight_kl: bool, steps: int = 6000, lr: float = 0.02) -> Tensor:
    """Where GRPO (scale none, k2 as a loss) goes when its samples come from softmax(theta / tau), Shape (P, K) float64.

    Deterministic descent on the expected direction g of the module docstring, with w = pi/q on the
    policy-gradient term if ``weight_pg`` and v = pi/q on the KL term if ``weight_kl`` (else 1), from pi_ref, Adam
    with a linearly decaying rate. With both weights on the zero of g is pi* at beta G/(G-1) (a check on this
    function: ``tests/lab/test_offpolicy.py``).
    """
    ref, r = bandit.ref_probs.double(), bandit.rewards.double()
    c = (group - 1) / group
    theta = torch.log(ref).clone()
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    b1, b2 = 0.9, 0.999
    for t in range(1, steps + 1):
        pi = torch.softmax(theta, -1)
        q = torch.softmax(theta / tau, -1)
        ell = torch.log(pi) - torch.log(ref)
        w = pi / q if weight_pg else torch.ones_like(pi)
        vk = pi / q if weight_kl else torch.ones_like(pi)
        u = -c * w * (r - (q * r).sum(-1, keepdim=True)) + beta * vk * ell  # per response y
        qu = q * u
        grad = qu - pi * qu.sum(-1, keepdim=True)  # sum_y q(y) u(y) (1[y=j] - pi_j)
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad * grad
        step = lr * (1 - (t - 1) / steps)
        theta = theta - step * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + 1e-12)
    return torch.softmax(theta, -1)


@dataclass
class OffPolicyCase:
    """One row: GRPO on the bed with a behaviour policy, a correction, and its target (see the module docstring)."""

    label: str
    objective: dict
    staleness: int = 0
    sampler_temperature: float = 1.0
    correction: dict = field(default_factory=dict)
    target: str = "star_c"  # star_c: pi* at beta/c | star: pi* at beta | mismatch: mismatch_fixed_point(...)
    steps: int = 400


def offpolicy_cases(tau: float = 3.0, staleness: int = 4) -> list[OffPolicyCase]:
    k2 = {"kl_estimator": "k2", "kl_placement": "as_loss"}
    k1 = {"kl_estimator": "k1", "kl_placement": "in_reward"}
    is_all = {"mode": "token_truncate", "clip_min": None, "clip_max": None}  # the plain importance weight, uncapped
    return [
        OffPolicyCase(f"GRPO k2 as loss, sampler at temperature {tau}, uncorrected", k2, sampler_temperature=tau,
                      target="mismatch"),
        OffPolicyCase(f"GRPO k2 as loss, sampler at temperature {tau}, IS on the policy gradient only (TRL)", k2,
                      sampler_temperature=tau, correction=dict(is_all, weight_kl=False), target="mismatch"),
        OffPolicyCase(f"GRPO k2 as loss, sampler at temperature {tau}, IS on both terms (default)", k2,
                      sampler_temperature=tau, correction=dict(is_all, weight_kl=True)),
        OffPolicyCase(f"GRPO k1 in reward, sampler at temperature {tau}, uncorrected", k1, sampler_temperature=tau,
                      target="star"),
        OffPolicyCase(f"GRPO k2 as loss, samples {staleness} steps stale, uncorrected", k2, staleness=staleness),
        OffPolicyCase(f"GRPO k2 as loss, samples {staleness} steps stale, IS on both terms", k2, staleness=staleness,
                      correction=dict(is_all, weight_kl=True)),
    ]


@dataclass
class OffPolicyResult:
    case: OffPolicyCase
    tv_target: tuple[float, float]  # TV(pi, target) per seed: mean, standard error
    tv_mean_target: float  # TV(seed-mean pi, target)
    tv_mean_onpolicy: float  # TV(seed-mean pi, the on-policy fixed point)
    tol: float
    seconds: float

    @property
    def verdict(self) -> str:
        if self.tv_mean_target > self.tol:
            return "MISSES its target"
        if self.case.target == "mismatch" and self.tv_mean_onpolicy > self.tol:
            return "matches its target (off π*)"
        return "matches π*"


def _target(case: OffPolicyCase, bandit: TabularBandit, beta: float, group: int) -> Tensor:
    c = (group - 1) / group
    if case.target == "star":
        return optimal_policy(bandit.ref_probs, bandit.rewards, beta)
    if case.target == "star_c":
        return optimal_policy(bandit.ref_probs, bandit.rewards, beta / c)
    weighted = bool(case.correction.get("mode"))
    return mismatch_fixed_point(bandit, beta, group, case.sampler_temperature, weight_pg=weighted,
                                weight_kl=weighted and case.correction.get("weight_kl", True))


def run_offpolicy_case(case: OffPolicyCase, bandit: TabularBandit, beta: float, seeds: int, seed: int = 0,
                       group: int = 16, samples_per_prompt: int = 1024) -> OffPolicyResult:
    """Train ``case`` on ``seeds`` stacked replicas of the bed (one vectorised run) and measure it against its
    target, with the conformance table's tolerance (3 d / sqrt(S) + 0.002, d the seeds' spread)."""
    from prefzoo.lab.runner import build_algorithm
    from prefzoo.lab.tabular import PromptSource, TableScorer, TrainSettings, train
    from prefzoo.types import CorrectionSettings

    start = time.perf_counter()
    tiled = bandit.tile(seeds)
    from prefzoo.lab.tabular import BED_SAMPLING

    sampling = SamplingParams(temperature=BED_SAMPLING.temperature, top_p=1.0,
                              max_new_tokens=BED_SAMPLING.max_new_tokens, correction=CorrectionSettings(**case.correction))
    algo = build_algorithm("grpo", {"num_samples": group, "scale_rewards": "none"}, case.objective, beta, sampling)
    policy = SamplerPolicy(tiled.ref_logits, staleness=case.staleness, sampler_temperature=case.sampler_temperature,
                           with_reference=algo.declaration.reference, seed=seed)
    source = PromptSource(tiled.num_prompts, repeats=max(1, samples_per_prompt // group))
    train(algo, policy, source, TrainSettings(steps=case.steps, lr=0.05), scorer=TableScorer(tiled.rewards),
          callback=lambda step, out: policy.record())
    probs = policy.probs().view(seeds, bandit.num_prompts, bandit.num_responses)
    target = _target(case, bandit, beta, group)
    onpolicy = optimal_policy(bandit.ref_probs, bandit.rewards,
                              beta if case.target == "star" else beta * group / (group - 1))
    tv = lambda a, b: 0.5 * (a - b).abs().sum(-1)  # noqa: E731
    per_seed = tv(probs, target).mean(-1)
    mean = probs.mean(0)
    spread = tv(probs, mean).mean().item()
    return OffPolicyResult(case, (per_seed.mean().item(), per_seed.std().item() / math.sqrt(seeds)),
                           tv(mean, target).mean().item(), tv(mean, onpolicy).mean().item(),
                           3 * spread / math.sqrt(seeds) + 0.002, time.perf_counter() - start)


def offpolicy_section(results: list[OffPolicyResult], bandit: TabularBandit, beta: float, group: int = 16) -> str:
    """The conformance page's off-policy section (markdown)."""
    c = (group - 1) / group
    star_c = optimal_policy(bandit.ref_probs, bandit.rewards, beta / c)
    names = {"star": "π* (β)", "star_c": f"π* at β/c = {beta / c:.4g}", "mismatch": "the mismatched zero of g"}
    rows = ["| case | target | TV(π, target) per seed | TV(π̄, target) | TV(π̄, on-policy fixed point) | tol | verdict |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.case.label} | {names[r.case.target]} | {r.tv_target[0]:.4f} ± {r.tv_target[1]:.4f} | "
                    f"{r.tv_mean_target:.4f} | {r.tv_mean_onpolicy:.4f} | {r.tol:.4f} | {r.verdict} |")
    tau = next((r.case.sampler_temperature for r in results if r.case.sampler_temperature != 1.0), 3.0)
    gaps = [(0.5 * (mismatch_fixed_point(bandit, beta, group, tau, weight_pg=pg, weight_kl=False) - star_c).abs()
             .sum(-1)).mean().item() for pg in (False, True)]
    return f"""## Off-policy: the sampler is not the trainer

The bandit above (β = {beta}), GRPO with G = {group}, scale none, one update per rollout
(`prefzoo/lab/offpolicy.py`). The rollouts come from a behaviour policy q and carry its log-probs, as a rollout
engine's do: either the policy at temperature {tau:g} (a persistent mismatch, exaggerated so that it shows) or the policy
as it was 4 optimizer steps ago (bounded staleness). Theory (derived in the module's docstring): the expected
update direction is g_j = Σ_y q(y) [−c w(y)(r(y) − E_q r) + β v(y) l(y)] (1[y=j] − π_j), c = (G−1)/G, l = log π/π_ref,
w and v the weights of the policy-gradient and the KL terms. A persistent mismatch moves the fixed point unless BOTH
terms are weighted by π/q: uncorrected its zero lies {gaps[0]:.4f} TV from π* at β/c, and with the policy-gradient
term corrected alone (TRL 1.16's convention, `rollout.correction.weight_kl=false`) {gaps[1]:.4f} away, further than
uncorrected (the two terms then see different distributions); prefzoo weights both by default. With the KL in the
reward every advantage is 0 at π* whatever the sampler, so a mismatch cannot move it. Staleness moves no fixed point
(where the policy stops, the policy of k steps ago is the policy): the stale rows reach π* corrected or not.

{chr(10).join(rows)}
"""
