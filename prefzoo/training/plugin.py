"""The run's algorithm plugin, built once from the typed config.

:func:`build_algorithm` is the one place a plugin is constructed for a run: the command line's pre-flight
(:func:`prefzoo.cli.preflight`) builds it -- which runs the plugin's ``validate_settings`` on the resolved
objective, before any model loads -- and hands the same object to the :class:`~prefzoo.training.loop.Trainer`.
It imports only the plugin registry and the config (no model, data or tokenizer), so the pre-flight stays fast.
"""

from __future__ import annotations

from prefzoo.algos import Algorithm, algorithm_class
from prefzoo.config import Config, resolve_objective, sampling_params

__all__ = ["build_algorithm"]


def build_algorithm(cfg: Config) -> Algorithm:
    """The plugin of ``cfg.algo`` (built-in, installed, or ``algo.target``) on the resolved objective, with the
    rollout's :class:`~prefzoo.types.SamplingParams` (:func:`prefzoo.config.sampling_params`).

    Raises:
        ConfigError: the plugin's own settings are invalid for this objective (its ``validate_settings``).
        PluginError: ``algo.target`` names something that is not a plugin.
    """
    return algorithm_class(cfg.algo)(cfg.algo, resolve_objective(cfg), sampling_params(cfg))
