"""Compose a run's typed config the way ``train.py`` does (Hydra over conf/), for in-process end-to-end tests."""

from __future__ import annotations

from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")

#: overrides that make a run on the tiny model take a few seconds
TINY_RUN = ["model=tiny", "trainer.device=cpu", "trainer.progress=false", "trainer.tensorboard=false",
            "trainer.num_threads=1", "trainer.save_every=0", "rollout.max_new_tokens=6", "eval.max_new_tokens=6",
            "eval.num_problems=2", "eval.diversity_prompts=2", "eval.diversity_samples=2", "eval.batch_size=4",
            "data.num_train=8", "data.num_eval=2", "trainer.batch_size=2"]


def compose(overrides: list[str]):
    """The validated :class:`prefzoo.config.Config` of ``python train.py <overrides>``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from prefzoo.cli import register_configs, to_typed

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return to_typed(hydra_compose(config_name="config", overrides=overrides))


def letter_share(prompts, completions, **_):
    """A reward that differs between random completions (the share of letters), so that every tiny-model rollout
    has non-zero advantages and every trainable part receives a gradient from the first step."""
    return [sum(ch.isalpha() for ch in text) / max(1, len(text)) for text in completions]


#: reward=sentiment's prompts with the letter-share reward
LETTER_REWARD = 'reward.functions=["tests.algos.hydra_runs:letter_share"]'


#: the settings a built-in plugin cannot default (distillation's teacher), for tests that build every plugin with its
#: other defaults
REQUIRED_SETTINGS = {"distill": {"teacher": "smollm2"}, "teacher_reward": {"teacher": "smollm2"}}
