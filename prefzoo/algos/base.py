"""The plugin contract: what an algorithm declares, and the few methods the training loop calls.

A plugin is a subclass of :class:`Algorithm` with a typed config (a subclass of :class:`AlgoConfig`), directly or
through its family's body (:class:`prefzoo.algos.online.OnlinePolicyGradient`,
:class:`prefzoo.algos.pairwise.DirectPreference`: not plugins themselves); no plugin subclasses another plugin. It
sees the world only through :mod:`prefzoo.types` (batches, :class:`~prefzoo.types.Policy`, a scorer) and
:mod:`prefzoo.objective` (the maths); it never imports a model class, a dataset or the loop.

**What it declares** (:class:`Declaration`, frozen, built once in the constructor by :meth:`Algorithm.declare`
from the plugin's config and the resolved objective): whether a reference policy must exist, whether it trains
on its own rollouts, whether it needs the run's reward during training, a value head, whether it trains at all,
how its loss is reduced (and the constant of a constant normaliser), passes and optimizer steps per batch, and
which optional capabilities it implements. The loop provides exactly what is declared -- no reference model is
loaded when none is needed -- and never probes a plugin with ``hasattr``/``getattr``.

**What it implements** (the loop calls only these):

=============================  ======================================================================
``validate_settings``          (static) checks of the plugin's own config against the resolved objective
``declare``                    the :class:`Declaration`
``loss``                       one micro-batch -> per-token or per-example losses + metrics (always)
``step_statistics``            capability ``step_statistics``: sums over the rows of an optimizer step, made before
                               the losses of its micro-batches; the loop adds them over processes and passes the
                               means to ``loss`` as ``step.statistics`` (KTO's reference point z0)
``check_data``                 once, with the offline training data's statistics (class counts), before training
``loss_mask``                  the tokens ``loss`` returns values for (per-token losses)
``make_experience``            online plugins: prompts -> a scored :class:`~prefzoo.types.Experience`. Capability
                               ``turn_rewards``: per-token returns that take an environment's step rewards on the
                               turns they reward (:meth:`~prefzoo.types.SequenceBatch.turn_rewards`), so
                               ``env.reward_placement=turn`` is honoured (refused for other plugins). Capability
                               ``sampler_correction``: the rollout's importance weights
                               (:func:`prefzoo.algos.online_sampling.engine_correction`) weight its loss, so
                               ``rollout.correction.*`` is honoured (refused for other plugins)
``f_divergence`` (capability)  ``objective.divergence`` other than reverse KL (``objective=forward_kl|js|alpha``)
                               changes the plugin's loss (DPO's family: its link); refused for other plugins
``after_step``                 once per step, with the step's metrics; returns extra metrics. Capability
                               ``adaptive_beta``: it updates the KL controller (``kl_ctl``) with the step's KL, so
                               ``objective.kl_controller=adaptive`` is honoured (refused for other plugins)
``evaluation_policy``          the policy the shared evaluation measures (best-of-n: its own procedure)
``implicit_rewards``           capability ``implicit_rewards``: held-out pair ranking
``reference_logps``            capability ``precomputed_reference``: summed reference log-probs of pairs
                               (batches may carry them); with ``precompute_reference`` the loop computes
                               them once before training
``save_artifacts``             capability ``saves_artifacts``: write a model of its own (the reward model)
``state_dict``/``load_state``  what a checkpoint keeps of the plugin (its KL controller)
=============================  ======================================================================

Defaults of the objective (beta, KL estimator and placement) and of the run settings an algorithm brings along
(rollout temperature, prompts per step) are fields of its config dataclass (``default_*``): the one place they
live. ``objective.beta=null``, ``objective.kl_estimator=null``, ``rollout.temperature=null`` and
``trainer.batch_size=null`` (the defaults) take them, see :func:`prefzoo.config.resolve_defaults`.

The sampling settings (:class:`~prefzoo.types.SamplingParams`) reach the plugin once, in its constructor: the
loss recomputes log-probs at ``self.sampling.temperature`` (the temperature the sampler drew with), and a
constant loss normaliser uses ``self.sampling.max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from torch import Tensor

from prefzoo.objective import AGGREGATIONS, loss_normaliser, make_kl_controller
from prefzoo.types import (NO_STEP, Batch, LossOutput, LossTokens, ObjectiveSettings, Policy, PromptBatch, SamplingParams,
                           Scorer, StepContext, ValueHeadSpec)

CAPABILITIES = ("adaptive_beta", "f_divergence", "implicit_rewards", "precomputed_reference", "sampler_correction",
                "saves_artifacts", "step_statistics", "turn_rewards")
#: what an offline plugin trains on: preference pairs (:class:`~prefzoo.types.PreferenceBatch`), unpaired labelled
#: rows (:class:`~prefzoo.types.UnpairedBatch`) or supervised sequences (:class:`~prefzoo.types.SequenceBatch` whose
#: ``completion_mask`` marks the tokens with a loss: SFT's text, prompt/completion and messages rows)
OFFLINE_DATA = ("pairs", "unpaired", "sequences")


@dataclass
class AlgoConfig:
    """Settings shared by every algorithm; each plugin subclasses it with its own fields and defaults.

    Attributes:
        name: the registry name of the plugin that runs (``algo=<name>``).
        preset: the name of a ``conf/algo/`` preset of another plugin, the algorithm the user chose (``algo=rpo``: the
            DPO plugin with ``loss_type=[sigmoid, sft]``, ``preset: rpo``); None: the plugin's own name. The run
            folder, summary.json's ``algo`` and the progress bar name the run by it
            (:func:`prefzoo.training.names.algo_name`); the plugin, its checks and resuming go by ``name``.
        target: a user's own plugin, by import path (``algo=custom algo.target=my_pkg.algos:MyAlgo``); None for
            the built-in and installed ones.
        default_beta: beta when ``objective.beta`` is null.
        default_kl_estimator / default_kl_placement: when ``objective.kl_estimator`` / ``kl_placement`` are null.
        default_temperature: the rollout temperature when ``rollout.temperature`` is null.
        default_batch_size: rows per step (pairs, or prompts for online algorithms) when ``trainer.batch_size``
            is null.
    """

    name: str = "???"
    preset: Optional[str] = None  # a conf/algo preset of the plugin (algo=rpo: the DPO plugin); the run's name
    target: Optional[str] = None  # algo=custom: the plugin's import path, e.g. my_pkg.algos:MyAlgo
    default_beta: float = 0.1
    default_kl_estimator: str = "k1"
    default_kl_placement: str = "in_reward"
    default_temperature: float = 1.0
    default_batch_size: int = 4


def check_beta(objective: ObjectiveSettings, who: str, why: str) -> None:
    """A plugin whose loss is undefined at beta = 0 refuses it: ``objective.beta`` must be > 0.

    Raises:
        ConfigError: ``objective.beta=<value>: <who> needs beta > 0 (<why>).``
    """
    from prefzoo.errors import ConfigError

    if not objective.beta > 0:
        raise ConfigError(f"objective.beta={objective.beta}: {who} needs beta > 0 ({why}).")


@dataclass(frozen=True)
class MetricWarning:
    """A warning the loop prints while a run goes wrong in a way the plugin knows how to read: the step metric
    ``metric`` at or above ``threshold`` for ``steps`` consecutive training steps (or for every step of a shorter
    run). One line, once per such streak (:mod:`prefzoo.training.watch`): ``<metric> = <value> for N steps in a row
    (steps a-b; <show>): <message>``.

    Attributes:
        metric: a key of the step's metrics (e.g. ``frac_zero_std_groups``).
        threshold: the value from which on the step counts (``metric >= threshold``).
        steps: consecutive steps before the warning.
        message: what it means and what to change (config keys with their values), one line.
        show: other step metrics quoted in the line (e.g. the mean ``reward``: all 0 or all 1 says which way).
    """

    metric: str
    threshold: float
    steps: int
    message: str
    show: tuple[str, ...] = ("reward",)


@dataclass(frozen=True)
class Declaration:
    """What a plugin needs from the loop and what it offers, stated once (see the module docstring).

    Attributes:
        reference: a reference policy pi_ref must exist (if False none is built, except the free
            adapter-disabled one under LoRA, for drift metrics).
        online: trains on its own rollouts: the loop hands it prompts and a scorer (``make_experience``);
            False: batches of preference pairs from the data set.
        reward: needs the run's reward during training (a scorer over sampled completions).
        value_head: the value head to build (PPO, reward models), or None.
        trains: False for a plugin with no training step (best-of-n): the loop runs none and evaluates
            :meth:`Algorithm.evaluation_policy` once.
        aggregation: how per-token / per-example losses are reduced (:data:`prefzoo.objective.AGGREGATIONS`).
        aggregation_constant: the constant of ``aggregation="constant"`` (tokens per sequence), else None.
        epochs: passes over each batch or rollout.
        num_minibatches: optimizer steps per pass.
        num_samples: completions sampled per prompt (G) by an online plugin (0: none); the evaluation's pass@k.
        capabilities: the optional methods implemented, a subset of :data:`CAPABILITIES`.
        precompute_reference: the loop computes the pairs' reference log-probs once before training and hands
            them in on the batches (needs the capability ``precomputed_reference``).
        progress_keys: metrics shown on the progress bar.
        data: offline plugins: what the batches hold, one of :data:`OFFLINE_DATA` (``pairs``: preference pairs;
            ``unpaired``: labelled rows, which the loop makes from unpaired data or by splitting pairs; ``sequences``:
            supervised rows, :class:`~prefzoo.types.SequenceBatch` es built from text, prompt/completion or messages
            rows, or from a preference file's prompt and chosen side, :mod:`prefzoo.data.sft`).
        loss_tokens: ``data="sequences"`` (and only then): which tokens of a row carry the loss
            (:class:`~prefzoo.types.LossTokens`: the completion only? the assistant turns only?).
        min_batch_size: the fewest rows each process must hold per optimizer step (``trainer.batch_size`` is
            refused below it times the number of processes, before anything loads); 1 for most plugins.
        warnings: :class:`MetricWarning` s the loop watches the step metrics for (e.g. no learning signal).
        uses_beta: the objective's beta enters the plugin's loss; False (SFT, reward models, best-of-n): a beta
            given on the command line is warned about before anything loads, and the summary records beta as null.
        teacher: the teacher the loop loads, frozen, beside the policy (a prefzoo run folder, a LoRA adapter folder
            over the run's base model, or a model path or id sharing its tokenizer); the policy the plugin sees is then
            a :class:`~prefzoo.types.DistillationPolicy`. None: no teacher.
        draws_prompts: the plugin may draw more prompts within a step (DAPO's dynamic sampling): the loop passes
            ``step.draw_prompts`` (one process, synchronous rollouts; refused otherwise before anything loads).
        token_entropy: the loss reads the policy's per-token entropy (a high-entropy token mask), so a policy that
            reports none (``backend=tinker``: the server returns no distribution) is refused before anything loads.
    """

    reference: bool
    online: bool = False
    reward: bool = False
    value_head: ValueHeadSpec | None = None
    trains: bool = True
    aggregation: str = "example_mean"
    aggregation_constant: int | None = None
    epochs: int = 1
    num_minibatches: int = 1
    num_samples: int = 0
    capabilities: frozenset[str] = frozenset()
    precompute_reference: bool = False
    progress_keys: tuple[str, ...] = ("loss",)
    data: str = "pairs"
    loss_tokens: LossTokens | None = None
    min_batch_size: int = 1
    warnings: tuple[MetricWarning, ...] = ()
    uses_beta: bool = True
    teacher: str | None = None
    draws_prompts: bool = False
    token_entropy: bool = False

    def __post_init__(self) -> None:
        from prefzoo.errors import PluginError

        if self.aggregation not in AGGREGATIONS:
            raise PluginError(f"declaration: aggregation={self.aggregation!r}; choose one of {', '.join(AGGREGATIONS)}")
        if (self.aggregation == "constant") != (self.aggregation_constant is not None):
            raise PluginError("declaration: aggregation='constant' needs aggregation_constant (tokens per sequence), "
                              "and only it takes one")
        unknown = set(self.capabilities) - set(CAPABILITIES)
        if unknown:
            raise PluginError(f"declaration: unknown capabilities {sorted(unknown)}; valid: {', '.join(CAPABILITIES)}")
        if self.precompute_reference and "precomputed_reference" not in self.capabilities:
            raise PluginError("declaration: precompute_reference needs the capability 'precomputed_reference'")
        if self.data not in OFFLINE_DATA:
            raise PluginError(f"declaration: data={self.data!r}; choose one of {', '.join(OFFLINE_DATA)}")
        if (self.data == "sequences") != (self.loss_tokens is not None):
            raise PluginError("declaration: data='sequences' needs loss_tokens (a prefzoo.types.LossTokens: which "
                              "tokens of a row carry the loss), and only it takes them")
        if self.min_batch_size < 1:
            raise PluginError(f"declaration: min_batch_size={self.min_batch_size} must be >= 1")
        if self.epochs < 1 or self.num_minibatches < 1:
            raise PluginError(f"declaration: epochs={self.epochs} and num_minibatches={self.num_minibatches} must be >= 1")

    def has(self, capability: str) -> bool:
        """Whether the plugin implements the optional ``capability`` (one of :data:`CAPABILITIES`)."""
        return capability in self.capabilities


class Algorithm:
    """Base class of algorithm plugins (see the module docstring for the contract).

    Class attributes:
        name: the registry name (``algo=<name>``); by default its config's ``name`` (set once, in the config
            dataclass: a class that sets ``config_class`` and no ``name`` takes ``config_class.name``).
        config_class: the plugin's typed config (a subclass of :class:`AlgoConfig`).

    Instance attributes:
        cfg, objective, sampling: the plugin's config, the resolved objective, the rollout's sampling settings.
        declaration: :meth:`declare`'s result, fixed for the run.
        kl_ctl: the beta controller (fixed or adaptive); ``beta`` is its current value.

    What the loop gives a plugin per step -- the all-reduce under data parallelism, more prompts for dynamic sampling,
    whether the drift metrics are due, an optimizer step's statistics -- is an argument of :meth:`make_experience` and
    :meth:`loss` (``step``, a :class:`~prefzoo.types.StepContext`); the loop never writes into a plugin, and a plugin
    returns what it computes.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[AlgoConfig]] = AlgoConfig

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        default = getattr(cls.__dict__.get("config_class"), "name", None)
        if "name" not in cls.__dict__ and isinstance(default, str) and default != "???":
            cls.name = default  # the algo= name lives once, in the config dataclass

    def __init__(self, cfg: AlgoConfig, objective: ObjectiveSettings, sampling: SamplingParams | None = None):
        self.validate_settings(cfg, objective)
        self.cfg = cfg
        self.objective = objective
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.kl_ctl = make_kl_controller(objective.kl_controller, objective.beta, objective.kl_target,
                                         objective.kl_horizon)
        self.declaration: Declaration = self.declare()
        self._check_hooks()

    def _check_hooks(self) -> None:
        """The hooks the loop calls take the step's context (``step``, a :class:`~prefzoo.types.StepContext`): a plugin
        written for the earlier contract (``loss(self, policy, batch)``) is refused in one line, not with a TypeError
        mid-step.

        Raises:
            PluginError: naming the hook and its signature.
        """
        import inspect

        from prefzoo.errors import PluginError

        hooks = [("loss", "policy, batch, step")]
        if self.declaration.online:
            hooks.append(("make_experience", "policy, prompts, score, step"))
        for hook, args in hooks:
            fn = getattr(type(self), hook)
            try:
                inspect.signature(fn).bind(self, *[None] * (args.count(",") + 1))
            except TypeError:
                raise PluginError(f"{type(self).__name__}.{hook}{inspect.signature(fn)} must take the step's context "
                                  f"too: {hook}(self, {args}) (a prefzoo.types.StepContext; see "
                                  "docs/adding-an-algorithm.md).") from None
            except ValueError:  # a signature inspect cannot read: left to the call
                pass

    # ------------------------------------------------------------------ declared
    @staticmethod
    def validate_settings(cfg: AlgoConfig, objective: ObjectiveSettings) -> None:
        """Check the plugin's own settings against the resolved objective; raise ``ConfigError`` naming the key.

        Runs before any model loads (the CLI) and in the constructor. Sees only the plugin's config and the
        resolved objective (defaults already applied), never the rest of the run config.
        """

    def declare(self) -> Declaration:
        """What this plugin needs and offers (called once, in the constructor)."""
        raise NotImplementedError(f"{type(self).__name__} must implement declare()")

    # ------------------------------------------------------------------- always
    @property
    def beta(self) -> float:
        return self.kl_ctl.beta

    def loss(self, policy: Policy, batch: Batch, step: StepContext = NO_STEP) -> LossOutput:
        """Per-token or per-example losses of one micro-batch (with gradients), and its metrics. ``step``: the loop's
        context of this optimizer step (``step.statistics``: capability ``step_statistics``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss()")

    def loss_mask(self, batch: Batch) -> Tensor | None:
        """The mask of the tokens ``loss`` will return values for (None for per-example losses)."""
        return None

    def normaliser(self, batch: Batch) -> float:
        """This micro-batch's share of the loss normaliser (summed over a mini-batch by the loop)."""
        mask = self.loss_mask(batch)
        d = self.declaration
        return loss_normaliser(mask if mask is not None else len(batch), d.aggregation, d.aggregation_constant)

    def make_experience(self, policy: Policy, prompts: PromptBatch, score: Scorer,
                        step: StepContext = NO_STEP) -> tuple[Batch, dict[str, float]]:
        """Online plugins: sample ``self.sampling``, score, and compute advantages, without gradients. ``step``: the
        loop's context of this training step (the all-reduce, more prompts, whether the drift metrics are due).

        Returns the batch the plugin's ``loss`` trains on and the rollout's metrics: an
        :class:`~prefzoo.types.Experience` (one row per completion: GRPO, PPO, ...), or a
        :class:`~prefzoo.types.PreferenceBatch` of pairs built from the samples (Online DPO), so that the
        loop's mini-batches and micro-batches never split a pair. The loop only selects, chunks and counts its rows.
        """
        raise NotImplementedError(f"{self.name} is offline: it trains on a preference dataset")

    def check_data(self, stats: dict[str, int]) -> None:
        """Called once before training with the offline training data's statistics (for unpaired rows
        ``{"desirable": n_D, "undesirable": n_U}``); may warn about them (KTO: the class balance). Default: nothing."""

    def after_step(self, metrics: dict[str, float], num_samples: int) -> dict[str, float]:
        """Called once per training step with the step's metrics (e.g. to adapt beta); returns extra metrics."""
        return {}

    def evaluation_policy(self, policy: Policy, score: Scorer | None) -> Policy:
        """The policy the shared evaluation measures: ``policy`` itself, or a plugin's own sampling procedure
        built on it (best-of-n: the best of n samples under ``score``)."""
        return policy

    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctl": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])

    # ------------------------------------------------- optional (declared capabilities)
    def implicit_rewards(self, policy: Policy, batch) -> tuple[Tensor, Tensor]:
        """Capability ``implicit_rewards``: the plugin's rewards of chosen and rejected, Shape (B,) each, for
        held-out preference accuracy."""
        raise NotImplementedError(f"{self.name} does not declare the capability 'implicit_rewards'")

    def reference_logps(self, policy: Policy, batch) -> tuple[Tensor, Tensor]:
        """Capability ``precomputed_reference``: summed reference log-probs (B,) of chosen and rejected."""
        raise NotImplementedError(f"{self.name} does not declare the capability 'precomputed_reference'")

    def save_artifacts(self, run_dir: Path, policy: Policy) -> None:
        """Capability ``saves_artifacts``: write a model of the plugin's own into ``run_dir``."""
        raise NotImplementedError(f"{self.name} does not declare the capability 'saves_artifacts'")

    def step_statistics(self, policy: Policy, batch: Batch, micro_batch_size: int) -> dict[str, tuple[float, float]]:
        """Capability ``step_statistics``: statistics of an optimizer step's rows, before any of its losses.

        ``batch`` is every row this process holds for the optimizer step (all its micro-batches; empty on a
        process that holds none); ``micro_batch_size`` bounds the rows of one forward pass. Runs without
        gradients. Returns ``{name: (sum, count)}`` -- the same names whatever the rows, an empty batch giving
        (0, 0) -- which the loop adds over processes and divides once
        (:func:`prefzoo.training.step.step_statistics`) and hands to every ``loss`` of the step as
        ``step.statistics = {name: sum / count}`` (0.0 where the count is 0): a statistic of the whole step, the
        same whatever the micro-batch size or the number of processes.
        """
        raise NotImplementedError(f"{self.name} does not declare the capability 'step_statistics'")
