"""Best-of-n sampling (Stiennon et al. 2020; Nakano et al. 2021; Gao et al. 2023): ``algo=bon algo.n=N``.

For a prompt x: draw n completions y_1..y_n i.i.d. from the reference pi_ref (temperature 1, no top-p),
score them with the run's reward r (the PROXY when a gold reward is evaluated next to it), answer with

    y* = argmax_i r(x, y_i)         (the first of the best on a tie)

Nothing is trained: the plugin declares ``trains=False``, the loop runs no step whatever
``trainer.max_steps`` says, and the shared :class:`~prefzoo.evaluation.evaluate.Evaluator` measures
:class:`BestOfNPolicy` -- the procedure above as a policy -- exactly as it measures trained policies: its
"greedy" answer to a held-out prompt and each of its samples are best-of-n draws, scored by the same
``task_reward`` / ``task_accuracy`` / ``gold_*`` / ``distinct_n`` metrics.

KL to the reference. pi_bon has no per-token factorisation, so the Monte-Carlo KL estimate the evaluator
uses for trained policies does not apply; BestOfNPolicy carries the analytic value instead,
KL(pi_bon || pi_ref) = log n - (n-1)/n (:func:`prefzoo.objective.best_of_n_kl`), which the evaluator writes
under the same keys (``kl_k1`` and ``kl_k3``, standard error 0, ``kl_method = "analytic"``). It is exact for a
reward without ties (a learned reward model) and an UPPER BOUND otherwise (a 0/1 verifier ties a lot; see
docs/conformance.md). ``entropy`` is not reported for best-of-n (no token-level distribution).

With LoRA the policy the plugin wraps is the base model with a fresh adapter (LoRA's B = 0: exactly the
reference); without LoRA it is the base model itself. Cost: n times the sampling of a trained policy, plus
scoring n completions per answer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration
from prefzoo.errors import ConfigError
from prefzoo.types import (NO_STEP, ObjectiveSettings, Policy, PromptBatch, SamplingParams, Scorer, SequenceBatch,
                           StepContext)
from prefzoo.objective import best_of_n_indices, best_of_n_kl


@dataclass
class BoNConfig(AlgoConfig):
    name: str = "bon"
    default_beta: float = 0.0  # no divergence coefficient: n sets the distance to the reference
    n: int = 4  # candidates per answer; n = 1 is the reference policy itself


class BestOfNPolicy:
    """Best-of-n of a base policy under a scorer, behind the sampling half of the Policy protocol.

    Args:
        base: the policy to draw candidates from (the reference: see the module docstring).
        score: ``score(samples, prompts) -> rewards (B,)``, the reward candidates are ranked by.
        n: candidates per answer (>= 1).

    ``sample(prompts, k, params)`` returns k answers per prompt (rows grouped as a policy's), each the best of
    n candidates sampled at temperature 1 without top-p (``params.temperature``, ``top_p`` and ``greedy`` are
    ignored: best-of-n is defined on the reference's own distribution; ``params.max_new_tokens`` applies).
    ``last_rewards`` holds the kept answers' rewards, Shape (B * k,). There are no per-token log-probs
    (``tractable_logps = False``); ``analytic_kl`` is KL(pi_bon || pi_ref) in nats per sequence.
    """

    tractable_logps = False
    reference = None
    value_model = None

    def __init__(self, base: Policy, score: Scorer, n: int):
        if score is None:
            raise ConfigError("best-of-n needs a scorer (the run's reward) to rank its candidates")
        self.base, self.score, self.n = base, score, int(n)
        self.analytic_kl = best_of_n_kl(self.n)
        self.last_rewards: Tensor | None = None

    # the evaluator reads and swaps the random source; it is the base policy's
    @property
    def generator(self):
        return self.base.generator

    @generator.setter
    def generator(self, value) -> None:
        self.base.generator = value

    def __getattr__(self, name):  # pad_id, tokenizer, device, ... of the base policy
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    @torch.no_grad()
    def sample(self, prompts: PromptBatch, num_samples: int, params: SamplingParams) -> SequenceBatch:
        """``num_samples`` best-of-n answers per prompt; rows [i*k, (i+1)*k) answer prompt i (k = num_samples)."""
        reference_params = dataclasses.replace(params, temperature=1.0, top_p=1.0, greedy=False)
        candidates = self.base.sample(prompts, num_samples * self.n, reference_params)  # n consecutive rows per answer
        rewards = self.score(candidates, prompts)
        keep = best_of_n_indices(rewards.detach().float().cpu(), self.n)
        self.last_rewards = rewards[keep.to(rewards.device)]
        return candidates.select(keep.to(candidates.completion_ids.device))

    def logps(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False):
        raise NotImplementedError("best-of-n has no per-token log-probs (its KL to the reference is analytic: "
                                  "log n - (n-1)/n)")

    def ref_logps(self, batch: SequenceBatch, temperature: float = 1.0):
        raise NotImplementedError("best-of-n has no per-token log-probs")


@register
class BestOfN(Algorithm):
    """``algo=bon``: best-of-n sampling from the reference; no training, evaluated like a trained policy."""

    config_class = BoNConfig

    @staticmethod
    def validate_settings(cfg: BoNConfig, objective: ObjectiveSettings) -> None:
        n = cfg.n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"algo.n={n!r}: best-of-n needs an integer n >= 1 (n = 1 is the reference itself).")

    def declare(self) -> Declaration:
        # no reference: the candidates come from the (untrained) policy itself; it samples and needs the scorer
        return Declaration(reference=False, online=True, reward=True, trains=False, progress_keys=(), uses_beta=False)

    def evaluation_policy(self, policy: Policy, score: Scorer | None) -> BestOfNPolicy:
        return BestOfNPolicy(policy, score, self.cfg.n)

    def loss(self, policy, batch, step: StepContext = NO_STEP):
        raise NotImplementedError("best-of-n has no training steps: the loop evaluates it directly")
