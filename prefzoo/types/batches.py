"""Batches: what data builds, engines return and plugins train on (the shapes and the notation are the package's,
:mod:`prefzoo.types`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from prefzoo.objective import last_token_index

__all__ = ["Batch", "SequenceBatch", "Experience", "Reply", "EpisodeLog", "episode_metrics", "PromptBatch",
           "PreferenceBatch", "UnpairedBatch", "ROLLOUT_SEED_COLUMN", "PROMPT_MESSAGES", "sequence_rewards", "pad_cat",
           "position_ids_from_mask"]


def position_ids_from_mask(mask: Tensor) -> Tensor:
    """The positions of a left-padded batch's tokens, counting only real tokens so that left padding does not shift
    them (what a causal LM's ``position_ids`` must be for its rotary or learned positions). ``mask``: Shape (B, L), bool
    or 0/1; returns Shape (B, L) long, 0 on the padding."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def pad_cat(tensors: list[Tensor], side: str, value) -> Tensor:
    """Concatenate (B_i, L_i) tensors along dim 0, padding dim 1 on ``side`` (``left`` | ``right``) with ``value`` to
    the longest L. Shape: [(B_i, L_i)] -> (sum B_i, max L_i), the inputs' dtype."""
    width = max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        pad = width - t.shape[1]
        if pad:
            filler = torch.full((t.shape[0], pad), value, dtype=t.dtype, device=t.device)
            t = torch.cat([filler, t] if side == "left" else [t, filler], dim=1)
        out.append(t)
    return torch.cat(out, dim=0)


@dataclass
class Batch:
    """Rows of tensors (first dim = batch) and per-row lists, selectable and concatenable by row.

    Subclasses add fields; every Tensor field has the batch as its first dimension, every list field has one
    entry per row, every other field is carried over unchanged.
    """

    def __len__(self) -> int:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (Tensor, list)):
                return len(v)
        return 0

    def select(self, index) -> "Batch":
        """The rows ``index`` (a slice, a list or a LongTensor of row numbers)."""
        if isinstance(index, Tensor):
            index = index.tolist()
        changes = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                changes[f.name] = v[index] if not isinstance(index, list) else v[torch.as_tensor(index, dtype=torch.long, device=v.device)]
            elif isinstance(v, list):
                changes[f.name] = v[index] if isinstance(index, slice) else [v[i] for i in index]
            elif isinstance(v, dict):
                changes[f.name] = {k: (x[index] if isinstance(index, slice) else [x[i] for i in index]) if isinstance(x, list)
                                   else (x[index] if isinstance(x, Tensor) else x) for k, x in v.items()}
        return dataclasses.replace(self, **changes)

    def to(self, device) -> "Batch":
        changes = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, **changes)

    def chunks(self, size: int) -> list["Batch"]:
        """Consecutive row slices of at most ``size`` rows."""
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]


@dataclass
class SequenceBatch(Batch):
    """Prompt + completion token ids. B = rows, P = prompt length, T = completion length.

    Attributes:
        prompt_ids: Shape (B, P), left-padded.
        prompt_mask: Shape (B, P) bool, True on real prompt tokens.
        completion_ids: Shape (B, T), right-padded.
        completion_mask: Shape (B, T) bool, True on completion tokens that count (EOS included).
        prompt_index: Shape (B,) long, which prompt of the source batch each row answers (rollouts), or None.
        truncated: Shape (B,) bool, completion hit the length limit without EOS, or None.
        sample_logps: Shape (B, T) float32, the log-prob each completion token had in the rollout engine that
            sampled it (0 on padding), when the engine is not the trainer's own model (``rollout.engine=vllm``);
            else None. Compared with the trainer's recomputation (:func:`prefzoo.objective.sampler_mismatch`).
        token_mask: Shape (B, T) bool, True on every completion position that holds a token, the policy's OR an
            environment's (a multi-turn trajectory: tool results and feedback between the policy's turns), or None
            when every token is the policy's (then it equals ``completion_mask``). ``completion_mask`` marks the
            policy's own tokens only: they alone have a loss, a KL term, an entropy term or a place in a per-token
            count; the environment's tokens are part of the state every forward pass attends to
            (:attr:`completion_tokens`).
        episodes: per row, what a multi-turn rollout recorded besides the ids (:class:`EpisodeLog`: the conversation,
            the environment's reward, turn and tool-call counts), or None for single-turn rows.
        sample_entropy: Shape (B, T) float32, the entropy (nats) of the distribution each completion token was drawn
            from (after the temperature and the top-k / top-p support; 0 on padding), when the sampling asked for it
            (``SamplingParams.report_entropy``) and the engine's sampler is the policy; else None.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    prompt_index: Tensor | None = None
    truncated: Tensor | None = None
    sample_logps: Tensor | None = None
    token_mask: Tensor | None = None
    episodes: list | None = None
    sample_entropy: Tensor | None = None

    @property
    def completion_tokens(self) -> Tensor:
        """Shape (B, T) bool: the completion positions that hold a token (the policy's or an environment's), i.e. what
        a forward pass attends to; ``completion_mask`` when there are no environment tokens."""
        return self.completion_mask if self.token_mask is None else self.token_mask

    def attention_mask(self) -> Tensor:
        """Shape (B, P + T) bool: the prompt's and the completion's tokens, every forward pass's attention mask."""
        return torch.cat([self.prompt_mask, self.completion_tokens], dim=1)

    def turn_rewards(self) -> Tensor | None:
        """Shape (B, T) float32: the environment's step rewards, each on the last token of the policy turn it rewarded
        (``env.reward_placement=turn``: :attr:`EpisodeLog.turn_rewards`), 0 elsewhere; None when no row places its
        rewards per turn (single-turn rows, the default placement). Units: reward units."""
        if self.episodes is None or all(e is None or e.turn_rewards is None for e in self.episodes):
            return None
        out = torch.zeros(self.completion_mask.shape, dtype=torch.float32, device=self.completion_mask.device)
        for row, episode in enumerate(self.episodes):
            for position, reward in (episode.turn_rewards or []) if episode is not None else []:
                out[row, position] += reward
        return out

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def num_tokens(self) -> int:
        """Tokens the policy reads per pass (prompt and completion tokens, an environment's included)."""
        return int(self.prompt_mask.sum() + self.completion_tokens.sum())

    def with_terminal_column(self, fill_id: int = 0) -> "SequenceBatch":
        """The batch with one more completion column, counted in each row right after its last token.

        Column L_b of row b (L_b = its number of completion tokens) becomes a counted filler token, so that
        ``values[b, L_b]`` -- the value of the state before that column -- is the value of the state after the
        whole completion. The filler never influences it (causal attention: a position sees only earlier ones).

        Shape: (B, P) prompts and (B, T) right-padded completions -> (B, T + 1) completions.
        """
        b, t = self.completion_ids.shape
        lengths = self.completion_tokens.sum(-1)  # right-padded: the last token of every kind is at lengths - 1
        filler = torch.full((b, 1), fill_id, dtype=self.completion_ids.dtype, device=self.completion_ids.device)
        ids = torch.cat([self.completion_ids, filler], dim=1)
        mask = torch.arange(t + 1, device=lengths.device)[None, :] <= lengths[:, None]
        if self.token_mask is None:
            return SequenceBatch(self.prompt_ids, self.prompt_mask, ids, mask)
        terminal = torch.zeros_like(mask).scatter(1, lengths[:, None], True)
        policy = torch.cat([self.completion_mask, torch.zeros_like(mask[:, :1])], dim=1) | terminal
        return SequenceBatch(self.prompt_ids, self.prompt_mask, ids, policy, token_mask=mask)

    @staticmethod
    def cat(batches: list["SequenceBatch"], pad_id: int = 0) -> "SequenceBatch":
        """Stack batches row-wise (prompts re-left-padded, completions re-right-padded to common lengths)."""
        opt = lambda name: (torch.cat([getattr(b, name) for b in batches])  # noqa: E731
                            if all(getattr(b, name) is not None for b in batches) else None)
        return SequenceBatch(
            prompt_ids=pad_cat([b.prompt_ids for b in batches], "left", pad_id),
            prompt_mask=pad_cat([b.prompt_mask for b in batches], "left", False),
            completion_ids=pad_cat([b.completion_ids for b in batches], "right", pad_id),
            completion_mask=pad_cat([b.completion_mask for b in batches], "right", False),
            prompt_index=opt("prompt_index"), truncated=opt("truncated"),
            sample_logps=(pad_cat([b.sample_logps for b in batches], "right", 0.0)
                          if all(b.sample_logps is not None for b in batches) else None),
            token_mask=(None if all(b.token_mask is None for b in batches) else
                        pad_cat([b.completion_tokens for b in batches], "right", False)),
            episodes=(None if all(b.episodes is None for b in batches) else
                      [e for b in batches for e in (b.episodes or [None] * len(b))]),
        )


@dataclass
class Experience(SequenceBatch):
    """A scored online rollout with what an online plugin's loss needs. B = prompts x G rows, T = completion.

    One type for every online algorithm (GRPO, PPO, ...): a plugin fills the fields it uses and leaves the
    others None.

    Attributes:
        rewards: Shape (B,) float32, the reward of each completion (before any KL shaping), or None.
        advantages: Shape (B, T) float32, per-token advantages, 0 on padding (a sequence-level advantage,
            GRPO's, is repeated over the row's tokens).
        loss_mask: Shape (B, T) bool, the tokens that enter the loss (the completion mask, minus rows a
            plugin excludes, e.g. truncated ones).
        old_logps: Shape (B, T) float32, log pi_old at sampling time (None: the loss uses logps.detach(),
            ratio exactly 1).
        ref_logps: Shape (B, T) float32, log pi_ref, or None without a reference.
        old_values: Shape (B, T) float32, V_old of the state before each token (PPO), or None.
        returns: Shape (B, T) float32, value targets (PPO), or None.
        sample_weights: Shape (B, T) float32, the sampler correction's importance weights when they also weight the
            KL-as-loss term (``rollout.correction.weight_kl``; the advantages carry them already), or None.
        is_weights: Shape (B, T) float32, the sampler correction's importance weights for a loss that weighs them
            itself (VESPO folds them into its sequence weight; the advantages then do NOT carry them), or None.
    """

    rewards: Tensor | None = None
    advantages: Tensor | None = None
    loss_mask: Tensor | None = None
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    old_values: Tensor | None = None
    returns: Tensor | None = None
    sample_weights: Tensor | None = None
    is_weights: Tensor | None = None

    @classmethod
    def from_samples(cls, samples: SequenceBatch, **fields) -> "Experience":
        """An experience over the rows of ``samples`` (their ids, masks, prompt index and truncation flags)."""
        base = {f.name: getattr(samples, f.name) for f in dataclasses.fields(SequenceBatch)}
        return cls(**base, **fields)

    def num_tokens(self) -> int:
        """Tokens the policy reads per pass over the rollout (prompt and completion tokens)."""
        return int(self.prompt_mask.sum() + self.completion_mask.sum())


@dataclass
class Reply:
    """An environment's answer to one policy turn (multi-turn rollouts, :mod:`prefzoo.environments`).

    Attributes:
        messages: chat messages appended to the conversation (``role`` "tool" for tool results, "user" for feedback);
            their text is tokenised with the chat template and enters the trajectory as environment tokens.
        done: the episode ends here (no more policy turns).
        tool_calls: calls the turn made; tool_errors: those that failed (unknown tool, malformed arguments, a tool
            that raised, timed out or returned a non-string).
        reward: the step's reward (a text environment's ``step()``; reward units), or None when the environment
            rewards the episode only at its end (TRL's ``get_reward()``).
    """

    messages: list[dict] = field(default_factory=list)
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None


@dataclass
class EpisodeLog:
    """What a multi-turn rollout recorded for one trajectory besides its token ids.

    Attributes:
        messages: the conversation after the prompt: the policy's turns (assistant messages, parsed: ``content``,
            ``tool_calls``) and the environment's messages, as TRL hands a conversational completion to a reward.
        answer: the last policy turn's text (what a positional reward function scores).
        env_reward: the environment's own reward (``get_reward()``, or the sum of a text environment's step
            rewards), or None.
        turns: policy turns; tool_calls / tool_errors: over the episode.
        cut: the episode was ended by the budget (``env.max_turns``, ``env.max_tokens``, a turn without EOS), not by
            itself.
        environment: the user's instance (TRL's reward functions receive them as ``environments=``), or None.
        turn_rewards: with ``env.reward_placement=turn``, ``(position, reward)`` of each step reward: the completion
            position of the last token of the policy turn the environment rewarded, and the step's reward (part of
            ``env_reward``, which stays the episode's total); None with the default placement (per trajectory).
    """

    messages: list[dict]
    answer: str
    env_reward: float | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    cut: bool = False
    environment: object = None
    turn_rewards: list | None = None


def episode_metrics(episodes: list[EpisodeLog]) -> dict[str, float]:
    """The means over a batch's multi-turn episodes: ``turns`` (policy turns), ``tool_calls``, ``tool_errors``
    (failed calls: unknown tool, malformed arguments, a tool that raised, timed out or returned a non-string) per
    episode, and ``frac_cut`` (share of episodes the budget ended); {} without episodes."""
    if not episodes:
        return {}
    n = len(episodes)
    return {"turns": sum(e.turns for e in episodes) / n, "tool_calls": sum(e.tool_calls for e in episodes) / n,
            "tool_errors": sum(e.tool_errors for e in episodes) / n, "frac_cut": sum(e.cut for e in episodes) / n}


#: Optional :attr:`PromptBatch.columns` entry: one int seed per prompt. A policy that finds it draws each
#: prompt's samples from a random stream seeded by it alone (not by the batch's other prompts), so a
#: rollout does not depend on how prompts are split into batches or data-parallel processes. It is not a
#: dataset column: scorers do not pass it on to reward functions.
ROLLOUT_SEED_COLUMN = "rollout_seed"

#: Reserved :attr:`PromptBatch.columns` entry: the prompts as chat messages, set by the data when its prompts are
#: conversational; the scorer hands it to TRL-style reward functions as their ``prompts`` (:mod:`prefzoo.rewards`).
PROMPT_MESSAGES = "prompt_messages"


@dataclass
class PromptBatch(Batch):
    """Prompts to sample from. B = prompts, P = prompt length.

    Attributes:
        prompt_ids: Shape (B, P), left-padded.
        prompt_mask: Shape (B, P) bool.
        columns: the dataset's other columns (e.g. ``answer``), each a list of B values, for reward functions;
            plus, from the training loop, :data:`ROLLOUT_SEED_COLUMN`.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    columns: dict[str, list] = field(default_factory=dict)


def sequence_rewards(values_fn: Callable[[SequenceBatch], Tensor], batch: SequenceBatch) -> Tensor:
    """r(x, y) from a scalar head: its value at the state after the LAST completion token.

    ``values_fn(batch)`` (``policy.values`` or a value model) gives V of the state before each completion token,
    Shape (B, T); read on :meth:`SequenceBatch.with_terminal_column` at the terminal column
    (:func:`prefzoo.objective.last_token_index` of the extended mask) it is the value after the whole reply.

    Shape: batch (B rows, right-padded completions) -> (B,) float32, with the gradient of ``values_fn``.
    Source: Ouyang et al. 2022, sec. 3.5 (the reward model's scalar read at the final token).
    """
    extended = batch.with_terminal_column()
    values = values_fn(extended)
    last = last_token_index(extended.completion_mask)
    return values.gather(1, last[:, None].long())[:, 0]


@dataclass
class PreferenceBatch(Batch):
    """B preference pairs. ``chosen`` and ``rejected`` share the prompt rows.

    Attributes:
        chosen / rejected: the two completions of each pair as :class:`SequenceBatch` es of B rows.
        index: Shape (B,) long, the pairs' row numbers in the dataset (for cached reference log-probs).
        ref_chosen_logps / ref_rejected_logps: Shape (B,) float32 summed reference log-probs if precomputed.
        weights: Shape (B,) float32 per-pair loss weights, or None (every pair weighs 1). Online plugins that build
            pairs from their own samples set it (Online DPO: 0 on a tied pair, which stays in the batch so that a
            step of ties is still a batch).
    """

    chosen: SequenceBatch
    rejected: SequenceBatch
    index: Tensor
    ref_chosen_logps: Tensor | None = None
    ref_rejected_logps: Tensor | None = None
    weights: Tensor | None = None

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def num_tokens(self) -> int:
        """Tokens the policy reads per pass: the prompt twice, chosen and rejected."""
        return int(2 * self.chosen.prompt_mask.sum() + self.chosen.completion_mask.sum()
                   + self.rejected.completion_mask.sum())

    def stacked(self, pad_id: int = 0) -> SequenceBatch:
        """Chosen rows then rejected rows as one :class:`SequenceBatch` of 2B rows (one forward pass for both)."""
        return SequenceBatch.cat([self.chosen, self.rejected], pad_id)

    def select(self, index) -> "PreferenceBatch":
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        if isinstance(index, list):
            index = torch.as_tensor(index, dtype=torch.long)
        return PreferenceBatch(self.chosen.select(index), self.rejected.select(index), self.index[index],
                               pick(self.ref_chosen_logps), pick(self.ref_rejected_logps), pick(self.weights))

    def to(self, device) -> "PreferenceBatch":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PreferenceBatch(self.chosen.to(device), self.rejected.to(device), self.index.to(device),
                               mv(self.ref_chosen_logps), mv(self.ref_rejected_logps), mv(self.weights))


@dataclass
class UnpairedBatch(SequenceBatch):
    """B unpaired rows: a prompt, a completion and a binary label each (KTO's data). B = rows, P = prompt length,
    T = completion length (the :class:`SequenceBatch` fields).

    Attributes:
        labels: Shape (B,) bool, True where the completion is desirable, False where it is undesirable.
        index: Shape (B,) long, the rows' numbers in the data set.
    """

    labels: Tensor | None = None
    index: Tensor | None = None
