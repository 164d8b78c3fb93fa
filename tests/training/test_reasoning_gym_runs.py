"""data=reasoning_gym end to end on the tiny random model: a 2-step GRPO run and a DPO run on the on-policy pairs.

Before: ``reward=reasoning_gym`` did not compose (Hydra: "Could not find 'reward/reasoning_gym'").
"""

import json

from prefzoo.rewards.reasoning_gym import reasoning_gym, reasoning_gym_accuracy

CALLS: list[dict] = []


def recorded(prompts, completions, **columns):
    """The reasoning_gym reward, recording what each call received."""
    CALLS.append({"prompts": list(prompts), **{k: list(v) for k, v in columns.items()}})
    return reasoning_gym(prompts, completions, **columns)


def _trainer(overrides, tmp_path):
    from prefzoo.training.loop import Trainer
    from tests.algos.hydra_runs import TINY_RUN, compose

    return Trainer(compose(TINY_RUN + overrides), tmp_path)


def test_grpo_samples_reasoning_gym_prompts_and_scores_them_with_their_entries(tmp_path):
    """2 steps x 2 prompts x G=2 samples. Every sample the reward scores (rollouts and evaluations) carries the
    entry of its own prompt (the entry's question is in the chat-templated prompt text) and its task; the letter-share reward beside it makes the
    advantages non-zero (the random model never answers right), so the update moves the adapter. The held-out
    task_accuracy is measured with the verifier (reasoning_gym_accuracy), 0 for the random model."""
    CALLS.clear()
    trainer = _trainer(["algo=grpo", "reward=reasoning_gym", "algo.num_samples=2", "trainer.max_steps=2",
                        "reward.functions=[tests.training.test_reasoning_gym_runs:recorded,"
                        "tests.algos.hydra_runs:letter_share]"], tmp_path)
    assert trainer.evaluator.correctness_fn is reasoning_gym_accuracy
    summary = trainer.run()
    assert summary["steps"] == 2 and summary["data"] == "reasoning_gym"
    # first the check of the reward on 2 training prompts (a placeholder completion, before the model loads); before
    # and after training: greedy answers to 2 held-out prompts, 2 x 2 samples; between them the 2 rollouts
    assert [len(call["prompts"]) for call in CALLS] == [2, 2, 4, 4, 4, 2, 4]
    for call in CALLS:
        assert call["task"] == ["chain_sum"] * len(call["prompts"])
        for prompt, entry in zip(call["prompts"], call["entry"]):
            assert json.loads(entry)["question"] in prompt and prompt.startswith("<|im_start|>")
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["reward/recorded"] for s in steps] == [0.0, 0.0] and all(s["grad_norm"] > 0 for s in steps)
    assert summary["results"]["task_accuracy"] == 0.0


def test_dpo_trains_on_pairs_built_from_a_reasoning_gym_task_cached_by_its_config(tmp_path, monkeypatch):
    """The pair builder samples 2 completions of each of 4 prompts from the random model: none is right, so each
    pair's chosen is the known answer in the task's format (<answer>oracle</answer>, scored 1.0 by the verifier)
    against a sampled one (score < 1). The pairs are cached under a key that includes the task config: a second run
    finds them, another data.task_config builds a second folder. DPO then trains 2 steps on them."""
    monkeypatch.setenv("PREFZOO_CACHE", str(tmp_path / "cache"))
    pairs = ["algo=dpo", "reward=reasoning_gym", "data.answer_format=tags", "data.pairs.num_prompts=4",
             "data.pairs.eval_prompts=2", "data.pairs.num_samples=2", "data.pairs.max_new_tokens=6",
             "trainer.max_steps=2"]
    summary = _trainer(pairs, tmp_path / "run1").run()
    (folder,) = (tmp_path / "cache" / "pairs").iterdir()
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and summary["steps"] == 2
    for row in rows:
        assert row["chosen"][0]["content"] == f"<answer>{row['answer']}</answer>"
        assert row["chosen_reward"] == 1.0 > row["rejected_reward"]
    assert summary["data_stats"]["train"]["known_answer_pairs"] == 4
    from prefzoo.cli import build_pairs
    from tests.algos.hydra_runs import TINY_RUN

    assert build_pairs(TINY_RUN + pairs) == 0
    assert len(list((tmp_path / "cache" / "pairs").iterdir())) == 1  # found again
    assert build_pairs(TINY_RUN + pairs + ["data.task_config.chain_sum.max_terms=3"]) == 0
    assert len(list((tmp_path / "cache" / "pairs").iterdir())) == 2
