"""Reward model (algo=rm): the Bradley-Terry loss by hand, the terminal-state read-out, and the round trip
train (algo=rm) -> save -> reward=model reward.path=... -> PPO, on the tiny model.

Tolerances (tests/bounds.py). The hand cases run in float64 (kind 1: a few roundings of numbers below 50, u64 = 1.1e-16
relative each; bound 1e-12 relative, or exact where nothing is rounded: sums of integer ids). The round trip compares
two float32 passes of the trained tiny model through different code (kind 3, measured): see its docstring.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from prefzoo.types import ObjectiveSettings, SequenceBatch
from prefzoo.algos.rm import RewardModelling, RMConfig
from prefzoo.objective import bradley_terry_loss
from prefzoo.types import sequence_rewards
from prefzoo.data.preference import collate_preferences, PreferenceExample
from prefzoo.errors import ConfigError
from tests.algos.hydra_runs import TINY_RUN, compose
from tests.models.helpers import one_thread_fixture

FIXTURE = str(Path(__file__).resolve().parents[1] / "fixtures" / "arithmetic_pairs.jsonl")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


def test_bradley_terry_loss_hand_values():
    """-log sigma(d) = log(1 + e^-d): d = 2 -> log(1 + e^-2) = 0.126928; d = 0 -> log 2 = 0.693147;
    d = -2 -> log(1 + e^2) = 2.126928; d = 40 -> ~4.2e-18 (no overflow at d = -40: 40.0). Relative to each value
    within 1e-12, so the 4.2e-18 too (log(1 + e^-40) = e^-40 (1 - 2e-18)); the 6-decimal values within 1e-6 (their
    rounding, <= 5e-7)."""
    f64 = dict(dtype=torch.float64)
    chosen = torch.tensor([2.0, 0.0, -1.0, 20.0, -20.0], **f64)
    rejected = torch.tensor([0.0, 0.0, 1.0, -20.0, 20.0], **f64)
    expected = torch.tensor([math.log1p(math.exp(-2)), math.log(2), math.log1p(math.exp(2)), math.exp(-40), 40.0],
                            **f64)
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected), expected, rtol=1e-12, atol=0)
    assert abs(expected[0].item() - 0.126928) < 1e-6 and abs(expected[2].item() - 2.126928) < 1e-6
    with pytest.raises(ValueError):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))


class SumPolicy:
    """values[b, t] = sum of the completion ids before column t (the state before token t), 0 on padding: the
    value of the state after the whole completion is then the sum of all its ids. float64."""

    pad_id = 0

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        ids = batch.completion_ids.double() * batch.completion_mask
        before = torch.cumsum(ids, dim=1) - ids
        return before.masked_fill(~batch.completion_mask, 0.0)


def test_terminal_read_out_and_loss_through_the_plugin():
    """Pairs (prompt [1], chosen, rejected): chosen [3, 2] vs rejected [1] -> r = 5 vs 1, d = 4; chosen [1] vs
    rejected [2, 2, 2] -> r = 1 vs 6, d = -5. Loss = [log(1 + e^-4), log(1 + e^5)]; accuracy 1/2."""
    examples = [PreferenceExample([1], [3, 2], [1]), PreferenceExample([1, 1], [1], [2, 2, 2])]
    batch = collate_preferences(examples, [0, 1], pad_id=0)
    ext = batch.chosen.with_terminal_column()
    assert ext.completion_mask.tolist() == [[True, True, True], [True, True, False]]
    f64 = dict(dtype=torch.float64)
    torch.testing.assert_close(sequence_rewards(SumPolicy().values, batch.rejected), torch.tensor([1.0, 6.0], **f64),
                               rtol=0, atol=0)
    algo = RewardModelling(RMConfig(), ObjectiveSettings(beta=0.0))
    assert not algo.declaration.reference and algo.declaration.value_head is not None and not algo.declaration.online
    out = algo.loss(SumPolicy(), batch)
    torch.testing.assert_close(out.values, torch.tensor([math.log1p(math.exp(-4)), math.log1p(math.exp(5))], **f64),
                               rtol=1e-12, atol=0)
    assert out.mask is None and out.metrics["accuracy"] == 0.5 and out.metrics["margin"] == -0.5  # (4 - 5) / 2
    chosen, rejected = algo.implicit_rewards(SumPolicy(), batch)
    torch.testing.assert_close(chosen, torch.tensor([5.0, 1.0], **f64), rtol=0, atol=0)
    centred = RewardModelling(RMConfig(center_rewards_coef=0.1), ObjectiveSettings(beta=0.0)).loss(SumPolicy(), batch)
    torch.testing.assert_close(centred.values - out.values, 0.1 * torch.tensor([36.0, 49.0], **f64), rtol=0, atol=1e-12)


def test_rm_then_ppo_with_the_learned_reward(tmp_path):
    """algo=rm on the fixture pairs: held-out accuracy is reported and the model is saved; reward=model reads it
    back and scores like the trained model; PPO then trains on the reward model's own prompts (data=model).

    The bounds (tests/bounds.py, kind 3: two float32 passes of the tiny model through different code, the trainer's
    padded batch against the saved model's scorer, and the scorer's fast path (adapter merged into the weights, rows
    packed) against its plain one). Measured (2026-12-06), at 1 and 2 torch threads alike: 7.2e-7 and 9.5e-7 on scores
    up to 3.75, 1.5 and 2 float32 ulps. Bound 1e-4 + 1e-4 relative, >= 100x that; a lost adapter, head or token moves
    a score by 1e-2 or more. Not marked numerics: it trains two runs (6 s)."""
    from prefzoo.rewards.model import reward_model_function
    from prefzoo.training.loop import Trainer

    rm_dir = tmp_path / "rm"
    cfg = compose(["algo=rm", "data=file", f"data.path={FIXTURE}", "data.eval_fraction=0.25", "trainer.max_steps=4",
                   "trainer.lr=0.01", "trainer.batch_size=4"] + [o for o in TINY_RUN if "num_problems" not in o])
    assert cfg.eval.num_problems == 0  # conf/algo/rm.yaml: nothing is sampled from a reward model
    trainer = Trainer(cfg, rm_dir)
    assert getattr(trainer.policy.reference, "kind", None) != "copy"  # no reference model is loaded
    summary = trainer.run()
    assert "preference_accuracy" in summary["eval_after"] and summary["eval_after"]["n_pairs"] == 10
    assert "task_reward" not in summary["eval_after"]
    assert summary["beta"] is None and summary["final_beta"] is None  # no divergence term: no beta recorded
    assert "no β (the loss has no divergence term)" in (rm_dir / "adapter" / "README.md").read_text()
    meta = json.loads((rm_dir / "value_model.json").read_text())
    assert meta["kind"] == "reward_model" and meta["data"]["path"] == FIXTURE
    assert (rm_dir / "adapter" / "adapter_config.json").is_file() and (rm_dir / "value_head.safetensors").is_file()

    # the saved model scores text as the trained one scores the same tokens
    ex = trainer.prefs.eval[:3]
    batch = collate_preferences(ex, [0, 1, 2], trainer.policy.pad_id)
    with torch.no_grad():
        expected = sequence_rewards(trainer.policy.values, batch.chosen)
    tok = trainer.tokenizer
    prompts = [tok.decode(e.prompt_ids) for e in ex]
    completions = [tok.decode(e.chosen_ids, skip_special_tokens=True) for e in ex]
    scores = reward_model_function(str(rm_dir))(prompts, completions)
    torch.testing.assert_close(torch.tensor(scores), expected, atol=1e-4, rtol=1e-4)
    # the scorer's fast path (adapter merged, rows packed, a prompt shared by 3 rows scored once) against the plain
    # pass on 9 rows: 3 prompts x 3 completions of different lengths
    from prefzoo.rewards.model import RewardModelFunction

    rows = [(p, c + " and so on" * k) for p, c in zip(prompts, completions) for k in range(3)]
    fast = RewardModelFunction(rm_dir, fast=True)
    assert fast.model.padding_free and not hasattr(fast.model.model, "peft_config")  # packed, merged
    plain = RewardModelFunction(rm_dir, fast=False)
    assert not plain.model.padding_free and hasattr(plain.model.model, "peft_config")
    args = ([p for p, _ in rows], [c for _, c in rows])
    torch.testing.assert_close(torch.tensor(fast(*args)), torch.tensor(plain(*args)), atol=1e-4, rtol=1e-4)

    with pytest.raises(ConfigError, match="reward.path"):
        reward_model_function(None)
    with pytest.raises(ConfigError, match="no reward model"):
        reward_model_function(str(tmp_path))

    ppo = compose(["algo=ppo", "reward=model", f"reward.path={rm_dir}", "trainer.max_steps=1", "algo.epochs=1"]
                  + TINY_RUN)
    assert ppo.data.name == "model"
    ppo_trainer = Trainer(ppo, tmp_path / "ppo")
    assert all("What is" in t for t in ppo_trainer.train_prompts.texts)  # the fixture's arithmetic prompts
    assert "answer" in ppo_trainer.train_prompts.columns
    out = ppo_trainer.run()
    assert "reward/reward_model" in out["final_train_metrics"] and "task_accuracy" in out["eval_after"]
