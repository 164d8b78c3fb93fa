"""The one runner of the lab's drivers: a registered plugin, unchanged, trained on stacked replicas of a bandit.

Both lab commands run their plugins through it — the conformance table (:mod:`prefzoo.lab.conformance`) and
the toy bandit (:mod:`prefzoo.lab.toy`) — so a plugin is set up, fed and trained the same way in both:

* :func:`build_algorithm` — the plugin from its registry name, config overrides and objective fields;
* :func:`train_replicas` — ``replicas`` stacked copies of the bandit (:meth:`TabularBandit.tile`), one
  vectorised run of the bed's driver (:func:`prefzoo.lab.tabular.train`, the Trainer's own optimisation step):
  online plugins sample from the policy, offline ones train full-batch on Bradley-Terry pairs of pi_ref with
  their reference log-probs computed once (:func:`with_reference_logps`), on those pairs split into shuffled
  unpaired rows for a plugin that declares ``data="unpaired"`` (KTO), or on their chosen sides for one that declares
  ``data="sequences"`` (SFT);
* :func:`sample_best_of_n` — best-of-n, which trains nothing: the empirical distribution of best-of-n draws.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from prefzoo.algos import get_algorithm
from prefzoo.algos.base import Algorithm
from prefzoo.lab.tabular import (BED_SAMPLING, PairSource, PromptSource, TableScorer, TabularBandit, TabularError,
                                 TabularPolicy,
                                 TrainSettings, preference_pairs, prompt_batch, train, unpaired_rows)
from prefzoo.types import ObjectiveSettings, SamplingParams

__all__ = ["build_algorithm", "train_replicas", "with_reference_logps", "sample_best_of_n"]


def build_algorithm(name: str, config: dict, objective: dict, beta: float, sampling=None) -> Algorithm:
    """Instantiate the registered plugin ``name`` with config overrides and an objective (``beta`` unless
    ``objective`` sets it); it samples as the bed does (:data:`~prefzoo.lab.tabular.BED_SAMPLING`), or as ``sampling``
    says."""
    cls = get_algorithm(name)
    return cls(cls.config_class(**config), ObjectiveSettings(**{"beta": beta, **objective}),
               BED_SAMPLING if sampling is None else sampling)


def train_replicas(algo: Algorithm, bandit: TabularBandit, replicas: int, seed: int, steps: int, lr: float, *,
                   samples_per_prompt: int, pairs_per_prompt: int, pairs=None, teacher: Tensor | None = None
                   ) -> TabularPolicy:
    """Train ``algo`` from pi_ref on ``replicas`` stacked copies of ``bandit``; returns the policy.

    The policy starts at pi_ref (with a reference and a value head as the plugin needs, its generator seeded
    with ``seed``) and trains ``steps`` steps of Adam at ``lr`` decaying linearly to 0
    (:class:`~prefzoo.lab.tabular.TrainSettings`). Online plugins get, each step, every prompt of every
    replica repeated so that it receives ``samples_per_prompt`` responses (in groups of the plugin's group
    size); offline plugins train full-batch on ``pairs`` (pairs of ``bandit.tile(replicas)``; default:
    ``pairs_per_prompt`` fresh pairs per prompt from pi_ref, seeded with ``seed + 1``; an unpaired plugin gets them
    as shuffled rows, :func:`~prefzoo.lab.tabular.unpaired_rows`). A plugin that declares a teacher gets ``teacher``
    (a probability table (P, K) of the bandit, tiled), which it then must be given.
    """
    tiled = bandit.tile(replicas)
    d = algo.declaration
    if d.teacher is not None and teacher is None:
        raise TabularError(f"{algo.name} declares a teacher: pass teacher=<a (P, K) probability table>")
    teacher_logits = None if d.teacher is None else torch.log(teacher.double()).repeat(replicas, 1).float()
    policy = TabularPolicy(tiled.ref_logits, with_reference=d.reference, value_head=d.value_head is not None, seed=seed,
                           teacher_logits=teacher_logits)
    settings = TrainSettings(steps=steps, lr=lr)
    if d.online:
        group = max(1, d.num_samples)
        source = PromptSource(tiled.num_prompts, repeats=max(1, samples_per_prompt // group))
        train(algo, policy, source, settings, scorer=TableScorer(tiled.rewards))
    else:
        if pairs is None:
            pairs = preference_pairs(tiled, pairs_per_prompt, torch.Generator().manual_seed(seed + 1))
        if d.data == "unpaired":  # the pairs' rows, shuffled (seed + 2)
            data = unpaired_rows(pairs, torch.Generator().manual_seed(seed + 2))
        elif d.data == "sequences":  # supervised rows: the pairs' prompts and chosen responses (SFT on a preference file)
            data = pairs.chosen
        else:
            data = with_reference_logps(algo, policy, pairs)
        train(algo, policy, PairSource(data), settings)
    return policy


def with_reference_logps(algo: Algorithm, policy: TabularPolicy, pairs):
    """The pairs with their summed reference log-probs filled in once (as the training loop does for a plugin that
    declares the capability ``precomputed_reference``); otherwise the pairs unchanged (the plugin computes them per
    batch: the same numbers on the bed)."""
    if not algo.declaration.has("precomputed_reference") or pairs.ref_chosen_logps is not None:
        return pairs
    chosen, rejected = algo.reference_logps(policy, pairs)
    return dataclasses.replace(pairs, ref_chosen_logps=chosen, ref_rejected_logps=rejected)


def sample_best_of_n(bandit: TabularBandit, n: int, draws: int, seeds: int, seed: int) -> Tensor:
    """Empirical best-of-n distribution, Shape (seeds, P, K): ``draws`` times per prompt and replica, sample n
    responses from pi_ref with :meth:`TabularPolicy.sample`, score them with :class:`TableScorer`, keep the
    first of the highest-scoring."""
    tiled = bandit.tile(seeds)
    ref_policy = TabularPolicy(tiled.ref_logits, seed=seed)
    rows = torch.arange(tiled.num_prompts).repeat_interleave(draws)
    samples = ref_policy.sample(prompt_batch(rows), n, SamplingParams(temperature=1.0, max_new_tokens=1))
    scores = TableScorer(tiled.rewards)(samples).view(-1, n)
    best = samples.completion_ids[:, 0].view(-1, n).gather(1, scores.argmax(1, keepdim=True))[:, 0]
    counts = torch.zeros(tiled.num_prompts, tiled.num_responses, dtype=torch.float64)
    counts.index_put_((rows, best), torch.ones(len(rows), dtype=torch.float64), accumulate=True)
    return (counts / draws).view(seeds, bandit.num_prompts, bandit.num_responses)
