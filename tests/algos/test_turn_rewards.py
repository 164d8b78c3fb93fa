"""``env.reward_placement=turn``: an environment's step rewards land on the turn they reward (issue 28, item 3).

One trajectory, completion layout ``P P E E P P`` (P: the policy's token, E: the environment's): policy turn 1 at
positions 0-1, the environment's reply at 2-3, policy turn 2 at 4-5. The environment rewards turn 1 with -0.25 and
turn 2 with 0.5; the reward functions give the final answer 1.0, so the episode's reward (what the scorer returns: the
functions' plus the environment's summed step rewards) is 1.0 - 0.25 + 0.5 = 1.25. With the step rewards on their turns
the per-token rewards over the policy's tokens are [0, -0.25, 0, 1.5]; per trajectory they are [0, 0, 0, 1.25].

Tolerances (tests/bounds.py, kind 1). Every reward here is a binary fraction with a few bits (-0.25, 0.5, 1.25, 1.5),
and so is every sum, difference and product by gamma = 0.5 of them: the float32 arithmetic is exact, and the tests
compare exactly. (The first version's -0.2 and 1.3 were rounded in float32: returns 4.8e-8 off, held to round
tolerances; whitened advantages 4.8e-7 off -1 and 1 (measured 2026-12-06), held to 1e-5, near the worst case ~1e-5 of
a whitening that divides the returns' rounding by their std, 0.1.) The one rounded result is REINFORCE++'s whitening,
(R - 1.375) / sqrt(0.125^2 + 1e-8) in float32: the 1e-8, the sum, the sqrt and the division round, <= 4 u32 = 2.4e-7
relative on values of size 1: bound 1e-6 (measured 2.2e-8).
"""

from __future__ import annotations

import math

import pytest
import torch

from prefzoo.algos.online_sampling import place_rewards
from prefzoo.algos.ppo import PPO, PPOConfig
from prefzoo.algos.reinforce_pp import ReinforcePP, ReinforcePPConfig
from prefzoo.types import EpisodeLog, ObjectiveSettings, PromptBatch, SamplingParams, SequenceBatch

LAYOUT = "PPEEPP"
POLICY = [i for i, c in enumerate(LAYOUT) if c == "P"]
PROMPTS = PromptBatch(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), {})


def trajectory(per_turn: bool) -> SequenceBatch:
    log = EpisodeLog(messages=[], answer="", env_reward=0.25, turns=2,
                     turn_rewards=[(1, -0.25), (5, 0.5)] if per_turn else None)
    policy = torch.tensor([[c == "P" for c in LAYOUT]])
    return SequenceBatch(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                         torch.ones(1, len(LAYOUT), dtype=torch.long), policy, torch.zeros(1, dtype=torch.long),
                         torch.zeros(1, dtype=torch.bool), token_mask=torch.ones(1, len(LAYOUT), dtype=torch.bool),
                         episodes=[log])


class FlatPolicy:
    """log pi = log pi_ref = 0 and V = 0 at every position: only the rewards shape the returns."""

    reference, value_model = object(), object()

    def __init__(self, batch):
        self.batch = batch

    def sample(self, prompts, n, params):
        return self.batch

    def _zeros(self, batch):
        return torch.zeros(batch.completion_ids.shape)

    def logps(self, batch, temperature=1.0, with_entropy=False):
        return self._zeros(batch), (self._zeros(batch) if with_entropy else None)

    def ref_logps(self, batch, temperature=1.0):
        return self._zeros(batch)

    def logps_and_values(self, batch, temperature=1.0, with_entropy=False):
        return (*self.logps(batch, temperature, with_entropy), self._zeros(batch))


def score(samples, prompts):
    return torch.tensor([1.25])


def test_the_dense_step_rewards_sit_on_each_turns_last_token():
    dense = trajectory(True).turn_rewards()
    assert dense.tolist() == [[0.0, -0.25, 0.0, 0.0, 0.0, 0.5]]
    assert trajectory(False).turn_rewards() is None


def test_placing_moves_the_step_rewards_and_keeps_the_total():
    """[0, -0.25, 0, 0, 0, 1.5] (the 1.25 minus the two step rewards on the last token, plus 0.5 there); the row sums
    to 1.25 either way; by trajectory the 1.25 is on position 5 alone."""
    penalty = torch.zeros(1, len(LAYOUT))
    turn = place_rewards(penalty, torch.tensor([1.25]), trajectory(True))
    assert turn[0].tolist() == [0.0, -0.25, 0.0, 0.0, 0.0, 1.5]
    by_trajectory = place_rewards(penalty, torch.tensor([1.25]), trajectory(False))
    assert by_trajectory[0].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.25]


@pytest.mark.parametrize("gamma,per_turn,expected", [
    (1.0, True, [1.25, 1.25, 1.5, 1.5]),
    (1.0, False, [1.25, 1.25, 1.25, 1.25]),
    # the policy's 4 tokens are the time steps (the environment's are skipped): rewards [0, -0.25, 0, 1.5],
    # R_3 = 1.5, R_2 = 0.5 * 1.5 = 0.75, R_1 = -0.25 + 0.5 * 0.75 = 0.125, R_0 = 0.5 * 0.125 = 0.0625
    (0.5, True, [0.0625, 0.125, 0.75, 1.5]),
    # by trajectory: [0, 0, 0, 1.25] -> R = 1.25 * [0.125, 0.25, 0.5, 1]
    (0.5, False, [0.15625, 0.3125, 0.625, 1.25]),
], ids=["turn", "trajectory", "turn_discounted", "trajectory_discounted"])
def test_ppo_returns_credit_each_turn_with_the_rewards_from_it_on(gamma, per_turn, expected):
    """PPO, beta 0, lambda 1 and V = 0: the value targets are the discounted reward-to-go over the policy's tokens
    (Schulman et al. 2016, GAE(gamma, 1) = the discounted return minus V). Turn 1's tokens get 1.25 = -0.25 + 1.5,
    turn 2's only the 1.5 after turn 1 (values in the parameter list, derived there). Exact (module docstring)."""
    algo = PPO(PPOConfig(num_samples=1, gae_gamma=gamma, gae_lambda=1.0), ObjectiveSettings(beta=0.0),
               SamplingParams(temperature=1.0))
    batch, _ = algo.make_experience(FlatPolicy(trajectory(per_turn)), PROMPTS, score)
    assert batch.returns[0, POLICY].tolist() == expected
    assert batch.returns[0, [2, 3]].tolist() == [0.0, 0.0]  # the environment's tokens are no time steps
    assert batch.rewards.tolist() == [1.25]  # the logged reward is the episode's, either way


def test_reinforce_pp_whitened_returns_tell_the_turns_apart():
    """REINFORCE++ (baseline=none: the batch whitening alone, beta 0): returns [1.25, 1.25, 1.5, 1.5] over the policy's
    tokens, mean 1.375, population std 0.125, whitened to [-1, -1, 1, 1] (times 0.125 / sqrt(0.125^2 + 1e-8), the
    whitening's epsilon: 1 - 3.2e-7). By trajectory every return is 1.25, so every advantage is 0, exactly (nothing to
    learn from one sample whose tokens all share its return)."""
    cfg = ReinforcePPConfig(num_samples=1, baseline="none")
    s = 0.125 / math.sqrt(0.125 ** 2 + 1e-8)
    for per_turn, expected in ((True, [-s, -s, s, s]), (False, [0.0, 0.0, 0.0, 0.0])):
        algo = ReinforcePP(cfg, ObjectiveSettings(beta=0.0), SamplingParams(temperature=1.0))
        batch, _ = algo.make_experience(FlatPolicy(trajectory(per_turn)), PROMPTS, score)
        assert batch.advantages[0, POLICY].tolist() == pytest.approx(expected, abs=1e-6 if per_turn else 0.0)


def test_only_the_plugins_with_per_token_returns_declare_it():
    from prefzoo.algos import REGISTRY
    from prefzoo.config import Config, resolve_objective
    from tests.algos.hydra_runs import REQUIRED_SETTINGS

    declared = set()
    for name, cls in REGISTRY.items():
        cfg = Config(algo=cls.config_class(**REQUIRED_SETTINGS.get(name, {})))
        if cls(cfg.algo, resolve_objective(cfg)).declaration.has("turn_rewards"):
            declared.add(name)
    assert declared == {"ppo", "reinforce_pp"}
