"""The cookbook's own RL trainer (``tinker_cookbook.rl.train.main``, tinker-cookbook 0.5.8) for 2 steps through
prefzoo's Tinker server on the tiny model (issue 50, A.1).

The task is an arithmetic environment written to the cookbook's ``Env`` interface (``initial_observation`` and
``step``: one turn, reward 1 for the right sum as the reply's last number, else 0), grouped by an ``EnvGroupBuilder``
(4 samples of one problem: the trainer centres rewards within a group), served by an ``RLDataset`` of 2 batches of 2
problems. The renderer is named explicitly (``qwen3_instruct``: SmolLM2's ChatML, see test_loops.py); the model name
given to the trainer is the server's model folder, which the trainer's ``get_tokenizer`` loads offline and the server
accepts as its model. The trainer runs unmodified: it creates its own ServiceClient (``TINKER_API_KEY`` from the
environment), a LoRA training client, a sampling client per step, ``forward_backward`` with its default loss
(importance_sampling) and ``optim_step``, and saves its final checkpoint through the server.

Checked: the trainer finishes 2 steps and logs, for each, rewards in [0, 1], a finite positive entropy, and its KL
between the sampler's log-probs and the trainer's near 0 (:data:`KL_BOUND`: the sampling client holds exactly the
weights just trained); its final checkpoint (state and sampler weights) is listed by the server.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Sequence

import chz
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")

from tinker_cookbook import renderers  # noqa: E402
from tinker_cookbook.rl import train  # noqa: E402
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: E402

PROBLEMS = [(3, 4), (12, 30), (7, 8), (25, 17)]
RENDERER = "qwen3_instruct"
#: kind 3 (tests/bounds.py): the trainer's KL between the sampler's log-probs and the training pass's, at the same
#: weights (the sampler is a snapshot of the adapter just trained): float rounding only, the decode loop's KV cache
#: against a full pass; measured |v1| = 6e-8, v2 = 3e-13 on both steps; factor ~170. A sampler on other weights (a stale
#: snapshot, another client's adapter) is off by the step's own size, orders of magnitude more.
KL_BOUND = 1e-5


class ArithmeticEnv(Env):
    """One question 'What is a+b?'; one reply; reward 1 if its last number is a+b."""

    def __init__(self, renderer, a: int, b: int):
        self.renderer, self.a, self.b = renderer, a, b

    async def initial_observation(self):
        prompt = self.renderer.build_generation_prompt([{"role": "user", "content": f"What is {self.a}+{self.b}?"}])
        return prompt, self.renderer.get_stop_sequences()

    async def step(self, action, *, extra=None):
        message, _ = self.renderer.parse_response(action)
        numbers = re.findall(r"-?\d+", renderers.get_text_content(message))
        reward = 1.0 if numbers and int(numbers[-1]) == self.a + self.b else 0.0
        return StepResult(reward=reward, episode_done=True, next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=self.renderer.get_stop_sequences(), metrics={"correct": reward})


@chz.chz
class ArithmeticGroup(EnvGroupBuilder):
    model_folder: str
    a: int
    b: int
    group_size: int = 4

    async def make_envs(self) -> Sequence[Env]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model_folder))
        return [ArithmeticEnv(renderer, self.a, self.b) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["arithmetic"]


class ArithmeticDataset(RLDataset):
    def __init__(self, builders: list[EnvGroupBuilder], batch_size: int):
        self.builders, self.batch_size = builders, batch_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return self.builders[index * self.batch_size: (index + 1) * self.batch_size]

    def __len__(self) -> int:
        return len(self.builders) // self.batch_size


@chz.chz
class ArithmeticDatasetBuilder(RLDatasetBuilder):
    model_folder: str

    async def __call__(self):
        builders = [ArithmeticGroup(model_folder=self.model_folder, a=a, b=b) for a, b in PROBLEMS]
        return ArithmeticDataset(builders, batch_size=2), None


def test_the_cookbook_rl_trainer_runs_two_steps_on_prefzoo(tinker_server, tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-cookbook")
    config = train.Config(learning_rate=1e-3, dataset_builder=ArithmeticDatasetBuilder(model_folder=tiny_folder),
                          model_name=tiny_folder, recipe_name="prefzoo_tinker_test", max_tokens=8,
                          log_path=str(tmp_path / "run"), eval_every=0, save_every=0, renderer_name=RENDERER,
                          base_url=tinker_server.url, lora_rank=8, max_steps=2, num_groups_to_log=0,
                          rollout_json_export=False)
    asyncio.run(train.main(config))

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/all/reward/total" in r]
    assert len(steps) == 2, rows
    for row in steps:
        assert 0.0 <= row["env/all/reward/total"] <= 1.0
        assert abs(row["optim/kl_sample_train_v1"]) <= KL_BOUND and abs(row["optim/kl_sample_train_v2"]) <= KL_BOUND
        assert math.isfinite(row["optim/entropy"]) and row["optim/entropy"] > 0
    saved = [json.loads(line) for line in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()]
    final = saved[-1]
    run_id = final["state_path"][len("tinker://"):].split("/")[0]
    listed = {c["tinker_path"] for c in tinker_server.server.list_checkpoints(run_id)}
    assert final["state_path"] in listed and final["sampler_path"] in listed
