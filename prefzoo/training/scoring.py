"""Turn sampled token ids into text and score them with the reward functions (the online algorithms' scorer)."""

from __future__ import annotations

import torch
from torch import Tensor

from prefzoo.errors import ConfigError
from prefzoo.objective import decoupled_group_rewards, overlong_penalty
from prefzoo.rewards.registry import CombinedReward
from prefzoo.rewards.protocol import COMPLETION_IDS, COMPLETION_MESSAGES, ENVIRONMENTS, completion_id_lists
from prefzoo.types import ROLLOUT_SEED_COLUMN, PromptBatch, SequenceBatch


def component_metrics(components: dict, missing_seen: set | None = None) -> dict[str, float]:
    """``reward/<name>``: the mean of each function's scores, the missing ones (None) left out (no key when all
    are missing); ``reward/<name>/missing``: the share of samples it returned None for, from the first step where
    it did on (``missing_seen`` remembers those functions across calls)."""
    out = {}
    for name, scores in components.items():
        given = [s for s in scores if s is not None]
        if given:
            out[f"reward/{name}"] = sum(given) / len(given)
        if missing_seen is not None and len(given) < len(scores):
            missing_seen.add(name)
        if missing_seen is not None and name in missing_seen:
            out[f"reward/{name}/missing"] = (len(scores) - len(given)) / max(1, len(scores))
    return out


class TextScorer:
    """``scorer(samples, prompts) -> rewards`` Shape (B,) float32, as :data:`prefzoo.algos.base.Scorer`.

    Decodes each completion (special tokens dropped), repeats the prompt's columns for its samples (not the
    loop's ``rollout_seed``), and calls the reward function. After each call ``last_metrics`` holds the mean
    of each reward function (``reward/<name>``) and ``last_texts`` the decoded completions; after :meth:`new_step`
    only the first call's metrics are kept until the next :meth:`new_step`.

    ``aggregation="gdpo"`` (``reward.aggregation``): the reward of a completion is GDPO's decoupled sum of the
    functions' scores, each normalised within its prompt's group (:func:`prefzoo.objective.decoupled_group_rewards`,
    eps 1e-4 as TRL's), instead of their weighted sum; the rows must come in groups of equal size (a rollout's).
    ``overlong=(max_length, buffer, factor)`` (``reward.overlong_buffer``): DAPO's soft overlong punishment of each
    completion's policy tokens, added after (:func:`prefzoo.objective.overlong_penalty`); metrics ``reward/overlong``
    (the mean penalty) and ``reward/frac_overlong`` (the share penalised).
    """

    def __init__(self, tokenizer, reward_fn, pad_id: int, aggregation: str = "sum",
                 overlong: tuple[int, int, float] | None = None):
        self.tokenizer, self.reward_fn, self.pad_id = tokenizer, reward_fn, pad_id
        self.aggregation, self.overlong = aggregation, overlong
        self.last_metrics: dict[str, float] = {}
        self.last_texts: list[str] = []
        self._missing_seen: set[str] = set()  # functions that returned None once: their missing share is logged on
        self._in_step, self._first = False, True  # after new_step: only the step's first call sets last_metrics

    def __call__(self, samples: SequenceBatch, prompts: PromptBatch) -> Tensor:
        """Multi-turn episodes (``samples.episodes``): a positional reward function scores each episode's final
        answer (its last policy turn), a TRL-style one gets the whole conversation after the prompt as the completion
        and ``environments=``; an environment's own reward (``get_reward()``, a text environment's summed step
        rewards) adds with weight 1, as TRL adds it (metric ``reward/env``)."""
        episodes = samples.episodes
        if episodes is None:
            ids = samples.completion_ids.masked_fill(~samples.completion_mask, self.pad_id)
            texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        else:
            texts = [e.answer for e in episodes]
        which = samples.prompt_index.tolist()
        cols = {k: [v[i] for i in which] for k, v in prompts.columns.items() if k != ROLLOUT_SEED_COLUMN}
        prompt_texts = cols.pop("prompt_text")
        cols[COMPLETION_IDS] = completion_id_lists(samples)  # TRL's completion_ids= (the reward pops it)
        if episodes is not None:
            cols[COMPLETION_MESSAGES] = [e.messages for e in episodes]
            cols[ENVIRONMENTS] = [e.environment for e in episodes]
        rewards = [float(r) for r in self.reward_fn(prompt_texts, texts, **cols)]
        keep, self._first = not self._in_step or self._first, False
        metrics = component_metrics(getattr(self.reward_fn, "last_components", {}) or {}, self._missing_seen)
        if episodes is not None and any(e.env_reward is not None for e in episodes):
            env = [e.env_reward or 0.0 for e in episodes]
            rewards = [r + v for r, v in zip(rewards, env)]
            metrics["reward/env"] = sum(env) / len(env)
        self.last_texts = texts
        device = samples.completion_ids.device
        out = torch.tensor(rewards, dtype=torch.float32, device=device)
        if self.aggregation == "gdpo":
            out = self.decoupled(samples, episodes).to(device)
        if self.overlong is not None:
            penalty = overlong_penalty(samples.completion_mask.sum(-1), *self.overlong).to(device)
            out = out + penalty
            metrics["reward/overlong"] = penalty.mean().item()
            metrics["reward/frac_overlong"] = (penalty < 0).float().mean().item()
        if keep:
            self.last_metrics = metrics
        return out

    def new_step(self) -> None:
        """The next call's metrics become ``last_metrics`` and the later calls' of the same step do not replace them
        (dynamic sampling scores extra rounds: the step's ``reward/<name>`` stay its first round's, as ``reward``)."""
        self._in_step, self._first = True, True

    def decoupled(self, samples: SequenceBatch, episodes) -> Tensor:
        """GDPO's decoupled sum of the last call's components (an environment's reward one more, weight 1)."""
        if not isinstance(self.reward_fn, CombinedReward):
            raise ConfigError("reward.aggregation=gdpo normalises each reward function's scores; this run's reward is "
                              "not a list of functions (reward.functions); use reward.aggregation=sum.")
        components = dict(self.reward_fn.last_components)
        weights = list(self.reward_fn.weights)
        if episodes is not None and any(e.env_reward is not None for e in episodes):
            components["env"], weights = [e.env_reward for e in episodes], weights + [1.0]
        index = samples.prompt_index
        groups = int(index.max()) + 1 if index is not None and len(index) else 0
        g = len(index) // groups if groups else 0
        if not groups or g < 2 or not torch.equal(index.cpu(), torch.arange(groups).repeat_interleave(g)):
            raise ConfigError("reward.aggregation=gdpo normalises each reward within a prompt's group: the rows must "
                             "come in groups of equal size >= 2 (algo.num_samples >= 2).")
        table = torch.tensor([[float("nan") if v is None else float(v) for v in scores]
                              for scores in components.values()], dtype=torch.float64)
        return decoupled_group_rewards(table, torch.tensor(weights), g)
