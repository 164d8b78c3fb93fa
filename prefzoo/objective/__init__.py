"""prefzoo.objective — the maths shared by every algorithm of the zoo.

Every algorithm optimises (or approximates) J(pi) = E_{y~pi}[r] - beta * D(pi || pi_ref).
This package holds the formulas, and nothing else: it imports only torch and prefzoo's leaf error module
(no model, data or training loop), so the same code runs on a tabular policy in the tests and on a real model.

Map (one idea per module):

    errors.py       ObjectiveError (a PrefzooError and a ValueError) and the input checks that raise it
    logprobs.py     logits -> per-token log-probs (float32, chunked), entropy, masked
                    sum/mean/var, whitening (with a data-parallel all-reduce hook)
    linear_logps.py hidden states -> per-token log-probs with the output layer fused in, chunked
                    with recomputation (the (N, V) logits never held), optional entropy
    kl.py           KL estimators k1/k2/k3 (Schulman 2020), "in_reward" vs "as_loss" placement
                    (which gradient each really follows: Liu et al. 2025), exact categorical KL
    divergences.py  f-divergences (reverse KL, forward KL, JS, alpha) for f-DPO (Wang et al.
                    2024): links f', implicit rewards, exact D_f, the regularised optimum
    controllers.py  beta controllers: fixed, adaptive (Ziegler et al. 2019)
    optimum.py      closed-form optimum pi* = pi_ref exp(r/beta) / Z and J* = beta log Z; the beta of a KL budget
                    (beta as its Lagrange multiplier)
    advantages.py   group-relative advantages (GRPO / Dr. GRPO), leave-one-out (RLOO), GAE (PPO), the sequence
                    reward on the last token
    surrogate.py    PPO clipped surrogate (with DAPO clip-higher, INTELLECT-2's two-sided clip), clipped value loss,
                    explained variance; DPPO's divergence mask, SAPO's soft gate, DRO's quadratic penalty, VESPO's
                    sequence-level gamma kernel (no ratio clip)
    masks.py        masks on the policy term: DeepSeek-V3.2's off-policy sequence mask, the high-entropy token mask
                    (Wang et al. 2025, "Beyond the 80/20 rule")
    shaping.py      reward shaping before the advantages: DAPO's overlong penalty, GDPO's per-reward group
                    normalisation (the decoupled sum)
    distillation.py the generalised JSD to a teacher per token (GKD; TRL's convention at the ends), chunked with
                    recomputation over the vocabulary; the teacher's log-ratio as a per-token reward
    importance.py   GSPO's sequence ratio (and GSPO-token's) and the sequence-level clip, CISPO's clipped IS weight,
                    -sg(w) A log pi, a sampler's log-prob mismatch and the weights that correct it (truncated or
                    masked, per token or per sequence: TIS, MIS, IcePop)
    pairwise.py     pairwise links on a pair's scores: Bradley-Terry sigmoid (cDPO smoothing), IPO, hinge,
                    rDPO, EXO, NCA, SPPO, APO, BCO, DiscoPOP, AOT, the chosen NLL
    odds.py         the log odds of a completion and ORPO's log odds ratio, stable near P = 1
    prospect.py     KTO's Kahneman-Tversky value of an unpaired, labelled completion (loss lambda_y - v)
    best_of_n.py    best-of-n: which sample it keeps, its analytic KL log n - (n-1)/n
    reduce.py       the one loss reduction (sequence/token mean, constant, example mean) with a
                    global normaliser, exact under gradient accumulation and data parallelism

Conventions (DESIGN.md): logps (B, T) float32, log_ratio = logps - ref_logps, bool masks with
True = "this token counts", loss = -objective.
"""

from .advantages import (ADVANTAGE_SCALES, add_sequence_reward, equal_reward_groups, gae, group_advantages,
                         leave_one_out_advantages)
from .best_of_n import best_of_n_indices, best_of_n_kl
from .controllers import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    make_kl_controller,
)
from .divergences import (
    DIVERGENCES,
    FDivergence,
    f_divergence,
    get_divergence,
    implicit_reward,
    regularised_optimum,
)
from .errors import ObjectiveError
from .kl import (
    ESTIMATORS,
    PLACEMENTS,
    categorical_kl,
    kl_estimate,
    kl_loss,
    kl_penalty_rewards,
    sequence_kl,
)
from .logprobs import (
    last_token_index,
    masked_logps,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    mean_logps,
    sequence_logps,
    support_log_mass,
    support_mask,
    token_entropy,
    token_logps,
)
from .linear_logps import linear_token_logps
from .optimum import beta_for_kl_budget, log_partition, optimal_policy, optimal_value, regularised_objective
from .reduce import AGGREGATIONS, aggregate_loss, loss_normaliser
from .odds import log_odds, log_odds_ratio
from .prospect import kto_loss
from .pairwise import PAIRWISE_LOSSES, PairScores, bradley_terry_loss, pairwise_loss
from .surrogate import (TRUST_REGION_LOSSES, clipped_surrogate_loss, clipped_value_loss, dppo_loss, dro_loss,
                        explained_variance, ratio_statistics, sapo_loss, vespo_loss)
from .masks import high_entropy_mask, off_policy_sequence_mask
from .shaping import decoupled_group_rewards, overlong_penalty
from .distillation import TokenLogits, chunked_generalized_jsd, generalized_jsd, teacher_log_ratio_rewards
from .importance import (CORRECTION_MODES, clipped_is_weight, correction_log_ratio, correction_metrics,
                         correction_weights, gspo_token_log_ratio, importance_sampling_loss, sampler_mismatch,
                         sequence_clipped_surrogate_loss, sequence_log_ratio, weighted_policy_gradient_loss)

__all__ = [
    # errors
    "ObjectiveError",
    # shaping
    "overlong_penalty",
    "decoupled_group_rewards",
    # distillation
    "TokenLogits",
    "generalized_jsd",
    "chunked_generalized_jsd",
    "teacher_log_ratio_rewards",
    # logprobs
    "token_logps",
    "support_mask",
    "support_log_mass",
    "linear_token_logps",
    "masked_logps",
    "sequence_logps",
    "mean_logps",
    "token_entropy",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "last_token_index",
    # kl
    "ESTIMATORS",
    "PLACEMENTS",
    "kl_estimate",
    "kl_penalty_rewards",
    "kl_loss",
    "categorical_kl",
    "sequence_kl",
    # divergences
    "DIVERGENCES",
    "FDivergence",
    "get_divergence",
    "implicit_reward",
    "f_divergence",
    "regularised_optimum",
    # controllers
    "KL_CONTROLLERS",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    # optimum
    "optimal_policy",
    "log_partition",
    "optimal_value",
    "regularised_objective",
    "beta_for_kl_budget",
    # advantages
    "ADVANTAGE_SCALES",
    "group_advantages",
    "equal_reward_groups",
    "leave_one_out_advantages",
    "gae",
    "add_sequence_reward",
    # surrogate
    "clipped_surrogate_loss",
    "clipped_value_loss",
    "explained_variance",
    "ratio_statistics",
    "vespo_loss",
    # masks
    "off_policy_sequence_mask",
    "high_entropy_mask",
    # importance
    "sequence_log_ratio",
    "gspo_token_log_ratio",
    "sequence_clipped_surrogate_loss",
    "clipped_is_weight",
    "importance_sampling_loss",
    "weighted_policy_gradient_loss",
    "sampler_mismatch",
    "CORRECTION_MODES",
    "correction_log_ratio",
    "correction_weights",
    "correction_metrics",
    # pairwise
    "PAIRWISE_LOSSES",
    "PairScores",
    "pairwise_loss",
    "bradley_terry_loss",
    # odds (ORPO)
    "log_odds",
    "log_odds_ratio",
    # prospect (KTO)
    "kto_loss",
    # best-of-n
    "best_of_n_kl",
    "best_of_n_indices",
    # reduce
    "AGGREGATIONS",
    "loss_normaliser",
    "aggregate_loss",
]
