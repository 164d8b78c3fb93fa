"""DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2: keep the groups with 0 < #correct < G, draw more prompts until the
batch is full) in the online family, on the tabular bed where which groups are informative is known: prompt 0's
responses all score 1 (never informative), prompt 1's score 0, 1, 0."""

from __future__ import annotations

import pytest
import torch

from prefzoo.errors import ConfigError
from prefzoo.lab.runner import build_algorithm
from prefzoo.lab.tabular import TableScorer, TabularPolicy, prompt_batch
from prefzoo.types import StepContext

REWARDS = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
G = 4


def _run(draw_rows, max_extra_draws=3, first=(0, 0, 1, 1), seed=0):
    algo = build_algorithm("grpo", dict(num_samples=G, scale_rewards="none", dynamic_sampling=True,
                                        max_extra_draws=max_extra_draws), dict(beta=0.0), 0.0)
    policy = TabularPolicy(torch.zeros(2, 3), with_reference=False, seed=seed)
    drawn = []

    def draw(round):
        drawn.append(round)
        return prompt_batch(torch.tensor(draw_rows))

    batch, metrics = algo.make_experience(policy, prompt_batch(torch.tensor(first)), TableScorer(REWARDS),
                                          StepContext(draw_prompts=draw))
    return batch, metrics, drawn


def _groups(batch):
    rewards = batch.rewards.view(-1, G)
    return batch.prompt_ids[::G, -1].tolist(), (rewards.max(-1).values != rewards.min(-1).values).tolist()


def test_the_batch_is_refilled_with_informative_groups_only():
    """4 groups asked; round 0 has 2 of prompt 0 (dropped) and 2 of prompt 1 (informative unless all 4 samples drew
    the same reward: (1/3)^4 + (2/3)^4 = 0.21 each); every extra round draws 4 prompt-1 groups. The batch holds 4
    groups, every one of prompt 1 and informative; each round's dropped groups are counted."""
    batch, m, drawn = _run([1, 1, 1, 1])
    prompts, informative = _groups(batch)
    assert len(batch.rewards) == 4 * G and prompts == [1, 1, 1, 1] and all(informative)
    assert m["dynamic/kept_groups"] == 4 and m["dynamic/extra_draws"] == len(drawn) >= 1
    assert drawn == list(range(1, len(drawn) + 1))  # rounds 1, 2, ...: distinct rollout seeds per round
    assert m["dynamic/dropped_groups"] >= 2  # prompt 0's two groups at least
    # advantages: r - group mean with scale none: a group of prompt 1 with rewards (0, 1, 0, 0) gets (-.25, .75, ...);
    # 0/1 rewards over G = 4 have dyadic means (k/4), so both sides are exact in float32: compared exactly
    a = batch.advantages[:, 0].view(-1, G)
    torch.testing.assert_close(a, batch.rewards.view(-1, G) - batch.rewards.view(-1, G).mean(-1, keepdim=True),
                               rtol=0, atol=0)


def test_at_the_cap_the_step_trains_on_fewer_groups():
    """Extra rounds that bring only prompt 0 (never informative): after max_extra_draws=2 rounds the batch is round
    0's informative groups, fewer than 4."""
    batch, m, drawn = _run([0, 0, 0, 0], max_extra_draws=2)
    prompts, informative = _groups(batch)
    assert drawn == [1, 2] and m["dynamic/extra_draws"] == 2
    assert set(prompts) == {1} and all(informative) and 0 < len(prompts) <= 2
    assert m["dynamic/dropped_groups"] == 2 + 8 + (2 - len(prompts))


def test_without_any_informative_group_the_first_round_is_kept():
    batch, m, drawn = _run([0, 0, 0, 0], max_extra_draws=1, first=(0, 0, 0, 0))
    assert len(batch.rewards) == 4 * G and m["dynamic/kept_groups"] == 0 and drawn == [1]
    assert float(batch.advantages.abs().max()) == 0.0


def test_the_plugins_without_a_group_baseline_refuse_it():
    with pytest.raises(ConfigError, match="whitened over the whole batch"):
        build_algorithm("reinforce_pp", dict(dynamic_sampling=True), {}, 0.05)
    with pytest.raises(ConfigError, match="whitened over the whole batch"):
        build_algorithm("reinforce_pp", dict(dynamic_sampling=True, baseline="group"), {"kl_placement": "as_loss"}, 0.0)
    with pytest.raises(ConfigError, match="still carries the KL penalty"):  # RLOO's default: k1 in the reward, 0.05
        build_algorithm("rloo", dict(dynamic_sampling=True), {"kl_estimator": "k1", "kl_placement": "in_reward"}, 0.05)
    with pytest.raises(ConfigError, match="max_extra_draws=-1 >= 0"):
        build_algorithm("rloo", dict(dynamic_sampling=True, max_extra_draws=-1), {}, 0.05)
    build_algorithm("rloo", dict(dynamic_sampling=True), {"kl_estimator": "k1", "kl_placement": "in_reward"}, 0.0)


def test_the_step_reports_the_first_rounds_reward_metrics():
    """The scorer is called once per round; after new_step (the loop's, each step) its reward/<name> metrics stay the
    first call's, as the step's ``reward`` does."""
    from prefzoo.models.loading import smollm2_tokenizer
    from prefzoo.rewards.registry import make_reward
    from prefzoo.training.scoring import TextScorer
    from tests.training.test_reward_shaping import _batch

    tok = smollm2_tokenizer()
    scorer = TextScorer(tok, make_reward(["tests.training.test_reward_shaping:digits"]), 0)
    first, prompts = _batch(tok, ["1", "22"], groups=1)
    second, _ = _batch(tok, ["333", "4444"], groups=1)
    scorer(first, prompts)
    scorer(second, prompts)
    assert scorer.last_metrics["reward/digits"] == 3.5  # no step: each call replaces them
    scorer.new_step()
    scorer(first, prompts)
    scorer(second, prompts)
    assert scorer.last_metrics["reward/digits"] == 1.5


def test_it_runs_through_the_loop_and_is_refused_with_asynchronous_rollouts(tmp_path):
    from prefzoo.training.loop import Trainer
    from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN, compose
    from tests.algos.test_distill import check_config

    run = [LETTER_REWARD, *TINY_RUN, "eval.before=false", "eval.after=false", "trainer.max_steps=2",
           "algo.dynamic_sampling=true"]
    summary = Trainer(compose(["algo=grpo", *run]), tmp_path).run()
    assert summary["final_train_metrics"]["dynamic/kept_groups"] >= 1
    with pytest.raises(ConfigError, match="synchronous rollouts only"):
        check_config(["algo=grpo", "algo.dynamic_sampling=true", "rollout.asynchronous=true"])


def test_a_group_equal_up_to_rounding_is_uninformative_for_the_filter_as_for_the_advantages():
    """Issue 48: the filter kept a group whose rewards differ only by rounding (0.5, 0.5, 0.5, 0.5000001: one float32
    ulp of 0.5 is 6e-8, so the last is 0.5 + 2 ulps), which then got all-zero advantages and trained nothing. One
    definition now: rewards of a group within 8 float32 ulps of its largest magnitude are equal, for both. A group that
    differs by a real reward (0.5 vs 0.75) stays informative, and its advantages are not zero."""
    from prefzoo.algos.online_sampling import informative_groups
    from prefzoo.objective import group_advantages

    rewards = torch.tensor([0.5, 0.5, 0.5, 0.5000001, 0.5, 0.5, 0.5, 0.75])
    assert informative_groups(rewards, 4).tolist() == [False, True]
    advantages = group_advantages(rewards, 4, "group", 1e-4).view(2, 4)
    assert (advantages[0] == 0).all() and (advantages[1] != 0).all()
