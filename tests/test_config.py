"""Tests for prefzoo.config: Hydra composition over the typed defaults, validation, objective resolution.

Configs are composed in-process exactly as ``train.py`` does (conf/ over the registered dataclasses), so
these tests are fast; tests/test_cli.py runs the real command line.
"""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from prefzoo.algos.dpo import DPOConfig
from prefzoo.algos.simpo import SimPOConfig
from prefzoo.cli import register_configs, to_typed
from prefzoo.config import Config, resolve_objective
from prefzoo.errors import ConfigError

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def composed(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=list(overrides))


def typed(*overrides: str) -> Config:
    return to_typed(composed(*overrides))


def test_defaults_compose_to_a_typed_config():
    cfg = typed()
    assert isinstance(cfg, Config) and isinstance(cfg.algo, DPOConfig)
    assert (cfg.algo.name, cfg.model.name, cfg.data.name, cfg.reward.name) == ("dpo", "smollm2", "arithmetic",
                                                                              "arithmetic")
    assert cfg.objective.divergence == "reverse_kl" and cfg.trainer.max_steps == 40


def test_group_choices_and_command_line_contract():
    cfg = typed("algo=simpo", "model=tiny", "objective=js", "trainer.max_steps=3", "trainer.seed=7",
                "data=file", "data.path=x.jsonl")
    assert isinstance(cfg.algo, SimPOConfig)
    assert (cfg.model.name, cfg.objective.divergence, cfg.trainer.max_steps, cfg.trainer.seed) == ("tiny", "js", 3, 7)
    assert (cfg.data.name, cfg.data.path) == ("file", "x.jsonl")
    assert typed("reward=sentiment").data.name == "sentiment"  # data follows reward by default
    assert typed("objective=alpha", "objective.alpha=0.3").objective.alpha == 0.3


@pytest.mark.parametrize("algo,beta,estimator,placement", [("dpo", 0.1, "k1", "in_reward"),
                                                           ("simpo", 2.0, "k1", "in_reward"),
                                                           ("grpo", 0.0, "k3", "as_loss")])
def test_null_objective_fields_take_the_algorithms_defaults(algo, beta, estimator, placement):
    o = resolve_objective(typed(f"algo={algo}"))
    assert (o.beta, o.kl_estimator, o.kl_placement) == (beta, estimator, placement)
    assert resolve_objective(typed(f"algo={algo}", "objective.beta=0.5")).beta == 0.5


@pytest.mark.parametrize("overrides,needles", [
    (["objective.beta=-1"], ["objective.beta=-1.0", ">= 0"]),
    (["objective.divergence=foo"], ["objective.divergence='foo'", "reverse_kl, forward_kl, js, alpha"]),
    (["data.on_bad_row=maybe"], ["data.on_bad_row='maybe'", "error, skip"]),
    (["model.reference=maybe"], ["auto, adapter_disabled, copy"]),
    (["model.quantization=8bit"], ["none, 4bit"]),
    (["model.dtype=float64"], ["float32, bfloat16, float16"]),
    (["model.quantization=4bit", "model.lora.enabled=false"], ["needs LoRA"]),
    (["objective=alpha", "objective.alpha=1.5"], ["0 < alpha < 1"]),
    (["objective.kl_controller=adaptive"], ["kl_target"]),
    (["data.max_prompt_length=300"], ["smaller than data.max_length=256"]),
    (["trainer.lr_schedule=cosine"], ["linear, constant"]),
    (["rollout.top_p=0"], ["(0, 1]"]),
    (["reward.weights=[1.0,2.0]"], ["one weight per function"]),
    (["algo.loss_type=nope"], ["sigmoid, ipo, hinge"]),
    (["algo.label_smoothing=0.5"], ["[0, 0.5)"]),
    (["objective.beta=0"], ["objective.beta=0.0: DPO needs beta > 0"]),
    (["algo=simpo", "objective.beta=0"], ["objective.beta=0.0: SimPO needs beta > 0"]),
    (["algo=grpo", "algo.num_samples=1"], ["at least 2"]),
])
def test_bad_values_raise_a_config_error_naming_the_valid_values(overrides, needles):
    with pytest.raises(ConfigError) as err:
        typed(*overrides)
    for needle in needles:
        assert needle in str(err.value)


def test_unknown_algorithm_lists_the_valid_ones():
    with pytest.raises(MissingConfigException) as err:
        composed("algo=nope")
    for name in ("dpo", "grpo", "simpo"):
        assert name in str(err.value)
    cfg = composed()
    cfg.algo.name = "nope"
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'; valid: .*dpo, .*simpo"):
        to_typed(cfg)
    cfg = composed()
    OmegaConf.update(cfg, "algo", "???", force_add=True)
    with pytest.raises(ConfigError, match="no algorithm chosen"):
        to_typed(cfg)


def test_wrong_types_and_unknown_keys_fail_at_composition():
    with pytest.raises(ConfigCompositionException, match="trainer.max_steps"):
        composed("trainer.max_steps=abc")
    with pytest.raises(ConfigCompositionException, match="trainer.foo"):
        composed("trainer.foo=1")


@pytest.mark.parametrize("override,why", [
    ("trainer.max_grad_norm=0", "clip_grad_norm_(params, 0) scales every gradient to 0: the run trains nothing, "
                                "silently (HF-style users write 0 to mean 'no clipping')"),
    ("model.lora.dropout=1.5", "accepted, then nn.Dropout raises a bare ValueError after the model has loaded"),
    ("data.pairs.num_samples=1", "one sample per prompt can never make a pair: the run fails only after "
                                        "sampling every prompt (minutes), with 'no usable rows'"),
    ("data.eval_fraction=2", "accepted, then datasets' train_test_split raises a bare ValueError"),
])
def test_values_that_fail_late_are_rejected_up_front(override, why):
    """Each of these passed validate() at first and failed late or silently (``why``); now refused up front."""
    with pytest.raises(ConfigError):
        typed(override)


def test_max_grad_norm_null_means_no_clipping_and_is_accepted():
    assert typed("trainer.max_grad_norm=null").trainer.max_grad_norm is None


def test_an_algorithm_brings_its_run_settings_and_the_command_line_still_wins():
    """GRPOConfig's default_temperature 0.7 and default_batch_size 8 (the one place they live): algo=grpo samples at
    temperature 0.7 with 8 prompts per step; other algorithms keep the base defaults (1.0, 4); an explicit override
    beats it; recipes that match budgets pin both back."""
    grpo, dpo = typed("algo=grpo"), typed("algo=dpo")
    assert (grpo.rollout.temperature, grpo.trainer.batch_size) == (0.7, 8)
    assert (dpo.rollout.temperature, dpo.trainer.batch_size) == (1.0, 4)
    assert typed("algo=grpo", "rollout.temperature=1.0").rollout.temperature == 1.0
    pinned = typed("algo=grpo", "+recipe=algo_compare")
    assert (pinned.rollout.temperature, pinned.trainer.batch_size) == (1.0, 4)


@pytest.mark.parametrize("old,new", [
    ("algo.num_generations=8", "algo.num_samples"), ("algo.num_iterations=2", "algo.epochs"),
    ("algo.epsilon_high=0.28", "algo.clip_eps_high"), ("algo.clip_range=0.1", "algo.clip_eps_low"),
    ("algo.value_clip_range=0.1", "algo.value_clip_eps"), ("algo.lam=0.9", "algo.gae_lambda"),
    ("algo.gamma=0.99", "algo.gae_gamma"), ("data.pairs.samples_per_prompt=4", "data.pairs.num_samples"),
    ("+algo.num_generations=8", "algo.num_samples"),
])
def test_renamed_keys_fail_naming_the_new_key(old, new):
    """Users' scripts with an old key get one line naming the new one (not Hydra's 'Key not in struct')."""
    from prefzoo.cli import check_renamed_keys

    with pytest.raises(ConfigError, match=f"was renamed: use {new}"):
        check_renamed_keys(["algo=grpo", old])
