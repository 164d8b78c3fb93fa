"""The online policy-gradient family's settings and checks (:mod:`prefzoo.algos.online` is its body): the config every
member derives from, the group-relative members' config, the checks they share, the warnings of a step that teaches
nothing, and the family's declaration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration, MetricWarning
from prefzoo.errors import ConfigError
from prefzoo.objective import ADVANTAGE_SCALES
from prefzoo.types import ObjectiveSettings

__all__ = ["AGGREGATION_OF", "OnlineConfig", "GroupRelativeConfig", "check_online_settings", "check_policy_term_masks",
           "check_dynamic_sampling",
           "check_adaptive_start", "check_group_relative_settings", "check_policy_clip", "stores_old_logps",
           "ZERO_SPREAD_STEPS", "zero_spread_warning", "MAXRL_WARNING", "online_declaration", "ADVANTAGE_EPS",
           "advantage_eps"]


#: ``algo.loss_aggregation`` -> the loss reduction (:data:`prefzoo.objective.AGGREGATIONS`): GRPO eq. 3 (mean over
#: each sequence, then over sequences), Dr. GRPO (a constant: the generation budget), DAPO eq. 8 (token mean), LUSPO
#: (each sequence's loss times its length: the per-token losses summed per sequence, then the mean over sequences;
#: with ``algo=gspo`` this is LUSPO, TRL 1.16's ``loss_type="luspo"``)
AGGREGATION_OF = {"grpo": "sequence_mean", "dr_grpo": "constant", "dapo": "token_mean", "luspo": "sequence_sum"}


@dataclass
class OnlineConfig(AlgoConfig):
    """The settings every member of the family has (its config derives from this one).

    Attributes:
        num_samples: G, completions sampled per prompt.
        loss_aggregation: ``grpo`` | ``dr_grpo`` | ``dapo`` | ``luspo`` (:data:`AGGREGATION_OF`).
        epochs: passes over each rollout (GRPO's mu, TRL's ``num_iterations``).
        num_minibatches: optimizer steps per pass.
        mask_truncated: completions without EOS contribute no loss.
        dynamic_sampling: DAPO's dynamic sampling (:func:`dynamic_sampling`): groups whose rewards are all equal are
            dropped and more prompts drawn until the step holds ``trainer.batch_size`` informative groups.
        max_extra_draws: the cap on dynamic sampling's extra rounds per step (each of ``trainer.batch_size`` prompts).
        off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence mask (None: off): a sequence with a negative
            advantage whose mean per-token log(pi_sampling / pi_theta) exceeds it carries no policy term
            (:func:`prefzoo.objective.off_policy_sequence_mask`; TRL 1.16's key, e.g. 0.5).
        top_entropy_quantile: rho of "Beyond the 80/20 rule": only the tokens whose entropy is in the top rho
            quantile of the micro-batch's counted tokens carry the policy term (:func:`prefzoo.objective.high_entropy_mask`;
            1.0: every token, the default; the paper's 0.2; TRL 1.16's key).
    """

    # With the arithmetic task's exact-match reward, G = 4 and SmolLM2-135M: at temperature 1.0 only ~4% of samples
    # are right and most groups are all-wrong (zero advantage, no gradient); at 0.7 ~15% are. 8 prompts per step
    # double the informative groups per step.
    default_temperature: float = 0.7
    default_batch_size: int = 8
    num_samples: int = 4
    loss_aggregation: str = "grpo"
    epochs: int = 1
    num_minibatches: int = 1
    mask_truncated: bool = False
    dynamic_sampling: bool = False
    max_extra_draws: int = 3
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0


#: ``algo.advantage_eps``'s default (null) per ``algo.scale_rewards``: what each method's own code adds to the
#: denominator. A standard deviation (``group``, ``batch``): 1e-4, TRL's ``GRPOTrainer``. MaxRL's mean (``mean``): 1e-6,
#: the authors' code (Tajwar et al. 2026, their verl ``compute_maxrl_outcome_advantage``), where 1e-4 is not negligible:
#: one right answer of four gives A = 0.75 / (0.25 + 1e-4) = 2.9988 instead of 2.99999. ``none`` divides by nothing.
ADVANTAGE_EPS = {"group": 1e-4, "batch": 1e-4, "mean": 1e-6, "none": 0.0}


@dataclass
class GroupRelativeConfig(OnlineConfig):
    """The config of the members whose advantage is GRPO's group-relative one (GRPO, GSPO, CISPO), with their common
    defaults: no KL term (beta = 0: DeepSeek-R1, Dr. GRPO, DAPO, GSPO and CISPO drop it); with beta > 0, k3 as a loss.

    Attributes:
        scale_rewards: ``group`` | ``batch`` | ``none`` | ``mean`` (:data:`prefzoo.objective.ADVANTAGE_SCALES`).
        advantage_eps: added to the denominator before dividing (the std; MaxRL's mean); null: the method's own,
            :data:`ADVANTAGE_EPS` (1e-4 for a std, as TRL; 1e-6 for MaxRL's mean, as its authors), filled in when the
            config is built (``__post_init__``), so the run's config.yaml and its checkpoints record the number used.
    """

    default_beta: float = 0.0
    default_kl_estimator: str = "k3"
    default_kl_placement: str = "as_loss"
    scale_rewards: str = "group"
    advantage_eps: float | None = None

    def __post_init__(self) -> None:
        if self.advantage_eps is None:  # an unknown scale_rewards stays null: check_group_relative_settings refuses it
            self.advantage_eps = ADVANTAGE_EPS.get(self.scale_rewards)


def advantage_eps(cfg: GroupRelativeConfig) -> float:
    """The eps :func:`prefzoo.objective.group_advantages` adds to its denominator: ``algo.advantage_eps``, or when it is
    null (a config whose null was set after it was built) the method's own for ``algo.scale_rewards``
    (:data:`ADVANTAGE_EPS`)."""
    return ADVANTAGE_EPS[cfg.scale_rewards] if cfg.advantage_eps is None else cfg.advantage_eps


def check_online_settings(cfg: OnlineConfig, objective: ObjectiveSettings, min_samples: int = 1,
                          why: str = "") -> None:
    """The checks every member's config shares: ``num_samples`` >= ``min_samples`` (``why``: what the others are
    for), ``loss_aggregation``, ``epochs`` and ``num_minibatches`` >= 1, and the adaptive controller's starting beta.

    Raises:
        ConfigError: the first bad value, naming its key and the valid range.
    """
    if not cfg.num_samples >= min_samples:
        raise ConfigError(f"algo.num_samples={cfg.num_samples}: algo={cfg.name} needs at least {min_samples} "
                          f"completion{'s' if min_samples > 1 else ''} per prompt{f' ({why})' if why else ''}.")
    if cfg.loss_aggregation not in AGGREGATION_OF:
        raise ConfigError(f"algo.loss_aggregation={cfg.loss_aggregation!r}; choose one of {', '.join(AGGREGATION_OF)}.")
    if cfg.epochs < 1 or cfg.num_minibatches < 1:
        raise ConfigError(f"algo.epochs={cfg.epochs} and algo.num_minibatches={cfg.num_minibatches} must be >= 1.")
    if cfg.dynamic_sampling and (cfg.num_samples < 2 or cfg.max_extra_draws < 0):
        raise ConfigError(f"algo.dynamic_sampling=true drops the groups of algo.num_samples={cfg.num_samples} "
                          f"completions whose rewards are all equal: it needs num_samples >= 2 and "
                          f"algo.max_extra_draws={cfg.max_extra_draws} >= 0.")
    if cfg.dynamic_sampling and objective.beta > 0 and objective.kl_placement == "in_reward":
        raise ConfigError(f"algo.dynamic_sampling=true with the KL in the reward (objective.beta={objective.beta}, "
                          "kl_placement=in_reward): a group of equal rewards still carries the KL penalty's "
                          "advantages, so dropping it would change the update; put the KL in the loss "
                          "(objective.kl_placement=as_loss) or set objective.beta=0.")
    check_policy_term_masks(cfg)
    check_adaptive_start(objective)


def check_policy_term_masks(cfg: OnlineConfig) -> None:
    """``algo.off_policy_mask_threshold`` (None or > 0, nats per token) and ``algo.top_entropy_quantile`` (in [0, 1]).

    Raises:
        ConfigError: naming the key, its range and the paper's value.
    """
    t = cfg.off_policy_mask_threshold
    if t is not None and not (isinstance(t, (int, float)) and 0 < t < float("inf")):
        raise ConfigError(f"algo.off_policy_mask_threshold={t} must be a number > 0 (nats per token; TRL's example "
                          "0.5) or null (off): at <= 0 even on-policy negative-advantage sequences could be dropped.")
    q = cfg.top_entropy_quantile
    if not (isinstance(q, (int, float)) and 0.0 <= q <= 1.0):
        raise ConfigError(f"algo.top_entropy_quantile={q} must be in [0, 1] (the share of the highest-entropy tokens "
                          "that carry the policy loss; 1.0 = every token, the paper recommends 0.2).")


def check_dynamic_sampling(cfg: OnlineConfig, why: str) -> None:
    """A member whose baseline is not the group refuses ``algo.dynamic_sampling`` (``why``: what its baseline is):
    a group of equal rewards still carries advantages there, so dropping it would change the update.

    Raises:
        ConfigError: naming the key and the reason.
    """
    if cfg.dynamic_sampling:
        raise ConfigError(f"algo.dynamic_sampling=true is for plugins whose baseline is the group (GRPO, GSPO, CISPO, "
                          f"RLOO); algo={cfg.name}: {why}.")


def check_range(cfg, keys: tuple[str, ...], valid: Callable[[float], bool], what: str) -> None:
    """Each of ``algo.<key>`` for ``keys`` passes ``valid``, else a one-line error saying it must be ``what``.

    Raises:
        ConfigError: naming the first key out of range, e.g. ``algo.gae_lambda=1.5 must be in [0, 1].``
    """
    for key in keys:
        if not valid(getattr(cfg, key)):
            raise ConfigError(f"algo.{key}={getattr(cfg, key)} must be {what}.")


def check_teacher(cfg) -> None:
    """A member that learns from a frozen teacher (``algo=distill``, ``algo=teacher_reward``) needs ``algo.teacher``.

    Raises:
        ConfigError: saying what a teacher can be.
    """
    if not cfg.teacher:
        raise ConfigError(f"algo={cfg.name} needs a teacher: algo.teacher=<a prefzoo run folder, a LoRA adapter "
                          "folder, or a model path or id sharing the student's tokenizer>.")


def check_adaptive_start(objective: ObjectiveSettings) -> None:
    """The adaptive KL controller (Ziegler et al. 2019) scales beta multiplicatively: it needs a starting beta > 0.

    Raises:
        ConfigError: naming ``objective.beta``.
    """
    if objective.kl_controller == "adaptive" and not objective.beta > 0:
        raise ConfigError("the adaptive KL controller needs a starting objective.beta > 0.")


def check_group_relative_settings(cfg: GroupRelativeConfig, objective: ObjectiveSettings) -> None:
    """The checks of a member with GRPO's advantages: :func:`check_online_settings` with G >= 2 (the group is the
    baseline), ``algo.advantage_eps`` >= 0, and ``algo.scale_rewards`` one of :data:`prefzoo.objective.ADVANTAGE_SCALES`.

    Raises:
        ConfigError: the first bad value, naming its key and the valid values.
    """
    check_online_settings(cfg, objective, min_samples=2, why="the group is the baseline")
    check_range(cfg, ("advantage_eps",), lambda v: v is None or v >= 0,
                ">= 0 (it is added to the std, or MaxRL's mean; null: 1e-4 for a std, 1e-6 for the mean)")
    if cfg.scale_rewards not in ADVANTAGE_SCALES:
        raise ConfigError(f"algo.scale_rewards={cfg.scale_rewards!r}; choose one of {', '.join(ADVANTAGE_SCALES)}.")


def check_policy_clip(cfg) -> None:
    """PPO's ratio clip: ``algo.clip_eps_low`` in [0, 1) and ``algo.clip_eps_high`` >= 0.

    Raises:
        ConfigError: naming both keys and their ranges.
    """
    if not 0 <= cfg.clip_eps_low < 1 or cfg.clip_eps_high < 0:
        raise ConfigError(f"algo.clip_eps_low={cfg.clip_eps_low} must be in [0, 1) and algo.clip_eps_high="
                          f"{cfg.clip_eps_high} >= 0.")


def stores_old_logps(epochs: int, num_minibatches: int) -> bool:
    """Whether a rollout must keep log pi_old (one no-grad pass at sampling time): True when any update after the
    first sees it, i.e. ``epochs * num_minibatches > 1`` (the later optimizer steps are off-policy)."""
    return epochs * num_minibatches > 1


#: steps in a row with every group's rewards equal before :func:`zero_spread_warning` is printed
ZERO_SPREAD_STEPS = 5


def zero_spread_warning(num_samples: int, temperature: float, steps: int = ZERO_SPREAD_STEPS) -> MetricWarning:
    """The warning of a plugin whose baseline is the group: every group of ``num_samples`` completions scored alike
    (``frac_zero_std_groups`` = 1) means every advantage is 0, and the reward teaches the policy nothing."""
    return MetricWarning(
        "frac_zero_std_groups", 1.0, steps,
        f"every group of algo.num_samples={num_samples} completions got one reward, so every advantage is 0 and the "
        "policy learns nothing from the reward. The reward is likely too hard (all 0) or too easy (all the same high "
        f"value) for this model, or the samples too alike: raise rollout.temperature={temperature:g} or "
        "algo.num_samples, or use an easier task or a reward that gives partial credit.")


#: MaxRL (``algo.scale_rewards=mean``): the advantage (r - mean) / mean is 0 for a group whose mean reward is <= 0
MAXRL_WARNING = MetricWarning(
    "frac_nonpositive_groups", 1.0, ZERO_SPREAD_STEPS,
    "every group's mean reward was <= 0, where MaxRL's advantage (r - mean) / mean is 0 (algo.scale_rewards=mean), so "
    "the loss and its gradient are 0 and nothing trains. MaxRL is for rewards >= 0 with some > 0 (e.g. 0/1 "
    "correctness); for rewards that can be negative use algo.scale_rewards=group (or none).")


def online_declaration(algo: Algorithm, progress_keys: tuple[str, ...], group_baseline: bool = True,
                       capabilities: frozenset[str] = frozenset()) -> Declaration:
    """The declaration of a member: a reference only when beta > 0 (or adaptive), rollouts scored by the run's reward,
    the loss reduction of ``algo.cfg.loss_aggregation`` (Dr. GRPO's constant is the sampling budget
    ``max_new_tokens``), the config's epochs, mini-batches and G; with ``group_baseline`` (the group is each sample's
    baseline) the :func:`zero_spread_warning`; ``capabilities`` as :class:`~prefzoo.algos.base.Declaration`'s, plus
    ``sampler_correction`` (every member weights its loss by :func:`engine_correction`'s weights)."""
    cfg, aggregation = algo.cfg, AGGREGATION_OF[algo.cfg.loss_aggregation]
    warnings = (zero_spread_warning(cfg.num_samples, algo.sampling.temperature),) if group_baseline else ()
    if isinstance(cfg, GroupRelativeConfig) and cfg.scale_rewards == "mean":
        warnings += (MAXRL_WARNING,)
    return Declaration(
        reference=algo.beta > 0 or algo.objective.kl_controller == "adaptive", online=True, reward=True,
        aggregation=aggregation,
        aggregation_constant=algo.sampling.max_new_tokens if aggregation == "constant" else None,
        epochs=cfg.epochs, num_minibatches=cfg.num_minibatches, num_samples=cfg.num_samples,
        progress_keys=progress_keys, warnings=warnings, capabilities=capabilities | {"sampler_correction"},
        draws_prompts=cfg.dynamic_sampling, token_entropy=cfg.top_entropy_quantile < 1.0)


# ----------------------------------------------------------------------------------------------- the rollout
