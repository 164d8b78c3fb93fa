"""Tests for prefzoo.config: Hydra composition over the typed defaults, validation, objective resolution.

Configs are composed in-process exactly as ``train.py`` does (conf/ over the registered dataclasses), so
these tests are fast; tests/test_cli.py runs the real command line.
"""

import copy
import functools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from prefzoo.algos.dpo import DPOConfig
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
    cfg = typed("algo=dpo", "model=tiny", "objective=js", "trainer.max_steps=3", "trainer.seed=7",
                "data=file", "data.path=x.jsonl")
    assert isinstance(cfg.algo, DPOConfig)
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
    (["model.reference=maybe"], ["auto, adapter_disabled, copy, base"]),
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
    beats it; recipes that match budgets pin both (algo_compare: the built-in pairs' sampling temperature 0.7, 4 per
    step)."""
    grpo, dpo = typed("algo=grpo"), typed("algo=dpo")
    assert (grpo.rollout.temperature, grpo.trainer.batch_size) == (0.7, 8)
    assert (dpo.rollout.temperature, dpo.trainer.batch_size) == (1.0, 4)
    assert typed("algo=grpo", "rollout.temperature=1.0").rollout.temperature == 1.0
    pinned = typed("algo=grpo", "+recipe=algo_compare")
    assert (pinned.rollout.temperature, pinned.trainer.batch_size) == (0.7, 4)


def test_algo_compare_covers_every_policy_algorithm_of_the_zoo():
    """The recipe's sweep lists every built-in plugin except the reward model (it trains a scorer, not a policy) and
    distillation (it needs a teacher run, not the task's reward): a plugin added to the zoo and forgotten here fails
    this test."""
    from pathlib import Path

    import yaml

    from prefzoo.algos import BUILTIN

    recipe = yaml.safe_load((Path(__file__).parents[1] / "prefzoo/conf/recipe/algo_compare.yaml").read_text())
    swept = recipe["hydra"]["sweeper"]["params"]["algo"].split(",")
    assert len(swept) == len(set(swept))
    assert set(swept) == set(BUILTIN) - {"rm", "distill", "teacher_reward"}


@pytest.mark.parametrize("old,new", [
    ("algo.num_generations=8", "algo.num_samples"), ("algo.num_iterations=2", "algo.epochs"),
    ("algo.epsilon_high=0.28", "algo.clip_eps_high"), ("algo.clip_range=0.1", "algo.clip_eps_low"),
    ("algo.value_clip_range=0.1", "algo.value_clip_eps"), ("algo.lam=0.9", "algo.gae_lambda"),
    ("algo.gamma=0.99", "algo.gae_gamma"), ("data.pairs.samples_per_prompt=4", "data.pairs.num_samples"),
    ("+algo.num_generations=8", "algo.num_samples"),
    ("rollout.is_correction_cap=2", "rollout.correction.mode=token_truncate rollout.correction.clip_max=C"),
])
def test_renamed_keys_fail_naming_the_new_key(old, new):
    """Users' scripts with an old key get one line naming the new one (not Hydra's 'Key not in struct')."""
    from prefzoo.cli import check_renamed_keys

    with pytest.raises(ConfigError, match=f"was renamed: use {new}"):
        check_renamed_keys(["algo=grpo", old])


def test_cispos_weight_bounds_have_keys_of_their_own_and_the_ratio_clip_keys_name_them():
    """CISPO's clip bounds an importance weight, not PPO's ratio (the online-family issue): algo.is_clip_eps_low/high.
    The ratio-clip keys, current for GRPO, fail for CISPO naming the new key (also in a sweep over both)."""
    from prefzoo.cli import check_renamed_keys

    for chosen in ("algo=cispo", "algo=grpo,cispo"):
        with pytest.raises(ConfigError, match="algo.clip_eps_high was renamed: use algo.is_clip_eps_high"):
            check_renamed_keys([chosen, "algo.clip_eps_high=0.3"])
    check_renamed_keys(["algo=grpo", "algo.clip_eps_high=0.3"])
    cfg = typed("algo=cispo", "algo.is_clip_eps_high=0.3")
    assert (cfg.algo.is_clip_eps_low, cfg.algo.is_clip_eps_high) == (1.0, 0.3)


# ------------------------------------------------------------------- NaN / inf, names and paths (issue 17, 13)

def float_keys(node, prefix=""):
    """Every key of a typed config whose declared type holds a float (``float``, ``Optional[float]``,
    ``list[float]``), found from the dataclass annotations, not from the check under test."""
    import dataclasses

    keys = []
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            keys += float_keys(value, key + ".")
        elif "float" in str(f.type):
            keys.append((key, "list" in str(f.type)))
    return keys


def nan_inf_cases():
    from prefzoo.algos import REGISTRY

    base = typed("model=tiny")
    cases = [("dpo", key, is_list) for key, is_list in float_keys(base) if not key.startswith("algo.")]
    seen = set()  # a field a plugin inherits (the online family's, the trust region's) is one field: tested once, in
    for name, cls in sorted(REGISTRY.items()):  # the first plugin (by name) that has it; its own fields in each
        fields = {f.name: f for f in __import__("dataclasses").fields(cls.config_class)}
        for key, is_list in float_keys(cls.config_class()):
            owner = (fields[key].name, _declaring_class(cls.config_class, key)) if key in fields else (key, cls)
            if owner not in seen:
                seen.add(owner)
                cases.append((name, f"algo.{key}", is_list))
    return cases


def _declaring_class(config_class, name: str):
    """The class in ``config_class``'s MRO whose own annotations declare field ``name`` (where a default is overridden
    the field is re-declared, so a subclass with its own default counts as its own)."""
    for klass in config_class.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return klass
    return config_class


NAN_INF = nan_inf_cases()


def test_the_float_keys_cover_every_part_of_the_config():
    keys = {key for _, key, _ in NAN_INF}
    assert {"objective.beta", "trainer.lr", "trainer.max_grad_norm", "data.pairs.temperature", "reward.weights",
            "algo.label_smoothing", "algo.gae_gamma", "algo.clip_eps_low", "model.lora.dropout"} <= keys
    assert len(NAN_INF) >= 30


@functools.lru_cache(maxsize=None)
def _composed_algo(algo: str):
    return composed(f"algo={algo}", "model=tiny")


def typed_with_value(algo: str, override: str) -> Config:
    """``typed(f"algo={algo}", "model=tiny", override)`` with Hydra composing each algorithm's config once: the
    value override is parsed by Hydra's own override parser and set on a copy, as composition sets it (a full
    composition costs ~0.5 s, and the sweep below has ~80 keys x 3 values)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = copy.deepcopy(_composed_algo(algo))
    parsed = OverridesParser.create().parse_override(override)
    OmegaConf.update(cfg, parsed.key_or_group, parsed.value(), merge=False)
    return to_typed(cfg)


#: the cases of the sweep that also go through a full Hydra composition (one scalar and one list key)
COMPOSED_NAN_INF = [("dpo", "objective.beta", False), ("dpo", "reward.weights", True)]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_key_refuses_nan_and_inf(value):
    """Before: objective.beta=nan, trainer.lr=nan, data.pairs.temperature=inf ... all passed validation (and ended in
    tracebacks later: NaN losses, torch's 'invalid learning rate', multinomial on inf). Every case through
    to_typed on the composed config with the value set by Hydra's override parser; COMPOSED_NAN_INF also through
    Hydra's composition of the override itself (typed)."""
    assert set(COMPOSED_NAN_INF) <= set(NAN_INF)
    def fully_composed(algo: str, override: str) -> Config:
        return typed(f"algo={algo}", "model=tiny", override)

    wrong = []
    for (algo, key, is_list), build in [*((case, typed_with_value) for case in NAN_INF),
                                        *((case, fully_composed) for case in COMPOSED_NAN_INF)]:
        override = f"{key}=[{value}]" if is_list else f"{key}={value}"
        named = f"{key}[0]={float(value)}" if is_list else f"{key}={float(value)}"
        try:
            build(algo, override)
            wrong.append((override, "accepted"))
        except ConfigError as err:
            if not str(err).startswith(f"{named} is not a finite number; give a finite value"):
                wrong.append((override, str(err)))
    assert wrong == []


def test_a_key_that_may_be_null_says_so():
    with pytest.raises(ConfigError, match=r"trainer.max_grad_norm=nan is not a finite number; give a finite value "
                                          r"\(or trainer.max_grad_norm=null\)"):
        typed("trainer.max_grad_norm=nan")


def test_early_stopping_metric_is_one_of_the_evaluations():
    """Before: accepted, then a KeyError traceback at the first evaluation (after the model had loaded)."""
    with pytest.raises(ConfigError) as err:
        typed("trainer.early_stopping.metric=nope")
    msg = str(err.value)
    assert msg.startswith("trainer.early_stopping.metric='nope' is not a metric of the evaluation; choose one of: ")
    for name in ("task_accuracy", "task_reward", "kl_k1", "preference_accuracy", "entropy"):
        assert name in msg
    assert typed("trainer.early_stopping.metric=task_accuracy_se").trainer.early_stopping.metric == "task_accuracy_se"
    assert typed("algo=grpo", "trainer.early_stopping.metric=pass_at_4")  # GRPO's default group of 4
    with pytest.raises(ConfigError, match="pass_at_4"):
        typed("algo=dpo", "trainer.early_stopping.metric=pass_at_4")


def test_adapter_path_must_be_an_adapter_folder(tmp_path):
    """Before: accepted, then peft's traceback after the base model had loaded."""
    with pytest.raises(ConfigError, match=r"model.adapter_path='.*nope' does not exist; give the folder of a trained "
                                          r"adapter \(it holds adapter_config.json"):
        typed(f"model.adapter_path={tmp_path / 'nope'}")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"holds no adapter_config.json.*use model.adapter_path={tmp_path}/adapter"):
        typed(f"model.adapter_path={tmp_path}")  # a run folder: the adapter is inside
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        typed(f"model.adapter_path={tmp_path / 'file'}")
    assert typed(f"model.adapter_path={tmp_path / 'adapter'}").model.adapter_path == str(tmp_path / "adapter")


def test_a_zero_learning_rate_is_a_warning(caplog):
    """Before: accepted without a word; the run trained nothing."""
    import logging

    with caplog.at_level(logging.WARNING, logger="prefzoo"):
        typed("trainer.lr=0", "trainer.max_steps=5")
        typed("trainer.lr=0", "algo=bon")  # best-of-n trains nothing anyway: no warning
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.lr=0: the optimizer leaves every weight as it is, so the 5 steps train nothing; give a learning "
        "rate > 0, e.g. trainer.lr=2e-4."]


@pytest.mark.parametrize("override,needle", [
    ("reward.functions=[tests.rewards.nope:fn]", "reward.functions: reward 'tests.rewards.nope:fn': could not import "
                                                 "module 'tests.rewards.nope'"),
    ("reward.functions=[tests.rewards.helpers:nope]", "module 'tests.rewards.helpers' has no attribute 'nope'"),
    ("reward.functions=[tests.rewards.helpers:NOT_CALLABLE]", "'NOT_CALLABLE' is not callable (it is int 42)"),
    ("reward.functions=[tests.rewards.helpers:one_argument]", "has the signature (completions), but a reward "
                                                              "function is called as fn(prompts, completions"),
    ("eval.gold_reward.functions=[tests.rewards.helpers:nope]", "eval.gold_reward.functions: reward "
                                                                "'tests.rewards.helpers:nope'"),
])
def test_reward_functions_are_checked_in_validation(override, needle):
    """Before: the gold reward's and the signature's errors came after the model had loaded (the gold reward is
    built with the evaluator; a wrong signature fails at the first call)."""
    with pytest.raises(ConfigError) as err:
        typed(override)
    assert needle in str(err.value)


def test_the_early_stopping_names_are_the_keys_the_evaluation_writes():
    """prefzoo/evaluation/metrics.py lists the names without importing the evaluator; read the keys the evaluator
    writes (``out["..."]`` and dict literals) from its source and compare, leaving out the non-numeric ones and the
    counts (``pass_at_<k>`` is an f-string key, checked by name)."""
    import re

    from prefzoo.evaluation.metrics import metric_names

    source = (Path(__file__).resolve().parents[1] / "prefzoo" / "evaluation" / "evaluate.py").read_text()
    written = set(re.findall(r'out\["(\w+)"\]', source)) | set(re.findall(r'"(\w+)": ', source))
    written -= {"greedy_examples", "sample_examples", "kl_method", "prompt", "completion", "n_pairs", "n_problems"}
    assert written == set(metric_names())
    assert 'f"pass_at_{k}"' in source and 'f"pass_at_{k}_se"' in source
    assert {"pass_at_4", "pass_at_4_se"} <= set(metric_names(4))


def test_reasoning_gym_data_is_scored_by_its_own_verifiers():
    """`data=reasoning_gym` alone (the issue's command) must not be scored by the default arithmetic exact match,
    which reads a reply's last number against an `answer` column those tasks do not have: the untouched default
    reward becomes reward=reasoning_gym (the reverse of `data: ${reward}` in the defaults list). Failing value before:
    reward.name == "arithmetic", then a one-line error at setup. A reward the user set stays theirs."""
    cfg = typed("algo=grpo", "data=reasoning_gym")
    assert (cfg.reward.name, list(cfg.reward.functions)) == ("reasoning_gym", ["reasoning_gym"])
    own = typed("algo=grpo", "data=reasoning_gym", "reward.functions=[format]")
    assert list(own.reward.functions) == ["format"]
    assert typed("algo=grpo").reward.name == "arithmetic"
