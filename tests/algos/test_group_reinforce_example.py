"""docs/adding-an-algorithm.md's example of a new online-family member (docs/examples/group_reinforce.py): a plain
REINFORCE with a group baseline is its config, its checks, an advantage function and a per-token loss -- and it
trains, through the loop, as a user's plugin named by import path."""

from __future__ import annotations

import pytest
import torch

from prefzoo.algos import load_target
from prefzoo.errors import ConfigError
from prefzoo.types import ObjectiveSettings
from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN, compose
from tests.algos.test_grpo import PROMPTS, TwoTokenPolicy, fixed_scores
from tests.test_cli import ROOT

EXAMPLE = ROOT / "docs" / "examples" / "group_reinforce.py"


@pytest.fixture()
def plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    return load_target("group_reinforce:GroupReinforce")


def test_the_doc_shows_the_example_this_file_runs_and_it_is_40_lines():
    doc = (ROOT / "docs" / "adding-an-algorithm.md").read_text()
    code = EXAMPLE.read_text()
    assert code in doc and len(code.splitlines()) <= 45


def test_group_baseline_advantages_and_the_reinforce_loss_by_hand(plugin):
    """Rewards [1, 0, 0, 1 | 0, 0, 0, 1] in groups of G = 4: means 0.5 and 0.25, so A = [0.5, -0.5, -0.5, 0.5 |
    -0.25, -0.25, -0.25, 0.75] on every token of each completion (0 on padding). The loss on a token is -A log pi
    of that token (REINFORCE), nothing clipped; with beta = 0 no KL term and no reference. Compared exactly (kind 1,
    no rounding): the 0/1 rewards, their group means and the centred rewards are dyadic, exact in float32, and the
    loss is one product -A log pi of the same float32 operands on both sides."""
    algo = plugin(plugin.config_class(num_samples=4), ObjectiveSettings(beta=0.0))
    assert algo.name == "group_reinforce" and not algo.declaration.reference
    policy = TwoTokenPolicy(with_reference=False)
    exp, metrics = algo.make_experience(policy, PROMPTS, fixed_scores([1, 0, 0, 1, 0, 0, 0, 1]))
    want = torch.tensor([0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75])[:, None].expand(8, 3)
    torch.testing.assert_close(exp.advantages, want.masked_fill(~exp.completion_mask, 0.0), rtol=0, atol=0)
    out = algo.loss(policy, exp)
    logps = policy.logps(exp)[0].detach()
    torch.testing.assert_close(out.values.detach(), (-want * logps).masked_fill(~exp.completion_mask, 0.0),
                               rtol=0, atol=0)
    assert out.token_metrics["clip_fraction"][0] == 0.0 and metrics["reward"] == 3 / 8


def test_its_checks_refuse_a_group_of_one_and_several_updates(plugin):
    with pytest.raises(ConfigError, match="algo.num_samples=1: algo=group_reinforce needs at least 2"):
        plugin(plugin.config_class(num_samples=1), ObjectiveSettings(beta=0.0))
    with pytest.raises(ConfigError, match="no importance ratio"):
        plugin(plugin.config_class(epochs=2), ObjectiveSettings(beta=0.0))


def test_it_trains_two_steps_on_the_tiny_model_as_a_users_plugin(tmp_path, plugin):
    from prefzoo.training.loop import Trainer

    cfg = compose(["algo=custom", "algo.target=group_reinforce:GroupReinforce", "reward=sentiment", LETTER_REWARD,
                   "trainer.max_steps=2", "trainer.lr=0.01"] + TINY_RUN)
    summary = Trainer(cfg, tmp_path).run()
    assert summary["steps"] == 2 and summary["algo"] == "group_reinforce"
    assert {"reward", "entropy", "clip_fraction", "frac_zero_std_groups"} <= set(summary["final_train_metrics"])
