"""reward.aggregation=gdpo and reward.overlong_buffer in the online scorer (prefzoo.training.scoring.TextScorer): the
scorer's rewards are GDPO's decoupled sum of the functions' scores plus DAPO's overlong penalty of each completion's
length, recomputed here from the functions' own scores; a run trains with both; bad settings are one line."""

from __future__ import annotations

import pytest
import torch

from prefzoo.errors import ConfigError
from prefzoo.objective import decoupled_group_rewards, overlong_penalty
from prefzoo.rewards.registry import make_reward
from prefzoo.training.scoring import TextScorer
from prefzoo.types import PromptBatch, SequenceBatch
from tests.bounds import U32, sum_bound


def digits(prompts, completions, **_):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def vowels(prompts, completions, **_):
    return [sum(ch in "aeiou" for ch in c) / max(1, len(c)) for c in completions]


def _batch(tokenizer, texts, groups):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(i) for i in ids)
    completion = torch.tensor([i + [0] * (width - len(i)) for i in ids])
    mask = torch.tensor([[j < len(i) for j in range(width)] for i in ids])
    g = len(texts) // groups
    samples = SequenceBatch(torch.ones(len(texts), 1, dtype=torch.long), torch.ones(len(texts), 1, dtype=torch.bool),
                            completion, mask, prompt_index=torch.arange(groups).repeat_interleave(g))
    return samples, PromptBatch(torch.ones(groups, 1, dtype=torch.long), torch.ones(groups, 1, dtype=torch.bool),
                                {"prompt_text": ["q"] * groups})


def test_the_scorer_returns_the_decoupled_sum_plus_the_overlong_penalty():
    from prefzoo.models.loading import smollm2_tokenizer

    tok = smollm2_tokenizer()
    texts = ["a 1", "bee 22 and more words", "e", "333 u", "hello 4 world", "xyz"]
    samples, prompts = _batch(tok, texts, groups=2)
    reward = make_reward([f"{__name__}:digits", f"{__name__}:vowels"], [1.0, 3.0])
    lengths = samples.completion_mask.sum(-1)
    cap = int(lengths.max())
    scorer = TextScorer(tok, reward, 0, "gdpo", (cap, 3, 0.5))
    got = scorer(samples, prompts)
    table = torch.tensor([digits(None, texts), vowels(None, texts)], dtype=torch.float64)
    want = decoupled_group_rewards(table, torch.tensor([1.0, 3.0]), 3) + overlong_penalty(lengths, cap, 3, 0.5)
    # the same two functions on the same float64 table, then one float32 addition: the same arithmetic, equal bit for
    # bit (measured 0; the bound was 1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert scorer.last_metrics["reward/frac_overlong"] > 0 and scorer.last_metrics["reward/overlong"] < 0
    # a float64 mean of 6 small integers: exact up to ~1e-16; rel 1e-12 leaves 1e4
    assert scorer.last_metrics["reward/digits"] == pytest.approx(sum(digits(None, texts)) / 6, rel=1e-12)


def test_groups_of_one_are_refused_in_one_line():
    from prefzoo.models.loading import smollm2_tokenizer

    tok = smollm2_tokenizer()
    samples, prompts = _batch(tok, ["a", "b"], groups=2)
    with pytest.raises(ConfigError, match="groups of equal size >= 2"):
        TextScorer(tok, make_reward([f"{__name__}:digits"]), 0, "gdpo")(samples, prompts)


def test_a_run_trains_with_both_and_bad_settings_are_one_line(tmp_path):
    from prefzoo.training.loop import Trainer
    from tests.algos.hydra_runs import TINY_RUN, compose
    from tests.algos.test_distill import check_config

    two = f'reward.functions=["{__name__}:digits","{__name__}:vowels"]'
    run = [two, *TINY_RUN, "eval.before=false", "eval.after=false", "trainer.max_steps=2"]
    summary = Trainer(compose(["algo=grpo", "reward.aggregation=gdpo", "algo.scale_rewards=batch",
                               "reward.overlong_buffer=3", *run]), tmp_path).run()
    m = summary["final_train_metrics"]
    assert "reward/overlong" in m and "reward/vowels" in m
    # the decoupled sum's mean over whole groups is 0 (float64, ~1e-16). What rounding adds (kind 2 of tests/bounds.py):
    # each decoupled reward |r| <= 2 (G - 1) / sqrt(G) = R (two functions of weight 1, a z-score of G = 4 samples is at
    # most (G - 1) / sqrt(G)) rounds to float32 and adds a penalty |p| <= 1: u32 (2R + 1); the two float32 means
    # of B = 8 rewards: sum_bound(8 + 2, R + 1) + sum_bound(8 + 2, 1). 3.1e-6; measured 0 (the bound was 1e-5).
    r_max = 2 * 3 / 4 ** 0.5
    bound = U32 * (2 * r_max + 1) + sum_bound(10, r_max + 1) + sum_bound(10, 1)
    assert abs(m["reward"] - m["reward/overlong"]) <= bound
    for overrides, message in [(["algo=dpo", "reward.aggregation=gdpo"], "samples 0 per prompt"),
                               (["algo=grpo", "reward.overlong_buffer=7"], "reward.overlong_buffer=7 must be in [1"),
                               (["algo=grpo", "reward.aggregation=mean"], "reward.aggregation"),
                               (["algo=dpo", "reward.overlong_buffer=3"], "algo=dpo trains on none")]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[")) as err:
            check_config([*overrides, two, "rollout.max_new_tokens=6"])
        assert "\n" not in str(err.value)


def test_the_gdpo_comparison_rewards_by_hand():
    """bench/gdpo_rewards (the real-model GDPO comparison's second rewards): format_x10 is 10 x format_reward on a
    plain prompt ("Reply with just the number."): a bare number 10, a sentence ending in the number 5, no number 0;
    period_x10 is 10 for a completion ending in a full stop (trailing spaces ignored), right or wrong, else 0."""
    from bench.gdpo_rewards import format_x10, period_x10

    prompt = "What is 2 + 3? Reply with just the number."
    assert format_x10([prompt] * 3, ["5", "The answer is 5", "five"]) == [10.0, 5.0, 0.0]
    assert period_x10([prompt] * 4, ["5.", "6.  ", "5", "The sum is five"]) == [10.0, 10.0, 0.0, 0.0]
