"""The evaluation before training, computed once per setting: the starting policy's evaluation, reused.

Before its first step a LoRA policy IS its base model (peft starts the adapter at B = 0, so W + BA = W exactly), and
a full fine-tune starts from the base weights: every run that starts from the same model, evaluates the same held-out
task the same way and seeds the evaluation alike measures the same numbers before training. On a 2-core CPU that
evaluation takes about two minutes of SmolLM2 (200 greedy answers, 64 samples and their KL passes), paid again by every
run of a sweep. So the part of it that depends only on the starting policy -- :meth:`Evaluator.policy_metrics
<prefzoo.evaluation.evaluate.Evaluator.policy_metrics>`: task accuracy and reward, the sampled metrics, pass@k, the
shifted task's metrics -- is kept under ``$PREFZOO_CACHE/evaluations/<key>.json`` and reused; the preference accuracy
(the plugin's implicit rewards, e.g. DPO's beta-scaled log-ratios) is computed every time, seconds.

The key (:func:`starting_key`) holds everything that can change those numbers: the model settings (``model.*``), the
task (``data.*`` but the pair-building settings), the reward and gold reward, the evaluation settings, the rollout
engine's settings, the environment of multi-turn episodes (``env.*``), ``trainer.seed`` (it seeds the evaluation's samples), the algorithm's name, whether a reference is
loaded (the KL keys) and pass@k's k, the device, on a CPU its instruction set and the torch thread count (a matmul's
rounding depends on both; 1 and 2 threads draw different samples of SmolLM2 from one seed), and the torch and
transformers versions; :data:`VERSION` is raised when the evaluation's computation
changes. A setting outside the key cannot change the starting policy's completions.

The model is named (``smollm2``, ``tiny``) or a local folder, whose files' sizes and modification times are in the
key too. Not reused (computed as before, :func:`not_reusable` says why): ``eval.reuse_before=false``; a model given
as a hub id (its files can change under the same name); a run that starts from an adapter (``model.adapter_path``),
reads a preference file (``data.path``: its held-out prompts live in a file) or scores with a function or model of the
user's (``reward.functions`` / ``eval.gold_reward.functions`` outside :data:`~prefzoo.rewards.registry.BUILTIN_REWARDS`,
``reward=model``): code and weights the key cannot see; a plugin that evaluates a policy of its own (best-of-n); a
resumed run (its evaluation before training is in its folder).

**Shipped** (:data:`SHIPPED`): the evaluation of ``make train``'s settings (the default run, RPO on SmolLM2) ships with
the package, as its preference pairs do (:mod:`prefzoo.data.pairs`), so a first ``make train`` goes to its first
training step in seconds; the key holds the environment it was computed in (torch, transformers, threads, device),
so another environment computes its own. ``tests/training/test_baseline.py`` (marker ``real_model``) computes it again
and compares. A reused evaluation says so: ``reused_from`` in ``eval_before.json`` and one line in the log.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from prefzoo.runtime import numerics_environment

log = logging.getLogger(__name__)

#: raised when the evaluation's computation (prefzoo.evaluation, the decode loop) changes what it measures
VERSION = 1
#: the evaluations that ship with prefzoo, one file per key (see the module docstring)
SHIPPED = Path(__file__).resolve().parents[1] / "evaluation" / "shipped"
#: ``eval.*`` keys that say when to evaluate, not what an evaluation measures
_WHEN = ("before", "after", "every", "steps", "reuse_before")


def not_reusable(cfg) -> str | None:
    """Why the starting policy's evaluation under ``cfg`` is computed rather than reused, or None when it may be
    reused (the plugin's evaluation policy and resuming are the trainer's to check)."""
    from prefzoo.rewards.registry import BUILTIN_REWARDS

    if not cfg.eval.reuse_before:
        return "eval.reuse_before=false"
    if cfg.model.adapter_path:
        return "the run starts from model.adapter_path"
    if cfg.backend.name != "local":
        return f"backend={cfg.backend.name}: the server samples (another random stream than this machine's)"
    if cfg.data.path:
        return "the held-out prompts come from data.path"
    if cfg.reward.name == "model" or cfg.reward.path:
        return "the reward is a model of the run's own (reward=model)"
    custom = [f for f in [*cfg.reward.functions, *cfg.eval.gold_reward.functions] if f not in BUILTIN_REWARDS]
    if custom:
        return f"reward function {custom[0]!r} is the user's own (its code is not in the key)"
    if getattr(cfg, "env", None) is not None and cfg.env.name == "custom":
        return "the environment (env.target) is the user's own (its code is not in the key)"
    if cfg.model.name not in ("smollm2", "tiny") and not Path(cfg.model.name).is_dir():
        return f"model.name={cfg.model.name!r} is a hub id (its files can change under the same name)"
    return None


def model_files(name: str) -> list | None:
    """(file, size, modification time) of each file of a local model folder, or None for a named model."""
    folder = Path(name)
    if name in ("smollm2", "tiny") or not folder.is_dir():
        return None
    return [(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()]


def environment(device: torch.device | str) -> dict:
    """What the same settings' numbers can still depend on (:func:`prefzoo.runtime.numerics_environment`)."""
    return numerics_environment(device)


def starting_key(cfg, *, reference: bool, num_samples: int, env: dict) -> tuple[str, dict]:
    """(key, parts): the cache key of the starting policy's evaluation under ``cfg`` (a typed
    :class:`~prefzoo.config.Config`) and the parts it hashes (written beside the result, so a file says what it is).

    Args:
        reference: the run loads a reference policy (the evaluation then measures KL(pi || pi_ref)).
        num_samples: k of the evaluation's pass@k (0: none).
        env: :func:`environment` of the process that evaluates.
    """
    def plain(node):
        return dataclasses.asdict(node) if dataclasses.is_dataclass(node) else dict(node)

    data = {k: v for k, v in plain(cfg.data).items() if k != "pairs"}
    if not data.get("demonstrations"):  # the default (no demonstrations): the keys before it existed, the shipped one
        data.pop("demonstrations", None)
    evaluation = {k: v for k, v in plain(cfg.eval).items() if k not in _WHEN}
    if not evaluation.get("sampler_logps"):  # the default (a pass of the policy): the keys before it existed
        evaluation.pop("sampler_logps", None)
    parts = {"version": VERSION, "algo": cfg.algo.name, "model": plain(cfg.model), "data": data,
             "reward": {k: v for k, v in plain(cfg.reward).items() if k not in SHAPING_KEYS}, "eval": evaluation, "rollout": _rollout_part(plain(cfg.rollout)),
             "model_files": model_files(cfg.model.name), "seed": cfg.trainer.seed, "reference": bool(reference),
             "num_samples": int(num_samples), "environment": env}
    if getattr(cfg, "env", None) is not None and cfg.env.name != "none":  # multi-turn episodes (keys before them unchanged)
        parts["env"] = plain(cfg.env)
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return f"{cfg.data.name}-{hashlib.sha256(blob).hexdigest()[:16]}", parts


#: reward settings that shape the TRAINING rewards only (the scorer of the online rollouts), never the evaluation's
#: reward: left out of the key, so keys made before they existed (the shipped one included) still match
SHAPING_KEYS = ("aggregation", "overlong_buffer", "overlong_penalty")

#: rollout settings of the training rollouts' worker (rollout.asynchronous): the evaluation never uses it
ASYNC_KEYS = ("asynchronous", "max_staleness", "async_timeout", "async_threads")
#: rollout.vllm settings of the server engine's transport (rollout.engine=vllm_server): where adapters go, how long a
#: request may take; the servers' addresses (rollout.servers) likewise stay out of the key
SERVER_KEYS = ("adapter_dir", "request_timeout")


def _rollout_part(rollout: dict) -> dict:
    """The rollout settings that shape the starting policy's evaluation, in the layout the keys had before
    ``rollout.correction``, ``rollout.top_k``, ``rollout.dtype`` and the asynchronous settings existed (so earlier keys,
    the shipped one included, still match): the correction and the rollout worker only change training, the servers'
    addresses and transport settings no sample; top_k and dtype
    (the sampler's copy, which the evaluation samples too) enter when set."""
    part = {k: v for k, v in rollout.items() if k not in ("correction", "top_k", "dtype", "servers", *ASYNC_KEYS)}
    if isinstance(part.get("vllm"), dict):  # the servers' adapter folder and time-out change no sample
        part["vllm"] = {k: v for k, v in part["vllm"].items() if k not in SERVER_KEYS}
    part["is_correction_cap"] = None  # (the key of the correction's earlier setting, never set for an evaluation)
    for key in ("top_k", "dtype"):
        if rollout.get(key):
            part[key] = rollout[key]
    return part


def cache_path(cache_root: Path, key: str) -> Path:
    return Path(cache_root) / "evaluations" / f"{key}.json"


#: what every stored evaluation of a starting policy holds (the greedy answers' reward, over how many problems)
REQUIRED = ("n_problems", "task_reward")


def invalid_result(result) -> str | None:
    """Why ``result`` is not a usable stored evaluation, or None: it must be a mapping that holds :data:`REQUIRED`
    (``n_problems`` > 0) and whose every metric (a name of :func:`prefzoo.evaluation.metrics.metric_names`, its
    standard error, ``pass_at_<k>``, the shifted task's ``ood_*``) is a number, not a string or a bool."""
    from prefzoo.evaluation.metrics import metric_names

    if not isinstance(result, dict):
        return f"its result is a {type(result).__name__}, not a mapping"
    missing = [k for k in REQUIRED if k not in result]
    if missing:
        return f"its result lacks {', '.join(missing)}"
    names = set(metric_names(0, ood=True))
    for k, v in result.items():
        if (k in names or k.startswith("pass_at_")) and (isinstance(v, bool) or not isinstance(v, (int, float))):
            return f"its {k} is {v!r}, not a number"
    if not result["n_problems"] > 0:
        return f"its n_problems is {result['n_problems']}"
    return None


def load(cache_root: Path, key: str) -> tuple[dict, Path] | None:
    """(the stored policy metrics, the file they came from) for ``key``: the cache's, else the shipped one; None when
    neither holds it. An entry that cannot be read (a damaged file, a folder where the file should be, a file where
    the ``evaluations`` folder should be, no permission) or does not hold the metrics it should
    (:func:`invalid_result`: an empty result, strings for numbers) is warned about in one line and not used: the
    evaluation is computed again (and stored in its place where the cache can be written)."""
    for path in (cache_path(cache_root, key), SHIPPED / f"{key}.json"):
        try:
            if not path.exists():
                continue
            stored = json.loads(path.read_text())
            result = stored["result"] if isinstance(stored, dict) else None
            why = invalid_result(result)
        except (OSError, ValueError, KeyError) as err:
            why = f"{type(err).__name__}: {getattr(err, 'strerror', None) or err}"
        if why is not None:
            log.warning("%s is not a readable evaluation (%s): the evaluation before training is computed again",
                        path, why)
            continue
        return result, path
    return None


def store(cache_root: Path, key: str, parts: dict, result: dict, seconds: float) -> Path | None:
    """Write ``result`` (the starting policy's metrics) under ``key``, atomically (two runs may finish it at once).
    A cache that cannot be written (read-only, a file where its folder should be, a full disk) is warned about in one
    line and skipped (None): the run goes on, and the next one computes the evaluation again."""
    path = cache_path(cache_root, key)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    made_by = {"seconds": round(seconds, 1), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "machine": f"{platform.machine()} {platform.processor() or ''}".strip()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": parts, "made_by": made_by, "result": result}, indent=2, default=str))
        os.replace(tmp, path)
    except OSError as err:
        log.warning("the evaluation before training could not be stored in %s (%s): it is computed again next time",
                    path, err.strerror or err)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return None
    return path


def describe(path: Path) -> str:
    """Where a reused evaluation came from, for the log: the shipped set or the cache file, and when it was made."""
    try:
        made = json.loads(path.read_text()).get("made_by", {})
    except (OSError, ValueError):
        made = {}
    where = "shipped with prefzoo" if path.parent == SHIPPED else f"cached in {path}"
    when = f", computed {made['date']}" if made.get("date") else ""
    return where + when
