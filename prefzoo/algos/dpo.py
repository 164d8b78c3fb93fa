"""Direct Preference Optimisation (Rafailov et al. 2023) and its f-divergence family (Wang et al. 2024).

The KL-regularised objective's optimum pi* = pi_ref exp(r/beta) / Z rearranges to
r(x, y) = beta log(pi*(y|x) / pi_ref(y|x)) + beta log Z(x); substituting it into the Bradley-Terry model
of preferences cancels Z and leaves a classification loss on log-ratios (Rafailov et al. 2023, eq. 7):

    margin = beta log(pi(y_w)/pi_ref(y_w)) - beta log(pi(y_l)/pi_ref(y_l))
    loss   = -log sigmoid(margin)

With a general f-divergence the implicit reward becomes beta f'(pi/pi_ref) (Wang et al. 2024, Thm. 1);
:func:`prefzoo.objective.implicit_reward` supplies it, so ``objective=forward_kl|js|alpha`` changes only
the link, and reverse KL gives exactly the loss above. ``algo.loss_type`` picks the link on the pair's scores
s = beta f'(pi/pi_ref) (the table, its equations and sources: :mod:`prefzoo.objective.pairwise`):

* ``sigmoid``  -(1-eps) log sigma(m) - eps log sigma(-m)  (eps = label_smoothing: conservative DPO,
  Mitchell 2023; eps = 0 is eq. 7 of Rafailov et al.);
* ``sigmoid_norm`` the sigmoid link on each side's log-ratio AVERAGED over its completion tokens,
  m = beta (log(pi/pi_ref)(y_w) / |y_w| - log(pi/pi_ref)(y_l) / |y_l|) (TRL 1.16's ``sigmoid_norm``; the logged
  rewards stay the summed ones, as TRL's; ``label_smoothing`` applies as in ``sigmoid``, which TRL's ignores);
* ``ipo``      (m / beta - 1 / (2 beta))^2  (Azar et al. 2023, eq. 17: the log-ratio difference is
  regressed to 1/(2 tau), tau = beta). Each side's log-ratio is AVERAGED over its completion tokens first
  (``ipo_average_log_ratio=true``, the default, as the IPO authors' code and TRL do): the target margin
  1/(2 beta) then does not depend on the completions' lengths. ``false`` keeps eq. 17 on summed log-ratios;
* ``hinge``    max(0, 1 - m)  (SLiC, Zhao et al. 2023, with the log-ratio scaled by beta);
* ``robust`` (rDPO: label_smoothing is the flip rate), ``exo_pair`` (label_smoothing is EXO's eps > 0),
  ``discopop`` (``discopop_tau``) on the margin; ``nca_pair``, ``sppo_hard``, ``apo_zero``, ``apo_down``,
  ``bco_pair`` and ``aot_unpaired`` on each side's score s = beta (f'(pi/pi_ref) - f'(1)), 0 at the reference
  (beta log(pi/pi_ref) under reverse KL, as TRL; for the other divergences TRL 1.16 subtracts other constants);
  ``aot`` on the sorted policy and reference log-prob margins (sorted within each micro-batch: its loss depends
  on ``trainer.micro_batch_size``, as TRL's on the per-device batch); ``sft``: the chosen's mean NLL;
* a list, ``loss_type=[sigmoid,sft]`` with ``loss_weights=[1.0,0.5]``: the weighted sum (weights default 1).
  Each component reads its own view: IPO the averaged log-ratios, the others the summed ones.

``bco_pair``'s reward shift delta is the running mean of the implicit rewards of both sides over every row of
every PREVIOUS step (row-weighted, from the step's logged ``bco/batch_reward``, so it is the same whatever the
micro-batch size or the number of processes); it is 0 at the first step, where the policy is the reference and
every reward is 0. (The BCO paper and TRL 0.x update it with each batch before using it: one step of lag here.)
It lives in the plugin's ``state_dict``, so a resumed run continues with the same delta.

Chosen and rejected go through the policy in one concatenated forward pass. Reference log-probs are
computed per batch under no_grad, or once before training (``precompute_ref_logps``: the capability
``precomputed_reference``).

The loss, the loss-type settings and their checks, the implicit rewards, IPO's averaging, bco_pair's shift and the
metrics are the pairwise family's (:class:`prefzoo.algos.pairwise.DirectPreference`), which Online DPO shares:
this module holds DPO's config and declaration. Metrics: the family's (TRL's names and meanings,
:mod:`prefzoo.algos.pairwise`).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefzoo.algos import register
from prefzoo.algos.base import Declaration
from prefzoo.algos.pairwise import DirectPreference, PairwiseConfig, check_pairwise_settings
from prefzoo.types import ObjectiveSettings


@dataclass
class DPOConfig(PairwiseConfig):
    name: str = "dpo"
    precompute_ref_logps: bool = False


@register
class DPO(DirectPreference):
    """DPO plugin: offline pairs, frozen reference, loss on the implicit-reward margin."""

    config_class = DPOConfig

    @staticmethod
    def validate_settings(cfg: DPOConfig, objective: ObjectiveSettings) -> None:
        check_pairwise_settings(cfg, objective, "DPO")

    def declare(self) -> Declaration:
        return Declaration(reference=True, aggregation="example_mean",
                           capabilities=frozenset({"implicit_rewards", "precomputed_reference", "f_divergence"}),
                           precompute_reference=self.cfg.precompute_ref_logps,
                           progress_keys=("loss", "rewards/accuracies", "rewards/margins"))
