"""The training loop shared by every algorithm.

One training step:

1. take the next batch — preference pairs (offline algorithms) or prompts, which the plugin turns into
   an experience batch by sampling, scoring and computing advantages (online algorithms);
2. for each of the declared ``epochs`` passes, split the batch into ``num_minibatches`` mini-batches; each
   mini-batch is one optimizer step (AdamW, gradient clipping, linear warm-up and decay), its gradient
   accumulated over micro-batches of ``trainer.micro_batch_size`` rows;
3. log the metrics (``metrics.jsonl``, TensorBoard, progress bar), checkpoint every ``save_every``
   steps.

Around the steps: the shared evaluation (:class:`~prefzoo.evaluation.evaluate.Evaluator`) before training, every
``eval.every`` steps (and every ``trainer.early_stopping.every`` steps with early stopping on
``trainer.early_stopping.metric``, best weights in ``best/``), and after training -- also when there was no step
(``trainer.max_steps=0``, or a plugin that declares ``trains=False``: best-of-n), which measures the
starting policy. The plugin chooses the policy evaluated (``Algorithm.evaluation_policy``: best-of-n's own
sampling procedure). ``objective.kl_budget`` stops the run once the latest KL(pi || pi_ref) measurement -- the
step's rollouts (metric ``kl``, online algorithms) or else the last held-out evaluation -- reaches it (nats per
sequence: the KL "spent" since the start). ``summary.json`` gathers it all; its ``results`` block has the same keys
for every algorithm (:data:`RESULT_KEYS`).

Data parallelism (``accelerate launch`` / ``torchrun`` with several processes, see
:mod:`prefzoo.training.distributed`): ``trainer.batch_size`` is the GLOBAL batch. Every process draws the
same global batch and takes its own contiguous shard of it (whole prompts for online algorithms,
:mod:`prefzoo.training.sharding`); each prompt's rollout is seeded by (seed, step, its position in the global
batch), so it samples the same whatever process holds it. Gradient-carrying forward passes go through DDP;
micro-batches but the last of an optimizer step run under ``no_sync``; the loss normaliser is all-reduced
and the loss multiplied by the number of processes (DDP averages), so the update equals one process's on
the global batch. Mini-batches (``num_minibatches`` > 1) are drawn from the global rows (process 0's
permutation, broadcast). Step metrics are reduced over processes (:func:`~prefzoo.training.sharding.reduce_metrics`).
Only the main process logs, evaluates and writes checkpoints, weights and the summary; the others wait at
barriers, and every process resumes from the same checkpoint files.

Gradient accumulation gives the same update as one big batch: the plugin returns per-token or
per-example losses, and every micro-batch divides its summed loss by the normaliser of the whole
mini-batch (all its tokens or sequences, across processes too), see
:func:`prefzoo.objective.aggregate_loss`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from prefzoo.algos.base import Algorithm, Declaration
from prefzoo.types import ROLLOUT_SEED_COLUMN, Batch
from prefzoo.config import Config, resolve_defaults
from prefzoo.data.preference import collate_preferences
from prefzoo.data.unpaired import collate_examples
from prefzoo.errors import CheckpointError
from prefzoo.evaluation.evaluate import Evaluator
from prefzoo.evaluation.ood import OOD_RESULTS, build_ood_evaluator
from prefzoo.models.loading import cache_dir, load_tokenizer
from prefzoo.environments import episode_factory
from prefzoo.rollout.multiturn import MultiTurnEngine, MultiTurnSettings
from prefzoo.training import baseline
from prefzoo.training.early_stopping import EarlyStopping
from prefzoo.training.checkpoint import (load_trainer_state, load_weights, rng_state, save_checkpoint, save_weights,
                                         set_rng_state)
from prefzoo.training.distributed import DataParallel, TrainableModules, setup_data_parallel
from prefzoo.training.model_card import write_model_card
from prefzoo.training.trackers import open_metrics_log
from prefzoo.training.resume import continue_schedule, run_config
from prefzoo.training.layout import CONFIG_FILE, EVAL_FILE, SUMMARY_FILE
from prefzoo.training.run_folder import RunFolder, open_run_folder, unlock_run_folder
from prefzoo.training.sampler import IndexSampler
from prefzoo.training.sharding import reduce_metrics, rollout_seeds, shard_range
from prefzoo.training.watch import MetricWatch
from prefzoo.training.step import accumulate_gradients, mean_metrics, optimisation_step  # noqa: F401 (re-exported)
from prefzoo.training.scoring import TextScorer
from prefzoo.training.plugin import build_algorithm
from prefzoo.training.setup import (build_gold_reward, build_policy, build_reward, check_reward_columns, probe_reward,
                                    probe_environment,
                                    correctness_function, evaluation_reward,
                                    heldout_pair_prompts, offline_data, pick_device, task_prompts)

log = logging.getLogger(__name__)


def global_pairs(per_process: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Add each metric's (sum, count) over processes. ``loss`` is a sum of shares (each process reports its share
    of the global loss per optimizer step): its sums add up, its count (optimizer steps) is one process's."""
    out: dict[str, list[float]] = {}
    for pairs in per_process:
        for k, (v, c) in pairs.items():
            acc = out.setdefault(k, [0.0, 0.0])
            acc[0] += v
            acc[1] = c if k == "loss" else acc[1] + c
    return out


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
    """Runs one configured experiment in ``run_dir`` (see the module docstring).

    ``dp``: this process's place among data-parallel processes (default: set up from the launch environment
    by :func:`~prefzoo.training.distributed.setup_data_parallel`; a single process when not launched as several).
    ``folder``: ``run_dir`` already checked, locked and its resume point found by
    :func:`~prefzoo.training.run_folder.open_run_folder` (default: done here, before any model loads).
    ``algo``: the run's plugin as the pre-flight built it (:func:`prefzoo.cli.preflight`; default: built here by
    :func:`~prefzoo.training.plugin.build_algorithm`).
    """

    #: rollout.asynchronous: the worker, started in :meth:`run` after a resume (None: synchronous rollouts), and a
    #: checkpoint's rows already requested from it (their step, rows)
    async_rollouts = None
    resumed_ahead: list | None = None
    #: True once the training steps have begun (after the evaluation before training): an error then names the step
    started = False

    def __init__(self, cfg: Config, run_dir: Path, dp: DataParallel | None = None, folder: RunFolder | None = None,
                 algo: Algorithm | None = None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        t = cfg.trainer
        if t.num_threads:
            torch.set_num_threads(t.num_threads)
        seed_everything(t.seed)
        self.dp = dp if dp is not None else setup_data_parallel(cfg, pick_device(t.device))
        self.device = self.dp.device or pick_device(t.device)
        resolve_defaults(cfg)
        self.folder = folder if folder is not None else open_run_folder(cfg, self.run_dir, self.dp)
        self.algo: Algorithm = algo if algo is not None else build_algorithm(cfg)  # the pre-flight's, or built here
        self.objective, self.sampling = self.algo.objective, self.algo.sampling
        self.declaration: Declaration = self.algo.declaration
        self.tokenizer = load_tokenizer(cfg.model.name)
        self.reward_fn = build_reward(cfg)
        self.train_prompts, self.eval_prompts = (task_prompts(cfg, self.tokenizer)
                                                 if self.declaration.online or cfg.data.path is None else (None, None))
        if self.eval_prompts is None and cfg.data.path:  # a preference file: evaluate on its held-out pairs' prompts
            self.eval_prompts = heldout_pair_prompts(cfg, self.tokenizer)
        check_reward_columns(cfg, self.train_prompts)  # before any model loads
        make_episode = episode_factory(cfg.env)  # env=...: rollouts and evaluations become episodes
        environments = probe_environment(make_episode, self.train_prompts)  # a reset that fails stops here
        if self.folder.resume is None:  # a reward that raises or returns NaN: here (a resumed run passed it at its start)
            probe_reward(self.reward_fn, self.train_prompts, environments)
        self.prefs = None
        self.data_stats: dict = {}
        with self.dp.main_process_first():  # the main process builds and caches pairs / converted weights first
            if not self.declaration.online:
                self.prefs, self.data_stats = offline_data(cfg, self.tokenizer, self.reward_fn, self.train_prompts,
                                                           self.eval_prompts, self.device, self.declaration.data)
                self.algo.check_data(self.data_stats.get("rows", {}))  # (unpaired rows: KTO's class balance)
            built = build_policy(cfg, self.declaration, self.tokenizer, self.device)
        self.policy, self.model, self.load_seconds = built.policy, built.model, built.load_seconds
        if make_episode is not None:
            self.policy.engine = MultiTurnEngine(self.policy.engine, self.tokenizer, make_episode,
                                                 MultiTurnSettings(cfg.env.max_turns, cfg.env.max_tokens,
                                                                   cfg.env.reward_placement))
        if self.dp.rank > 0:  # the model is built alike everywhere; from here on (dropout) each process draws its own
            seed_everything(t.seed + 1_000_003 * self.dp.rank)
        self.algo.all_reduce = self.dp.all_reduce_sum if self.dp.enabled else None
        n_rows = len(self.prefs.train) if self.prefs is not None else len(self.train_prompts)
        self.sampler = IndexSampler(n_rows, t.batch_size, t.seed)
        if self.declaration.draws_prompts:  # dynamic sampling's extra rounds (one process, synchronous: pre-flight)
            self.algo.draw_prompts = self.extra_prompts
        self.ref_cache = self.precompute_reference() if self.declaration.precompute_reference else None
        self.weights_loaded = False  # FSDP: a resumed run's weights, loaded before sharding (maybe_resume: the rest)
        if self.dp.fsdp and self.folder.resume is not None:
            self.load_resumed_weights()
        self.train_module = None  # DDP over the trainable modules, or them sharded (FSDP; data parallel only)
        if self.dp.enabled:
            ref = self.policy.reference
            frozen = [ref.module] if ref is not None and ref.module is not None and ref.module is not self.model else []
            self.train_module = self.dp.wrap(TrainableModules(self.model, self.policy.value_model), frozen=frozen)
            self.policy.train_forward = self.train_module
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # (after sharding: FSDP's DTensors)
        if self.policy.value_model is not None:
            self.params += [p for p in self.policy.value_model.parameters() if p.requires_grad
                            and not any(p is q for q in self.params)]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay)
        self.max_steps = t.max_steps if self.declaration.trains else 0  # best-of-n: no training steps
        self.watch = MetricWatch(self.declaration.warnings, self.max_steps)  # the plugin's warnings (no learning signal)
        rows = t.batch_size * max(1, self.declaration.num_samples)
        if self.declaration.num_minibatches > rows:
            from prefzoo.errors import ConfigError

            raise ConfigError(f"algo.num_minibatches={self.declaration.num_minibatches} exceeds the {rows} rows of a step "
                              "(trainer.batch_size x algo.num_samples); lower it or raise trainer.batch_size.")
        self.optimizer_steps = self.max_steps * self.declaration.epochs * self.declaration.num_minibatches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.lr_schedule, t.warmup_steps, self.optimizer_steps))
        rc = cfg.reward
        overlong = (cfg.rollout.max_new_tokens, rc.overlong_buffer, rc.overlong_penalty) if rc.overlong_buffer else None
        self.scorer = (TextScorer(self.tokenizer, self.reward_fn, self.policy.pad_id, rc.aggregation, overlong)
                       if self.declaration.reward else None)
        self.evaluator = Evaluator(self.algo.evaluation_policy(self.policy, self.scorer),
                                   evaluation_reward(cfg, self.reward_fn, self.eval_prompts), self.eval_prompts, cfg.eval,
                                   correctness_fn=correctness_function(cfg, self.eval_prompts),
                                   preference_examples=self.prefs.eval if self.prefs else None,
                                   implicit_rewards=(self.algo.implicit_rewards if self.declaration.has("implicit_rewards")
                                                     else None),
                                   num_samples=self.declaration.num_samples, seed=t.seed,
                                   progress=t.progress, gold_reward_fn=build_gold_reward(cfg))
        self.ood_evaluator = build_ood_evaluator(cfg, self.evaluator, self.tokenizer)  # eval.ood (ood_*), or None
        self.metrics_log = open_metrics_log(cfg, self.run_dir, self.dp.is_main)  # report_to: tensorboard, trackio, wandb
        self.step = 0
        self.async_ahead: list[tuple[int, list[int]]] = []  # (step, rows) submitted to the worker, in order
        self.kl_spent: float | None = None  # the latest KL(pi || pi_ref) measurement, nats per sequence
        self.eval_history: list[dict] = []  # {"step", numeric evaluation metrics...}: before, every N steps, after
        self.train_seconds = 0.0  # time in training steps (rollouts and updates), evaluations excluded
        es = t.early_stopping
        self.early_stopping = EarlyStopping(es.metric, es.mode, es.patience, es.min_delta) if es.metric else None
        self.check_kl_budget()

    # ----------------------------------------------------------------- batches
    def step_prompts(self, idx: list[int], step: int, start: int = 0, stop: int | None = None):
        """The prompts of rows ``idx`` of training step ``step`` (0-based), with their per-prompt rollout seeds."""
        prompts = self.train_prompts.batch(idx, self.policy.pad_id).to(self.device)
        stop = len(idx) if stop is None else stop
        prompts.columns[ROLLOUT_SEED_COLUMN] = rollout_seeds(self.cfg.trainer.seed, step, range(start, stop))
        return prompts

    def extra_prompts(self, round: int):
        """Round ``round`` (>= 1) of the current step's extra prompts (dynamic sampling): the sampler's next batch,
        with rollout seeds after the step's first round's."""
        idx = self.sampler.next()
        return self.step_prompts(idx, self.step, round * len(idx), (round + 1) * len(idx))

    def next_batch(self) -> tuple[Batch, dict]:
        """This process's share of the step's global batch (all of it in one process)."""
        if self.scorer is not None:
            self.scorer.new_step()  # the step's reward/<name> metrics: its first scoring's (dynamic sampling scores more)
        every = self.cfg.trainer.kl_metric_every  # logged step numbers self.step + 1 = every, 2 every, ...
        self.algo.drift_metrics_due = bool(every) and (self.step + 1) % every == 0
        if self.async_rollouts is not None:
            return self.async_batch()
        # rows an asynchronous run had drawn ahead before its checkpoint come first (resumed synchronously)
        idx = self.resumed_ahead.pop(0)[1] if self.resumed_ahead else self.sampler.next()
        start, stop = shard_range(len(idx), self.dp.rank, self.dp.world_size)
        idx = idx[start:stop]
        if self.declaration.online:
            prompts = self.step_prompts(idx, self.step, start, stop)
            return self.algo.make_experience(self.policy, prompts, self.scorer)
        examples = [self.prefs.train[i] for i in idx]
        return collate_examples(examples, idx, self.policy.pad_id, self.ref_cache).to(self.device), {}

    # -------------------------------------------------------- asynchronous rollouts (rollout.asynchronous)
    def start_async(self, ahead: list | None) -> None:
        """Start the rollout worker (:mod:`prefzoo.rollout.async_rollouts`), send it the current adapter (version =
        ``self.step``) and submit the rollouts of the next max_staleness + 1 steps: those of a checkpoint's ``ahead``
        first (their rows were drawn before it was saved; they are sampled again, with the restored weights)."""
        from functools import partial

        from prefzoo.rollout.async_rollouts import AsyncEngine, AsyncRollouts, adapter_state
        from prefzoo.training.setup import build_rollout_worker

        r = self.cfg.rollout
        self.async_rollouts = AsyncRollouts(partial(build_rollout_worker, self.cfg), r.max_staleness,
                                            r.async_threads, r.async_timeout)
        c = r.correction  # the worker's log-probs serve a correction or the mismatch metrics; else one pass saved
        self.async_engine = AsyncEngine(self.async_rollouts, keep_logps=bool(c.mode or c.bypass or r.log_mismatch))
        self.async_rollouts.push_weights(self.step, adapter_state(self.model))
        self.async_ahead: list[tuple[int, list[int]]] = []
        for step, idx in ahead or []:
            self.submit_async(step, idx)
        while len(self.async_ahead) < r.max_staleness + 1:
            step = self.async_ahead[-1][0] + 1 if self.async_ahead else self.step
            if step >= self.max_steps:
                break
            self.submit_async(step, self.sampler.next())

    def submit_async(self, step: int, idx: list[int]) -> None:
        self.async_ahead.append((step, list(idx)))
        self.async_rollouts.submit(step, self.step_prompts(idx, step), max(1, self.declaration.num_samples),
                                   self.algo.sampling, self.policy.eos_token_ids, self.policy.pad_id)

    def async_batch(self) -> tuple[Batch, dict]:
        """This step's experience from the worker's rollout (the policy's engine swapped for the step's rollout)."""
        step, idx = self.async_ahead.pop(0)
        if step != self.step:
            raise RuntimeError(f"asynchronous rollouts out of order: step {step + 1} where {self.step + 1} was due")
        prompts = self.step_prompts(idx, step)
        self.async_engine.step = step
        engine, self.policy.engine = self.policy.engine, self.async_engine
        try:
            batch, metrics = self.algo.make_experience(self.policy, prompts, self.scorer)
        finally:
            self.policy.engine = engine
        return batch, {**metrics, **self.async_engine.last_metrics}

    def after_update_async(self) -> None:
        """After an optimizer step: the new adapter to the worker (version = steps done), then the next request."""
        from prefzoo.rollout.async_rollouts import adapter_state

        self.async_rollouts.push_weights(self.step + 1, adapter_state(self.model))
        step = self.step + 1 + self.cfg.rollout.max_staleness
        if step < self.max_steps:
            self.submit_async(step, self.sampler.next())

    def stop_async(self) -> None:
        if self.async_rollouts is not None:
            self.async_rollouts.close()
            self.async_rollouts = None

    @torch.no_grad()
    def precompute_reference(self) -> dict[int, tuple[float, float]]:
        """Summed reference log-probs of every training pair, computed once (declared ``precompute_reference``)."""
        cache: dict[int, tuple[float, float]] = {}
        size = self.cfg.trainer.micro_batch_size
        mine = list(range(self.dp.rank, len(self.prefs.train), self.dp.world_size))  # every process computes a share
        for start in tqdm(range(0, len(mine), size), desc="reference log-probs",
                          disable=not (self.cfg.trainer.progress and self.dp.is_main)):
            idx = mine[start:start + size]
            batch = collate_preferences([self.prefs.train[i] for i in idx], idx, self.policy.pad_id).to(self.device)
            chosen, rejected = self.algo.reference_logps(self.policy, batch)
            cache.update({i: (float(c), float(r)) for i, c, r in zip(idx, chosen.tolist(), rejected.tolist())})
        if self.dp.enabled:
            for part in self.dp.gather_objects(cache):
                cache.update(part)
        return cache

    def row_layout(self, n: int) -> tuple[int, int]:
        """(offset of this process's first row among the global rows, number of global rows) of a step's batch,
        whose rows are the processes' rows concatenated in rank order."""
        if not self.dp.enabled:
            return 0, n
        counts = self.dp.gather_objects(n)
        return sum(counts[:self.dp.rank]), sum(counts)

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        with self.dp.gathered() if self.declaration.online else contextlib.nullcontext():  # FSDP: rollouts whole
            batch, metrics = self.next_batch()
        t1 = time.perf_counter()
        n = len(batch)
        offset, n_global = self.row_layout(n)
        dp = self.dp
        parallel = {} if not dp.enabled else {
            "all_reduce": dp.all_reduce_sum, "loss_scale": float(dp.world_size), "placeholder": batch.select([0]),
            "no_sync": lambda: dp.no_sync(self.train_module)}
        if dp.fsdp:  # every process runs as many sharded passes (each all-gathers); FSDP2 reduce-scatters each
            from prefzoo.training.fsdp import all_reduce_replicated_grads, clip_grad_norm

            parallel.update(no_sync=None, equal_passes=dp.max_over_processes, gathered=dp.gathered,
                            sync_grads=lambda params: all_reduce_replicated_grads(params, dp.world_size),
                            clip_grad_norm=clip_grad_norm)
        clip = self.cfg.trainer.max_grad_norm
        pairs = optimisation_step(  # one permutation of the GLOBAL rows per pass (process 0's, broadcast)
            self.algo, self.policy, batch, self.optimizer, self.scheduler, self.params,
            self.cfg.trainer.micro_batch_size, max_grad_norm=clip if clip else float("inf"),
            permutation=lambda rows: dp.broadcast_object(torch.randperm(rows).tolist()),
            layout=(offset, n_global), parallel=parallel)
        t2 = time.perf_counter()
        out = dict(metrics)  # the rollout's (per-row means over this process's rows)
        if self.scorer is not None:
            out.update(self.scorer.last_metrics)
        out.update({"time/step": t2 - t0, "time/update": t2 - t1, "time/experience": t1 - t0,
                    "tokens_per_second": batch.num_tokens() * self.declaration.epochs / max(t2 - t1, 1e-9)})
        if dp.enabled:  # global metrics (the same on every process, so after_step adapts beta alike everywhere)
            out = reduce_metrics(dp.gather_objects((n, out)))
            pairs = global_pairs(dp.gather_objects(dict(pairs)))
        out.update(mean_metrics(pairs))  # per-token metrics: token means of the global batch (sums / counts)
        out.update(self.algo.after_step(out, n_global))
        out["beta"] = self.algo.beta
        if self.async_rollouts is not None:
            self.after_update_async()
        return out

    # -------------------------------------------------------------- checkpoints
    def trainer_state(self) -> dict:
        """Everything to resume from (called by every process: the RNG states of all of them are gathered)."""
        rng = rng_state(self.policy.generator)
        if self.dp.fsdp:  # gathered (collectives: every process), in the layout of one process's state
            from prefzoo.training.fsdp import full_optimizer_state

            optimizer = full_optimizer_state(self.train_module, self.optimizer, self.params)
            value = self.dp.full_state(self.policy.value_model) if self.policy.value_model is not None else None
        else:
            optimizer = self.optimizer.state_dict()
            value = self.policy.value_model.state_dict() if self.policy.value_model is not None else None
        return {"step": self.step, "optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                "sampler": self.sampler.state_dict(), "algo": self.algo.state_dict(),
                "rng": rng, "rng_per_process": self.dp.gather_objects(rng) if self.dp.enabled else None,
                "kl_spent": self.kl_spent, "eval_history": self.eval_history, "train_seconds": self.train_seconds,
                "early_stopping": self.early_stopping.state_dict() if self.early_stopping else None,
                "optimizer_steps": self.optimizer_steps,
                "async_ahead": list(self.async_ahead) if self.async_rollouts is not None else None,
                "value_model": value}

    def maybe_resume(self) -> bool:
        point = self.folder.resume  # checked against the config before the model loaded (prefzoo.training.resume)
        if point is None:
            if self.cfg.trainer.resume:  # nothing to resume (warned): start afresh, without the steps of a run that
                self.metrics_log.truncate_after(0)  # died before its first checkpoint
            return False
        ckpt, state = point.folder, point.state if point.state is not None else load_trainer_state(point.folder)
        point.state = None
        if not self.weights_loaded:
            load_weights(self.model, ckpt)
            if state.get("value_model") is not None:
                self.policy.value_model.load_state_dict(state["value_model"])
        if self.dp.fsdp:  # the whole state on every process, each keeping its shard
            from prefzoo.training.fsdp import load_optimizer_state

            load_optimizer_state(self.train_module, self.optimizer, self.params, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        continue_schedule(self.optimizer, self.scheduler, state.get("optimizer_steps"), self.optimizer_steps)
        self.sampler.load_state_dict(state["sampler"])
        self.algo.load_state_dict(state["algo"])
        per_process = state.get("rng_per_process")
        same_world = per_process is not None and len(per_process) == self.dp.world_size
        set_rng_state(per_process[self.dp.rank] if same_world else state["rng"], self.policy.generator)
        self.step = state["step"]
        self.resumed_ahead = [(int(st), [int(i) for i in idx]) for st, idx in state.get("async_ahead") or []]
        self.kl_spent = state.get("kl_spent")
        self.eval_history = list(state.get("eval_history") or [])
        self.train_seconds = state.get("train_seconds", 0.0)
        if self.early_stopping is not None and state.get("early_stopping"):
            self.early_stopping.load_state_dict(state["early_stopping"])
        self.metrics_log.truncate_after(self.step)
        log.info("resumed from %s (step %d)", ckpt, self.step)
        return True

    def load_resumed_weights(self) -> None:
        """FSDP: the resumed checkpoint's adapter (and value model) into the whole model, before it is sharded."""
        point = self.folder.resume
        if point.state is None:
            point.state = load_trainer_state(point.folder)
        load_weights(self.model, point.folder)
        if point.state.get("value_model") is not None:
            self.policy.value_model.load_state_dict(point.state["value_model"])
        self.weights_loaded = True

    def save(self) -> None:
        """Write a checkpoint (main process; every process calls this, and waits until it is written)."""
        state = self.trainer_state()
        weights = self.dp.full_state(self.model)  # FSDP: gathered on the main process; else None (the model's own)
        error = None
        if self.dp.is_main:
            try:  # a failed write (full disk) keeps the previous checkpoints and stops every process cleanly
                save_checkpoint(self.run_dir, self.step, self.model, state, run_config=run_config(self.cfg),
                                state_dict=weights)
            except CheckpointError as err:
                error = err
        error = self.dp.broadcast_object(error)
        if error is not None:
            raise error
        self.dp.barrier()

    # --------------------------------------------------------------------- run
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
                                           num_samples=self.declaration.num_samples,
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

    def evaluate(self, tag: str, starting: bool = False) -> dict:
        """Run the shared evaluation, write ``eval_<tag>.json`` and add the result to the eval history. ``starting``:
        the policy has not trained yet (:meth:`starting_metrics`)."""
        start = time.perf_counter()
        result = self.starting_metrics() if starting else self.policy_metrics()
        result.update(self.evaluator.pair_metrics())
        result["seconds"] = round(time.perf_counter() - start, 1)
        (self.run_dir / EVAL_FILE.format(tag=tag)).write_text(json.dumps(result, indent=2))
        self.metrics_log.log_eval(self.step, result)  # eval/<metric> in TensorBoard and the trackers
        self.eval_history.append({"step": self.step, "tag": tag,
                                  **{k: v for k, v in result.items() if isinstance(v, (int, float, str))
                                     and not k.endswith("examples")}})
        return result

    def evaluate_everywhere(self, tag: str, starting: bool = False) -> dict | None:
        """:meth:`evaluate` on the main process (None elsewhere). Under FSDP every process runs the same evaluation
        (its result thrown away): the passes of the sharded units then stay the same on every process, which FSDP2's
        per-unit state needs (a unit that ran forwards on one process only went out of step with the others in the
        next backward: a hang). Call it in a :meth:`DataParallel.gathered` block."""
        if self.dp.is_main:
            return self.evaluate(tag, starting)
        if self.dp.fsdp:
            self.starting_metrics() if starting else self.policy_metrics()
            self.evaluator.pair_metrics()
        return None

    def periodic_evaluation(self, metrics: dict) -> tuple[bool, float | None]:
        """Evaluate on held-out data during training (every ``eval.every`` steps, and every
        ``trainer.early_stopping.every`` steps with early stopping): the result goes to ``eval_step<N>.json``, the
        eval history and the step's metrics (``eval/...``); early stopping keeps the best weights in ``best/``.

        Returns (stop, kl): stop is True when the early-stopping metric has not improved for ``patience``
        evaluations; kl is the evaluation's KL(pi || pi_ref) estimate (``kl_k1``, nats per sequence) or None. The
        main process evaluates; its answer is broadcast."""
        stop, kl, improved = False, None, False
        with self.dp.gathered():  # FSDP: the whole model evaluates
            result = self.evaluate_everywhere(f"step{self.step:06d}")
            if self.dp.is_main:
                metrics.update({f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float))})
                kl = result.get("kl_k1")
                if self.early_stopping is not None and self.step % self.cfg.trainer.early_stopping.every == 0:
                    improved, stop = self.early_stopping.update(result, self.step)
            stop, kl, improved = self.dp.broadcast_object((bool(stop), kl, improved))
        if improved:
            weights = self.dp.full_state(self.model)
            if self.dp.is_main:
                save_weights(self.model, self.run_dir / "best", state_dict=weights)
        return stop, kl

    def evaluation_due(self) -> bool:
        """Whether this step ends with a held-out evaluation (early stopping's, or ``eval.every``'s and ``eval.steps``'
        except at the last step, which the evaluation after training covers)."""
        t, every = self.cfg.trainer, self.cfg.eval.every
        if self.early_stopping is not None and self.step % t.early_stopping.every == 0:
            return True
        last_step = self.step == self.max_steps and self.cfg.eval.after
        listed = self.step in self.cfg.eval.steps or (bool(every) and self.step % every == 0)
        return listed and not last_step

    def check_kl_budget(self) -> None:
        """``objective.kl_budget`` needs a KL measurement: the online algorithms measure KL(pi || pi_ref) on every
        step's rollouts (metric ``kl``); the others only in held-out evaluations during training.

        Raises:
            ConfigError: a KL budget, but nothing measures the KL during training.
        """
        from prefzoo.errors import ConfigError

        if self.cfg.objective.kl_budget is None or not self.declaration.trains:
            return
        if self.policy.reference is None:
            raise ConfigError(f"objective.kl_budget is set, but this run has no reference to measure KL against "
                              f"(algo={self.cfg.algo.name} without LoRA loads none); use LoRA or drop the budget.")
        periodic = self.cfg.eval.every or self.cfg.eval.steps or self.cfg.trainer.early_stopping.metric
        if not self.declaration.online and not periodic:
            raise ConfigError(f"objective.kl_budget: algo={self.cfg.algo.name} measures no KL while it trains (it "
                              "samples nothing); set eval.every=N to measure KL(pi || pi_ref) on held-out samples every "
                              "N steps, which the budget then uses.")

    def train_loop(self, bar, main: bool, last: dict, stop_reason: str, budget) -> tuple[dict, str]:
        """The training steps until max_steps, the KL budget or early stopping: (the last step's metrics, why it
        stopped)."""
        t = self.cfg.trainer
        while self.step < self.max_steps:
            last = self.train_step()
            self.step += 1
            for line in self.watch.update(self.step, last) if main else ():
                log.warning(line)
            self.train_seconds += last.get("time/step", 0.0)
            stop, eval_kl = self.periodic_evaluation(last) if self.evaluation_due() else (False, None)
            kl = last.get("kl", eval_kl) if self.declaration.online else eval_kl  # this step's rollouts, else held out
            if kl is not None:
                self.kl_spent = float(kl)
            if budget is not None and self.kl_spent is not None:
                last["kl_spent"] = self.kl_spent
            if self.step % t.log_every == 0 or self.step == self.max_steps or stop:
                self.metrics_log.log(self.step, last)
            bar.update(1)
            bar.set_postfix({k: f"{last[k]:.3g}" for k in self.declaration.progress_keys if k in last})
            if t.save_every and self.step % t.save_every == 0:
                self.save()
            if budget is not None and self.kl_spent is not None and self.kl_spent >= budget:
                stop_reason = "kl_budget"
                break
            if stop:
                stop_reason = "early_stopping"
                break
        return last, stop_reason

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        started = time.perf_counter()
        resumed = self.maybe_resume()
        main = self.dp.is_main
        before = None
        if self.max_steps and cfg.eval.before and not (resumed and (self.run_dir / EVAL_FILE.format(tag="before")).is_file()):
            with self.dp.gathered():  # FSDP: the whole model evaluates (on every process: evaluate_everywhere)
                before = self.evaluate_everywhere("before", starting=not resumed)
                if main:
                    print_eval("before training", before)
                self.dp.barrier()
        elif main and (self.run_dir / EVAL_FILE.format(tag="before")).is_file():
            before = json.loads((self.run_dir / EVAL_FILE.format(tag="before")).read_text())
        bar = tqdm(total=self.max_steps, initial=self.step, desc=f"{cfg.algo.name}",
                   disable=not (t.progress and main), dynamic_ncols=True)
        last: dict = {}
        stop_reason = "max_steps" if self.declaration.trains else "no_training"
        budget = cfg.objective.kl_budget
        if cfg.rollout.asynchronous and self.declaration.online and self.step < self.max_steps:
            self.start_async(self.resumed_ahead)
            self.resumed_ahead = None
        self.started = True
        try:
            last, stop_reason = self.train_loop(bar, main, last, stop_reason, budget)
        finally:
            self.stop_async()
        bar.close()
        if self.step and (not t.save_every or self.step % t.save_every):
            self.save()
        summary = None
        state = self.dp.full_state(self.model)  # FSDP: gathered on the main process; else None (the model's own)
        with self.dp.gathered():  # FSDP: the whole model evaluates (on every process: evaluate_everywhere)
            after = None
            if main:
                weights = save_weights(self.model, self.run_dir, state_dict=state)
                if self.declaration.has("saves_artifacts"):  # a model of the plugin's own (algo=rm: the reward model)
                    self.algo.save_artifacts(self.run_dir, self.policy)
            if cfg.eval.after:  # also with no training step: a max_steps=0 run measures its starting policy
                after = self.evaluate_everywhere("after")
            if main:
                if after is not None:
                    print_eval("after training" if self.step else "(no training steps)", after)
                summary = make_summary(cfg, self, before, after, last, time.perf_counter() - started, stop_reason,
                                       weights)
                (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
                write_model_card(cfg, self.run_dir, weights, summary)  # <weights>/README.md over peft's template
            self.dp.barrier()
        self.metrics_log.close()
        unlock_run_folder(self.run_dir)
        return self.dp.broadcast_object(summary)  # every process returns the main process's summary


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
    runs by, see :func:`results_block`; ``eval_history``: every held-out evaluation, with its step)."""
    strip = lambda d: {k: v for k, v in (d or {}).items() if not k.endswith("examples")}  # noqa: E731
    return {
        "algo": cfg.algo.name, "model": cfg.model.name, "data": cfg.data.name, "reward": cfg.reward.name,
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


def write_resolved_config(cfg: Config, run_dir: Path) -> None:
    (run_dir / CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
