"""The training loop shared by every algorithm.

One training step:

1. take the next batch (:class:`~prefzoo.training.experience.ExperienceSource`) -- preference pairs (offline
   algorithms) or prompts, which the plugin turns into an experience batch by sampling, scoring and computing
   advantages (online algorithms), with the step's :class:`~prefzoo.types.StepContext` as an argument;
2. for each of the declared ``epochs`` passes, split the batch into ``num_minibatches`` mini-batches; each
   mini-batch is one optimizer step (AdamW, gradient clipping, linear warm-up and decay), its gradient
   accumulated over micro-batches of ``trainer.micro_batch_size`` rows (:func:`prefzoo.training.step.optimisation_step`);
3. log the metrics (``metrics.jsonl``, TensorBoard, progress bar), checkpoint every ``save_every`` steps.

What the run trains and samples with is built once, before the first step (:mod:`prefzoo.training.build`): the model,
what the plugin declares beside it, the engine stack (the base engine, multi-turn episodes, asynchronous rollouts) and
the policy. The loop never writes into the plugin or the policy: what it gives the plugin each step is an argument.

Around the steps: the held-out evaluations (:mod:`prefzoo.training.evaluations`) before training, during it and after
it -- also when there was no step (``trainer.max_steps=0``, or a plugin that declares ``trains=False``: best-of-n),
which measures the starting policy. ``objective.kl_budget`` stops the run once the latest KL(pi || pi_ref) measurement
-- the step's rollouts (metric ``kl``, online algorithms) or else the last held-out evaluation -- reaches it (nats per
sequence: the KL "spent" since the start). ``summary.json`` gathers it all (:mod:`prefzoo.training.summary`).

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

Gradient accumulation gives the same update as one big batch: the plugin returns per-token or per-example losses,
and every micro-batch divides its summed loss by the normaliser of the whole mini-batch (all its tokens or
sequences, across processes too), see :func:`prefzoo.objective.aggregate_loss`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from prefzoo.algos.base import Algorithm, Declaration
from prefzoo.config import Config, resolve_defaults
from prefzoo.data.preference import collate_preferences
from prefzoo.environments import episode_factory
from prefzoo.errors import CheckpointError
from prefzoo.models.loading import load_tokenizer
from prefzoo.training.build import build_engine, build_parts, make_policy
from prefzoo.training.checkpoint import (load_trainer_state, load_weights, rng_state, save_checkpoint, save_weights,
                                         set_rng_state)
from prefzoo.training.distributed import DataParallel, TrainableModules, setup_data_parallel
from prefzoo.training.evaluations import RunEvaluations
from prefzoo.training.experience import ExperienceSource
from prefzoo.training.layout import CONFIG_FILE, EVAL_FILE, SUMMARY_FILE
from prefzoo.training.names import algo_name
from prefzoo.training.model_card import write_model_card
from prefzoo.training.plugin import build_algorithm
from prefzoo.training.resume import continue_schedule, run_config
from prefzoo.training.run_folder import RunFolder, open_run_folder, unlock_run_folder
from prefzoo.training.scoring import TextScorer
from prefzoo.training.setup import (resolve_precision, build_reward, check_reward_columns, heldout_pair_prompts, offline_data, pick_device,
                                    probe_environment, probe_reward, task_prompts)
from prefzoo.training.sharding import reduce_metrics
from prefzoo.training.step import accumulate_gradients, mean_metrics, optimisation_step  # noqa: F401 (re-exported)
from prefzoo.training.summary import (RESULT_KEYS, make_summary, print_change, print_eval,  # noqa: F401 (re-exported)
                                     results_block)
from prefzoo.training.trackers import open_metrics_log
from prefzoo.training.watch import MetricWatch
from prefzoo.types import StepContext

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
        resolve_precision(cfg, self.device)  # model.dtype=auto -> what this device runs well (before config.yaml is saved)
        self.folder = folder if folder is not None else open_run_folder(cfg, self.run_dir, self.dp)
        self.algo: Algorithm = algo if algo is not None else build_algorithm(cfg)  # the pre-flight's, or built here
        self.objective, self.sampling = self.algo.objective, self.algo.sampling
        self.declaration: Declaration = self.algo.declaration
        self.tokenizer = load_tokenizer(cfg.model.name)
        self.reward_fn = build_reward(cfg)
        make_episode = self.read_data()
        self.build_model(make_episode)
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # (after sharding: FSDP's DTensors)
        if self.policy.value_model is not None:
            self.params += [p for p in self.policy.value_model.parameters() if p.requires_grad
                            and not any(p is q for q in self.params)]
        if self.remote is not None:  # backend=tinker: the schedule here, Adam's moments on the server
            from prefzoo.tinker.backend import TinkerOptimizer

            self.optimizer = TinkerOptimizer(self.remote, t.lr, t.weight_decay, t.max_grad_norm)
        else:
            self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay)
        self.max_steps = t.max_steps if self.declaration.trains else 0  # best-of-n: no training steps
        self.watch = MetricWatch(self.declaration.warnings, self.max_steps)  # the plugin's warnings (no learning signal)
        self.optimizer_steps = self.max_steps * self.declaration.epochs * self.declaration.num_minibatches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.lr_schedule, t.warmup_steps, self.optimizer_steps))
        rc = cfg.reward
        overlong = (cfg.rollout.max_new_tokens, rc.overlong_buffer, rc.overlong_penalty) if rc.overlong_buffer else None
        self.scorer = (TextScorer(self.tokenizer, self.reward_fn, self.policy.pad_id, rc.aggregation, overlong)
                       if self.declaration.reward else None)
        self.metrics_log = open_metrics_log(cfg, self.run_dir, self.dp.is_main)  # report_to: tensorboard, trackio, wandb
        self.evaluations = RunEvaluations(cfg, self.algo, self.policy, self.scorer, self.reward_fn, self.eval_prompts,
                                          self.prefs, self.tokenizer, self.device, self.dp, self.run_dir,
                                          self.metrics_log)
        self.source = ExperienceSource(cfg, self.algo, self.policy, self.prefs.train if self.prefs is not None
                                       else self.train_prompts, self.dp, self.device, self.scorer, self.ref_cache,
                                       self.engine if cfg.rollout.asynchronous and self.declaration.online else None)
        self.step = 0
        self.kl_spent: float | None = None  # the latest KL(pi || pi_ref) measurement, nats per sequence
        self.train_seconds = 0.0  # time in training steps (rollouts and updates), evaluations excluded

    # ------------------------------------------------------------------------------------------------ set-up
    def read_data(self):
        """The task's prompts (or a preference file's held-out prompts), checked before any model loads: the reward's
        columns, one episode of the environment, the reward functions once (not again on resume). The episode
        factory of ``env=...``, or None."""
        cfg = self.cfg
        self.train_prompts, self.eval_prompts = (task_prompts(cfg, self.tokenizer)
                                                 if self.declaration.online or cfg.data.path is None else (None, None))
        if self.eval_prompts is None and cfg.data.path:  # a preference file: evaluate on its held-out pairs' prompts
            self.eval_prompts = heldout_pair_prompts(cfg, self.tokenizer)
        check_reward_columns(cfg, self.train_prompts)  # before any model loads
        make_episode = episode_factory(cfg.env)  # env=...: rollouts and evaluations become episodes
        environments = probe_environment(make_episode, self.train_prompts,  # a reset that fails stops here
                                         cfg.rollout.asynchronous and self.declaration.online)
        if self.folder.resume is None:  # a reward that raises or returns NaN: here (a resumed run passed it at its start)
            probe_reward(self.reward_fn, self.train_prompts, environments)
        return make_episode

    def build_model(self, make_episode) -> None:
        """The offline data, the model and its companions, the engine stack, the reference log-probs a plugin wants
        precomputed, data parallelism (the resumed weights loaded first under FSDP), and the policy over all of it."""
        cfg, t = self.cfg, self.cfg.trainer
        self.prefs, self.data_stats = None, {}
        self.remote = None  # backend=tinker: the session on the server (prefzoo.tinker.backend)
        if cfg.backend.name == "tinker":
            self.build_remote()
            return
        with self.dp.main_process_first():  # the main process builds and caches pairs / converted weights first
            if not self.declaration.online:
                self.prefs, self.data_stats = offline_data(cfg, self.tokenizer, self.reward_fn, self.train_prompts,
                                                           self.eval_prompts, self.device, self.declaration.data,
                                                           self.declaration.loss_tokens)
                self.algo.check_data(self.data_stats.get("rows", {}))  # (unpaired rows: KTO's class balance)
            parts = build_parts(cfg, self.declaration, self.tokenizer, self.device)
        self.model, self.load_seconds = parts.model, parts.load_seconds
        self.engine = build_engine(cfg, parts, self.tokenizer, make_episode, self.declaration.online)
        if self.dp.rank > 0:  # the model is built alike everywhere; from here on (dropout) each process draws its own
            seed_everything(t.seed + 1_000_003 * self.dp.rank)
        self.ref_cache = (self.precompute_reference(make_policy(cfg, parts, self.engine, self.tokenizer))
                          if self.declaration.precompute_reference else None)
        self.weights_loaded = False  # FSDP: a resumed run's weights, loaded before sharding (maybe_resume: the rest)
        if self.dp.fsdp and self.folder.resume is not None:
            self.load_resumed_weights(parts.value_model)
        self.train_module = None  # DDP over the trainable modules, or them sharded (FSDP; data parallel only)
        if self.dp.enabled:
            ref = parts.reference
            frozen = [ref.module] if ref is not None and ref.module is not None and ref.module is not self.model else []
            self.train_module = self.dp.wrap(TrainableModules(self.model, parts.value_model), frozen=frozen)
        self.policy = make_policy(cfg, parts, self.engine, self.tokenizer, train_forward=self.train_module)

    def build_remote(self) -> None:
        """``backend=tinker`` (:mod:`prefzoo.tinker.backend`): a training client on the server (from the resumed
        checkpoint's server state, weights and optimizer, when resuming), the policy over it, and the "model" the loop
        saves (the server's state); an offline plugin's pairs first, and its precomputed reference log-probs. The
        reference pi_ref is the server's base model, as the local LoRA run's free adapter-disabled one (drift metrics;
        beta > 0; DPO's reference). No engine stack here: the server samples."""
        from prefzoo.tinker.backend import connect
        from prefzoo.validation.backend import base_model_name

        cfg, start = self.cfg, time.perf_counter()
        if not self.declaration.online:  # the pairs (built-in ones are built here once, where not shipped or cached)
            self.prefs, self.data_stats = offline_data(cfg, self.tokenizer, self.reward_fn, self.train_prompts,
                                                       self.eval_prompts, self.device, self.declaration.data,
                                                       self.declaration.loss_tokens)
            self.algo.check_data(self.data_stats.get("rows", {}))
        resume = self.folder.resume.folder if self.folder.resume is not None else None
        self.remote, self.policy, self.model = connect(
            cfg.backend.url, base_model_name(cfg), cfg.model.lora.r, cfg.trainer.seed, True, self.tokenizer,
            resume_folder=resume, timeout=cfg.backend.timeout)
        self.load_seconds = time.perf_counter() - start
        self.engine, self.train_module = None, None
        self.ref_cache = self.precompute_reference(self.policy) if self.declaration.precompute_reference else None
        self.weights_loaded = True  # (a resumed run's weights: the server's state, loaded by connect)

    @torch.no_grad()
    def precompute_reference(self, policy) -> dict[int, tuple[float, float]]:
        """Summed reference log-probs of every training pair, computed once (declared ``precompute_reference``)."""
        cache: dict[int, tuple[float, float]] = {}
        size = self.cfg.trainer.micro_batch_size
        mine = list(range(self.dp.rank, len(self.prefs.train), self.dp.world_size))  # every process computes a share
        for start in tqdm(range(0, len(mine), size), desc="reference log-probs",
                          disable=not (self.cfg.trainer.progress and self.dp.is_main)):
            idx = mine[start:start + size]
            batch = collate_preferences([self.prefs.train[i] for i in idx], idx, policy.pad_id).to(self.device)
            chosen, rejected = self.algo.reference_logps(policy, batch)
            cache.update({i: (float(c), float(r)) for i, c, r in zip(idx, chosen.tolist(), rejected.tolist())})
        if self.dp.enabled:
            for part in self.dp.gather_objects(cache):
                cache.update(part)
        return cache

    # ---------------------------------------------------------------------------------------- what others read
    @property
    def evaluator(self):
        return self.evaluations.evaluator

    @property
    def eval_history(self) -> list[dict]:
        return self.evaluations.history

    @property
    def early_stopping(self):
        return self.evaluations.early_stopping

    def policy_metrics(self) -> dict:
        return self.evaluations.policy_metrics()

    # ---------------------------------------------------------------------------------------------- one step
    def step_context(self) -> StepContext:
        """What this step gives the plugin (:class:`~prefzoo.types.StepContext`): the all-reduce under data
        parallelism, more prompts for dynamic sampling, whether the drift metrics are due (``trainer.kl_metric_every``:
        logged step numbers ``step + 1`` = every, 2 every, ...)."""
        every = self.cfg.trainer.kl_metric_every
        return StepContext(all_reduce=self.dp.all_reduce_sum if self.dp.enabled else None,
                           draw_prompts=self.source.draw_prompts(self.step) if self.declaration.draws_prompts else None,
                           drift_metrics_due=bool(every) and (self.step + 1) % every == 0)

    def row_layout(self, n: int) -> tuple[int, int]:
        """(offset of this process's first row among the global rows, number of global rows) of a step's batch,
        whose rows are the processes' rows concatenated in rank order."""
        if not self.dp.enabled:
            return 0, n
        counts = self.dp.gather_objects(n)
        return sum(counts[:self.dp.rank]), sum(counts)

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.scorer is not None:
            self.scorer.new_step()  # the step's reward/<name> metrics: its first scoring's (dynamic sampling scores more)
        context = self.step_context()
        with self.dp.gathered() if self.declaration.online else contextlib.nullcontext():  # FSDP: rollouts whole
            batch, metrics = self.source.next_batch(self.step, context)
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
        if self.remote is not None:  # backend=tinker: the server clips (AdamParams.grad_clip_norm) and measures
            clip = None
        elif not clip:
            clip = float("inf")
        pairs = optimisation_step(  # one permutation of the GLOBAL rows per pass (process 0's, broadcast)
            self.algo, self.policy, batch, self.optimizer, self.scheduler, self.params,
            self.cfg.trainer.micro_batch_size, max_grad_norm=clip,
            permutation=lambda rows: dp.broadcast_object(torch.randperm(rows).tolist()),
            layout=(offset, n_global), parallel=parallel, step=context)
        t2 = time.perf_counter()
        if self.remote is not None and self.remote.grad_norms:  # backend=tinker: the server's, one per optimizer step
            pairs["grad_norm"] = [sum(self.remote.grad_norms), float(len(self.remote.grad_norms))]
            self.remote.grad_norms = []
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
        self.source.after_update(self.step, self.model)  # rollout.asynchronous: the new adapter to the worker
        return out

    # -------------------------------------------------------------------------------------------- checkpoints
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
                **self.source.state(), "algo": self.algo.state_dict(),
                "rng": rng, "rng_per_process": self.dp.gather_objects(rng) if self.dp.enabled else None,
                "kl_spent": self.kl_spent, "eval_history": self.eval_history, "train_seconds": self.train_seconds,
                "early_stopping": self.early_stopping.state_dict() if self.early_stopping else None,
                "optimizer_steps": self.optimizer_steps, "value_model": value}

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
        self.source.load_state(state)
        self.algo.load_state_dict(state["algo"])
        per_process = state.get("rng_per_process")
        same_world = per_process is not None and len(per_process) == self.dp.world_size
        set_rng_state(per_process[self.dp.rank] if same_world else state["rng"], self.policy.generator)
        self.step = state["step"]
        self.kl_spent = state.get("kl_spent")
        self.eval_history[:] = list(state.get("eval_history") or [])
        self.train_seconds = state.get("train_seconds", 0.0)
        if self.early_stopping is not None and state.get("early_stopping"):
            self.early_stopping.load_state_dict(state["early_stopping"])
        self.metrics_log.truncate_after(self.step)
        log.info("resumed from %s (step %d)", ckpt, self.step)
        return True

    def load_resumed_weights(self, value_model) -> None:
        """FSDP: the resumed checkpoint's adapter (and value model) into the whole model, before it is sharded."""
        point = self.folder.resume
        if point.state is None:
            point.state = load_trainer_state(point.folder)
        load_weights(self.model, point.folder)
        if point.state.get("value_model") is not None:
            value_model.load_state_dict(point.state["value_model"])
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

    # ---------------------------------------------------------------------------------------------------- run
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
            due = self.evaluations.due(self.step, self.max_steps)
            stop, eval_kl = self.evaluations.periodic(self.step, last, self.model) if due else (False, None)
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

    def evaluate_before(self, resumed: bool) -> dict | None:
        """The evaluation before training (a resumed run's own, read back), on every process under FSDP."""
        saved = self.run_dir / EVAL_FILE.format(tag="before")
        if self.max_steps and self.cfg.eval.before and not (resumed and saved.is_file()):
            with self.dp.gathered():  # FSDP: the whole model evaluates (on every process: everywhere)
                before = self.evaluations.everywhere("before", self.step, starting=not resumed)
                if self.dp.is_main:
                    print_eval("before training", before)
                self.dp.barrier()
            return before
        return json.loads(saved.read_text()) if self.dp.is_main and saved.is_file() else None

    def run(self) -> dict:
        if self.remote is None:
            return self._run()
        status = "errored"
        try:  # backend=tinker: the session ends with the run, so the server frees the run's models
            summary = self._run()
            status = "success"
            return summary
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            self.remote.close(status)

    def _run(self) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        started = time.perf_counter()
        resumed = self.maybe_resume()
        main = self.dp.is_main
        before = self.evaluate_before(resumed)
        bar = tqdm(total=self.max_steps, initial=self.step, desc=algo_name(cfg.algo),
                   disable=not (t.progress and main), dynamic_ncols=True)
        stop_reason = "max_steps" if self.declaration.trains else "no_training"
        if cfg.rollout.asynchronous and self.declaration.online and self.step < self.max_steps:
            self.source.start(self.step, self.max_steps, self.model)
        self.started = True
        try:
            last, stop_reason = self.train_loop(bar, main, {}, stop_reason, cfg.objective.kl_budget)
        finally:
            self.source.close()
        bar.close()
        if self.step and (not t.save_every or self.step % t.save_every):
            self.save()
        summary = None
        state = self.dp.full_state(self.model)  # FSDP: gathered on the main process; else None (the model's own)
        with self.dp.gathered():  # FSDP: the whole model evaluates (on every process: everywhere)
            after = None
            if main:
                weights = save_weights(self.model, self.run_dir, state_dict=state)
                if self.declaration.has("saves_artifacts"):  # a model of the plugin's own (algo=rm: the reward model)
                    self.algo.save_artifacts(self.run_dir, self.policy)
            if cfg.eval.after:  # also with no training step: a max_steps=0 run measures its starting policy
                after = self.evaluations.everywhere("after", self.step)
            if main:
                if after is not None:
                    print_eval("after training" if self.step else "(no training steps)", after)
                    if self.step:
                        print_change(before, after)
                summary = make_summary(cfg, self, before, after, last, time.perf_counter() - started, stop_reason,
                                       weights)
                (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
                write_model_card(cfg, self.run_dir, weights, summary)  # <weights>/README.md over peft's template
            self.dp.barrier()
        self.metrics_log.close()
        unlock_run_folder(self.run_dir)
        return self.dp.broadcast_object(summary)  # every process returns the main process's summary


def write_resolved_config(cfg: Config, run_dir: Path) -> None:
    (run_dir / CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
