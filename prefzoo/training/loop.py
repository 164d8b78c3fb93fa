"""The training loop shared by every algorithm.

One training step:

1. take the next batch — preference pairs (offline algorithms) or prompts, which the plugin turns into
   an experience batch by sampling, scoring and computing advantages (online algorithms);
2. for each of ``algo.epochs`` passes, split the batch into ``algo.num_minibatches`` mini-batches; each
   mini-batch is one optimizer step (AdamW, gradient clipping, linear warm-up and decay), its gradient
   accumulated over micro-batches of ``trainer.micro_batch_size`` rows;
3. log the metrics (``metrics.jsonl``, TensorBoard, progress bar), checkpoint every ``save_every``
   steps.

Gradient accumulation gives the same update as one big batch: the plugin returns per-token or
per-example losses, and every micro-batch divides its summed loss by the normaliser of the whole
mini-batch (all its tokens or sequences, across processes too), see
:func:`prefzoo.objective.aggregate_loss`.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from prefzoo.algos import get_algorithm
from prefzoo.algos.base import Algorithm, Batch, SamplingParams
from prefzoo.config import Config, resolve_objective
from prefzoo.data.preference import collate_preferences
from prefzoo.evaluation.evaluate import Evaluator
from prefzoo.models.loading import load_tokenizer
from prefzoo.training.early_stopping import EarlyStopping
from prefzoo.training.checkpoint import (latest_checkpoint, load_trainer_state, load_weights, rng_state,
                                         save_checkpoint, save_weights, set_rng_state)
from prefzoo.training.metrics_log import MetricsLog
from prefzoo.training.sampler import IndexSampler
from prefzoo.training.step import accumulate_gradients  # noqa: F401  (re-exported: it lives in step.py)
from prefzoo.training.scoring import TextScorer
from prefzoo.training.setup import (build_policy, build_reward, correctness_function, pick_device, preference_data,
                                    task_prompts)

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_lambda(schedule: str, warmup: int, total: int):
    """Multiplier of the base learning rate at optimizer step s: linear warm-up, then linear decay to 0."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "constant":
            return 1.0
        return max(0.0, (total - step) / max(1, total - warmup))
    return f


class Trainer:
    """Runs one configured experiment in ``run_dir`` (see the module docstring)."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t = cfg.trainer
        if t.num_threads:
            torch.set_num_threads(t.num_threads)
        seed_everything(t.seed)
        self.device = pick_device(t.device)
        algo_cls = get_algorithm(cfg.algo.name)
        self.objective = resolve_objective(cfg)
        self.algo: Algorithm = algo_cls(cfg.algo, self.objective)
        self.tokenizer = load_tokenizer(cfg.model.name)
        self.reward_fn = build_reward(cfg)
        self.train_prompts, self.eval_prompts = (task_prompts(cfg, self.tokenizer)
                                                 if self.algo.online or cfg.data.path is None else (None, None))
        self.prefs = None
        self.data_stats: dict = {}
        if not self.algo.online:
            self.prefs, self.data_stats = preference_data(cfg, self.tokenizer, self.reward_fn, self.train_prompts,
                                                          self.eval_prompts, self.device)
        built = build_policy(cfg, self.algo, self.tokenizer, self.device)
        self.policy, self.model, self.load_seconds = built.policy, built.model, built.load_seconds
        n_rows = len(self.prefs.train) if self.prefs is not None else len(self.train_prompts)
        self.sampler = IndexSampler(n_rows, t.batch_size, t.seed)
        self.ref_cache = self.precompute_reference() if getattr(cfg.algo, "precompute_ref_logps", False) else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if self.policy.value_model is not None:
            self.params += [p for p in self.policy.value_model.parameters() if p.requires_grad
                            and not any(p is q for q in self.params)]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay)
        self.optimizer_steps = t.max_steps * self.algo.epochs * self.algo.num_minibatches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.lr_schedule, t.warmup_steps, self.optimizer_steps))
        self.scorer = TextScorer(self.tokenizer, self.reward_fn, self.policy.pad_id) if self.algo.online else None
        self.sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                       max_new_tokens=cfg.rollout.max_new_tokens)
        self.evaluator = Evaluator(self.policy, self.reward_fn, self.eval_prompts, cfg.eval,
                                   correctness_fn=correctness_function(cfg, self.eval_prompts),
                                   preference_examples=self.prefs.eval if self.prefs else None, algo=self.algo,
                                   group_size=getattr(self.algo.cfg, "num_generations", 0), seed=t.seed,
                                   progress=t.progress)
        self.metrics_log = MetricsLog(self.run_dir, tensorboard=t.tensorboard)
        self.step = 0
        self.cumulative_kl = 0.0
        es = t.early_stopping
        self.early_stopping = EarlyStopping(es.metric, es.mode, es.patience, es.min_delta) if es.metric else None

    # ----------------------------------------------------------------- batches
    def next_batch(self) -> tuple[Batch, dict]:
        idx = self.sampler.next()
        if self.algo.online:
            prompts = self.train_prompts.batch(idx, self.policy.pad_id).to(self.device)
            return self.algo.make_experience(self.policy, prompts, self.scorer, self.sampling)
        examples = [self.prefs.train[i] for i in idx]
        return collate_preferences(examples, idx, self.policy.pad_id, self.ref_cache).to(self.device), {}

    @torch.no_grad()
    def precompute_reference(self) -> dict[int, tuple[float, float]]:
        """Summed reference log-probs of every training pair, computed once (``algo.precompute_ref_logps``)."""
        cache: dict[int, tuple[float, float]] = {}
        size = self.cfg.trainer.micro_batch_size
        for start in tqdm(range(0, len(self.prefs.train), size), desc="reference log-probs",
                          disable=not self.cfg.trainer.progress):
            idx = list(range(start, min(start + size, len(self.prefs.train))))
            batch = collate_preferences([self.prefs.train[i] for i in idx], idx, self.policy.pad_id).to(self.device)
            chosen, rejected = self.algo.reference_logps(self.policy, batch)
            cache.update({i: (float(c), float(r)) for i, c, r in zip(idx, chosen.tolist(), rejected.tolist())})
        return cache

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch, metrics = self.next_batch()
        t1 = time.perf_counter()
        n = len(batch)
        per_mb = math.ceil(n / self.algo.num_minibatches)
        step_metrics: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.algo.epochs):
            order = torch.randperm(n).tolist() if self.algo.num_minibatches > 1 else list(range(n))
            for start in range(0, n, per_mb):
                mb = batch.select(order[start:start + per_mb])
                self.optimizer.zero_grad(set_to_none=True)
                m = accumulate_gradients(self.algo, self.policy, mb, self.cfg.trainer.micro_batch_size)
                clip = self.cfg.trainer.max_grad_norm
                m["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, clip if clip else float("inf")))
                m["lr"] = self.scheduler.get_last_lr()[0]
                self.optimizer.step()
                self.scheduler.step()
                for k, v in m.items():
                    step_metrics[k].append(v)
        t2 = time.perf_counter()
        out = {k: float(np.mean(v)) for k, v in step_metrics.items()}
        out.update(metrics)
        if self.scorer is not None:
            out.update(self.scorer.last_metrics)
        out.update(self.algo.after_step(out, n))
        tokens = getattr(batch, "num_tokens", None)
        tokens = tokens() if callable(tokens) else n
        out.update({"time/step": t2 - t0, "time/update": t2 - t1, "time/experience": t1 - t0,
                    "tokens_per_second": tokens * self.algo.epochs / max(t2 - t1, 1e-9), "beta": self.algo.beta})
        return out

    # -------------------------------------------------------------- checkpoints
    def trainer_state(self) -> dict:
        return {"step": self.step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "sampler": self.sampler.state_dict(), "algo": self.algo.state_dict(),
                "rng": rng_state(self.policy.generator), "cumulative_kl": self.cumulative_kl,
                "early_stopping": self.early_stopping.state_dict() if self.early_stopping else None,
                "value_model": self.policy.value_model.state_dict() if self.policy.value_model is not None else None}

    def maybe_resume(self) -> bool:
        ckpt = latest_checkpoint(self.run_dir)
        if not self.cfg.trainer.resume or ckpt is None:
            return False
        state = load_trainer_state(ckpt)
        load_weights(self.model, ckpt)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.algo.load_state_dict(state["algo"])
        if state.get("value_model") is not None:
            self.policy.value_model.load_state_dict(state["value_model"])
        set_rng_state(state["rng"], self.policy.generator)
        self.step = state["step"]
        self.cumulative_kl = state.get("cumulative_kl", 0.0)
        if self.early_stopping is not None and state.get("early_stopping"):
            self.early_stopping.load_state_dict(state["early_stopping"])
        self.metrics_log.truncate_after(self.step)
        log.info("resumed from %s (step %d)", ckpt, self.step)
        return True

    def save(self) -> None:
        save_checkpoint(self.run_dir, self.step, self.model, self.trainer_state())

    # --------------------------------------------------------------------- run
    def evaluate(self, tag: str) -> dict:
        start = time.perf_counter()
        result = self.evaluator.run()
        result["seconds"] = round(time.perf_counter() - start, 1)
        (self.run_dir / f"eval_{tag}.json").write_text(json.dumps(result, indent=2))
        return result

    def early_stop_check(self, metrics: dict) -> bool:
        """Evaluate on held-out data (results added to ``metrics`` as ``eval/...``); keep the best weights in
        ``best/``; True when the metric has not improved for ``patience`` evaluations."""
        result = self.evaluate(f"step{self.step:06d}")
        improved, stop = self.early_stopping.update(result, self.step)
        metrics.update({f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float))})
        if improved:
            save_weights(self.model, self.run_dir / "best")
        return stop

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        started = time.perf_counter()
        resumed = self.maybe_resume()
        before = None
        if t.max_steps and cfg.eval.before and not (resumed and (self.run_dir / "eval_before.json").is_file()):
            before = self.evaluate("before")
            print_eval("before training", before)
        elif (self.run_dir / "eval_before.json").is_file():
            before = json.loads((self.run_dir / "eval_before.json").read_text())
        bar = tqdm(total=t.max_steps, initial=self.step, desc=f"{cfg.algo.name}", disable=not t.progress,
                   dynamic_ncols=True)
        last: dict = {}
        stop_reason = "max_steps"
        while self.step < t.max_steps:
            last = self.train_step()
            self.step += 1
            if "kl" in last:
                self.cumulative_kl += max(0.0, last["kl"])
                last["cumulative_kl"] = self.cumulative_kl
            stop = False
            if self.early_stopping is not None and self.step % t.early_stopping.every == 0:
                stop = self.early_stop_check(last)
            if self.step % t.log_every == 0 or self.step == t.max_steps or stop:
                self.metrics_log.log(self.step, last)
            bar.update(1)
            bar.set_postfix({k: f"{last[k]:.3g}" for k in self.algo.progress_keys if k in last})
            if t.save_every and self.step % t.save_every == 0:
                self.save()
            if cfg.objective.kl_budget is not None and self.cumulative_kl >= cfg.objective.kl_budget:
                stop_reason = "kl_budget"
                break
            if stop:
                stop_reason = "early_stopping"
                break
        bar.close()
        if self.step and (not t.save_every or self.step % t.save_every):
            self.save()
        weights = save_weights(self.model, self.run_dir)
        if hasattr(self.algo, "save"):  # a plugin that leaves a model of its own (algo=rm: the reward model)
            self.algo.save(self.run_dir, self.policy)
        after = None
        if cfg.eval.after and t.max_steps:
            after = self.evaluate("after")
            print_eval("after training", after)
        summary = make_summary(cfg, self, before, after, last, time.perf_counter() - started, stop_reason, weights)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.metrics_log.close()
        return summary


def make_summary(cfg, trainer, before, after, last, seconds, stop_reason, weights) -> dict:
    """The run's final numbers, under the same keys for every algorithm."""
    strip = lambda d: {k: v for k, v in (d or {}).items() if not k.endswith("examples")}  # noqa: E731
    return {
        "algo": cfg.algo.name, "model": cfg.model.name, "data": cfg.data.name, "reward": cfg.reward.name,
        "beta": trainer.objective.beta, "final_beta": trainer.algo.beta, "divergence": trainer.objective.divergence,
        "kl_estimator": trainer.objective.kl_estimator, "kl_placement": trainer.objective.kl_placement,
        "seed": cfg.trainer.seed, "steps": trainer.step, "stop_reason": stop_reason,
        "wall_seconds": round(seconds, 1), "model_load_seconds": round(trainer.load_seconds, 1),
        "eval_before": strip(before), "eval_after": strip(after), "final_train_metrics": last,
        "data_stats": trainer.data_stats or None, "weights": str(weights),
        "cumulative_kl": trainer.cumulative_kl,
        "early_stopping": trainer.early_stopping.state_dict() if trainer.early_stopping else None,
    }


def print_eval(title: str, result: dict) -> None:
    keys = [k for k in ("task_accuracy", "task_reward", "preference_accuracy", "pass_at_4", "kl_k1", "entropy",
                        "distinct_2") if k in result]
    parts = []
    for k in keys:
        se = result.get(f"{k}_se")
        parts.append(f"{k}={result[k]:.3f}" + (f"±{se:.3f}" if se is not None and not math.isnan(se) else ""))
    print(f"[prefzoo] eval {title}: " + ", ".join(parts), flush=True)


def write_resolved_config(cfg: Config, run_dir: Path) -> None:
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
