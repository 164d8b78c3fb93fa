"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv:2402.04792).

Each step, for every prompt x: sample two completions y_1, y_2 from the CURRENT policy, let a judge pick the
preferred one, and take one step of the DPO loss on these fresh pairs (Guo et al., Algorithm 1: OAIF):

    margin = beta f'(pi(y_w)/pi_ref(y_w)) - beta f'(pi(y_l)/pi_ref(y_l))      (reverse KL: beta log(pi/pi_ref))
    loss   = ell(margin)                 ell: the DPO family's loss types (prefzoo.objective.pairwise_loss)

The judge (``judge``): ``reward`` -- the run's reward (any reward function, or a trained reward model with
``reward=model``): the higher reward wins, and a TIE (equal rewards, e.g. both answers wrong) carries no
preference: the pair is dropped (weight 0, counted in ``frac_ties``); ``bradley_terry`` -- y_1 wins with
probability sigmoid((r_1 - r_2) / ``bt_scale``), a stochastic annotator (one uniform per prompt, from a stream
seeded by the prompt's rollout seed when the loop gives one, so it does not depend on how prompts are batched;
else from the plugin's own generator, seeded 0). The loss is DPO's, from the same code
(:class:`prefzoo.algos.pairwise.DirectPreference`): every loss type of ``algo=dpo`` and weighted lists of them
(``algo.loss_type``, ``algo.loss_weights``), label smoothing, IPO's averaged log-ratio, DiscoPOP's tau, bco_pair's
running shift, and the divergence (``objective=forward_kl|js|alpha``); a tied pair takes no part in any link
(nor in the batch sort of ``aot`` / ``aot_unpaired``).

Departures and choices: the pairs are a :class:`~prefzoo.types.PreferenceBatch` (so no mini-batch or micro-batch
splits a pair), with the reference's summed log-probs computed once at sampling time; the log-probs of both
sides are recomputed at the rollout temperature, as every online plugin here does (the policy being trained is
the one that samples). The loss is the mean over ALL pairs of the step, a tied pair contributing 0 (as GRPO's
zero-advantage groups do): the gradient is the untied pairs' mean scaled by their share, and a step of ties
changes nothing. Guo et al. use an LLM annotator; any scorer of completions is a judge here.

Where it converges (``docs/conformance.md``): with a Bradley-Terry judge of scale 1 and reverse KL, every pair's
expected gradient vanishes when beta (log pi/pi_ref (y_1) - log pi/pi_ref (y_2)) = r_1 - r_2, i.e. at pi*, whatever
distribution the pairs come from: pi* is the fixed point. The ``reward`` judge's labels are deterministic: the
margins of untied pairs are pushed without bound, towards the best-reward responses (no finite fixed point).

Metrics: ``reward``, ``reward_std`` (of the samples), ``frac_ties`` (pairs dropped), ``kl`` (KL(pi || pi_ref)
per sequence, k1 from the summed log-probs, nats), ``entropy`` (nats per token), and over the untied pairs DPO's
(:mod:`prefzoo.algos.pairwise`: ``rewards/chosen`` / ``rewards/rejected`` (beta log(pi/pi_ref)),
``rewards/margins``, ``rewards/accuracies``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import Declaration, MetricWarning
from prefzoo.algos.online_sampling import sample_and_score
from prefzoo.algos.online_settings import ZERO_SPREAD_STEPS
from prefzoo.algos.pairwise import DirectPreference, PairwiseConfig, check_pairwise_settings
from prefzoo.errors import ConfigError
from prefzoo.objective import sequence_logps
from prefzoo.types import (NO_STEP, ROLLOUT_SEED_COLUMN, ObjectiveSettings, Policy, PreferenceBatch, PromptBatch,
                           Scorer, StepContext)

JUDGES = ("reward", "bradley_terry")


@dataclass
class OnlineDPOConfig(PairwiseConfig):
    name: str = "online_dpo"
    default_temperature: float = 0.7  # as GRPO: answers that differ on the arithmetic task
    default_batch_size: int = 8
    judge: str = "reward"  # reward (higher wins, ties dropped) | bradley_terry (sampled, scale bt_scale)
    bt_scale: float = 1.0


@register
class OnlineDPO(DirectPreference):
    """Online DPO plugin: two samples per prompt, judged by the run's reward, the DPO loss on the fresh pairs."""

    config_class = OnlineDPOConfig

    def __init__(self, cfg: OnlineDPOConfig, objective: ObjectiveSettings, sampling=None):
        super().__init__(cfg, objective, sampling)
        self.generator = torch.Generator().manual_seed(0)  # the judge's draws when prompts carry no rollout seed

    @staticmethod
    def validate_settings(cfg: OnlineDPOConfig, objective: ObjectiveSettings) -> None:
        check_pairwise_settings(cfg, objective, "Online DPO")
        if cfg.judge not in JUDGES:
            raise ConfigError(f"algo.judge={cfg.judge!r}; choose one of {', '.join(JUDGES)}.")
        if not cfg.bt_scale > 0:
            raise ConfigError(f"algo.bt_scale={cfg.bt_scale} must be > 0 (reward units per logit of preference).")

    def declare(self) -> Declaration:
        ties = MetricWarning(  # judged by the reward, a tie is a pair of weight 0
            "frac_ties", 1.0, ZERO_SPREAD_STEPS,
            "both completions of every prompt got the same reward, so every pair is a tie of weight 0 and the policy "
            "learns nothing. The reward is likely too hard or too easy for this model, or the samples too alike: "
            f"raise rollout.temperature={self.sampling.temperature:g}, use a reward that gives partial credit, or "
            "algo.judge=bradley_terry.")
        return Declaration(reference=True, online=True, reward=True, aggregation="example_mean", num_samples=2,
                           capabilities=frozenset({"implicit_rewards", "f_divergence"}),
                           progress_keys=("reward", "rewards/accuracies", "frac_ties"),
                           warnings=(ties,) if self.cfg.judge == "reward" else ())

    @torch.no_grad()
    def make_experience(self, policy: Policy, prompts: PromptBatch, score: Scorer,
                        step: StepContext = NO_STEP) -> tuple[PreferenceBatch, dict]:
        r = sample_and_score(policy, prompts, score, 2, self.sampling, need_logps=False)
        first, second = r.rewards[0::2], r.rewards[1::2]
        if self.cfg.judge == "reward":
            first_wins, tie = first > second, first == second
        else:
            p_first = torch.sigmoid((first - second) / self.cfg.bt_scale)
            first_wins = self.judge_uniforms(prompts).to(p_first.device) < p_first
            tie = torch.zeros_like(first_wins)
        pairs = torch.arange(len(first), device=first.device)
        chosen_rows = torch.where(first_wins, 2 * pairs, 2 * pairs + 1)
        rejected_rows = torch.where(first_wins, 2 * pairs + 1, 2 * pairs)
        ref_seq = sequence_logps(r.ref_logps, r.samples.completion_mask)
        batch = PreferenceBatch(r.samples.select(chosen_rows), r.samples.select(rejected_rows), pairs,
                                ref_seq[chosen_rows], ref_seq[rejected_rows], (~tie).float())
        return batch, dict(r.metrics, frac_ties=tie.float().mean().item())

    def judge_uniforms(self, prompts: PromptBatch) -> Tensor:
        """One U(0, 1) draw per prompt, Shape (P,) float32: from each prompt's rollout seed (mixed by one LCG step,
        so the stream differs from the sampler's) when the loop provides them, else from ``self.generator``."""
        seeds = prompts.columns.get(ROLLOUT_SEED_COLUMN)
        if seeds is None:
            return torch.rand(len(prompts.prompt_ids), generator=self.generator)
        mix = lambda s: (int(s) * 6364136223846793005 + 1442695040888963407) % 2 ** 63  # noqa: E731
        return torch.stack([torch.rand(1, generator=torch.Generator().manual_seed(mix(s)))[0] for s in seeds])
