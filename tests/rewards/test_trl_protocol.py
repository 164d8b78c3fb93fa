"""TRL's reward-function protocol (issue 14, item 3): functions written as TRL documents them (tests/rewards/helpers.py,
from TRL's GRPOTrainer docs: ``reward_len(completions, **kwargs)``, a regex format reward, a conversational one
reading ``completion[0]["content"]``, one returning None) are called with keywords, get message lists on
conversational prompts, and train GRPO unchanged; prefzoo's positional form ``fn(prompts, completions, **columns)``
keeps working beside them.
"""

import json

import pytest

from prefzoo.rewards.protocol import PROMPT_MESSAGES
from prefzoo.rewards.registry import CombinedReward, check_reward_signature
from tests.rewards import helpers

PROMPTS = ["What is 2+2?", "What is 1+2?", "What is 3+1?"]
GOOD = "<think>add</think><answer>4</answer>"


def test_trl_length_reward_is_called_with_keywords():
    """Expected: -abs(20 - len(c)), computed here: 20 characters -> 0, 3 -> -17, 25 -> -5. Before: RewardError
    "reward function 'reward_len' raised TypeError: reward_len() takes 1 positional argument but 2 were given"."""
    reward = CombinedReward([helpers.reward_len])
    assert reward(PROMPTS, ["a" * 20, "abc", "b" * 25], answer=[4, 3, 4]) == [0.0, -17.0, -5.0]


def test_trl_format_reward_and_a_column_as_keyword():
    """The regex format reward: only the first completion has the <think>/<answer> form (1, 0, 0); the ground-truth
    reward reads the ``answer`` column as a keyword: '4' in the 1st and 3rd completion, '3' not in the 2nd ('five?')."""
    reward = CombinedReward([helpers.format_reward_func, helpers.reward_with_ground_truth])
    totals = reward(PROMPTS, [GOOD, "five?", "it is 4"], answer=[4, 3, 4])
    assert reward.last_components == {"format_reward_func": [1.0, 0.0, 0.0], "reward_with_ground_truth": [1.0, 0.0, 1.0]}
    assert totals == [2.0, 0.0, 1.0]


def test_conversational_prompts_give_message_lists_to_trl_functions_and_strings_to_positional_ones():
    """With the prompts as chat messages (column PROMPT_MESSAGES, as the prompt batches of a conversational file
    carry them), a TRL function sees prompts as message lists and each completion as
    [{"role": "assistant", "content": text}] (TRL's form), so ``completion[0]["content"]`` works: format 1, 0; the
    positional-form length_reward still sees the plain strings: len(GOOD)=36, len("no")=2; and neither sees the
    reserved column."""
    messages = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    helpers.seen.calls.clear()
    reward = CombinedReward([helpers.conversational_format_reward, helpers.length_reward, helpers.seen])
    reward(["<chat>2+2", "<chat>1+2"], [GOOD, "no"], answer=[4, 3], completion_ids=[[1, 2], [3]],
           **{PROMPT_MESSAGES: messages})
    assert reward.last_components["conversational_format_reward"] == [1.0, 0.0]
    assert reward.last_components["length_reward"] == [float(len(GOOD)), 2.0]
    (call,) = helpers.seen.calls
    assert call["prompts"] == messages
    assert call["completions"] == [[{"role": "assistant", "content": GOOD}], [{"role": "assistant", "content": "no"}]]
    assert call["completion_ids"] == [[1, 2], [3]] and call["answer"] == [4, 3] and PROMPT_MESSAGES not in call


def test_standard_prompts_give_strings_and_completion_ids_to_trl_functions():
    helpers.seen.calls.clear()
    CombinedReward([helpers.seen])(PROMPTS[:1], ["x"], answer=[4], completion_ids=[[7]])
    assert helpers.seen.calls == [{"prompts": PROMPTS[:1], "completions": ["x"], "completion_ids": [[7]], "answer": [4]}]


def test_none_scores_are_missing_excluded_and_counted():
    """only_even_answers returns None for the odd answer 3 (sample 1): that sample's total is const_one's 1.0 alone
    (1 + 1, 1 + nothing, 1 + 1 = [2, 1, 2]), the function's component keeps None there, and the count of missing
    scores is 1 of 3. Before: RewardError "returned a non-number (NoneType) None for sample 1"."""
    reward = CombinedReward([helpers.const_one, helpers.only_even_answers])
    assert reward(PROMPTS, ["a", "b", "c"], answer=[4, 3, 4]) == [2.0, 1.0, 2.0]
    assert reward.last_components["only_even_answers"] == [1.0, None, 1.0]
    assert reward.last_missing == {"const_one": 0, "only_even_answers": 1}


def test_samples_no_function_scores_are_warned_about_once_naming_the_functions(caplog):
    """Hardening round 3, item 4: a function that returns None for every sample trained on reward 0 with only a
    metric (and the zero-spread warning blamed the task). Now, as TRL does, one warning when a sample got None from
    every function -- once per run, naming them -- and none when another function scored it (the test above)."""
    import logging

    reward = CombinedReward([helpers.only_even_answers])
    with caplog.at_level(logging.WARNING, logger="prefzoo.rewards"):
        assert reward(PROMPTS, ["a", "b", "c"], answer=[3, 5, 4]) == [0.0, 0.0, 1.0]
        reward(PROMPTS, ["a", "b", "c"], answer=[3, 5, 7])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("every reward function (only_even_answers) returned None for 2 of the 3 samples")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefzoo.rewards"):
        CombinedReward([helpers.const_one, helpers.only_even_answers])(PROMPTS, ["a", "b", "c"], answer=[3, 5, 7])
    assert caplog.records == []


@pytest.mark.parametrize("fn", [helpers.reward_len, helpers.format_reward_func, helpers.conversational_format_reward,
                                helpers.reward_with_ground_truth, helpers.only_even_answers, helpers.seen])
def test_the_signature_check_accepts_trl_functions(fn):
    """Before: ConfigError "has the signature (completions, **kwargs), but a reward function is called as ..."."""
    check_reward_signature("mod:fn", fn)
    check_reward_signature("mod:fn", fn, ["answer"])


def test_a_trl_function_missing_its_column_is_refused_up_front():
    """reward_with_ground_truth needs ``answer``; data with only ``subject`` cannot feed it."""
    from prefzoo.errors import ConfigError

    with pytest.raises(ConfigError, match="missing a required argument: 'answer'"):
        check_reward_signature("mod:fn", helpers.reward_with_ground_truth, ["subject"])


@pytest.mark.slow  # ~20 s of CPU: 2 GRPO steps of the tiny model on 8 conversational prompts, 2 evaluations
def test_trl_functions_train_grpo_on_conversational_prompts_unchanged(tmp_path):
    """GRPO, 2 steps, on a prompt file in TRL's conversational form, rewarded by TRL's conversational format reward
    (``completion[0]["content"]``: a plain string there is a TypeError, so the run finishing shows the messages
    arrived), the length reward and the None-returning one. Every answer is odd but row 0's, and a step takes 2
    distinct prompts x 2 samples, so at most one prompt of a step is even: reward/only_even_answers/missing is 0.5
    or 1.0 on both steps (logged from the first, which certainly has an odd one), and the function's mean, where
    any sample scored, is 1.0 (it returns only 1.0 or None: a None counted as 0 would pull it below 1). Before:
    RewardError "'conversational_format_reward' raised TypeError: ... takes 1 positional argument but 2 were given"."""
    from prefzoo.training.loop import Trainer
    from tests.algos.hydra_runs import TINY_RUN, compose

    rows = [{"prompt": [{"role": "user", "content": f"What is {i}+{i + 1}?"}], "answer": 0 if i == 0 else 2 * i + 1}
            for i in range(10)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fns = "[tests.rewards.helpers:conversational_format_reward,tests.rewards.helpers:reward_len," \
          "tests.rewards.helpers:only_even_answers]"
    cfg = compose(["algo=grpo", "data=file", f"data.path={path}", "data.eval_fraction=0.2", f"reward.functions={fns}",
                   "trainer.max_steps=2", "algo.num_samples=2", *TINY_RUN])
    Trainer(cfg, tmp_path / "run").run()
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/reward_len" in s]
    assert len(steps) == 2
    for s in steps:
        assert s["reward/only_even_answers/missing"] in (0.5, 1.0)
        assert s.get("reward/only_even_answers", 1.0) == 1.0
        assert s["reward/conversational_format_reward"] == 0.0  # a random model writes no <think> form
