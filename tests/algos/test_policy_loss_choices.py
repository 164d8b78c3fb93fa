"""algo.policy_loss's surrogates without the ratio clip (DPPO, SAPO, DRO) for the group-sampling plugins, MaxRL's
scale_rewards=mean and objective.kl_bias_correction: each trains two tiny steps through the composed command line,
with its metrics; the bad spellings are one line before anything loads."""

from __future__ import annotations

import math

import pytest

from prefzoo.config import to_typed
from prefzoo.errors import ConfigError
from prefzoo.training.loop import Trainer
from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN, compose

# two optimizer steps per rollout, so the surrogates see a ratio other than 1 on the second mini-batch
RUN = [LETTER_REWARD, *TINY_RUN, "trainer.max_steps=2", "trainer.lr=0.05", "rollout.temperature=1.0",
       "algo.num_minibatches=2", "eval.before=false", "eval.after=false"]


@pytest.mark.parametrize("algo,loss,extra", [
    ("grpo", "dppo_tv", []), ("grpo", "dppo_kl", []), ("grpo", "sapo", []), ("grpo", "dro", []),
    ("rloo", "sapo", []), ("reinforce_pp", "dppo_tv", []),
    ("grpo", "clipped", ["algo.scale_rewards=mean", "objective.beta=0.05", "objective.kl_bias_correction=true"]),
])
def test_each_choice_trains_two_tiny_steps(tmp_path, algo, loss, extra):
    summary = Trainer(compose([f"algo={algo}", f"algo.policy_loss={loss}", *RUN, *extra]), tmp_path).run()
    m = summary["final_train_metrics"]
    assert summary["steps"] == 2 and math.isfinite(m["loss"]) and 0 <= m["clip_fraction"] <= 1
    if loss == "sapo":
        assert 0 < m["gate_weight_mean"] <= 1  # 4 s (1 - s) <= 1, = 1 at ratio 1
    if extra:
        assert m["kl_loss"] >= 0


@pytest.mark.parametrize("overrides,message", [
    (["algo=grpo", "algo.policy_loss=clip"], "spells PPO's ratio clip 'clipped'"),
    (["algo=grpo", "algo.policy_loss=ppo"], "choose one of clipped, dppo_tv, dppo_kl, sapo, dro"),
    (["algo=grpo", "algo.policy_loss=sapo", "algo.sapo_temperature_neg=0"], "algo.sapo_temperature_neg=0"),
    (["algo=grpo", "algo.policy_loss=dppo_kl", "algo.dppo_delta=-1"], "algo.dppo_delta=-1"),
    (["algo=rloo", "objective.kl_bias_correction=true"], "objective.kl_placement=in_reward"),
    (["algo=grpo", "algo.scale_rewards=median"], "none, mean"),
])
def test_bad_choices_are_one_line(overrides, message):
    from prefzoo.algos import get_algorithm

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("'", "'")) as err:
        typed = to_typed(compose([*overrides, *TINY_RUN]))
        algo = get_algorithm(typed.algo.name)
        algo.validate_settings(typed.algo, __import__("prefzoo.config", fromlist=["x"]).resolve_objective(typed))
    assert "\n" not in str(err.value)
