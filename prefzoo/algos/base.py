"""The small interfaces an algorithm plugin sees: batches, a policy, a scorer — never a model class or a dataset.

A plugin works with:

* :class:`SequenceBatch` — prompts (left-padded) and completions (right-padded) as token ids with bool
  masks; the same layout for a 135M-parameter transformer and for a tabular policy over a handful of
  responses (:mod:`prefzoo.tabular`).
* :class:`Policy` — computes per-token log-probs of completion tokens (with gradients), the reference
  policy's log-probs (without), values (PPO), and samples completions.
* a scorer ``score(batch) -> rewards (B,)`` handed in by the training loop for online algorithms.

The training loop owns optimisation (micro-batches, accumulation, the optimizer step); a plugin turns a
batch into per-token or per-example losses plus metrics (:class:`LossOutput`), and, when online, turns
prompts into an :class:`Experience` (sampling, scoring, advantages).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from prefzoo.objective.controllers import make_kl_controller
from prefzoo.objective.reduce import loss_normaliser


def _pad_cat(tensors: list[Tensor], side: str, value) -> Tensor:
    """Concatenate (B_i, L_i) tensors along dim 0, padding dim 1 on ``side`` to the longest L."""
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
    """Prompt + completion token ids. B = rows, P = prompt length, C = completion length.

    Attributes:
        prompt_ids: Shape (B, P), left-padded.
        prompt_mask: Shape (B, P) bool, True on real prompt tokens.
        completion_ids: Shape (B, C), right-padded.
        completion_mask: Shape (B, C) bool, True on completion tokens that count (EOS included).
        prompt_index: Shape (B,) long, which prompt of the source batch each row answers (rollouts), or None.
        truncated: Shape (B,) bool, completion hit the length limit without EOS, or None.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    prompt_index: Tensor | None = None
    truncated: Tensor | None = None

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())

    @staticmethod
    def cat(batches: list["SequenceBatch"], pad_id: int = 0) -> "SequenceBatch":
        """Stack batches row-wise (prompts re-left-padded, completions re-right-padded to common lengths)."""
        opt = lambda name: (torch.cat([getattr(b, name) for b in batches])  # noqa: E731
                            if all(getattr(b, name) is not None for b in batches) else None)
        return SequenceBatch(
            prompt_ids=_pad_cat([b.prompt_ids for b in batches], "left", pad_id),
            prompt_mask=_pad_cat([b.prompt_mask for b in batches], "left", False),
            completion_ids=_pad_cat([b.completion_ids for b in batches], "right", pad_id),
            completion_mask=_pad_cat([b.completion_mask for b in batches], "right", False),
            prompt_index=opt("prompt_index"), truncated=opt("truncated"),
        )


#: Optional :attr:`PromptBatch.columns` entry: one int seed per prompt. A policy that finds it draws each
#: prompt's samples from a random stream seeded by it alone (not by the batch's other prompts), so a
#: rollout does not depend on how prompts are split into batches or data-parallel processes. It is not a
#: dataset column: scorers do not pass it on to reward functions.
ROLLOUT_SEED_COLUMN = "rollout_seed"


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
    max_new_tokens: int = 64
    greedy: bool = False


@dataclass
class LossOutput:
    """What a plugin's ``loss`` returns; the training loop reduces it with :func:`prefzoo.objective.aggregate_loss`.

    Attributes:
        values: per-token losses, Shape (B, C), or per-example losses, Shape (B,). Units: nats-scale.
        mask: Shape (B, C) bool for per-token losses; None for per-example ones.
        metrics: scalars (floats) describing this micro-batch; averaged over micro-batches by row count.
    """

    values: Tensor
    mask: Tensor | None
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    """What a plugin may ask of a policy (a language model with adapters, or a tabular policy)."""

    def logps(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
              ) -> tuple[Tensor, Tensor | None]:
        """Per-token log pi_theta of the completion tokens (float32, 0 where masked), Shape (B, C), with grad;
        and the per-token entropy of pi_theta (nats, Shape (B, C), no grad) when ``with_entropy``."""

    def ref_logps(self, batch: SequenceBatch, temperature: float = 1.0) -> Tensor:
        """Per-token log pi_ref of the completion tokens, Shape (B, C), float32, no grad."""

    def sample(self, prompts: PromptBatch, num_samples: int, params: SamplingParams) -> SequenceBatch:
        """``num_samples`` completions per prompt, grouped: rows [i*n, (i+1)*n) answer prompt i."""


Scorer = Callable[[SequenceBatch, PromptBatch], Tensor]
"""``score(samples, prompts) -> rewards`` Shape (B,) float32, one scalar reward per sampled completion."""


@dataclass
class AlgoConfig:
    """Settings shared by every algorithm; each plugin subclasses it with its own fields and defaults."""

    name: str = "???"


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


class Algorithm:
    """Base class of algorithm plugins. Subclasses set the class attributes and implement ``loss``.

    Class attributes:
        name: the registry name (``algo=<name>``).
        config_class: the plugin's typed config (subclass of :class:`AlgoConfig`).
        default_beta: beta when ``objective.beta`` is null.
        default_kl_estimator / default_kl_placement: when ``objective.kl_estimator`` / ``kl_placement`` are null.
        online: True if it trains on its own samples (needs prompts, a scorer and ``make_experience``);
            False if it trains on a fixed preference dataset.
        needs_value_head: True if ``policy.values`` is used (PPO).
        trains: False for a plugin without training steps (best-of-n): the loop runs none, whatever
            ``trainer.max_steps`` says, and evaluates :meth:`evaluation_policy` once.

    Instance attribute set by the training loop:
        all_reduce: under data parallelism, a callable returning the element-wise SUM of a tensor over all
            processes (every process must call it, in the same order); None in one process. A plugin that
            computes batch statistics (advantage whitening, a batch-wide reward std) passes it on to the
            objective function that takes it, so the statistics are those of the global batch.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[AlgoConfig]] = AlgoConfig
    default_beta: ClassVar[float] = 0.1
    default_kl_estimator: ClassVar[str] = "k1"
    default_kl_placement: ClassVar[str] = "in_reward"
    online: ClassVar[bool] = False
    needs_value_head: ClassVar[bool] = False
    trains: ClassVar[bool] = True
    aggregation: str = "example_mean"
    max_length_for_aggregation: int | None = None
    progress_keys: ClassVar[tuple[str, ...]] = ("loss",)
    all_reduce: Callable[[Tensor], Tensor] | None = None

    def __init__(self, cfg: AlgoConfig, objective: ObjectiveSettings):
        self.cfg = cfg
        self.objective = objective
        self.kl_ctl = make_kl_controller(objective.kl_controller, objective.beta, objective.kl_target,
                                         objective.kl_horizon)

    @property
    def beta(self) -> float:
        return self.kl_ctl.beta

    @property
    def epochs(self) -> int:
        """Passes over each batch or rollout (PPO epochs, GRPO's num_iterations)."""
        return int(getattr(self.cfg, "epochs", 1))

    @property
    def num_minibatches(self) -> int:
        """Optimizer steps per pass over a batch or rollout."""
        return int(getattr(self.cfg, "num_minibatches", 1))

    @property
    def needs_reference(self) -> bool:
        """Whether a reference policy must exist (if not, none is loaded)."""
        return True

    def evaluation_policy(self, policy: Policy, score: Scorer | None) -> Policy:
        """The policy the shared evaluation measures: ``policy`` itself, or a plugin's own sampling procedure
        built on it (best-of-n: the best of n samples under ``score``)."""
        return policy

    def make_experience(self, policy: Policy, prompts: PromptBatch, score: Scorer,
                        sampling: SamplingParams) -> tuple[Batch, dict[str, float]]:
        """Online algorithms: sample, score and compute advantages, without gradients."""
        raise NotImplementedError(f"{self.name} is offline: it trains on a preference dataset")

    def loss(self, policy: Policy, batch: Batch) -> LossOutput:
        """Per-token or per-example losses of one micro-batch (with gradients), and its metrics."""
        raise NotImplementedError

    def loss_mask(self, batch: Batch) -> Tensor | None:
        """The mask of the tokens ``loss`` will return values for (None for per-example losses)."""
        return None

    def normaliser(self, batch: Batch) -> float:
        """This micro-batch's share of the loss normaliser (summed over a mini-batch by the loop)."""
        mask = self.loss_mask(batch)
        return loss_normaliser(mask if mask is not None else len(batch), self.aggregation,
                               self.max_length_for_aggregation)

    def after_step(self, metrics: dict[str, float], num_samples: int) -> dict[str, float]:
        """Called once per training step with the step's metrics (e.g. to adapt beta); returns extra metrics."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctl": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])
