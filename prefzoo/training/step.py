"""One training step's optimisation, and one optimizer step's gradients: the functions every trainer shares.

* :func:`optimisation_step` — ``algo.epochs`` passes over a batch, each split into ``algo.num_minibatches``
  mini-batches; each mini-batch is one optimizer step (zero the gradients, accumulate them, clip, step the
  optimizer and the learning-rate schedule). :meth:`prefzoo.training.loop.Trainer.train_step` and the tabular
  bed's driver (:func:`prefzoo.lab.tabular.train`) both call it: they differ only in where the batch and the
  mini-batch orders come from, and in the optimizer they pass.
* :func:`accumulate_gradients` — the whole contract between the training loop and an algorithm plugin: it
  splits a (mini-)batch into micro-batches, asks the plugin for per-token or per-example losses, reduces them
  with the one global normaliser (:func:`prefzoo.objective.aggregate_loss`) and backpropagates. A plugin with
  the capability ``step_statistics`` first gets the statistics of the whole optimizer step
  (:func:`step_statistics`: over all its micro-batches and processes), as the normaliser does, in the
  :class:`~prefzoo.types.StepContext` its ``loss`` receives.

They live in their own small module (it imports only torch, numpy, the plugin base, the objective layer and
:mod:`prefzoo.training.sharding`) so that light drivers — the tabular conformance test bed and the toy bandit
(:mod:`prefzoo.lab`) — run the very same code as :class:`prefzoo.training.loop.Trainer` without importing
models, tokenizers or datasets. ``prefzoo.training.loop`` re-exports :func:`accumulate_gradients`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, Callable, ContextManager

import torch

from prefzoo.algos.base import Algorithm

from prefzoo.types import NO_STEP, Batch, StepContext
from prefzoo.objective import aggregate_loss
from prefzoo.training.sharding import minibatch_rows

__all__ = ["optimisation_step", "accumulate_gradients", "step_statistics", "mean_metrics", "add_pairs"]


def mean_metrics(pairs: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``{name: sum / count}`` of (sum, count) metric pairs (:func:`accumulate_gradients`, :func:`optimisation_step`)."""
    return {k: (v / n if n else 0.0) for k, (v, n) in pairs.items()}


def add_pairs(total: dict[str, list[float]], pairs: Mapping[str, Sequence[float]]) -> None:
    """Add (sum, count) metric pairs into ``total``, in place."""
    for k, (v, n) in pairs.items():
        acc = total.setdefault(k, [0.0, 0.0])
        acc[0] += float(v)
        acc[1] += float(n)


def optimisation_step(algo: Algorithm, policy, batch: Batch, optimizer: torch.optim.Optimizer, scheduler,
                      params: Sequence[torch.Tensor], micro_batch_size: int | None, *,
                      max_grad_norm: float | None = None,
                      permutation: Callable[[int], Sequence[int]] | None = None,
                      layout: tuple[int, int] | None = None,
                      parallel: Mapping[str, Any] | None = None,
                      step: StepContext = NO_STEP) -> dict[str, list[float]]:
    """One training step's updates on ``batch``: the declared ``epochs`` passes x ``num_minibatches`` optimizer steps.

    Each pass splits the (global) rows into ``num_minibatches`` mini-batches of ceil(N / num_minibatches)
    rows, in a fresh order ``permutation(N)`` when there is more than one mini-batch (in row order otherwise).
    Each mini-batch is one optimizer step: ``optimizer.zero_grad``, :func:`accumulate_gradients` over
    micro-batches of ``micro_batch_size`` rows, gradient clipping, ``optimizer.step()``, ``scheduler.step()``.

    Args:
        params: the trained parameters (clipped together).
        micro_batch_size: rows per forward/backward; None: each mini-batch at once.
        max_grad_norm: clip the gradients' global norm to it and report ``grad_norm`` (``float("inf")``:
            measure without clipping); None: neither clip nor measure.
        scheduler: a learning-rate scheduler stepped after every optimizer step, or None (a constant rate).
        permutation: ``n -> a permutation of range(n)`` (a list of ints), drawn once per pass when
            ``num_minibatches > 1`` (default: ``torch.randperm(n)`` from torch's global generator).
            Data parallel: every process must receive the same one (the Trainer broadcasts process 0's).
        layout: data parallelism: (offset of this process's first row among the global rows, number of global
            rows); mini-batches are cut from the global rows and each process takes the rows it holds
            (:func:`prefzoo.training.sharding.minibatch_rows`). Default: (0, len(batch)), one process.
        parallel: keyword arguments for :func:`accumulate_gradients` (``all_reduce``, ``loss_scale``,
            ``no_sync``, ``placeholder``, ``equal_passes``, ``gathered``), and two of its own under FSDP:
            ``sync_grads`` (``params -> None``, after the backward passes: the replicated parameters' gradients
            averaged over processes) and ``clip_grad_norm`` (in place of ``torch.nn.utils.clip_grad_norm_``).
        step: the training step's context, handed to every ``loss`` (:class:`~prefzoo.types.StepContext`).

    Returns:
        ``{name: [sum, count]}`` over every optimizer step of the step: the plugin's metrics as
        :func:`accumulate_gradients` pairs them (per-row means weighted by rows, per-token sums with token counts),
        ``loss`` (one count per optimizer step), ``lr`` (the rate each step used) and ``grad_norm`` (before clipping,
        when ``max_grad_norm`` is set), one count per optimizer step. :func:`mean_metrics` divides; under data
        parallelism the pairs are added over processes first (:func:`prefzoo.training.loop.global_pairs`).
    """
    n = len(batch)
    d = algo.declaration
    offset, n_global = layout if layout is not None else (0, n)
    per_mb = math.ceil(n_global / d.num_minibatches)
    draw = permutation if permutation is not None else (lambda rows: torch.randperm(rows).tolist())
    parallel = dict(parallel or {})
    sync_grads = parallel.pop("sync_grads", None)
    clip = parallel.pop("clip_grad_norm", torch.nn.utils.clip_grad_norm_)
    totals: dict[str, list[float]] = {}
    whole = d.num_minibatches == 1  # each pass is one optimizer step on every row, in order: the batch itself
    alone = (offset, n_global) == (0, n)  # one process holds every row: a mini-batch's rows are its local rows
    for _ in range(d.epochs):
        order = range(n_global) if whole else draw(n_global)
        for start in range(0, n_global, per_mb):
            rows = order[start:start + per_mb]
            mb = batch if whole else batch.select(rows if alone else minibatch_rows(rows, offset, n))
            optimizer.zero_grad(set_to_none=True)
            m = accumulate_gradients(algo, policy, mb, micro_batch_size or max(1, len(mb)), step=step, **parallel)
            if sync_grads is not None:
                sync_grads(params)
            if max_grad_norm is not None:
                m["grad_norm"] = (float(clip(params, max_grad_norm)), 1.0)
            m["lr"] = (scheduler.get_last_lr()[0] if scheduler is not None else optimizer.param_groups[0]["lr"], 1.0)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            add_pairs(totals, m)
    return totals


@torch.no_grad()
def step_statistics(algo: Algorithm, policy, batch: Batch, micro_batch_size: int, all_reduce=None) -> dict[str, float]:
    """The means of a plugin's statistics over one optimizer step (capability ``step_statistics``).

    ``algo.step_statistics(policy, batch, micro_batch_size)`` gives ``{name: (sum, count)}`` over this process's
    rows of the step; the sums and counts are added over processes (``all_reduce``, in sorted name order, so every
    process must return the same names) and divided once: ``{name: sum / count}`` (0.0 where the count is 0).
    The mean of the whole step -- all micro-batches, all processes -- before any of its losses.
    """
    pairs = algo.step_statistics(policy, batch, micro_batch_size)
    names = sorted(pairs)
    if not names:
        return {}
    totals = torch.tensor([[float(pairs[k][0]), float(pairs[k][1])] for k in names], dtype=torch.float64)
    if all_reduce is not None:
        totals = all_reduce(totals)
    return {k: (float(totals[i, 0] / totals[i, 1]) if float(totals[i, 1]) else 0.0) for i, k in enumerate(names)}


def _zero_weight_pass(algo: Algorithm, policy, placeholder: Batch, aggregation: str, normaliser: float,
                      step: StepContext) -> None:
    """A forward and backward of ``placeholder`` whose loss is multiplied by 0: the collectives of a pass, no
    gradient."""
    out = algo.loss(policy, placeholder, step)
    (aggregate_loss(out.values, out.mask, aggregation, normaliser) * 0.0).backward()


def accumulate_gradients(algo: Algorithm, policy, batch: Batch, micro_batch_size: int, all_reduce=None,
                         loss_scale: float = 1.0, no_sync: Callable[[], ContextManager] | None = None,
                         placeholder: Batch | None = None, equal_passes: Callable[[int], int] | None = None,
                         gathered: Callable[[], ContextManager] | None = None,
                         step: StepContext = NO_STEP) -> dict[str, float]:
    """Backpropagate the loss of ``batch`` through micro-batches, normalised over the whole batch.

    Args:
        all_reduce: callable summing a tensor over data-parallel processes (None: one process).
        loss_scale: multiplies each micro-batch loss (the number of processes under DDP, which averages).
        no_sync: data parallelism: a context-manager factory (DDP's ``no_sync``) entered around the forward and
            backward of every micro-batch but the last, so gradients are all-reduced once per call.
        placeholder: data parallelism: rows to run with weight 0 when ``batch`` is empty on this process (every
            process must take part in the gradient all-reduce); unused when ``batch`` has rows.
        equal_passes: FSDP: maps this process's number of micro-batches to the largest over the processes; the
            difference is made up with passes of ``placeholder`` at weight 0, since every sharded forward all-gathers
            and every backward reduce-scatters, and the processes must run as many.
        gathered: FSDP: a context-manager factory (the sharded modules made whole) for the plugin's
            ``step_statistics`` passes, whose number may differ between processes.
        step: the training step's context; every ``loss`` receives it, with this optimizer step's ``statistics``
            (capability ``step_statistics``).

    Returns:
        ``{name: (sum, count)}``: each per-row metric summed times its rows with the row count, each per-token
        metric's (sum, token count) added over micro-batches, so that sum / count -- taken once, after adding
        the pairs over processes too -- is the batch's mean whatever the micro-batch size; plus ``loss``
        as (this process's share of the batch's total loss, 1): the sum over processes is the global loss.
        :func:`mean_metrics` divides.
    """
    aggregation = algo.declaration.aggregation
    if algo.declaration.has("step_statistics"):  # before the losses: a statistic of the whole optimizer step
        with gathered() if gathered is not None else contextlib.nullcontext():
            statistics = step_statistics(algo, policy, batch, micro_batch_size, all_reduce)
        step = dataclasses.replace(step, statistics=statistics)
    micros = batch.chunks(micro_batch_size)
    normaliser = torch.tensor(float(sum(algo.normaliser(m) for m in micros)))
    if all_reduce is not None:
        normaliser = all_reduce(normaliser)
    padding = equal_passes(len(micros)) - len(micros) if equal_passes is not None else 0
    for _ in range(padding if micros else 0):  # FSDP: as many sharded passes as the busiest process
        _zero_weight_pass(algo, policy, placeholder, aggregation, float(normaliser), step)
    if not micros and placeholder is not None:  # no rows here: join the all-reduce with zero gradients
        for _ in range(max(1, padding)):
            _zero_weight_pass(algo, policy, placeholder, aggregation, float(normaliser), step)
        return {"loss": 0.0}
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # name -> [sum, count]
    total = 0.0
    for i, m in enumerate(micros):
        sync = no_sync is None or i == len(micros) - 1
        with contextlib.nullcontext() if sync else no_sync():
            out = algo.loss(policy, m, step)
            loss = aggregate_loss(out.values, out.mask, aggregation, float(normaliser))
            (loss * loss_scale).backward()
        total += float(loss.detach())
        for k, v in out.metrics.items():  # per-row means: weighted by rows
            sums[k][0] += float(v) * len(m)
            sums[k][1] += len(m)
        for k, (v, n) in out.token_metrics.items():  # per-token (sum, count): added up
            sums[k][0] += float(v)
            sums[k][1] += float(n)
    metrics = {k: (v, n) for k, (v, n) in sums.items()}
    metrics["loss"] = (total, 1.0)
    return metrics
