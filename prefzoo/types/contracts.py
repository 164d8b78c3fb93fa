"""The interfaces and settings between the rooms: how completions are sampled and corrected, what a plugin's loss
returns, the policy, scorer and engine protocols, the value head, the resolved objective (notation: :mod:`prefzoo.types`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from torch import Tensor, nn

from prefzoo.objective import TokenLogits
from prefzoo.types.batches import PromptBatch, SequenceBatch

__all__ = ["SamplingParams", "CorrectionSettings", "LossOutput", "Policy", "ValuePolicy", "DistillationPolicy", "Scorer",
           "ValueHeadSpec", "LossTokens", "ObjectiveSettings", "RolloutEngine", "StepContext", "NO_STEP"]


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
        and the per-token entropy of pi_theta (nats, Shape (B, T), no grad) when ``with_entropy`` (None from a policy
        that has no next-token distribution to give: ``backend=tinker``'s, whose server returns log-probs only)."""

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


@dataclass(frozen=True)
class LossTokens:
    """Which tokens of a supervised row carry the loss, as a plugin that trains on sequences (``data="sequences"``:
    SFT) declares them; the data layer builds each row's ``completion_mask`` from it (:mod:`prefzoo.data.sft`). The
    names and meanings are TRL's ``SFTConfig`` keys.

    Attributes:
        completion_only_loss: prompt/completion rows (and a preference file's prompt + chosen): the completion's
            tokens only (True) or every token after the first (False: the prompt's too).
        assistant_only_loss: ``messages`` rows: the assistant turns' tokens only (True) or every token after the
            first (False: the system, user and tool messages and the chat template's headers too).
    """

    completion_only_loss: bool
    assistant_only_loss: bool


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


@runtime_checkable
class RolloutEngine(Protocol):
    """What draws completions for a policy (:mod:`prefzoo.rollout`): one of the base engines (``hf``, ``vllm``,
    ``vllm_server``), or a layer over one (multi-turn episodes, asynchronous rollouts) -- the run's engine stack, built
    once (:func:`prefzoo.training.setup.build_engine`).

    Attributes:
        name: the base engine's name, ``hf``, ``vllm`` or ``vllm_server`` (``rollout.engine``).
    """

    name: str

    def sample(self, model: nn.Module, prompts: PromptBatch, num_samples: int, params: SamplingParams, *,
               eos_token_ids: list[int], pad_id: int, generator=None) -> SequenceBatch:
        """``num_samples`` completions per prompt from ``model`` as it is now (the trained model: a peft model
        under LoRA). An engine that keeps weights of its own brings them up to date with ``model`` first.

        ``eos_token_ids`` end a completion (the EOS is its last counted token), ``pad_id`` fills after it (the
        policy's, passed on each call); ``generator`` draws the randomness of prompts without a
        :data:`~prefzoo.types.ROLLOUT_SEED_COLUMN` seed. Rows [i*G, (i+1)*G) answer prompt i, completions right-padded
        after the first EOS (the EOS counted), rows without EOS ``truncated``. The result may carry ``sample_logps``
        (Shape (B*G, T), the engine's log-probs of its tokens)."""

    def close(self) -> None:
        """Free what the engine holds (processes, memory); a no-op for an in-process engine."""


@dataclass(frozen=True)
class StepContext:
    """What the training loop gives a plugin for one training step (and, with ``statistics``, one optimizer step): an
    argument of :meth:`~prefzoo.algos.base.Algorithm.make_experience` and :meth:`~prefzoo.algos.base.Algorithm.loss`,
    never an attribute the loop writes into the plugin. Frozen: a plugin reads it, and returns what it computes.

    Attributes:
        all_reduce: under data parallelism, a callable returning the element-wise SUM of a tensor over all processes
            (every process must call it, in the same order); None in one process. A plugin that computes batch
            statistics (advantage whitening, a batch-wide reward std) passes it on.
        draw_prompts: for a plugin that declares ``draws_prompts`` (DAPO's dynamic sampling), ``draw_prompts(round)``
            returns the next ``trainer.batch_size`` training prompts with their rollout seeds (distinct for each
            ``round`` >= 1 of the step); None otherwise.
        drift_metrics_due: whether a plugin that declares no reference, but has one (the adapter-disabled base under
            LoRA), runs it this step for the drift metrics alone (``trainer.kl_metric_every``).
        statistics: capability ``step_statistics``: ``{name: mean}`` of the current optimizer step's statistics, over
            all its rows on all processes (KTO's reference point z0); None outside an optimizer step or for a plugin
            without the capability.
    """

    all_reduce: Callable[[Tensor], Tensor] | None = None
    draw_prompts: Callable[[int], PromptBatch] | None = None
    drift_metrics_due: bool = True
    statistics: dict[str, float] | None = None


#: the context of a step outside the training loop (one process, nothing to draw, the drift metrics due)
NO_STEP = StepContext()
