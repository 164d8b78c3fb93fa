"""A run's held-out evaluations (:class:`RunEvaluations`): before training, every ``eval.every`` steps or after the
steps of ``eval.steps`` (and every ``trainer.early_stopping.every`` steps with early stopping on
``trainer.early_stopping.metric``, the best weights in ``best/``), and after training -- also when there was no step,
which measures the starting policy.

The shared evaluation is :class:`~prefzoo.evaluation.evaluate.Evaluator` over the policy the plugin chooses
(``Algorithm.evaluation_policy``: best-of-n's own sampling procedure), with the shifted task's (``eval.ood``) beside
it. The starting policy's part of the evaluation before training is reused when an evaluation with the same settings
exists (:mod:`prefzoo.training.baseline`). Each evaluation writes ``eval_<tag>.json``, goes to the trackers
(``eval/<metric>``) and into the run's history (``summary.json``'s ``eval_history``). Under data parallelism the main
process evaluates; under FSDP every process runs the same passes (:meth:`RunEvaluations.everywhere`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from prefzoo.evaluation.evaluate import Evaluator
from prefzoo.evaluation.ood import build_ood_evaluator
from prefzoo.models.loading import cache_dir
from prefzoo.training import baseline
from prefzoo.training.checkpoint import save_weights
from prefzoo.training.early_stopping import EarlyStopping
from prefzoo.training.layout import EVAL_FILE
from prefzoo.training.setup import build_gold_reward, correctness_function, evaluation_reward

log = logging.getLogger(__name__)

__all__ = ["RunEvaluations"]


class RunEvaluations:
    """The evaluations of one run (module docstring).

    Args:
        cfg: the run's typed config; algo: its plugin; policy: the trained policy; scorer: the run's reward of
            sampled completions (or None); reward_fn: the run's reward; prompts: the held-out prompts; prefs: the
            offline data (its held-out pairs), or None; tokenizer, device, dp, run_dir, metrics_log: the run's.
    """

    def __init__(self, cfg, algo, policy, scorer, reward_fn, prompts, prefs, tokenizer, device, dp, run_dir: Path,
                 metrics_log):
        d = algo.declaration
        self.cfg, self.algo, self.policy, self.scorer, self.device = cfg, algo, policy, scorer, device
        self.dp, self.run_dir, self.metrics_log = dp, Path(run_dir), metrics_log
        self.evaluator = Evaluator(algo.evaluation_policy(policy, scorer), evaluation_reward(cfg, reward_fn, prompts),
                                   prompts, cfg.eval, correctness_fn=correctness_function(cfg, prompts),
                                   preference_examples=prefs.eval if prefs else None,
                                   implicit_rewards=algo.implicit_rewards if d.has("implicit_rewards") else None,
                                   num_samples=d.num_samples, seed=cfg.trainer.seed, progress=cfg.trainer.progress,
                                   gold_reward_fn=build_gold_reward(cfg))
        self.ood_evaluator = build_ood_evaluator(cfg, self.evaluator, tokenizer)  # eval.ood (ood_*), or None
        es = cfg.trainer.early_stopping
        self.early_stopping = EarlyStopping(es.metric, es.mode, es.patience, es.min_delta) if es.metric else None
        self.history: list[dict] = []  # {"step", numeric evaluation metrics...}: before, every N steps, after

    def policy_metrics(self) -> dict:
        """The evaluation's metrics of the policy's own completions, the shifted task's (``eval.ood``) included."""
        result = self.evaluator.policy_metrics()
        if self.ood_evaluator is not None:  # eval.ood: the same evaluation on the shifted task, keys ood_*
            result.update(self.ood_evaluator.run())
        return result

    def starting_metrics(self) -> dict:
        """:meth:`policy_metrics` of the starting policy, reused from an evaluation with the same settings when there is
        one (:mod:`prefzoo.training.baseline`: the cache, or the set that ships), else computed and stored; the result
        says where it came from (``reused_from``)."""
        why = baseline.not_reusable(self.cfg)
        if why is None and self.algo.evaluation_policy(self.policy, self.scorer) is not self.policy:
            why = f"algo={self.cfg.algo.name} evaluates a policy of its own"
        if why is not None:
            log.debug("the evaluation before training is computed: %s", why)
            return self.policy_metrics()
        key, parts = baseline.starting_key(self.cfg, reference=self.policy.reference is not None,
                                           num_samples=self.algo.declaration.num_samples,
                                           env=baseline.environment(self.device))
        found = baseline.load(cache_dir(), key)
        if found is not None:
            result, path = found
            log.info("evaluation before training: the starting policy's, reused (%s); eval.reuse_before=false computes "
                     "it again", baseline.describe(path))
            return {**result, "reused_from": str(path)}
        start = time.perf_counter()
        result = self.policy_metrics()
        baseline.store(cache_dir(), key, parts, result, time.perf_counter() - start)
        return result

    def evaluate(self, tag: str, step: int, starting: bool = False) -> dict:
        """Run the shared evaluation after ``step`` steps, write ``eval_<tag>.json`` and add the result to the history.
        ``starting``: the policy has not trained yet (:meth:`starting_metrics`)."""
        start = time.perf_counter()
        result = self.starting_metrics() if starting else self.policy_metrics()
        result.update(self.evaluator.pair_metrics())
        result["seconds"] = round(time.perf_counter() - start, 1)
        (self.run_dir / EVAL_FILE.format(tag=tag)).write_text(json.dumps(result, indent=2))
        self.metrics_log.log_eval(step, result)  # eval/<metric> in TensorBoard and the trackers
        self.history.append({"step": step, "tag": tag,
                             **{k: v for k, v in result.items() if isinstance(v, (int, float, str))
                                and not k.endswith("examples")}})
        return result

    def everywhere(self, tag: str, step: int, starting: bool = False) -> dict | None:
        """:meth:`evaluate` on the main process (None elsewhere). Under FSDP every process runs the same evaluation
        (its result thrown away): the passes of the sharded units then stay the same on every process, which FSDP2's
        per-unit state needs (a unit that ran forwards on one process only went out of step with the others in the
        next backward: a hang). Call it in a :meth:`DataParallel.gathered` block."""
        if self.dp.is_main:
            return self.evaluate(tag, step, starting)
        if self.dp.fsdp:
            self.starting_metrics() if starting else self.policy_metrics()
            self.evaluator.pair_metrics()
        return None

    def due(self, step: int, max_steps: int) -> bool:
        """Whether step ``step`` (1-based, just done) ends with a held-out evaluation (early stopping's, or
        ``eval.every``'s and ``eval.steps``' except at the last step, which the evaluation after training covers)."""
        t, every = self.cfg.trainer, self.cfg.eval.every
        if self.early_stopping is not None and step % t.early_stopping.every == 0:
            return True
        last_step = step == max_steps and self.cfg.eval.after
        listed = step in self.cfg.eval.steps or (bool(every) and step % every == 0)
        return listed and not last_step

    def periodic(self, step: int, metrics: dict, model) -> tuple[bool, float | None]:
        """Evaluate on held-out data during training (:meth:`due`): the result goes to ``eval_step<N>.json``, the
        history and the step's ``metrics`` (``eval/...``); early stopping keeps the best weights (of ``model``) in
        ``best/``.

        Returns (stop, kl): stop is True when the early-stopping metric has not improved for ``patience``
        evaluations; kl is the evaluation's KL(pi || pi_ref) estimate (``kl_k1``, nats per sequence) or None. The
        main process evaluates; its answer is broadcast."""
        stop, kl, improved = False, None, False
        with self.dp.gathered():  # FSDP: the whole model evaluates
            result = self.everywhere(f"step{step:06d}", step)
            if self.dp.is_main:
                metrics.update({f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float))})
                kl = result.get("kl_k1")
                if self.early_stopping is not None and step % self.cfg.trainer.early_stopping.every == 0:
                    improved, stop = self.early_stopping.update(result, step)
            stop, kl, improved = self.dp.broadcast_object((bool(stop), kl, improved))
        if improved:
            weights = self.dp.full_state(model)
            if self.dp.is_main:
                save_weights(model, self.run_dir / "best", state_dict=weights)
        return stop, kl
