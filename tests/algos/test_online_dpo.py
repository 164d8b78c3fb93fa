"""Online DPO plugin: pairs from two samples per prompt ranked by the reward (ties dropped and counted), the DPO
loss on them by hand, the Bradley-Terry judge's per-prompt draws, and a 2-step run on the tiny model.

Tolerances (tests/bounds.py, kind 1: the hand cases are exact). The stub's table is float64; the pair metrics and the
KL are float64 sums (prefzoo/algos/pairwise.py), within 1e-12 of their formulas, over 1000x the float64 rounding
(u64 = 1.1e-16 relative). The losses are computed in float64 and rounded ONCE to float32 (``losses.float()`` there):
a loss is within u32 = 6e-8 of its formula relative to its size, its gradient (through that cast, with the float32
upstream 1/3) within 2 u32; both are held to 1e-6 relative, 16x and 8x that worst case. A float32 mean of the 3
losses (>= 0) adds two additions and a division, 4 u32 = 2.4e-7 relative in all (held to 1e-6 relative against the
formula); a hand value written to 7 decimals is off by at most 1.5e-7 (three rounded terms summed): against those the
bound is 1e-6 absolute, 3x the worst case of both together (<= 3.1e-7). ``frac_ties``, a float32 mean of booleans, is
one rounding: 1e-6 relative, 16x. The tie's loss and gradient are exactly 0 (weight 0): compared exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from prefzoo.algos.online_dpo import OnlineDPO, OnlineDPOConfig
from prefzoo.errors import ConfigError
from prefzoo.objective import aggregate_loss
from prefzoo.types import ROLLOUT_SEED_COLUMN, ObjectiveSettings, PromptBatch, SequenceBatch
from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN, compose
from tests.models.helpers import one_thread_fixture


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


class PairPolicy:
    """Three prompts x 2 samples, one token each (ids 0..5 = rows), log pi = a trainable table per row and
    log pi_ref = log pi - rho with rho = (0.2, -0.1 | 0.0, 0.5 | 0.25, 0.25), in float64. Rows 4 and 5 are binary
    fractions (log pi -0.75 and -1.0), so their log-ratios log pi - (log pi - rho) are exactly 0.25 and pair 2's margin
    exactly 0: its accuracy (margin > 0) does not hang on a rounding. (With rho 0.3 and log pi -0.7, -0.9 the margin
    was 0 up to rounding: -3.0e-8 in float32, +5.6e-17 in float64, which counted the pair as right.)"""

    def __init__(self):
        self.logp = torch.nn.Parameter(torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.75, -1.0], dtype=torch.float64))
        self.rho = torch.tensor([0.2, -0.1, 0.0, 0.5, 0.25, 0.25], dtype=torch.float64)
        self.reference = object()

    def sample(self, prompts, n, params):
        assert n == 2 and len(prompts.prompt_ids) == 3
        mask = torch.ones(6, 1, dtype=torch.bool)
        return SequenceBatch(prompts.prompt_ids.repeat_interleave(2, 0), prompts.prompt_mask.repeat_interleave(2, 0),
                             torch.arange(6)[:, None], mask, torch.arange(3).repeat_interleave(2), torch.zeros(6, dtype=torch.bool))

    def logps(self, batch, temperature=1.0, with_entropy=False):
        lp = self.logp[batch.completion_ids[:, 0]][:, None]
        return lp, (torch.ones_like(lp) if with_entropy else None)

    def ref_logps(self, batch, temperature=1.0):
        ids = batch.completion_ids[:, 0]
        return (self.logp.detach()[ids] - self.rho[ids])[:, None]


PROMPTS = PromptBatch(torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool), {})
REWARDS = lambda samples, prompts: torch.tensor([0.0, 1.0, 0.5, 0.5, 0.9, 0.2])  # noqa: E731


def make(beta=0.5, **cfg):
    return OnlineDPO(OnlineDPOConfig(**cfg), ObjectiveSettings(beta=beta))


def test_pairs_by_reward_with_the_tie_dropped_and_the_dpo_loss_by_hand():
    """Prompt 0: rewards (0, 1): row 1 chosen, row 0 rejected. Prompt 1: (0.5, 0.5): a tie, weight 0 (its order,
    the second sample first since the first does not win strictly, does not matter). Prompt 2:
    (0.9, 0.2): row 4 chosen. Sigmoid loss at beta 0.5 on margin = beta (rho_w - rho_l): pair 0: 0.5 (-0.1 - 0.2)
    = -0.15 -> log(1 + e^0.15) = 0.770957; pair 2: 0.5 (0.25 - 0.25) = 0 -> log 2 = 0.693147; the tie: 0. Mean over
    the 3 pairs: (0.770957 + 0.693147)/3. accuracies over the 2 untied pairs: (0 + 0)/2 (margins -0.15 and 0)."""
    algo, policy = make(), PairPolicy()
    batch, m = algo.make_experience(policy, PROMPTS, REWARDS)
    assert batch.chosen.completion_ids[:, 0].tolist() == [1, 3, 4] and batch.rejected.completion_ids[:, 0].tolist() == [0, 2, 5]
    assert batch.weights.tolist() == [1.0, 0.0, 1.0] and m["frac_ties"] == pytest.approx(1 / 3, rel=1e-6)
    out = algo.loss(policy, batch)
    want = [math.log1p(math.exp(0.15)), 0.0, math.log(2.0)]  # the tie's 0 is exact (weight 0)
    torch.testing.assert_close(out.values.detach().double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    loss = aggregate_loss(out.values, None, "example_mean", 3.0)
    assert float(loss) == pytest.approx(sum(want) / 3, rel=1e-6)
    total, count = out.token_metrics["rewards/margins"]
    assert (total / count, count) == (pytest.approx(-0.075, abs=1e-12), 2.0)
    assert out.token_metrics["rewards/accuracies"] == (0.0, 2.0)
    # k1 drift from the summed log-probs, over all 6 samples: mean of rho = 1.1 / 6
    assert out.token_metrics["kl"][0] / out.token_metrics["kl"][1] == pytest.approx(1.1 / 6, abs=1e-12)


def test_the_tied_pair_gets_no_gradient():
    """d loss / d logp: pair 0 (chosen row 1, rejected row 0) gets -+ beta sigmoid(-m)/3 = -+0.5 sigmoid(0.15)/3,
    pair 2 (rows 4, 5) -+0.5 * 0.5 / 3; rows 2 and 3 (the tie) exactly 0."""
    algo, policy = make(), PairPolicy()
    batch, _ = algo.make_experience(policy, PROMPTS, REWARDS)
    out = algo.loss(policy, batch)
    aggregate_loss(out.values, None, "example_mean", 3.0).backward()
    s = 1 / (1 + math.exp(-0.15))
    want = torch.tensor([0.5 * s / 3, -0.5 * s / 3, 0.0, 0.0, -0.25 / 3, 0.25 / 3], dtype=torch.float64)
    torch.testing.assert_close(policy.logp.grad, want, rtol=1e-6, atol=0)  # the tie's zeros exactly


def test_bradley_terry_judge_draws_one_uniform_per_prompt_from_its_rollout_seed():
    """With rollout seeds the draws depend on each prompt's seed only: the same seed gives the same label in any
    batch. P(row 2i wins) = sigmoid(r_2i - r_2i+1): with rewards (0, 1) the first sample wins when u < 0.2689."""
    algo = make(judge="bradley_terry")
    seeded = PromptBatch(PROMPTS.prompt_ids, PROMPTS.prompt_mask, {ROLLOUT_SEED_COLUMN: [7, 8, 9]})
    u = algo.judge_uniforms(seeded)
    u_again = algo.judge_uniforms(PromptBatch(PROMPTS.prompt_ids[:1], PROMPTS.prompt_mask[:1], {ROLLOUT_SEED_COLUMN: [8]}))
    assert float(u_again[0]) == float(u[1])
    batch, m = algo.make_experience(PairPolicy(), seeded, REWARDS)
    first_wins = u < torch.sigmoid(torch.tensor([-1.0, 0.0, 0.7]))
    assert batch.chosen.completion_ids[:, 0].tolist() == torch.where(first_wins, torch.tensor([0, 2, 4]),
                                                                     torch.tensor([1, 3, 5])).tolist()
    assert m["frac_ties"] == 0.0 and batch.weights.tolist() == [1.0, 1.0, 1.0]


def test_pair_weights_travel_with_their_pairs():
    """PreferenceBatch.weights (the contract's per-pair weight) follows select: rows [2, 1] get weights [1, 0]."""
    batch, _ = make().make_experience(PairPolicy(), PROMPTS, REWARDS)
    sub = batch.select([2, 1])
    assert sub.weights.tolist() == [1.0, 0.0] and sub.ref_chosen_logps.tolist() == batch.ref_chosen_logps[[2, 1]].tolist()
    assert [c.weights.tolist() for c in batch.chunks(2)] == [[1.0, 0.0], [1.0]]


def test_settings_and_declaration():
    with pytest.raises(ConfigError, match="Online DPO needs beta > 0"):
        make(beta=0.0)
    with pytest.raises(ConfigError, match="algo.judge='llm'"):
        make(judge="llm")
    d = make().declaration
    assert d.online and d.reference and d.num_samples == 2 and d.aggregation == "example_mean"
    assert d.has("implicit_rewards")


def test_online_dpo_runs_two_steps_on_the_tiny_model(tmp_path):
    from prefzoo.training.loop import Trainer

    cfg = compose(["algo=online_dpo", "reward=sentiment", LETTER_REWARD, "trainer.max_steps=2", "trainer.lr=0.01",
                   "trainer.micro_batch_size=1"] + TINY_RUN)
    summary = Trainer(cfg, tmp_path).run()
    metrics = summary["final_train_metrics"]
    for key in ("reward", "reward_std", "kl", "entropy", "frac_ties", "rewards/accuracies", "rewards/margins"):
        assert key in metrics, key
    assert summary["steps"] == 2


def test_exo_pair_without_label_smoothing_is_refused_up_front_as_dpo_refuses_it():
    """EXO's loss has log eps in it: eps = label_smoothing = 0 is refused at construction (the CLI's pre-flight),
    in one line naming the key and EXO's value, as algo=dpo does (before: accepted, failing at the first loss)."""
    with pytest.raises(ConfigError, match=r"algo.loss_type=exo_pair needs algo.label_smoothing > 0 .*1e-3"):
        make(loss_type="exo_pair")


def test_apo_zero_reads_each_side_by_hand():
    """APO-zero (D'Oosterlinck et al. 2024, eq. 7) on each side's score s = beta log(pi/pi_ref) = 0.5 rho.
    Pair 0: chosen row 1 (rho -0.1, s_w = -0.05), rejected row 0 (rho 0.2, s_l = 0.1):
    1 - sigma(-0.05) + sigma(0.1) = 1 - 0.4875026 + 0.5249792 = 1.0374766. Pair 2: rows 4 and 5 (rho 0.25 both):
    1 - sigma(0.125) + sigma(0.125) = 1. The tie (pair 1): 0. Mean over the 3 pairs: 2.0374766 / 3 = 0.6791589.
    (Before: the plugin passed a bare margin, and apo_zero refused it at the first loss.)"""
    policy = PairPolicy()
    algo = make(loss_type="apo_zero")
    batch, _ = algo.make_experience(policy, PROMPTS, REWARDS)
    out = algo.loss(policy, batch)
    assert out.values.tolist() == pytest.approx([1.0374766, 0.0, 1.0], abs=1e-6)
    assert float(out.values.mean()) == pytest.approx(0.6791589, abs=1e-6)


def test_aot_sorts_only_the_untied_pairs():
    """AOT (paired) sorts the policy's and the reference's margins over the batch and takes -log sigma of the sorted
    differences. Untied pairs: 0 (chosen row 1, rejected row 0) and 2 (rows 4, 5). Policy margins beta (log pi_w -
    log pi_l): 0.5 (-2.0 + 1.0) = -0.5 and 0.5 (-0.75 + 1.0) = 0.125; reference (log pi_ref = log pi - rho):
    0.5 (-1.9 + 1.2) = -0.35 and 0.5 (-1.0 + 1.25) = 0.125. Sorted differences: (-0.5 + 0.35, 0.125 - 0.125) =
    (-0.15, 0),
    losses log(1 + e^0.15) = 0.7709570 and log 2 = 0.6931472; the tie adds 0: mean over 3 pairs 0.4880347. Sorting the
    tie in too (its margins -0.5 and -0.75) would give (0.25, -0.15, 0) and another mean."""
    policy = PairPolicy()
    algo = make(loss_type="aot")
    batch, _ = algo.make_experience(policy, PROMPTS, REWARDS)
    out = algo.loss(policy, batch)
    assert float(out.values.mean()) == pytest.approx((0.7709570 + 0.6931472) / 3, abs=1e-6)


LOSS_TYPES = ["sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "sppo_hard", "apo_zero", "apo_down",
              "bco_pair", "discopop", "aot", "aot_unpaired", "sft", ["sigmoid", "sft"]]


@pytest.mark.parametrize("loss_type", LOSS_TYPES, ids=str)
def test_every_loss_type_of_dpo_trains_two_steps(loss_type):
    """Every loss type DPO has (the list is written out here, not read from the code) trains two steps of the loop's
    optimisation step on fresh pairs: finite losses, the untied pairs' log-probs move, the tie's does not (its rows
    3 and 2 get no gradient). exo_pair runs at EXO's eps 1e-3. (Before: 8 of the 14 passed validation, then failed
    at the first loss.)"""
    from prefzoo.training.step import mean_metrics, optimisation_step

    policy = PairPolicy()
    algo = make(loss_type=loss_type, label_smoothing=1e-3 if loss_type == "exo_pair" else 0.0)
    before = policy.logp.detach().clone()
    opt = torch.optim.SGD([policy.logp], lr=0.5)
    for _ in range(2):
        batch, _ = algo.make_experience(policy, PROMPTS, REWARDS)
        metrics = mean_metrics(optimisation_step(algo, policy, batch, opt, None, [policy.logp], 2))
        algo.after_step(metrics, len(batch))
        assert math.isfinite(metrics["loss"]), metrics
    moved = (policy.logp.detach() - before).abs()
    assert moved[[2, 3]].tolist() == [0.0, 0.0]
    assert moved[[1, 4]].min() > 0  # the chosen of each untied pair (sft reads the chosen alone)


def test_a_weighted_list_of_loss_types_runs_through_the_loop_on_the_tiny_model(tmp_path):
    """The loop's path for a stateful link (bco_pair's running shift, folded in after_step) in a weighted list."""
    from prefzoo.training.loop import Trainer

    cfg = compose(["algo=online_dpo", "algo.loss_type=[bco_pair,sft]", "algo.loss_weights=[1.0,0.5]", "reward=sentiment",
                   LETTER_REWARD, "trainer.max_steps=2", "trainer.lr=0.01", "algo.judge=bradley_terry"] + TINY_RUN)
    summary = Trainer(cfg, tmp_path).run()
    metrics = summary["final_train_metrics"]
    assert summary["steps"] == 2 and math.isfinite(metrics["loss"])
    assert metrics["loss/bco_pair"] > 0 and metrics["loss/sft"] > 0 and "bco/reward_shift" in metrics
