"""Where a training step's batch comes from: :class:`ExperienceSource`.

Each step takes the next ``trainer.batch_size`` rows of the training data (:class:`~prefzoo.training.sampler.IndexSampler`,
seeded, resumable mid-epoch), this process's contiguous share of them under data parallelism
(:func:`~prefzoo.training.sharding.shard_range`), and turns them into a batch:

* offline plugins: the rows' preference pairs or unpaired rows, collated (with the precomputed reference log-probs when
  the plugin declares them);
* online plugins: the rows' prompts, each with its rollout seed -- a function of (run seed, step, the prompt's
  position in the global batch), so a prompt samples the same whatever process holds it
  (:func:`~prefzoo.training.sharding.rollout_seeds`) -- handed to the plugin's ``make_experience``.

With ``rollout.asynchronous`` the source also drives the rollout worker (:mod:`prefzoo.rollout.async_rollouts`): when
the run starts it sends the current adapter (version = the step) and asks for the rollouts of the next
``max_staleness + 1`` steps; after every update it sends the new adapter and asks for the next step's. Rows drawn ahead
are part of the checkpoint (:meth:`state`), and a resumed run asks for them first. The samples themselves come back
through the engine stack's asynchronous layer, which the plugin's sampling reaches as it reaches any engine.
"""

from __future__ import annotations

from functools import partial

import torch

from prefzoo.algos.base import Algorithm
from prefzoo.data.unpaired import collate_examples
from prefzoo.training.sampler import IndexSampler
from prefzoo.training.sharding import rollout_seeds, shard_range
from prefzoo.types import ROLLOUT_SEED_COLUMN, Batch, StepContext

__all__ = ["ExperienceSource"]


class ExperienceSource:
    """The training data of a run, step by step (see the module docstring).

    Args:
        cfg: the run's typed config (``trainer.seed`` / ``batch_size``, ``rollout.*``).
        algo: the plugin (its declaration says online or offline; online ones make the experience).
        policy: the policy the plugin samples and scores with.
        rows: the training rows: a :class:`~prefzoo.data.prompts.PromptSet` (online plugins) or the offline
            examples (``prefs.train``).
        dp: this process's place among the data-parallel processes.
        device: where batches go.
        scorer: the reward of sampled completions (online plugins), or None.
        ref_cache: precomputed reference log-probs of the offline rows, or None.
        async_engine: the engine stack's asynchronous layer (``rollout.asynchronous``), or None.
    """

    def __init__(self, cfg, algo: Algorithm, policy, rows, dp, device: torch.device, scorer=None, ref_cache=None,
                 async_engine=None):
        self.cfg, self.algo, self.policy, self.rows, self.dp, self.device = cfg, algo, policy, rows, dp, device
        self.scorer, self.ref_cache, self.async_engine = scorer, ref_cache, async_engine
        self.online = algo.declaration.online
        self.sampler = IndexSampler(len(rows), cfg.trainer.batch_size, cfg.trainer.seed)
        self.resumed_ahead: list[tuple[int, list[int]]] = []  # a checkpoint's rows drawn ahead (async), asked first
        self.ahead: list[tuple[int, list[int]]] = []  # (step, rows) submitted to the worker, in order
        self.rollouts = None  # the worker's handle while it runs (rollout.asynchronous)

    # ----------------------------------------------------------------------------------------------- the rows
    def step_prompts(self, idx: list[int], step: int, start: int = 0, stop: int | None = None):
        """The prompts of rows ``idx`` of training step ``step`` (0-based), with their per-prompt rollout seeds
        (positions ``start`` .. ``stop`` of the global batch)."""
        prompts = self.rows.batch(idx, self.policy.pad_id).to(self.device)
        stop = len(idx) if stop is None else stop
        prompts.columns[ROLLOUT_SEED_COLUMN] = rollout_seeds(self.cfg.trainer.seed, step, range(start, stop))
        return prompts

    def draw_prompts(self, step: int):
        """``round -> prompts``: round ``round`` (>= 1) of step ``step``'s extra prompts (dynamic sampling): the
        sampler's next batch, with rollout seeds after the step's first round's."""
        return partial(self._extra_prompts, step)

    def _extra_prompts(self, step: int, round: int):
        idx = self.sampler.next()
        return self.step_prompts(idx, step, round * len(idx), (round + 1) * len(idx))

    def next_batch(self, step: int, context: StepContext) -> tuple[Batch, dict]:
        """This process's share of step ``step``'s global batch (all of it in one process), and the rollout's
        metrics (online plugins)."""
        if self.rollouts is not None:
            return self._async_batch(step, context)
        # rows an asynchronous run had drawn ahead before its checkpoint come first (resumed synchronously)
        idx = self.resumed_ahead.pop(0)[1] if self.resumed_ahead else self.sampler.next()
        start, stop = shard_range(len(idx), self.dp.rank, self.dp.world_size)
        idx = idx[start:stop]
        if self.online:
            prompts = self.step_prompts(idx, step, start, stop)
            return self.algo.make_experience(self.policy, prompts, self.scorer, context)
        examples = [self.rows[i] for i in idx]
        return collate_examples(examples, idx, self.policy.pad_id, self.ref_cache).to(self.device), {}

    # ---------------------------------------------------------------------- asynchronous rollouts (the worker)
    def start(self, step: int, max_steps: int, model) -> None:
        """Start the rollout worker, send it the current adapter (version = ``step``) and submit the rollouts of the
        next ``max_staleness + 1`` steps (a checkpoint's rows drawn ahead first: sampled again, with the restored
        weights)."""
        from prefzoo.rollout.async_rollouts import AsyncRollouts, adapter_state
        from prefzoo.training.build import build_rollout_worker

        r = self.cfg.rollout
        self.max_steps = max_steps
        self.rollouts = AsyncRollouts(partial(build_rollout_worker, self.cfg), r.max_staleness, r.async_threads,
                                      r.async_timeout)
        self.async_engine.serve(self.rollouts)
        self.rollouts.push_weights(step, adapter_state(model))
        self.ahead = []
        for ahead_step, idx in self.resumed_ahead:
            self._submit(ahead_step, idx)
        self.resumed_ahead = []
        while len(self.ahead) < r.max_staleness + 1:
            next_step = self.ahead[-1][0] + 1 if self.ahead else step
            if next_step >= max_steps:
                break
            self._submit(next_step, self.sampler.next())

    def _submit(self, step: int, idx: list[int]) -> None:
        self.ahead.append((step, list(idx)))
        self.rollouts.submit(step, self.step_prompts(idx, step), max(1, self.algo.declaration.num_samples),
                             self.algo.sampling, self.policy.eos_token_ids, self.policy.pad_id)

    def _async_batch(self, step: int, context: StepContext) -> tuple[Batch, dict]:
        """Step ``step``'s experience from the worker's rollout (the engine stack's asynchronous layer serves it)."""
        ahead_step, idx = self.ahead.pop(0)
        if ahead_step != step:
            raise RuntimeError(f"asynchronous rollouts out of order: step {ahead_step + 1} where {step + 1} was due")
        batch, metrics = self.algo.make_experience(self.policy, self.step_prompts(idx, step), self.scorer, context)
        return batch, {**metrics, **self.async_engine.last_metrics}

    def after_update(self, step: int, model) -> None:
        """After step ``step``'s update (0-based): the new adapter to the worker (version = steps done), then the
        next request."""
        if self.rollouts is None:
            return
        from prefzoo.rollout.async_rollouts import adapter_state

        self.rollouts.push_weights(step + 1, adapter_state(model))
        next_step = step + 1 + self.cfg.rollout.max_staleness
        if next_step < self.max_steps:
            self._submit(next_step, self.sampler.next())

    def close(self) -> None:
        """Stop the worker (if it runs)."""
        if self.rollouts is not None:
            self.async_engine.serve(None)
            self.rollouts.close()
            self.rollouts = None

    # ---------------------------------------------------------------------------------------------- checkpoints
    def state(self) -> dict:
        """What a checkpoint keeps of the source: the sampler's place, and the rows drawn ahead of it (async)."""
        return {"sampler": self.sampler.state_dict(),
                "async_ahead": list(self.ahead) if self.rollouts is not None else None}

    def load_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.resumed_ahead = [(int(st), [int(i) for i in idx]) for st, idx in state.get("async_ahead") or []]
