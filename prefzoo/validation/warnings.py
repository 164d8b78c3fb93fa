"""The pre-flight's warnings: legal settings that make a run do nothing, or that cannot apply to it (one line each; the run
goes on as it would without them)."""

from __future__ import annotations

import logging

log = logging.getLogger("prefzoo.config")

__all__ = ['warn_idle', 'warn_ignored']


def warn_idle(cfg, trains: bool, uses_beta: bool = True) -> None:
    """Warn about legal values that make a training run change nothing, and a beta the plugin does not use."""
    if not uses_beta and cfg.objective.beta:
        log.warning("objective.beta=%g does nothing for algo=%s: its loss has no divergence term (the summary records "
                    "beta as null); leave objective.beta unset.", cfg.objective.beta, cfg.algo.name)
    if trains and cfg.trainer.lr == 0 and cfg.trainer.max_steps > 0:
        log.warning("trainer.lr=0: the optimizer leaves every weight as it is, so the %d steps train nothing; "
                    "give a learning rate > 0, e.g. trainer.lr=2e-4.", cfg.trainer.max_steps)


def warn_ignored(cfg, online: bool) -> None:
    """One warning per setting that cannot apply to this run, though it changes nothing (round 4 of bad inputs): the
    run goes on as it would without it, and the line says what to drop. ``online``: the plugin samples its own
    training data (an offline plugin samples nothing: the rollout settings do not apply)."""
    from prefzoo.config import EnvConfig, RewardConfig, RolloutConfig

    r, e, rw = cfg.rollout, cfg.env, cfg.reward
    rollout_default = RolloutConfig()
    ignored = [
        (e.name != "retry" and e.turn_cost != EnvConfig().turn_cost,
         f"env.turn_cost={e.turn_cost} is env=retry's cost of another attempt, and this run plays env={e.name}"),
        (r.correction.mode is None and not r.correction.weight_kl,
         "rollout.correction.weight_kl=false weighs nothing without rollout.correction.mode (there are no weights)"),
        (not online and r.log_mismatch, f"rollout.log_mismatch=true: algo={cfg.algo.name} samples nothing to compare"),
        (not online and r.top_k != rollout_default.top_k,
         f"rollout.top_k={r.top_k}: algo={cfg.algo.name} samples nothing while it trains (the evaluation samples "
         "without top-k)"),
        (not online and r.asynchronous, f"rollout.asynchronous=true: algo={cfg.algo.name} samples no training batch"),
        (rw.overlong_buffer is None and rw.overlong_penalty != RewardConfig().overlong_penalty,
         f"reward.overlong_penalty={rw.overlong_penalty} applies over reward.overlong_buffer tokens, and none is set"),
        (bool(cfg.eval.steps) and max(cfg.eval.steps) > cfg.trainer.max_steps,
         f"eval.steps={list(cfg.eval.steps)} lists steps past trainer.max_steps={cfg.trainer.max_steps} (those "
         "evaluations never happen)"),
    ]
    for applies, what in ignored:
        if applies:
            log.warning("%s: the setting is ignored; drop it.", what)
    if r.dtype == "float16" and _device_type(cfg) == "cpu":
        log.warning("rollout.dtype=float16 on a CPU: float16 matmuls have no native kernels here and run far slower "
                    "than float32 (20x measured); use rollout.dtype=bfloat16 (native on CPUs with AVX512-BF16 or AMX) "
                    "or leave it unset.")


def _device_type(cfg) -> str:
    import torch

    device = cfg.trainer.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
