"""Resuming a run (``trainer.resume=true``): which checkpoint, whether the config may continue it, and its schedule.

* **What defines a run** (:func:`run_config`): every setting but those in :data:`MAY_CHANGE`: the algorithm and its
  settings, the model and adapter shape, the data, the reward, the objective, the rollout sampling, the seed, the
  optimiser and its learning-rate schedule (``trainer.lr``, ``lr_schedule``, ``warmup_steps``, ``weight_decay``),
  the batch size, gradient clipping, and early stopping's metric, mode and min_delta. Each checkpoint stores them in
  ``run_config.json``; resuming with any of them changed is refused with every differing key and its two values
  (:func:`check_run_config`), before any model loads. A setting added to prefzoo after the checkpoint was written
  is accepted at its default.
* **What may change** (:data:`MAY_CHANGE`): ``trainer.max_steps``, the evaluation (``eval.*``), logging and progress
  (``log_every``, ``progress``, ``tensorboard``), ``save_every``, the device and threads, ``micro_batch_size`` and the
  fast paths (the same update, up to float rounding), early stopping's ``every`` / ``patience``,
  ``objective.kl_budget`` (a stopping rule, like max_steps), and ``algo.preset`` (a name: the plugin and its settings
  are checked; a run of the default RPO made before presets were named resumes as ``algo=rpo``).
* **Which checkpoint** (:func:`find_resume_point`): the newest complete one that can be read; a damaged one is
  skipped with a warning naming it. Nothing to resume: a warning, and the run starts from scratch.
* **The learning rate** (:func:`continue_schedule`): a changed ``trainer.max_steps`` rebuilds the schedule for the new
  horizon, continued at the current optimizer step (the lr a run started with that max_steps has there), with a
  warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from prefzoo.errors import CheckpointError, ConfigError, RunFolderError
from prefzoo.training.layout import CHECKPOINTS_DIR, METRICS_FILE, RUN_CONFIG_FILE, STATE_FILE, SUMMARY_FILE
from prefzoo.training.checkpoint import (DamagedCheckpoint, check_resumable, check_weights, complete_checkpoints,
                                         load_run_config, load_trainer_state)

log = logging.getLogger(__name__)

#: Settings that may differ between a run and its resumption (a key, or a prefix ending in ".").
MAY_CHANGE = ("trainer.max_steps", "trainer.resume", "trainer.progress", "trainer.tensorboard", "trainer.report_to", "trainer.device",
              "trainer.num_threads", "trainer.fsdp", "trainer.save_every", "trainer.log_every", "trainer.kl_metric_every",
              "trainer.micro_batch_size",
              "trainer.early_stopping.every", "trainer.early_stopping.patience", "objective.kl_budget",
              "model.fast.", "model.gradient_checkpointing", "eval.", "algo.preset",
              "backend.url", "backend.timeout")  # (a Tinker server restarted elsewhere with the states: the same run)


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in MAY_CHANGE)


def run_config(cfg) -> dict:
    """The run-defining settings of ``cfg`` as ``{"algo.name": "dpo", "model.lora.r": 16, ...}`` (JSON values)."""
    tree = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)
    flat = {k: v for k, v in _flatten(tree).items() if not may_change(k)}
    return json.loads(json.dumps(flat, default=str))


ABSENT = "(absent)"


def differences(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(key, value in the checkpoint, value now) for every run-defining key that differs. When the algorithm differs,
    the settings only one of the two algorithms has are left out (the algorithm's name says it)."""
    other_algo = saved.get("algo.name") != now.get("algo.name")
    out = []
    for key in sorted(set(saved) | set(now)):
        if may_change(key):
            continue
        a, b = saved.get(key, ABSENT), now.get(key, ABSENT)
        if a == b or (other_algo and key.startswith("algo.") and key != "algo.name" and ABSENT in (a, b)):
            continue
        out.append((key, a, b))
    return out


_MISSING = object()


def _json(value):
    return json.loads(json.dumps(value, default=str))


def schema_default(cfg, key: str):
    """The schema's default of the dotted ``key`` in ``cfg``'s dataclasses (JSON form), or a sentinel if none."""
    *path, last = key.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part, None) if not isinstance(node, dict) else node.get(part)
    if node is None or not dataclasses.is_dataclass(node):
        return _MISSING
    field = {f.name: f for f in dataclasses.fields(node)}.get(last)
    if field is None:
        return _MISSING
    if field.default is not dataclasses.MISSING:
        return _json(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return _json(field.default_factory())
    return _MISSING


def check_run_config(cfg, run_dir: Path, folder: Path, saved: dict | None) -> None:
    """Refuse to resume the run in ``run_dir`` from checkpoint ``folder`` with run-defining settings changed.

    A setting the checkpoint lacks (added to prefzoo after it was written) is accepted when it has its schema default
    now (logged): that is the value every run that never set it gets; set to anything else, it is refused like a
    change.

    Raises:
        ConfigError: one line listing ``key: <checkpoint value> (checkpoint) vs <value> (now)`` for each change.
    """
    if saved is None:
        log.warning("%s has no %s (a checkpoint of an earlier prefzoo): the settings it was made with cannot be "
                    "checked against this run's", folder, RUN_CONFIG_FILE)
        return
    diffs = differences(saved, run_config(cfg))
    defaults = {key: schema_default(cfg, key) for key, a, _ in diffs if a == ABSENT}
    added = [key for key, a, b in diffs if a == ABSENT and b == defaults[key]]
    if added:
        log.info("%s predates the settings %s: resuming with their defaults (%s)", folder.name, ", ".join(added),
                 ", ".join(f"{k}={defaults[k]}" for k in added))
        diffs = [d for d in diffs if d[0] not in added]
    if not diffs:
        return
    listed = "; ".join(f"{key}: {a!r} (checkpoint) vs {b!r} (now)" for key, a, b in diffs)
    raise ConfigError(f"trainer.resume=true: the run in {run_dir} was made with other settings, which define a run and "
                      f"cannot change on resume: {listed}. Put them back to continue it, or start a new run in another "
                      f"folder (hydra.run.dir=...). (Checked against {folder / 'run_config.json'}; what may change on "
                      "resume: README, 'Resuming a run'.)")


def check_restored_optimizer(cfg, folder: Path, state: dict) -> None:
    """What a resume restores agrees with the config: the optimizer and its learning-rate schedule come back from the
    checkpoint's trainer state with the base learning rate and weight decay they were built with, whatever the config
    says. A checkpoint without ``run_config.json`` (an earlier prefzoo's) or with an edited one would otherwise train
    at the saved rate while ``config.yaml`` and the model card record the new one.

    Raises:
        ConfigError: ``key: <restored value> (checkpoint) vs <value> (now)`` for ``trainer.lr`` and
            ``trainer.weight_decay`` where they differ, naming the trainer-state file.
    """
    t = cfg.trainer
    groups = (state.get("optimizer") or {}).get("param_groups") or []
    base = (state.get("scheduler") or {}).get("base_lrs") or [g.get("initial_lr") for g in groups]
    diffs = []
    for key, restored, now in (("trainer.lr", base, t.lr),
                               ("trainer.weight_decay", [g.get("weight_decay") for g in groups], t.weight_decay)):
        values = sorted({float(v) for v in restored if v is not None})
        if values and values != [float(now)]:
            diffs.append(f"{key}: {values[0] if len(values) == 1 else values!r} (checkpoint) vs {now!r} (now)")
    if diffs:
        raise ConfigError(f"trainer.resume=true: the optimizer in {folder / STATE_FILE} was built with other settings, "
                          f"and a resume continues it as saved: {'; '.join(diffs)}. Put them back to continue the run, or "
                          "start a new run in another folder (hydra.run.dir=...).")


@dataclass
class ResumePoint:
    """The checkpoint a run continues from, and its trainer state once read (None: read it again, elsewhere)."""

    folder: Path
    state: dict | None = None


def refuse_earlier_run(run_dir: Path) -> None:
    """A new run (``trainer.resume=false``) refuses a folder that holds an earlier run's records: its metrics would
    be appended to the old ``metrics.jsonl``, its checkpoints pruned beside the old ones, and a later resume would
    pick the old run's newest checkpoint.

    Raises:
        RunFolderError: naming the folder, what it holds, ``trainer.resume=true`` and another folder.
    """
    held = [name for name in (METRICS_FILE, SUMMARY_FILE) if (run_dir / name).is_file()]
    checkpoints = complete_checkpoints(run_dir) if (run_dir / CHECKPOINTS_DIR).is_dir() else []
    if checkpoints:
        held.append(f"{CHECKPOINTS_DIR}/{checkpoints[-1].name}")
    if held:
        raise RunFolderError(f"{run_dir} holds an earlier run ({', '.join(held)}): continue it with "
                             "trainer.resume=true, or start this run in another folder (hydra.run.dir=<another "
                             "folder>); nothing was changed.")


def find_resume_point(cfg, run_dir: Path) -> ResumePoint | None:
    """The checkpoint ``trainer.resume=true`` continues from, checked against ``cfg`` (main process).

    The newest complete checkpoint that can be read (trainer state, weights headers, run_config.json); a damaged one
    is skipped with a warning naming it. None (with a warning) when there is nothing to resume.

    Without ``trainer.resume`` the folder must hold no earlier run (:func:`refuse_earlier_run`).

    Raises:
        RunFolderError: a new run in a folder that holds an earlier run.
        UnsafeCheckpoint: the trainer state would run code when loaded (never falls back: the folder is suspect).
        CheckpointError: every checkpoint is damaged.
        ConfigError: run-defining settings differ from the checkpoint's (:func:`check_run_config`).
    """
    if not cfg.trainer.resume:
        refuse_earlier_run(run_dir)
        return None
    found = complete_checkpoints(run_dir)
    if not found:
        again = f" (its {METRICS_FILE} is started again)" if (run_dir / METRICS_FILE).is_file() else ""
        log.warning("trainer.resume=true, but there is nothing to resume in %s (no complete checkpoint): starting "
                    "from scratch%s", run_dir, again)
        return None
    damaged = []
    for folder in reversed(found):
        try:
            state = load_trainer_state(folder)
            check_resumable(folder, state)
            check_weights(folder)
            saved = load_run_config(folder)
        except DamagedCheckpoint as err:
            damaged.append((folder, err))
            continue
        if damaged:
            log.warning("checkpoint %s is damaged (%s): resuming from the previous complete one, %s%s",
                        ", ".join(str(f) for f, _ in damaged), "; ".join(str(e) for _, e in damaged), folder.name,
                        set_aside([f for f, _ in damaged]))
        check_run_config(cfg, run_dir, folder, saved)
        check_restored_optimizer(cfg, folder, state)
        return ResumePoint(folder, state)
    reasons = "; ".join(f"{f.name}: {e}" for f, e in damaged)
    raise CheckpointError(f"trainer.resume=true: every checkpoint in {run_dir / 'checkpoints'} is damaged ({reasons}), "
                          "so nothing can be resumed. Start again in another folder, or remove the checkpoints folder "
                          "and run with trainer.resume=false.")


DAMAGED_PREFIX = "damaged-"


def set_aside(folders: list[Path]) -> str:
    """Rename damaged checkpoints to ``checkpoints/damaged-step-N`` (kept for inspection, no longer a checkpoint: they
    would count among the newest ones kept); returns the note for the warning."""
    moved = []
    for folder in folders:
        target = folder.with_name(DAMAGED_PREFIX + folder.name)
        try:
            if target.exists():
                shutil.rmtree(target)
            folder.rename(target)
            moved.append(target.name)
        except OSError:
            pass
    return f" (the damaged one is kept as checkpoints/{', '.join(moved)})" if moved else ""


def continue_schedule(optimizer, scheduler, saved_horizon: int | None, horizon: int) -> None:
    """After the scheduler state is loaded: give each parameter group the lr of the CURRENT schedule (built for
    ``horizon`` optimizer steps) at the current optimizer step. Unchanged ``trainer.max_steps``: nothing changes (the
    saved lr is that value, bit for bit). Changed: the schedule of a run started with the new max_steps, from here on,
    and a warning; before, the saved lr of the old horizon was used for one step (0 at the end of a linear decay)."""
    step = scheduler.last_epoch
    lrs = [base * f(step) for f, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    if lrs == [group["lr"] for group in optimizer.param_groups]:
        return
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)
    before = str(saved_horizon) if saved_horizon is not None else "another number of"
    log.warning("trainer.max_steps changed on resume (the schedule's horizon: %s -> %d optimizer steps): the "
                "learning-rate schedule is rebuilt for the new horizon and continues at optimizer step %d with lr %.6g "
                "(the lr a run started with this max_steps has there)", before, horizon, step, lrs[0])
