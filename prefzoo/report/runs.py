"""The runs a report reads: every ``summary.json`` under a folder, its Hydra overrides, and which settings were swept.

A run is ``{"dir", "summary", "overrides": {key: value}, "job": bool, "task", "env"}`` (:func:`load_runs`);
:func:`metric` reads an evaluation of it (``eval_after`` by default). :data:`HEADLINE` lists the evaluation keys a report
shows and :data:`DESCRIPTION` says what each measures (the tables' legend, the plots' axis labels).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from prefzoo.training.layout import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
from prefzoo.training.names import task_name

__all__ = ["HEADLINE", "DESCRIPTION", "load_runs", "swept_keys", "is_eval_only", "metric", "eval_history",
           "training_seconds", "is_number", "is_best_of_n", "analytic_kl"]

HEADLINE = ("task_accuracy", "task_reward", "sample_reward", "gold_task_reward", "gold_sample_reward",
            "preference_accuracy", "kl_k1", "entropy", "distinct_1", "distinct_2", "ood_task_accuracy", "ood_distinct_2",
            "episode_turns", "episode_tool_calls", "episode_tool_errors", "episode_frac_cut")

#: what each evaluation key measures (table legend, axis labels)
DESCRIPTION = {
    "task_accuracy": "exact-match accuracy of the greedy answer to each held-out prompt",
    "task_reward": "the run's reward of the greedy answer (the PROXY when a gold reward is evaluated)",
    "sample_reward": "the run's reward, mean over temperature-1 samples (the proxy when a gold reward is evaluated)",
    "gold_task_reward": "the gold reward (eval.gold_reward) of the greedy answer",
    "gold_sample_reward": "the gold reward, mean over temperature-1 samples",
    "preference_accuracy": "held-out pairs ranked right by the implicit (or reward-model) reward; ties count 1/2",
    "kl_k1": "KL(π ‖ π_ref) in nats per completion: k1 estimate on temperature-1 samples; best-of-n: the analytic "
             "log n − (n−1)/n (exact without reward ties, an upper bound otherwise)",
    "entropy": "mean per-token entropy of the policy on its samples (nats); none for best-of-n",
    "distinct_1": "distinct unigrams / all unigrams across the samples of one prompt, averaged over prompts",
    "distinct_2": "distinct bigrams / all bigrams across the samples of one prompt, averaged over prompts",
    "ood_task_accuracy": "task_accuracy on the shifted held-out task of eval.ood (out of distribution: no training "
                         "problem)",
    "ood_distinct_2": "distinct_2 of the samples of the shifted task's prompts (eval.ood)",
    "episode_turns": "multi-turn runs (env=...): policy turns per greedy held-out episode",
    "episode_tool_calls": "tool calls per greedy held-out episode",
    "episode_tool_errors": "failed tool calls per episode (unknown tool, malformed arguments, a tool that raised, timed "
                           "out or returned no text)",
    "episode_frac_cut": "share of the greedy episodes the budget ended (env.max_turns, env.max_tokens, a turn without "
                        "end-of-turn)",
}


def _value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _task_and_env(run_dir: Path, summary: dict) -> tuple[str | None, str | None]:
    """What the run's rewards were measured on: summary.json's ``task`` and ``env``; for a run written before
    summary.json had them, its resolved ``config.yaml`` (:func:`prefzoo.training.summary.task_name` of its ``data``,
    its ``env.name``); else the summary's ``data`` name and no environment (None)."""
    task, env = summary.get("task"), summary.get("env")
    if task is None or env is None:
        config_path = run_dir / CONFIG_FILE
        try:
            config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else None
        except yaml.YAMLError:
            config = None
        config = config if isinstance(config, dict) else {}
        if task is None and isinstance(config.get("data"), dict):
            task = task_name(config["data"])
        if env is None and isinstance(config.get("env"), dict):
            env = config["env"].get("name")
    return task if task is not None else summary.get("data"), env


def load_runs(root: Path) -> list[dict]:
    """Every run under ``root``: ``{"dir", "summary", "overrides": {key: value}, "job": bool, "task", "env"}``,
    sorted by folder.

    ``job``: the run has Hydra's ``.hydra/overrides.yaml`` (a job of the sweep); a run without one (e.g. a
    recipe's prerequisite run, :class:`prefzoo.report.callbacks.TrainFirst`) is listed but does not decide which
    settings were swept. ``task`` / ``env``: what its rewards were measured on (:func:`_task_and_env`; None where
    unknown)."""
    runs = []
    for summary_path in sorted(Path(root).rglob(SUMMARY_FILE)):
        run_dir = summary_path.parent
        overrides = {}
        over_file = run_dir / ".hydra" / "overrides.yaml"
        if over_file.is_file():
            for item in yaml.safe_load(over_file.read_text()) or []:
                key, _, value = item.partition("=")
                overrides[key.lstrip("+~")] = _value(value)
        summary = json.loads(summary_path.read_text())
        task, env = _task_and_env(run_dir, summary)
        runs.append({"dir": run_dir, "summary": summary, "overrides": overrides, "job": over_file.is_file(),
                     "task": task, "env": env})
    return runs


#: overrides that say how a run was executed, not what it computed: never "swept" (no column, plot or label)
INERT_KEYS = ("trainer.num_threads", "trainer.fsdp", "trainer.progress", "trainer.log_every", "trainer.kl_metric_every", "trainer.save_every",
              "trainer.tensorboard", "trainer.report_to", "trainer.resume", "eval.before")


def is_eval_only(run: dict) -> bool:
    """The run trained nothing on purpose: ``trainer.max_steps=0`` (it measures its starting policy: the base model,
    or a checkpoint's adapter given as ``model.adapter_path``)."""
    return run["overrides"].get("trainer.max_steps") == 0


def swept_keys(runs: list[dict]) -> list[str]:
    """Override keys whose value is not the same in every run of the sweep (in first-seen order), except
    :data:`INERT_KEYS` (thread count, progress bars, logging, checkpoints, resuming (bit for bit the same run), the
    before-training evaluation). An eval-only run's ``trainer.max_steps=0`` (:func:`is_eval_only`) says how it was
    run, not a number of steps swept: only the training runs decide whether ``trainer.max_steps`` was swept."""
    jobs = [r for r in runs if r.get("job", True)] or runs
    keys: dict[str, set] = {}
    for run in jobs:
        for k in run["overrides"]:
            keys.setdefault(k, set())
    for k in keys:
        keys[k] = {json.dumps(run["overrides"].get(k), default=str) for run in jobs
                   if not (k == "trainer.max_steps" and is_eval_only(run))}
    return [k for k, values in keys.items() if len(values) > 1 and k not in INERT_KEYS]


def metric(run: dict, name: str, when: str = "eval_after"):
    return (run["summary"].get(when) or {}).get(name)


def eval_history(run: dict) -> list[dict]:
    """The run's evaluations in step order: ``eval_history`` or, for older runs, before and after."""
    s = run["summary"]
    if s.get("eval_history"):
        return s["eval_history"]
    return [e for e in (s.get("eval_before"), s.get("eval_after")) if e]


def training_seconds(run: dict) -> dict[int, float] | None:
    """Seconds spent in training steps up to and including each step, ``{step: seconds}`` with ``{0: 0.0}``: the
    cumulative sum of the ``time/step`` of the run's ``metrics.jsonl`` (rollouts and updates; evaluations excluded, as
    the summary's ``train_seconds``). A step logged twice (a resumed run redoes the steps after its checkpoint) counts
    once, its last line. None when the run has no ``metrics.jsonl`` or a step without ``time/step`` (nothing to add
    up); unreadable lines are skipped (the beta doctor, ``prefzoo diagnose``, is the place that reports them)."""
    path = Path(run["dir"]) / METRICS_FILE
    if not path.is_file():
        return None
    per_step: dict[int, float] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            continue
        seconds = row.get("time/step")
        if not is_number(seconds):
            return None
        per_step[row["step"]] = float(seconds)
    if not per_step:
        return None
    total, out = 0.0, {0: 0.0}
    for step in sorted(per_step):
        total += per_step[step]
        out[step] = total
    return out


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not (isinstance(x, float) and math.isnan(x))


def is_best_of_n(run: dict) -> bool:
    return run["summary"].get("algo") == "bon"


def analytic_kl(run: dict) -> bool:
    return metric(run, "kl_method") == "analytic"
