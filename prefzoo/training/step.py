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

from collections import defaultdict

import torch

from prefzoo.algos.base import Algorithm, Batch
from prefzoo.objective import aggregate_loss

__all__ = ["accumulate_gradients"]


def accumulate_gradients(algo: Algorithm, policy, batch: Batch, micro_batch_size: int, all_reduce=None,
                         loss_scale: float = 1.0) -> dict[str, float]:
    """Backpropagate the loss of ``batch`` through micro-batches, normalised over the whole batch.

    Args:
        all_reduce: callable summing a tensor over data-parallel processes (None: one process).
        loss_scale: multiplies each micro-batch loss (the number of processes under DDP, which averages).

    Returns:
        metrics averaged over micro-batches (weighted by rows), plus ``loss`` (the batch's total loss).
    """
    micros = batch.chunks(micro_batch_size)
    normaliser = torch.tensor(float(sum(algo.normaliser(m) for m in micros)))
    if all_reduce is not None:
        normaliser = all_reduce(normaliser)
    sums: dict[str, float] = defaultdict(float)
    rows = 0
    total = 0.0
    for m in micros:
        out = algo.loss(policy, m)
        loss = aggregate_loss(out.values, out.mask, algo.aggregation, float(normaliser))
        (loss * loss_scale).backward()
        total += float(loss.detach())
        for k, v in out.metrics.items():
            sums[k] += float(v) * len(m)
        rows += len(m)
    metrics = {k: v / max(1, rows) for k, v in sums.items()}
    metrics["loss"] = total
    return metrics
