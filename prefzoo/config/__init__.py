"""The typed configuration: every default lives here; ``conf/*.yaml`` files hold only what differs.

Hydra composes ``conf/config.yaml`` over these dataclasses (registered in Hydra's ConfigStore), so a
misspelt key or a value of the wrong type fails at composition; :func:`validate` then checks values
(ranges, names, combinations) and raises :class:`~prefzoo.errors.ConfigError` before any model loads.

Each algorithm's own settings are the dataclass its plugin declares (``Algorithm.config_class``),
registered as ``schema/algo/<name>`` and used by ``conf/algo/<name>.yaml``. This module knows no plugin: the
CLI (:mod:`prefzoo.cli`) hands it the plugins' schemas (:func:`register_configs`) and validates a plugin's own
settings after :func:`resolve_defaults` has filled the algorithm's defaults in.

The nulls that mean "the algorithm's default" -- ``objective.beta``, ``objective.kl_estimator``,
``objective.kl_placement``, ``rollout.temperature``, ``trainer.batch_size`` -- are replaced by the plugin
config's ``default_*`` fields in :func:`resolve_defaults`, before validation; the run's ``config.yaml`` records
the resolved values.
"""

from __future__ import annotations

from collections.abc import Mapping

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from prefzoo.config.checks import (ENGINES, VLLM_INSTALL, check_asynchronous, check_correction, check_finite,
                                   check_rollout_engine, check_server_url, non_finite_floats, validate)
from prefzoo.config.schema import (GROUP_SCHEMAS, Config, resolve_defaults, CorrectionConfig, DataConfig,
                                   EarlyStoppingConfig, EnvConfig, EvalConfig, FastPathConfig, GoldRewardConfig,
                                   LoraConfig, ModelConfig, ObjectiveConfig, OODConfig, PairsConfig, RewardConfig,
                                   RolloutConfig, TrainerConfig, VLLMConfig)
from prefzoo.errors import ConfigError
from prefzoo.types import CorrectionSettings, ObjectiveSettings, SamplingParams

__all__ = ["Config", "LoraConfig", "FastPathConfig", "ModelConfig", "PairsConfig", "DataConfig", "RewardConfig",
           "ObjectiveConfig", "VLLMConfig", "CorrectionConfig", "RolloutConfig", "GoldRewardConfig", "OODConfig",
           "EvalConfig", "EarlyStoppingConfig", "TrainerConfig", "EnvConfig", "GROUP_SCHEMAS", "register_configs",
           "resolve_defaults", "validate", "to_typed", "resolve_objective", "sampling_params", "check_finite",
           "non_finite_floats", "check_asynchronous", "check_correction", "check_rollout_engine", "check_server_url",
           "ENGINES", "VLLM_INSTALL"]


def register_configs(algo_schemas: Mapping[str, type], extra_algos: Mapping[str, type] = {}) -> None:
    """Register the schemas with Hydra's ConfigStore (``base_config``, ``schema/<group>/...``,
    ``schema/algo/<name>`` for each of ``algo_schemas``); ``extra_algos`` (installed plugins without a yaml in
    ``conf/algo/``) also become choices ``algo=<name>``."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=f"schema/{group}", name="base", node=node)
    for name, schema in algo_schemas.items():
        cs.store(group="schema/algo", name=name, node=schema)
    for name, schema in extra_algos.items():
        cs.store(group="algo", name=name, node=schema)


def to_typed(cfg: DictConfig) -> Config:
    """Turn Hydra's composed DictConfig (its ``algo`` already a plugin schema) into the typed :class:`Config`,
    resolve the algorithm's defaults and validate it. (:func:`prefzoo.cli.to_typed` is the plugin-aware entry.)

    Raises:
        ConfigError: a value out of range, an unknown name, or an inconsistent combination.
    """
    try:
        typed = OmegaConf.to_object(cfg)
    except Exception as err:  # OmegaConf validation errors carry the key
        raise ConfigError(f"invalid configuration: {err}") from err
    return validate(typed)


def resolve_objective(cfg: Config) -> ObjectiveSettings:
    """The objective the plugin optimises, with nulls replaced by the algorithm's defaults
    (:func:`resolve_defaults`, applied here too for configs built in Python)."""
    resolve_defaults(cfg)
    o = cfg.objective
    return ObjectiveSettings(
        beta=float(o.beta), divergence=o.divergence, alpha=o.alpha,
        kl_estimator=o.kl_estimator, kl_placement=o.kl_placement,
        kl_controller=o.kl_controller, kl_target=o.kl_target, kl_horizon=o.kl_horizon,
        kl_bias_correction=o.kl_bias_correction,
    )


def sampling_params(cfg: Config) -> SamplingParams:
    """The rollout's sampling settings (``rollout.*``, defaults resolved) as the plugin and the sampler see them:
    built here alone, once per run."""
    resolve_defaults(cfg)
    r = cfg.rollout
    c = r.correction
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                          correction=CorrectionSettings(mode=c.mode, clip_min=c.clip_min, clip_max=c.clip_max,
                                                        bypass=c.bypass, match_support=c.match_support,
                                                        weight_kl=c.weight_kl))
