"""The shared vocabulary of prefzoo: batches, the policy and scorer interfaces, sampling settings, the resolved
objective, and what a plugin returns.

Every room of the house speaks these types: the models implement :class:`Policy`, data builds
:class:`SequenceBatch` / :class:`PreferenceBatch` / :class:`PromptBatch`, rollout engines return
:class:`SequenceBatch`, the online plugins return an :class:`Experience`, every plugin's ``loss`` returns a
:class:`LossOutput`. This module imports nothing of prefzoo but :mod:`prefzoo.objective`, so importing it loads
no plugin, model or dataset.

Notation (used in every docstring of prefzoo, DESIGN.md's glossary):

    B   rows of a batch (sequences; for online algorithms B = prompts x G)
    T   completion token positions (the completion axis, right-padded)
    P   prompt token positions (left-padded)
    G   completions sampled per prompt (``num_samples``)
    V   vocabulary size

    logps (B, T)        log pi_theta(y_t | x, y_<t), float32, 0 on padding
    seq_logps (B,)      sum over a row's counted tokens of logps
    ref_logps (B, T)    the same under the reference policy pi_ref (no gradient)
    old_logps (B, T)    the same under the policy that sampled the rollout (no gradient)
    log_ratio           logps - ref_logps (policy vs reference, only)
    is_log_ratio        logps - old_logps (policy vs sampler: the importance-sampling log-ratio); ratio = exp of it
    rewards (B,)        one scalar reward per completion; token_rewards (B, T) per token
    advantages (B, T)   always per token (a sequence-level advantage is repeated over the row's tokens)
    completion_mask     bool, True on the tokens that count (EOS included); never an inverted mask
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

from prefzoo.objective import TokenLogits, last_token_index

__all__ = ["Batch", "SequenceBatch", "Reply", "EpisodeLog", "episode_metrics", "PromptBatch", "PreferenceBatch", "DistillationPolicy", "TokenLogits", "UnpairedBatch", "Experience", "SamplingParams", "LossOutput",
           "Policy", "ValuePolicy", "Scorer", "ObjectiveSettings", "ValueHeadSpec", "ROLLOUT_SEED_COLUMN", "PROMPT_MESSAGES",
           "sequence_rewards", "pad_cat"]


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
    """

    rewards: Tensor | None = None
    advantages: Tensor | None = None
    loss_mask: Tensor | None = None
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    old_values: Tensor | None = None
    returns: Tensor | None = None
    sample_weights: Tensor | None = None

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


@dataclass
class SamplingParams:
    """How completions are sampled. ``temperature`` also divides the logits when log-probs are recomputed."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    max_new_tokens: int = 64
    greedy: bool = False
    #: also return, per sampled token, the log-prob and the entropy (nats) of the distribution it was drawn from
    #: (``SequenceBatch.sample_logps`` / ``sample_entropy``) where the engine's sampler is the policy up to float32
    #: rounding (the hf engine; the held-out evaluation asks, to skip a pass of the policy)
    report_entropy: bool = False
    #: how a rollout whose sampler is not the trainer is corrected (``rollout.correction.*``)
    correction: "CorrectionSettings" = field(default_factory=lambda: CorrectionSettings())


@dataclass
class CorrectionSettings:
    """The off-policy correction of a rollout drawn by a sampler other than the trainer (``rollout.correction.*``;
    :func:`prefzoo.objective.correction_weights`).

    Attributes:
        mode: None (the mismatch is logged, not corrected) or one of ``token_truncate``, ``token_mask``,
            ``sequence_truncate``, ``sequence_mask`` (TRL's names).
        clip_min, clip_max: the band [C_min, C_max] of the weights pi_trainer / pi_sampler (None: unbounded).
        bypass: the sampler's log-probs ARE log pi_old: no recomputation pass, the surrogate's ratio is
            pi_theta / pi_sampler (two policies instead of three); no separate weight.
        match_support: the trainer's log-probs in the weight are renormalised over the top-k / top-p support the
            sampler kept (:func:`prefzoo.objective.support_log_mass`), so a matched sampler gives a weight of 1.
        weight_kl: the weights also multiply the KL-as-loss term (its gradient is then that of the trainer's
            policy, not the sampler's: needed for the fixed point, docs/off-policy.md); false: TRL's convention.
    """

    mode: str | None = None
    clip_min: float | None = None
    clip_max: float | None = 3.0
    bypass: bool = False
    match_support: bool = True
    weight_kl: bool = True


@dataclass
class LossOutput:
    """What a plugin's ``loss`` returns; the training loop reduces it with :func:`prefzoo.objective.aggregate_loss`.

    Attributes:
        values: per-token losses, Shape (B, T), or per-example losses, Shape (B,). Units: nats-scale.
        mask: Shape (B, T) bool for per-token losses; None for per-example ones.
        metrics: per-row means (floats) over this micro-batch's rows; the loop weights them by row count over
            micro-batches and processes.
        token_metrics: per-token quantities as (sum over tokens, token count) pairs; the loop adds both over
            micro-batches and processes and divides once, so the logged value is the token mean of the whole
            batch whatever the micro-batch size or the number of processes.
    """

    values: Tensor
    mask: Tensor | None
    metrics: dict[str, float] = field(default_factory=dict)
    token_metrics: dict[str, tuple[float, float]] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    """What a plugin may ask of a policy (a language model with adapters, or a tabular policy).

    Attributes:
        reference: the reference pi_ref (any object), or None when the run has none.
        tractable_logps: whether per-token log-probs exist (False: best-of-n's procedure).
        analytic_kl: KL(pi || pi_ref) in closed form (nats per sequence), or None.
    """

    reference: object | None
    tractable_logps: bool
    analytic_kl: float | None

    def logps(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
              ) -> tuple[Tensor, Tensor | None]:
        """Per-token log pi_theta of the completion tokens (float32, 0 where masked), Shape (B, T), with grad;
        and the per-token entropy of pi_theta (nats, Shape (B, T), no grad) when ``with_entropy``."""

    def ref_logps(self, batch: SequenceBatch, temperature: float = 1.0) -> Tensor:
        """Per-token log pi_ref of the completion tokens, Shape (B, T), float32, no grad."""

    def sample(self, prompts: PromptBatch, num_samples: int, params: SamplingParams) -> SequenceBatch:
        """``num_samples`` completions per prompt, grouped: rows [i*n, (i+1)*n) answer prompt i."""


@runtime_checkable
class ValuePolicy(Policy, Protocol):
    """A policy with a value head: what plugins that declare ``value_head`` get (PPO, reward models)."""

    def values(self, batch: SequenceBatch) -> Tensor:
        """Per-token values V(s_t) of the state before each completion token, Shape (B, T), float32, with grad."""

    def logps_and_values(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
                         ) -> tuple[Tensor, Tensor | None, Tensor]:
        """``(*logps(batch, temperature, with_entropy), values(batch))``, in one forward where the value head shares
        the policy's trunk (a policy may always just make the two calls)."""

    def save_value_head(self, folder, extra: dict | None = None):
        """Write the value model (adapter, head, how to rebuild it) into ``folder``."""


@runtime_checkable
class DistillationPolicy(Policy, Protocol):
    """A policy with a frozen teacher pi_T beside it: what a plugin that declares a ``teacher`` gets (``algo=distill``).

    The teacher shares the policy's vocabulary (and tokenizer); it may differ in size. Both methods see the batch as
    :meth:`Policy.logps` does (the completion tokens, predicted from the state before each).
    """

    def token_logits(self, batch: SequenceBatch, teacher: bool = False) -> TokenLogits:
        """The next-token logits over the vocabulary at the batch's counted positions (``completion_mask``'s True
        entries, row-major: N of them), at temperature 1 (the caller divides): the policy's, with gradients, or with
        ``teacher`` the teacher's, without. In the linear form (final hidden states (N, d) and the output layer) where
        the model's logits are its output layer applied to them, so that the (N, V) logits are never all held
        (:func:`prefzoo.objective.chunked_generalized_jsd`)."""

    def teacher_logps(self, batch: SequenceBatch, temperature: float = 1.0) -> Tensor:
        """Per-token log pi_T of the completion tokens, Shape (B, T) float32, 0 where masked, no grad."""


Scorer = Callable[[SequenceBatch, PromptBatch], Tensor]
"""``score(samples, prompts) -> rewards`` Shape (B,) float32, one scalar reward per sampled completion."""


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


@dataclass(frozen=True)
class ValueHeadSpec:
    """How a plugin that declares a value head wants it built (:mod:`prefzoo.models.value`).

    Attributes:
        adapter: ``separate`` (its own LoRA adapter beside the policy's: PPO's default) or ``shared`` (the head on
            the policy's own adapter: the reward model).
        init: ``zeros`` (V = 0 at the start: PPO) or ``normal`` (N(0, 1/(hidden+1)): a reward model that ranks at
            chance instead of all ties).
    """

    adapter: str = "separate"
    init: str = "zeros"


@dataclass
class ObjectiveSettings:
    """The resolved objective a plugin optimises: J = E[r] - beta * D(pi || pi_ref)."""

    beta: float
    divergence: str = "reverse_kl"
    alpha: float = 0.5
    kl_estimator: str = "k1"
    kl_placement: str = "in_reward"
    kl_controller: str = "fixed"
    kl_target: float | None = None
    kl_horizon: int = 10000
    kl_bias_correction: bool = False


