"""A two-turn tabular bed: the policy acts, the environment answers at random, the policy acts again (issue 28).

**The bed.** For each prompt x: the policy picks a1 in {0..K1-1}; the environment draws a state s ~ P(s | x, a1) (its
"tokens", which the policy does not choose); the policy picks a2 in {0..K2-1} having seen (x, a1, s); the reward is
r(x, a1, s, a2). A trajectory is a :class:`~prefzoo.types.SequenceBatch` row with the completion ``[a1, s, a2]``:
``completion_mask = [True, False, True]`` (the policy's own tokens) and ``token_mask = [True, True, True]``. The policy
(:class:`TwoTurnPolicy`) is three logit tables -- pi(a1 | x), a model q(s | x, a1) of the environment's token (a
language model predicts every token it reads) and pi(a2 | x, a1, s) -- and the reference starts the three at
pi_ref(a1 | x), P(s | x, a1) (the reference models the environment correctly) and pi_ref(a2 | h).

**Theory** (the KL over the policy's decisions only). J = E[r] - beta E[KL(pi(.|x) || pi_ref(.|x)) +
KL(pi(.|h) || pi_ref(.|h))], h = (x, a1, s), with the transition P left as it is. Backwards (soft Bellman):

    V2(h)      = beta log sum_a2 pi_ref(a2 | h) exp(r(h, a2) / beta),      pi*(a2 | h) = pi_ref(a2|h) exp(r/beta) / Z(h)
    Q1(x, a1)  = sum_s P(s | x, a1) V2(x, a1, s)                          (an EXPECTATION over the environment)
    pi*(a1 | x) = pi_ref(a1 | x) exp(Q1(x, a1) / beta) / Z(x)

(:func:`turn_optimum`). **The wrong variant** puts the environment's token in the loss and in the KL as if the policy
had chosen it (``completion_mask = [True, True, True]``), while s is still drawn from P. With the KL in the reward and
a baseline, the joint fixed point (derived in ``tests/lab/test_turns.py``) tilts q toward the good states,
q(s | x, a1) proportional to P(s | x, a1) exp(V2 / beta), and pays for it with beta log q/P, so the first action sees
the SOFT maximum over states instead of their expectation:

    Q1_wrong(x, a1) = beta log sum_s P(s | x, a1) exp(V2(x, a1, s) / beta)  >=  Q1(x, a1)   (Jensen)

-- the optimism of treating the environment's randomness as the policy's choice (Levine 2018, "Reinforcement Learning
and Control as Probabilistic Inference", section 2.4). :func:`wrong_turn_fixed_point` gives pi_wrong(a1 | x); the
conformance rows measure both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from prefzoo.types import PromptBatch, SamplingParams, SequenceBatch

__all__ = ["TwoTurnBed", "TwoTurnPolicy", "TwoTurnScorer", "turn_bed", "turn_optimum", "wrong_turn_fixed_point"]


@dataclass
class TwoTurnBed:
    """Shapes: ``ref1`` (P, K1) logits of pi_ref(a1|x); ``transition`` (P, K1, S) probabilities P(s|x,a1); ``ref2``
    (P, K1, S, K2) logits of pi_ref(a2|h); ``rewards`` (P, K1, S, K2)."""

    ref1: Tensor
    transition: Tensor
    ref2: Tensor
    rewards: Tensor

    def tile(self, n: int) -> "TwoTurnBed":
        """n stacked copies of the prompts (independent replicas, as :meth:`TabularBandit.tile`)."""
        return TwoTurnBed(*(t.repeat(n, *([1] * (t.dim() - 1))) for t in (self.ref1, self.transition, self.ref2,
                                                                          self.rewards)))


def turn_bed() -> TwoTurnBed:
    """The conformance bed: 3 prompts, K1 = 3 first actions, S = 2 environment states, K2 = 3 second actions.

    Action 0 of prompt 0 is a gamble (state 1, worth much, comes 30% of the time), action 1 a sure thing; prompt 1
    has a rare good state; prompt 2 deterministic transitions (there the right and wrong variants must agree)."""
    g = torch.Generator().manual_seed(7)
    ref1 = torch.tensor([[0.0, 0.3, -0.2], [0.5, 0.0, 0.0], [0.0, -0.4, 0.4]])
    transition = torch.tensor([[[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]],
                               [[0.95, 0.05], [0.6, 0.4], [0.3, 0.7]],
                               [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    ref2 = torch.randn(3, 3, 2, 3, generator=g) * 0.5
    rewards = torch.rand(3, 3, 2, 3, generator=g) * 0.4
    rewards[0, 0, 1] += 1.0  # the gamble's good state
    rewards[1, 0, 1] += 1.2  # the rare good state
    return TwoTurnBed(ref1, transition, ref2, rewards)


def _log(t: Tensor) -> Tensor:
    return torch.log(t.clamp_min(1e-30)).masked_fill(t == 0, float("-inf"))


def second_values(bed: TwoTurnBed, beta: float) -> Tensor:
    """V2(h) = beta log sum_a2 pi_ref(a2|h) exp(r/beta), Shape (P, K1, S)."""
    return beta * torch.logsumexp(torch.log_softmax(bed.ref2.double(), -1) + bed.rewards.double() / beta, -1)


def turn_optimum(bed: TwoTurnBed, beta: float) -> tuple[Tensor, Tensor]:
    """(pi*(a1|x) Shape (P, K1), pi*(a2|h) Shape (P, K1, S, K2)) of the KL over the policy's decisions (module
    docstring), float64."""
    lp2 = torch.log_softmax(bed.ref2.double(), -1) + bed.rewards.double() / beta
    pi2 = torch.softmax(lp2, -1)
    q1 = (bed.transition.double() * second_values(bed, beta)).sum(-1)
    pi1 = torch.softmax(torch.log_softmax(bed.ref1.double(), -1) + q1 / beta, -1)
    return pi1, pi2


def wrong_turn_fixed_point(bed: TwoTurnBed, beta: float) -> Tensor:
    """pi_wrong(a1|x), Shape (P, K1): the first action's fixed point when the environment's token is in the loss and
    the KL (Q1_wrong = beta log E_P exp(V2/beta)); float64."""
    q1 = beta * torch.logsumexp(_log(bed.transition.double()) + second_values(bed, beta) / beta, -1)
    return torch.softmax(torch.log_softmax(bed.ref1.double(), -1) + q1 / beta, -1)


class TwoTurnPolicy(nn.Module):
    """pi(a1|x), q(s|x,a1), pi(a2|h) as trainable logit tables, started at the reference (module docstring);
    ``count_environment``: mark the environment's token as the policy's (the wrong variant)."""

    def __init__(self, bed: TwoTurnBed, seed: int = 0, count_environment: bool = False):
        super().__init__()
        self.bed = bed
        self.t1 = nn.Parameter(bed.ref1.clone().float())
        self.ts = nn.Parameter(_log(bed.transition).clamp_min(-30.0).float())
        self.t2 = nn.Parameter(bed.ref2.clone().float())
        self.ref = (bed.ref1.float(), _log(bed.transition).clamp_min(-30.0).float(), bed.ref2.float())
        self.reference = self.ref
        self.generator = torch.Generator().manual_seed(seed)
        self.count_environment = count_environment

    tractable_logps, analytic_kl, value_model = True, None, None

    def _tables(self, tables, batch: SequenceBatch, temperature: float):
        x = batch.prompt_ids[:, -1].long()
        a1, s, a2 = batch.completion_ids[:, 0].long(), batch.completion_ids[:, 1].long(), batch.completion_ids[:, 2].long()
        l1 = torch.log_softmax(tables[0][x] / temperature, -1)
        ls = torch.log_softmax(tables[1][x, a1] / temperature, -1)
        l2 = torch.log_softmax(tables[2][x, a1, s] / temperature, -1)
        return torch.stack([l1.gather(1, a1[:, None])[:, 0], ls.gather(1, s[:, None])[:, 0],
                            l2.gather(1, a2[:, None])[:, 0]], 1), (l1, ls, l2)

    def logps(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False):
        """Per position [log pi(a1|x), log q(s|x,a1), log pi(a2|h)], Shape (B, 3); 0 where no token is."""
        logps, dists = self._tables((self.t1, self.ts, self.t2), batch, temperature)
        ent = None
        if with_entropy:
            ent = torch.stack([-(d.exp() * d).nan_to_num().sum(-1) for d in dists], 1).detach()
        return logps, ent

    def ref_logps(self, batch: SequenceBatch, temperature: float = 1.0) -> Tensor:
        return self._tables(self.ref, batch, temperature)[0].detach()

    @torch.no_grad()
    def sample(self, prompts: PromptBatch, num_samples: int, params: SamplingParams) -> SequenceBatch:
        """a1 ~ pi, s ~ P (the ENVIRONMENT's transition, never the model q), a2 ~ pi; rows grouped by prompt."""
        x = prompts.prompt_ids[:, -1].long().repeat_interleave(num_samples)
        g = self.generator
        a1 = torch.multinomial(torch.softmax(self.t1[x], -1), 1, generator=g)[:, 0]
        s = torch.multinomial(self.bed.transition[x, a1].float(), 1, generator=g)[:, 0]
        a2 = torch.multinomial(torch.softmax(self.t2[x, a1, s], -1), 1, generator=g)[:, 0]
        b = len(x)
        policy = torch.tensor([True, self.count_environment, True]).expand(b, 3).clone()
        return SequenceBatch(x[:, None], torch.ones(b, 1, dtype=torch.bool), torch.stack([a1, s, a2], 1), policy,
                             prompt_index=torch.arange(prompts.prompt_ids.shape[0]).repeat_interleave(num_samples),
                             truncated=torch.zeros(b, dtype=torch.bool), token_mask=torch.ones(b, 3, dtype=torch.bool))

    def first_policy(self) -> Tensor:
        return torch.softmax(self.t1.detach().double(), -1)

    def second_policy(self) -> Tensor:
        return torch.softmax(self.t2.detach().double(), -1)


class TwoTurnScorer:
    """``score(samples, prompts) -> r(x, a1, s, a2)`` read from the bed's table."""

    def __init__(self, rewards: Tensor):
        self.rewards = rewards.float()
        self.last_metrics: dict[str, float] = {}

    def __call__(self, samples: SequenceBatch, prompts=None) -> Tensor:
        x = samples.prompt_ids[:, -1].long()
        c = samples.completion_ids.long()
        return self.rewards[x, c[:, 0], c[:, 1], c[:, 2]]


# ------------------------------------------------------------------------------------- the conformance rows
@dataclass
class TurnCase:
    """One multi-turn row: a plugin, its settings, and whether the environment's token is counted (the wrong
    variant: its target is :func:`wrong_turn_fixed_point` instead of pi*)."""

    label: str
    algo: str
    config: dict
    objective: dict
    wrong: bool = False


def turn_cases(group: int = 8) -> list[TurnCase]:
    k1 = {"kl_estimator": "k1", "kl_placement": "in_reward"}
    return [TurnCase("RLOO, k1 in reward", "rloo", {"num_samples": group}, k1),
            TurnCase("GRPO (scale none), k1 in reward", "grpo", {"num_samples": group, "scale_rewards": "none"}, k1),
            TurnCase("REINFORCE++, k1 per token", "reinforce_pp", {"num_samples": group}, k1),
            TurnCase("GSPO (scale none), k1 in reward", "gspo", {"num_samples": group, "num_minibatches": 1, "scale_rewards": "none"}, k1),
            TurnCase("CISPO (scale none), k1 in reward", "cispo", {"num_samples": group, "num_minibatches": 1, "scale_rewards": "none"}, k1),
            TurnCase("WRONG: RLOO with the environment's token in loss and KL", "rloo", {"num_samples": group}, k1, True),
            TurnCase("WRONG: GRPO with the environment's token in loss and KL", "grpo",
                     {"num_samples": group, "scale_rewards": "none"}, k1, True)]


@dataclass
class TurnResult:
    case: TurnCase
    tv_first: tuple[float, float]  # TV(pi(a1|x), pi*) per seed: mean, standard error
    tv_first_target: float  # TV(seed-mean pi(a1|x), the case's target)
    tv_first_star: float  # TV(seed-mean pi(a1|x), pi*)
    tol: float
    tv_second: float  # visitation-weighted TV(seed-mean pi(a2|h), pi*(a2|h)) under pi* and P
    seconds: float

    @property
    def verdict(self) -> str:
        if self.tv_first_target > self.tol:
            return "MISSES its target"
        return "matches pi*" if not self.case.wrong else f"matches its (wrong) target; off pi* by {self.tv_first_star:.3f}"


def run_turn_case(case: TurnCase, bed: TwoTurnBed, beta: float, seeds: int, seed: int = 0, steps: int = 600,
                  repeats: int = 128) -> TurnResult:
    """Train ``case`` on ``seeds`` stacked replicas of ``bed`` (one vectorised run, as the bandit's conformance runs
    do) and measure the first and second turns against the targets."""
    import math
    import time

    from prefzoo.lab.runner import build_algorithm
    from prefzoo.lab.tabular import PromptSource, TrainSettings, train

    start = time.perf_counter()
    tiled = bed.tile(seeds)
    algo = build_algorithm(case.algo, case.config, case.objective, beta)
    policy = TwoTurnPolicy(tiled, seed=seed, count_environment=case.wrong)
    p = bed.ref1.shape[0]
    train(algo, policy, PromptSource(p * seeds, repeats=repeats), TrainSettings(steps=steps, lr=0.05),
          scorer=TwoTurnScorer(tiled.rewards))
    star1, star2 = turn_optimum(bed, beta)
    target = wrong_turn_fixed_point(bed, beta) if case.wrong else star1
    first = policy.first_policy().view(seeds, p, -1)
    second = policy.second_policy().view(seeds, *star2.shape)
    tv = lambda a, b: 0.5 * (a - b).abs().sum(-1)  # noqa: E731
    per_seed = tv(first, star1).mean(-1)
    mean = first.mean(0)
    spread = tv(first, mean).mean().item()
    visits = star1[..., None] * bed.transition.double()  # P(a1, s | x) under pi* and the environment
    tv2 = (tv(second.mean(0), star2) * visits).sum((-1, -2)).mean().item()
    se = per_seed.std().item() / math.sqrt(seeds) if seeds > 1 else float("nan")
    return TurnResult(case, (per_seed.mean().item(), se), tv(mean, target).mean().item(), tv(mean, star1).mean().item(),
                      3 * spread / math.sqrt(seeds) + 0.002, tv2, time.perf_counter() - start)


def turn_section(results: list[TurnResult], bed: TwoTurnBed, beta: float) -> str:
    """The conformance page's multi-turn section (markdown)."""
    star1, _ = turn_optimum(bed, beta)
    wrong = wrong_turn_fixed_point(bed, beta)
    gap = (0.5 * (star1 - wrong).abs().sum(-1)).mean().item()
    rows = ["| case | target | TV(π(a1), π*) per seed | TV(π̄(a1), target) | tol | TV(π̄(a2), π*) weighted | verdict |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.case.label} | {'π_wrong (soft max over s)' if r.case.wrong else 'π* (expectation over s)'} | "
                    f"{r.tv_first[0]:.4f} ± {r.tv_first[1]:.4f} | {r.tv_first_target:.4f} | {r.tol:.4f} | "
                    f"{r.tv_second:.4f} | {r.verdict} |")
    return f"""## Multi-turn: the KL over the policy's decisions only

A two-turn bed (`prefzoo/lab/turns.py`, β = {beta}): 3 prompts; the policy picks a1 (3 actions), the environment draws
a state s ~ P(s | x, a1) (2 states: its token, which the policy does not choose), the policy picks a2 (3 actions) having
seen it. The trajectory [a1, s, a2] has `completion_mask` [1, 0, 1] and `token_mask` [1, 1, 1], as a multi-turn
rollout's. Theory: π*(a2 | h) ∝ π_ref(a2 | h) exp(r / β) and π*(a1 | x) ∝ π_ref(a1 | x) exp(E_s[V2] / β), V2 = β log
Σ π_ref exp(r / β): the environment's transition is left as it is. The WRONG rows count the environment's token as the
policy's (in the loss and in the KL); their fixed point, derived in `tests/lab/test_turns.py`, tilts the model's belief
about s and gives a1 the soft maximum β log E_s exp(V2 / β) instead of the expectation -- optimism about the
environment's randomness. On this bed the two targets are {gap:.4f} apart in TV (prompt 2 has deterministic transitions:
there they agree). The second turn's TV is weighted by how often π* and P visit each history.

{chr(10).join(rows)}
"""
