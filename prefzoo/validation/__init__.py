"""The pre-flight: every check that looks beyond the config's values, made before any model loads. The typed config
(:mod:`prefzoo.config`) checks values alone; these look at registries, files, the machine and the plugin's declaration.
The command line (:func:`prefzoo.cli.preflight`) and :func:`prefzoo.train` run them after the config's own checks,
in this order:

* names (:mod:`prefzoo.validation.references`, before the plugin is built: :func:`check_names`) -- the annotator of
  the built-in pairs, ``eval.ood``'s shifted task, a reasoning-gym system prompt; then (:func:`check_run`) what the
  config names exists: the early-stopping metric, ``model.adapter_path`` (an adapter, safetensors), ``model.name`` as a
  folder (safetensors), every reward function (imports, is callable, takes ``(prompts, completions, **columns)``), a
  distillation teacher that loads and fits the student (its vocabulary; an adapter's shapes);
* the settings against the plugin's declaration (:mod:`prefzoo.validation.plugin`) -- the rows per process and step,
  the model parts (the weights' dtype, the reference mode, the value head's adapter), a controller, a correction,
  a divergence the plugin honours, an environment it can play, the rows of a step for its mini-batches, a KL budget
  something measures, what runs in one process only, reward shaping, demonstrations for a plugin that trains on them;
* the machine (:mod:`prefzoo.validation.machine`) -- vLLM installed (and the LoRA rank it serves) for
  ``rollout.engine=vllm``; the servers of
  ``rollout.engine=vllm_server`` answer and serve the run's model;
* the backend (:mod:`prefzoo.validation.backend`) -- ``backend=tinker``: what a Tinker server cannot do, refused;
  the server answers and serves the run's model;
* warnings (:mod:`prefzoo.validation.warnings`) -- legal settings that make a run do nothing or cannot apply to it.
"""

from __future__ import annotations

from prefzoo.validation.backend import check_backend, check_backend_server
from prefzoo.validation.machine import check_engine_installed, check_rollout_servers
from prefzoo.validation.plugin import (check_batch_size, check_correction_support, check_demonstrations,
                                       check_divergence_support, check_early_stopping_reported, check_environment,
                                       check_explicit_reward,
                                       check_kl_budget, check_kl_controller, check_model_parts, check_parallel,
                                       check_reward_shaping, check_step_rows, has_reference)
from prefzoo.validation.references import (check_adapter_path, check_annotator, check_early_stopping_metric,
                                           check_model_name, check_names, check_ood_eval, check_references,
                                           check_reward_functions, check_teacher, check_teacher_fits)
from prefzoo.validation.warnings import warn_idle, warn_ignored

__all__ = ["check_run", "check_names", "check_annotator", "check_ood_eval", "check_early_stopping_metric",
           "check_adapter_path", "check_model_name", "check_reward_functions", "check_references", "check_teacher",
           "check_teacher_fits", "check_batch_size", "check_kl_controller", "check_divergence_support",
           "check_explicit_reward", "check_correction_support", "check_environment", "check_step_rows",
           "has_reference", "check_kl_budget", "check_model_parts", "check_early_stopping_reported", "check_parallel",
           "check_reward_shaping", "check_demonstrations", "check_engine_installed", "check_rollout_servers", "check_backend",
           "check_backend_server",
           "warn_idle", "warn_ignored"]


def check_run(cfg, declaration, processes: int, overrides: list[str] | None = None) -> None:
    """Every check of the pre-flight after the plugin is built (module docstring), then its warnings.

    Args:
        cfg: the typed, validated config; declaration: the plugin's; processes: the launch's data-parallel process
            count; overrides: the words the user wrote (for what was chosen explicitly), or None.

    Raises:
        ConfigError (and the checks' other one-line errors): the first problem found.
    """
    d = declaration
    check_backend(cfg, d, processes)  # backend=tinker: what a Tinker server cannot do, before anything else
    check_batch_size(cfg, d.min_batch_size, processes)  # rows per process and step
    check_model_parts(cfg, d)  # the weights' dtype, the reference mode, the value head's adapter
    check_kl_controller(cfg, d.has("adaptive_beta"))
    check_environment(cfg, d.online, d.has("turn_rewards"))  # env=...: shape, budget, reward placement
    check_correction_support(cfg, d.has("sampler_correction"))  # rollout.correction.* honoured?
    check_references(cfg, d.num_samples)  # early-stopping metric, adapter folder, model folder, reward functions
    check_early_stopping_reported(cfg, d)  # ... and a metric this run reports
    check_teacher(d.teacher)  # algo=distill: a teacher prefzoo can load
    check_teacher_fits(cfg, d.teacher)  # ... that shares the student's vocabulary (and base, as an adapter)
    check_divergence_support(cfg, d.has("f_divergence"))  # objective=forward_kl|js|alpha honoured?
    check_explicit_reward(cfg, overrides)  # data=reasoning_gym with reward=arithmetic written out
    check_reward_shaping(cfg, d)  # gdpo, the overlong penalty
    check_step_rows(cfg, d.num_minibatches, d.num_samples)  # mini-batches within a step's rows
    check_demonstrations(cfg, d)  # data.demonstrations: SFT on a built-in task with known answers
    check_kl_budget(cfg, d)  # something measures the KL it compares
    check_parallel(cfg, d, processes)  # the in-process vLLM engine, the rollout worker, dynamic sampling: one process
    check_engine_installed(cfg)  # rollout.engine=vllm: vLLM here
    check_rollout_servers(cfg)  # rollout.engine=vllm_server: the servers answer and serve the run's model
    check_backend_server(cfg)  # backend=tinker: the server answers and serves the run's model
    warn_idle(cfg, d.trains, d.uses_beta)
    warn_ignored(cfg, d.online)  # legal settings that cannot apply to this run: one warning each
