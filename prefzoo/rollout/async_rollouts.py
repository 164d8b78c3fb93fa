"""Asynchronous rollouts with bounded staleness (``rollout.asynchronous=true rollout.max_staleness=k``).

While the trainer updates on batch n, a rollout WORKER (another process, one core of its own) samples the next batches
with an adapter a few optimizer steps old, so generation and training overlap instead of taking turns.

**Schedule.** With staleness bound k, the trainer submits the rollout of step n + k + 1 right after it has sent the
worker the adapter of version n + 1 (the weights after step n). The worker handles its requests in order and always
samples with the newest adapter it has received, so the rollout the trainer uses at step m was drawn by the policy of
version m - k or later: its staleness m - version is at most k by construction (no batch is ever too old to use, so
none is dropped). k = 0 is the synchronous run: the rollout of step m is drawn with the weights of step m, and, with
the same sampler as the trainer's hf engine (the merged-weights copy, the same per-prompt seeds, one thread), the same
tokens: the update is the synchronous one exactly (``tests/rollout/test_async_rollouts.py``).

**What travels.** The worker builds the policy's model itself once (the factory the training side hands it: base
weights from the same files and seed, the LoRA adapter as configured), then receives only the adapter's tensors after
each optimizer step (no merge on the trainer's side; the worker merges into its own copy,
:class:`prefzoo.models.merged.MergedCopy`). A rollout comes back as the :class:`~prefzoo.types.SequenceBatch` the hf
engine would return, with ``sample_logps`` (the log-probs it was drawn with) and the adapter version that drew it.

**The loss.** Each sample's behaviour policy is the worker's: the plugin recomputes log pi_old with the trainer's
current weights and, with ``rollout.correction.mode``, weights by pi_old / pi_behaviour
(:func:`prefzoo.algos.online_sampling.engine_correction`), or with ``rollout.correction.bypass`` uses the worker's log-probs as
pi_old. Without either, the staleness is logged and not corrected; the tabular rows of the conformance table show
that bounded staleness moves no fixed point, and a persistent mismatch does unless both terms are weighted.

**Multi-turn episodes** (``env=...``): the worker's engine is the multi-turn layer over its hf engine
(:class:`~prefzoo.rollout.multiturn.MultiTurnEngine`, the environment built in the worker from its import path), so
whole episodes run there, turn by turn, with the same per-episode seeds, masks and budget as in the trainer; each
episode's environment instance comes back with its rollout (TRL's reward functions read it as ``environments=``).

**Faults.** A worker that dies or stops answering for ``rollout.async_timeout`` seconds stops the run with one line
(:class:`~prefzoo.errors.RolloutWorkerError`): the last checkpoint is whole (checkpoints are written by the trainer
only). An error prefzoo raises on purpose in the worker (a :class:`~prefzoo.errors.PrefzooError`: an environment's
:class:`~prefzoo.errors.EnvironmentFailure`, ``SystemExit`` in its ``step`` included, or a malformed reply's
:class:`~prefzoo.errors.DataError`) comes back as itself, and the trainer raises it: the same one line as in a
synchronous run. Anything else the worker raises is a :class:`~prefzoo.errors.RolloutWorkerError` naming it. The
worker ignores Ctrl-C (SIGINT reaches the whole process group): the trainer stops, and stops it. A trainer that dies
without stopping it (``kill -9``, an out-of-memory kill) is noticed by the worker itself: a thread of its own
waits on the parent's sentinel and ends the worker at once (:func:`_exit_with_parent`), so no orphan keeps its memory
or the trainer's output pipe.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections import deque
from typing import Callable

import torch
from torch import nn

from prefzoo.errors import PrefzooError, RolloutWorkerError, describe_error
from prefzoo.types import ROLLOUT_SEED_COLUMN, PromptBatch, SamplingParams, SequenceBatch

__all__ = ["AsyncRollouts", "AsyncEngine", "adapter_state"]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors of ``model`` (the LoRA adapter's A and B), detached CPU copies, by parameter name."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


def _exit_with_parent() -> None:
    """(In the worker) end this process as soon as the trainer that started it is gone, however it died: a daemon
    thread waits on the parent process's sentinel (a pipe the kernel closes when the parent exits), then exits
    without cleanup (the queues' feeder threads would wait for a reader that is gone)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="prefzoo-parent-watch", daemon=True).start()


def _worker(build: Callable[[], tuple[nn.Module, object]], threads: int, requests, results) -> None:
    """The worker process: build the model and its engine, then answer requests in order (see the module docstring).

    Messages in: ("weights", version, {name: tensor}), ("sample", step, prompts, num_samples, params, eos_ids, pad_id),
    ("stop",). Out: ("ready",), ("batch", step, version, batch, seconds), ("error", step, message, error): ``error``
    the :class:`~prefzoo.errors.PrefzooError` itself (raised again by the trainer), or None for anything else."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    torch.set_num_threads(max(1, int(threads)))
    step = None
    try:
        model, engine = build()
        params = dict(model.named_parameters())
        version = None
        results.put(("ready",))
        while True:
            message = requests.get()
            if message[0] == "stop":
                return
            if message[0] == "weights":
                version, state = message[1], message[2]
                missing = [n for n, p in params.items() if p.requires_grad and n not in state]
                if missing:
                    raise KeyError(f"the trainer's adapter lacks {len(missing)} of the worker's tensors, e.g. {missing[0]}")
                with torch.no_grad():  # copy_ (not .data) so the merged copy sees the version counters move
                    for name, tensor in state.items():
                        if name in params:  # (the trainer's value adapter, if any, is not the sampler's)
                            params[name].copy_(tensor)
                continue
            _, step, prompts, num_samples, sampling, eos_ids, pad_id = message
            start = time.perf_counter()
            batch = engine.sample(model, prompts, num_samples, sampling, eos_token_ids=eos_ids, pad_id=pad_id)
            _check_sendable(batch)
            results.put(("batch", step, version, batch, time.perf_counter() - start))
    except BaseException as err:  # noqa: BLE001 -- sent back (SystemExit included); the trainer raises it
        results.put(("error", step, *_sendable_error(err)))


def _check_sendable(batch: SequenceBatch) -> None:
    """(In the worker) the episodes' environment instances can travel to the trainer: a queue pickles a message in a
    thread of its own, where an error is printed and the message lost (the trainer would wait for it until its
    timeout), so they are pickled here first.

    Raises:
        EnvironmentFailure: an instance cannot be pickled (a lock, an open socket, a lambda in its attributes)."""
    if not batch.episodes:
        return
    from prefzoo.errors import EnvironmentFailure

    for log in batch.episodes:
        try:
            pickle.dumps(log.environment)
        except Exception as err:  # noqa: BLE001 -- pickling user objects raises many kinds
            name = type(log.environment).__name__
            raise EnvironmentFailure(
                f"env: a {name} instance cannot be sent from the rollout worker to the trainer "
                f"({describe_error(err)}); with rollout.asynchronous=true each episode's environment travels with its rollout (the reward "
                f"functions read it): keep {name}'s state picklable (open connections in reset, not __init__; no "
                "lambdas or locks in its attributes), or set rollout.asynchronous=false", method=name,
                cause=describe_error(err)) from None


def _sendable_error(err: BaseException) -> tuple[str, PrefzooError | None]:
    """(In the worker) ``err`` as the trainer receives it: one line, and the error itself when it is one prefzoo
    raises on purpose (it pickles with its message), so that the trainer raises the same error as a synchronous run."""
    if isinstance(err, PrefzooError):
        try:
            return str(err), pickle.loads(pickle.dumps(err))
        except Exception:  # noqa: BLE001 -- a subclass whose arguments do not round-trip: its line alone
            pass
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    return f"{describe_error(err)}{where}", None


class AsyncRollouts:
    """The trainer's side of the worker: start it, send it adapters and requests, take its rollouts in order.

    Args:
        build: a picklable callable returning (model, engine) in the worker: the policy's model (a peft LoRA model
            built as the trainer's) and the hf engine that samples it (:class:`prefzoo.rollout.engine.HFEngine` with
            ``report_logps``).
        max_staleness: k, the bound (see the module docstring).
        threads: torch threads of the worker.
        timeout: seconds to wait for one rollout before the run stops.
        start_timeout: seconds to wait for the worker to build its model (None: max(timeout, 600)).
    """

    def __init__(self, build: Callable, max_staleness: int, threads: int = 1, timeout: float = 600.0,
                 start_timeout: float | None = None):
        ctx = torch.multiprocessing.get_context("spawn")
        self.max_staleness = int(max_staleness)
        self.timeout = float(timeout)
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_worker, args=(build, threads, self.requests, self.results), daemon=True,
                                   name="prefzoo-rollout-worker")
        self.process.start()
        self.pending: deque[int] = deque()  # steps submitted and not yet taken, in order
        self.pending_prompts: deque[tuple[list[int], torch.Tensor]] = deque()  # their rollout seeds and prompt ids
        self.version: int | None = None  # the newest adapter version sent
        self._receive("ready", None, max(self.timeout, 600.0) if start_timeout is None else float(start_timeout))

    def _receive(self, kind: str, step: int | None, timeout: float | None = None):
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RolloutWorkerError(
                        f"the rollout worker (pid {self.process.pid}) died with exit code {self.process.exitcode}"
                        + (f" while sampling step {step + 1}" if step is not None else " while starting")
                        + "; the last checkpoint is intact: resume with trainer.resume=true") from None
                if time.monotonic() > deadline:
                    self.process.terminate()  # (a hung worker reads no stop message)
                    self.close()
                    raise RolloutWorkerError(
                        f"the rollout worker sent nothing for {timeout:g} s (rollout.async_timeout)"
                        + (f" while sampling step {step + 1}" if step is not None else " while starting")
                        + "; it was stopped; the last checkpoint is intact: resume with trainer.resume=true, or "
                        "raise rollout.async_timeout") from None
                continue
            if message[0] == "error":
                self.close()
                if message[3] is not None:  # prefzoo's own error in the worker (an environment's): the same line
                    raise message[3]
                raise RolloutWorkerError(f"the rollout worker failed"
                                         + (f" on step {message[1] + 1}" if message[1] is not None else "")
                                         + f": {message[2]}")
            if message[0] != kind:
                raise RolloutWorkerError(f"the rollout worker answered {message[0]!r} where {kind!r} was due")
            return message

    def push_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Send the adapter of ``version`` (optimizer steps done); requests submitted after it are sampled with it."""
        self.requests.put(("weights", int(version), state))
        self.version = int(version)

    def submit(self, step: int, prompts: PromptBatch, num_samples: int, params: SamplingParams,
               eos_token_ids: list[int], pad_id: int) -> None:
        """Ask for the rollout of ``step`` (0-based) of ``prompts`` (on the CPU; the per-prompt seeds in its columns)."""
        self.requests.put(("sample", int(step), prompts.to("cpu"), int(num_samples), params, list(eos_token_ids),
                           int(pad_id)))
        self.pending.append(int(step))
        self.pending_prompts.append((list(prompts.columns.get(ROLLOUT_SEED_COLUMN) or []), prompts.prompt_ids.cpu()))

    def next_pending(self) -> tuple[int, list[int], torch.Tensor]:
        """(step, its prompts' rollout seeds, their ids (B, P) on the CPU) of the next rollout to take.

        Raises:
            RolloutWorkerError: none is pending (a schedule bug)."""
        if not self.pending:
            raise RolloutWorkerError("no rollout was submitted to the worker for this step (a schedule bug)")
        return self.pending[0], *self.pending_prompts[0]

    def take(self, step: int) -> tuple[SequenceBatch, dict[str, float]]:
        """The rollout of ``step`` and its metrics: ``async/staleness`` (step - the version that drew it, <= k),
        ``async/wait_seconds`` (how long the trainer waited for it) and ``async/worker_seconds`` (its sampling time).

        Raises:
            RolloutWorkerError: the worker died, failed, or was silent for ``timeout`` s; the next pending rollout is
                not this step's (a schedule bug).
            PrefzooError: the one prefzoo raised in the worker (an environment's
                :class:`~prefzoo.errors.EnvironmentFailure`), as a synchronous run raises it.
        """
        if not self.pending or self.pending[0] != step:
            raise RolloutWorkerError(f"no rollout of step {step + 1} was submitted (pending: {list(self.pending)})")
        start = time.perf_counter()
        _, got, version, batch, seconds = self._receive("batch", step)
        self.pending.popleft()
        self.pending_prompts.popleft()
        if got != step:
            raise RolloutWorkerError(f"the rollout worker returned step {got + 1} where step {step + 1} was due")
        staleness = step - version
        if staleness > self.max_staleness:  # cannot happen with the schedule of the module docstring
            raise RolloutWorkerError(f"the rollout of step {step + 1} was drawn {staleness} versions ago, over "
                                     f"rollout.max_staleness={self.max_staleness}")
        return batch, {"async/staleness": float(staleness), "async/wait_seconds": time.perf_counter() - start,
                       "async/worker_seconds": float(seconds)}

    def close(self) -> None:
        """Stop the worker (a stop message, then terminate if it does not exit within 10 s)."""
        if self.process.is_alive():
            try:
                self.requests.put(("stop",))
            except (OSError, ValueError):
                pass
            self.process.join(10)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)
        for q in (self.requests, self.results):
            q.cancel_join_thread()
            q.close()


class AsyncEngine:
    """The asynchronous layer of the engine stack (``rollout.asynchronous``): it serves a training step's rollout from
    the worker (:class:`AsyncRollouts`), and every other call -- the held-out evaluation, which samples the trainer's
    current weights -- from the engine below it (``inner``).

    A training step's prompts carry their per-prompt rollout seeds (:data:`~prefzoo.types.ROLLOUT_SEED_COLUMN`, set
    by the loop); the worker was asked for exactly those prompts and seeds, in step order, so a call with seeds is the
    next pending rollout, checked against it. ``last_metrics`` holds the last served rollout's ``async/*`` metrics.
    ``keep_logps=False`` drops the worker's log-probs from the rollout, so that a run that neither corrects nor logs
    the mismatch does not pay the trainer's extra no-grad pass that comparing them takes. The worker is attached by
    :meth:`serve` once the run starts (after a resume); before that every call goes to ``inner``."""

    def __init__(self, inner, keep_logps: bool = True):
        self.inner = inner
        self.name = inner.name
        self.keep_logps = keep_logps  # False: the worker's log-probs are dropped (no correction, no mismatch pass)
        self.rollouts: AsyncRollouts | None = None
        self.last_metrics: dict[str, float] = {}

    def serve(self, rollouts: AsyncRollouts | None) -> None:
        """Serve the training steps' rollouts from ``rollouts`` (None: from ``inner`` again, the worker stopped)."""
        self.rollouts = rollouts

    def sample(self, model, prompts: PromptBatch, num_samples: int, params: SamplingParams, *, eos_token_ids,
               pad_id: int, generator=None) -> SequenceBatch:
        seeds = prompts.columns.get(ROLLOUT_SEED_COLUMN)
        if self.rollouts is None or seeds is None:
            return self.inner.sample(model, prompts, num_samples, params, eos_token_ids=eos_token_ids, pad_id=pad_id,
                                     generator=generator)
        step, wanted, submitted = self.rollouts.next_pending()
        batch, self.last_metrics = self.rollouts.take(step)
        # (a multi-turn rollout's prompts are rendered by the worker's episodes, with the tools and the environment's
        # first text: they are not the dataset's ids, which the submitted request's are compared with instead)
        same_prompts = torch.equal(submitted, prompts.prompt_ids.cpu()) and (
            batch.episodes is not None or torch.equal(batch.prompt_ids[::num_samples].cpu(), submitted))
        if list(seeds) != wanted or len(batch) != len(prompts) * num_samples or not same_prompts:
            raise RolloutWorkerError(f"the worker's rollout of step {step + 1} is of other prompts than the "
                                     "trainer's (a schedule bug)")
        if not self.keep_logps:
            batch.sample_logps = None
        return batch.to(prompts.prompt_ids.device)

    def close(self) -> None:
        self.inner.close()
