"""What a run reports at its end: ``summary.json`` (:func:`make_summary`; its ``results`` block has the same keys for every
algorithm, :data:`RESULT_KEYS`), and the evaluation's line on the console (:func:`print_eval`)."""

from __future__ import annotations

import dataclasses
import math

from prefzoo.evaluation.ood import OOD_RESULTS
from prefzoo.training.names import algo_name, task_name

__all__ = ["RESULT_KEYS", "results_block", "make_summary", "print_eval", "print_change"]


#: ``summary["results"]``: the comparable numbers of a run, the same keys for every algorithm (None where a
#: run has no such number). See :func:`results_block`.
RESULT_KEYS = ("reward", "reward_se", "sample_reward", "sample_reward_se", "gold_reward", "gold_reward_se",
               "gold_sample_reward", "gold_sample_reward_se", "task_accuracy", "task_accuracy_se",
               "preference_accuracy", "kl", "kl_se", "kl_k3", "kl_method", "entropy", "distinct_1", "distinct_2",
               "completion_length", "train_reward", "train_kl", "kl_spent", "steps", "stop_reason", "wall_seconds",
               "train_seconds", "eval_seconds", *OOD_RESULTS)


def results_block(after: dict | None, last: dict, trainer, stop_reason: str, seconds: float) -> dict:
    """The flat, comparable block of ``summary.json`` (``results``), keys :data:`RESULT_KEYS`:

    * ``reward`` / ``task_accuracy``: greedy answers to the held-out prompts under the run's reward (the proxy
      when a gold reward is evaluated) / exact match; ``sample_reward``: temperature-1 samples;
      ``gold_reward`` / ``gold_sample_reward``: the same answers under ``eval.gold_reward``;
    * ``kl`` (+ ``kl_se``), ``kl_k3``: KL(pi || pi_ref) in nats per sequence on held-out samples, k1 and k3
      estimates (``kl_method = "sampled"``), or best-of-n's analytic log n - (n-1)/n (``"analytic"``); None
      without a reference;
    * ``entropy`` (nats per token), ``distinct_1`` / ``distinct_2``, ``completion_length`` (tokens);
    * ``train_reward`` / ``train_kl``: the last training step's rollout reward and KL (online algorithms);
      ``kl_spent``: the last KL measurement during training (what ``objective.kl_budget`` compares);
    * ``steps``, ``stop_reason``; ``wall_seconds`` (the whole run after set-up: evaluations included),
      ``train_seconds`` (training steps only) and ``eval_seconds`` (all evaluations);
    * ``ood_*`` (``eval.ood``): the shifted task's reward, accuracy, KL and diversity, named as above
      (:data:`~prefzoo.evaluation.ood.OOD_RESULTS`).
    """
    a = after or {}
    history = trainer.eval_history
    values = {
        "reward": a.get("task_reward"), "reward_se": a.get("task_reward_se"),
        "sample_reward": a.get("sample_reward"), "sample_reward_se": a.get("sample_reward_se"),
        "gold_reward": a.get("gold_task_reward"), "gold_reward_se": a.get("gold_task_reward_se"),
        "gold_sample_reward": a.get("gold_sample_reward"), "gold_sample_reward_se": a.get("gold_sample_reward_se"),
        "task_accuracy": a.get("task_accuracy"), "task_accuracy_se": a.get("task_accuracy_se"),
        "preference_accuracy": a.get("preference_accuracy"),
        "kl": a.get("kl_k1"), "kl_se": a.get("kl_k1_se"), "kl_k3": a.get("kl_k3"), "kl_method": a.get("kl_method"),
        "entropy": a.get("entropy"), "distinct_1": a.get("distinct_1"), "distinct_2": a.get("distinct_2"),
        "completion_length": a.get("completion_length"),
        "train_reward": last.get("reward"), "train_kl": last.get("kl") if trainer.declaration.online else None,
        "kl_spent": trainer.kl_spent, "steps": trainer.step, "stop_reason": stop_reason,
        "wall_seconds": round(seconds, 1), "train_seconds": round(trainer.train_seconds, 1),
        "eval_seconds": round(sum(h.get("seconds", 0.0) for h in history), 1),
        **{k: a.get(name) for k, name in OOD_RESULTS.items()},
    }
    return {k: values[k] for k in RESULT_KEYS}


def make_summary(cfg, trainer, before, after, last, seconds, stop_reason, weights) -> dict:
    """The run's final numbers, under the same keys for every algorithm (``results``: the flat block to compare
    runs by, see :func:`results_block`; ``eval_history``: every held-out evaluation, with its step); ``task``
    (:func:`prefzoo.training.names.task_name`) and ``env`` (``env.name``, ``none`` for single-turn rollouts) say what the rewards were
    measured on."""
    strip = lambda d: {k: v for k, v in (d or {}).items() if not k.endswith("examples")}  # noqa: E731
    return {
        "algo": algo_name(cfg.algo), "model": cfg.model.name, "data": cfg.data.name, "reward": cfg.reward.name,
        "task": task_name(cfg.data), "env": cfg.env.name,
        "algo_settings": dataclasses.asdict(cfg.algo) if dataclasses.is_dataclass(cfg.algo) else dict(cfg.algo),
        "gold_reward": list(cfg.eval.gold_reward.functions) or None,
        "beta": trainer.objective.beta if trainer.declaration.uses_beta else None,
        "final_beta": trainer.algo.beta if trainer.declaration.uses_beta else None, "divergence": trainer.objective.divergence,
        "kl_estimator": trainer.objective.kl_estimator, "kl_placement": trainer.objective.kl_placement,
        "seed": cfg.trainer.seed, "steps": trainer.step, "stop_reason": stop_reason,
        "wall_seconds": round(seconds, 1), "model_load_seconds": round(trainer.load_seconds, 1),
        "results": results_block(after, last, trainer, stop_reason, seconds),
        "eval_before": strip(before), "eval_after": strip(after), "eval_history": trainer.eval_history,
        "final_train_metrics": last,
        "data_stats": trainer.data_stats or None, "weights": str(weights),
        "kl_budget": cfg.objective.kl_budget, "kl_spent": trainer.kl_spent,
        "early_stopping": trainer.early_stopping.state_dict() if trainer.early_stopping else None,
        "num_processes": trainer.dp.world_size,
        "reference": trainer.algo.declaration.reference,  # the plugin's declaration (prefzoo diagnose reads it)
        "capabilities": sorted(trainer.algo.declaration.capabilities),
    }


def print_eval(title: str, result: dict) -> None:
    keys = [k for k in ("task_accuracy", "task_reward", "gold_task_reward", "sample_reward", "gold_sample_reward",
                        "preference_accuracy", "pass_at_4", "kl_k1", "entropy", "distinct_2", "ood_task_accuracy",
                        "ood_distinct_2") if k in result]
    parts = []
    for k in keys:
        se = result.get(f"{k}_se")
        parts.append(f"{k}={result[k]:.3f}" + (f"±{se:.3f}" if se is not None and not math.isnan(se) else ""))
    print(f"[prefzoo] eval {title}: " + ", ".join(parts), flush=True)


#: the metrics :func:`print_change` shows, in this order, where both evaluations have them
CHANGE_KEYS = ("task_accuracy", "preference_accuracy", "gold_task_reward", "task_reward", "sample_reward", "kl_k1")


def print_change(before: dict | None, after: dict | None) -> None:
    """The line a newcomer looks for after training: each of :data:`CHANGE_KEYS` in both evaluations, ``before ->
    after`` with their standard errors, e.g. ``[prefzoo] before -> after training: task_accuracy 0.255±0.031 ->
    0.745±0.031, kl_k1 0.000±0.000 -> 5.261±0.310``. Nothing when either evaluation is missing or they share no key."""
    if not before or not after:
        return

    def shown(result: dict, key: str) -> str:
        se = result.get(f"{key}_se")
        return f"{result[key]:.3f}" + (f"±{se:.3f}" if se is not None and not math.isnan(se) else "")

    parts = [f"{k} {shown(before, k)} -> {shown(after, k)}" for k in CHANGE_KEYS if k in before and k in after]
    if parts:
        print("[prefzoo] before -> after training: " + ", ".join(parts), flush=True)
