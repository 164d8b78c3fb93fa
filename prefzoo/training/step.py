"""One optimizer step's gradients from one batch: the function every trainer shares.

:func:`accumulate_gradients` is the whole contract between the training loop and an algorithm plugin: it
splits a (mini-)batch into micro-batches, asks the plugin for per-token or per-example losses, reduces them
with the one global normaliser (:func:`prefzoo.objective.aggregate_loss`) and backpropagates. It lives in
its own small module (it imports only torch, the plugin base and the objective layer) so that light
drivers — the tabular conformance test bed (:mod:`prefzoo.tabular`) and the toy bandit — run the very same
code as :class:`prefzoo.training.loop.Trainer` without importing models, tokenizers or datasets.
``prefzoo.training.loop`` re-exports it.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, ContextManager

import torch

from prefzoo.algos.base import Algorithm

from prefzoo.types import Batch
from prefzoo.objective import aggregate_loss

__all__ = ["accumulate_gradients", "mean_metrics"]


def mean_metrics(pairs: dict[str, tuple[float, float]]) -> dict[str, float]:
    """``{name: sum / count}`` of :func:`accumulate_gradients`' pairs (``loss`` is a total: count 1)."""
    return {k: (v / n if n else 0.0) for k, (v, n) in pairs.items()}


def accumulate_gradients(algo: Algorithm, policy, batch: Batch, micro_batch_size: int, all_reduce=None,
                         loss_scale: float = 1.0, no_sync: Callable[[], ContextManager] | None = None,
                         placeholder: Batch | None = None) -> dict[str, float]:
    """Backpropagate the loss of ``batch`` through micro-batches, normalised over the whole batch.

    Args:
        all_reduce: callable summing a tensor over data-parallel processes (None: one process).
        loss_scale: multiplies each micro-batch loss (the number of processes under DDP, which averages).
        no_sync: data parallelism: a context-manager factory (DDP's ``no_sync``) entered around the forward and
            backward of every micro-batch but the last, so gradients are all-reduced once per call.
        placeholder: data parallelism: rows to run with weight 0 when ``batch`` is empty on this process (every
            process must take part in the gradient all-reduce); unused when ``batch`` has rows.

    Returns:
        ``{name: (sum, count)}``: each per-row metric summed times its rows with the row count, each per-token
        metric's (sum, token count) added over micro-batches, so that sum / count -- taken once, after adding
        the pairs over processes too -- is the batch's mean whatever the micro-batch size; plus ``loss``
        as (this process's share of the batch's total loss, 1): the sum over processes is the global loss.
        :func:`mean_metrics` divides.
    """
    aggregation = algo.declaration.aggregation
    micros = batch.chunks(micro_batch_size)
    normaliser = torch.tensor(float(sum(algo.normaliser(m) for m in micros)))
    if all_reduce is not None:
        normaliser = all_reduce(normaliser)
    if not micros and placeholder is not None:  # no rows here: join the all-reduce with zero gradients
        out = algo.loss(policy, placeholder)
        (aggregate_loss(out.values, out.mask, aggregation, float(normaliser)) * 0.0).backward()
        return {"loss": 0.0}
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # name -> [sum, count]
    total = 0.0
    for i, m in enumerate(micros):
        sync = no_sync is None or i == len(micros) - 1
        with contextlib.nullcontext() if sync else no_sync():
            out = algo.loss(policy, m)
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
