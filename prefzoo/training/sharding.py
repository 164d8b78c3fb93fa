"""How a global batch is split over data-parallel processes, and how their metrics are put back together.

Pure functions (no process group): the training loop calls them with its rank and world size, and the
tests call them directly.

* Every process runs the same :class:`~prefzoo.training.sampler.IndexSampler` (same seed), so all agree on
  the global batch of each step; process r takes the contiguous slice :func:`shard_range` of it. For online
  algorithms the unit is the prompt, so all G samples of a prompt stay in one process (GRPO's group
  statistics are local and exact), and the rows of the processes, concatenated in rank order, are the rows
  one process would have built.
* :func:`rollout_seeds` gives each prompt of a step a seed from (seed, step, its position in the GLOBAL
  batch): what a prompt samples does not depend on which process holds it (see
  :meth:`prefzoo.models.policy.CausalLMPolicy.sample`).
* :func:`minibatch_rows` maps a mini-batch of global row numbers to this process's local rows.
* :func:`reduce_metrics` turns each process's step metrics into the global ones.
"""

from __future__ import annotations

import math

import numpy as np


def shard_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """The slice [start, stop) of n global items that process ``rank`` of ``world_size`` takes.

    Contiguous, in rank order, sizes differing by at most one (the first ``n % world_size`` processes take one
    more). Raises ValueError when some process would get nothing (n < world_size).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if n < world_size:
        raise ValueError(f"{n} items cannot be shared by {world_size} processes: each needs at least one")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rollout_seeds(seed: int, step: int, positions: range | list[int]) -> list[int]:
    """One 63-bit seed per prompt, a function of (run seed, step, position of the prompt in the global batch)."""
    return [int(np.random.SeedSequence([seed, step, p]).generate_state(1, np.uint64)[0] >> np.uint64(1))
            for p in positions]


def minibatch_rows(global_rows, offset: int, local_rows: int) -> list[int]:
    """The local row numbers of the global rows ``global_rows`` that live on a process holding global rows
    [offset, offset + local_rows), in the mini-batch's order."""
    return [i - offset for i in global_rows if offset <= i < offset + local_rows]


def _reduce_key(key: str, values: list[float], weights: list[int]) -> float:
    if key == "loss":  # each process's share of the global loss (global normaliser): the sum is the loss
        return float(sum(values))
    if key.startswith("time/") or key.endswith("_max"):  # the step waits for the slowest process
        return float(max(values))
    if key.endswith("_min"):
        return float(min(values))
    if key.endswith("per_second"):  # throughput of all processes together
        return float(sum(values))
    total = sum(weights)
    if total == 0:
        return float(np.mean(values))
    return float(sum(v * w for v, w in zip(values, weights)) / total)


def reduce_metrics(per_process: list[tuple[int, dict]]) -> dict:
    """The global step metrics from each process's ``(rows, metrics)``.

    Rules, by key: ``loss`` is summed (each process reports its share of the global loss); ``time/*`` and
    ``*_max`` take the maximum, ``*_min`` the minimum; ``*per_second`` is summed (total throughput); every
    other number is the mean over processes weighted by their rows, which is the exact global mean for
    per-row means (rewards, lengths, KL per sequence, accuracies) and a row-weighted average of per-process
    values for the rest (e.g. ``reward_std`` is not the std of the global batch). Values that are the same on
    every process (``grad_norm`` after the all-reduce, ``lr``, ``beta``) come out unchanged. A key missing on
    some process is reduced over those that have it; non-numbers are taken from the first process.
    """
    keys: list[str] = []
    for _, metrics in per_process:
        keys += [k for k in metrics if k not in keys]
    out = {}
    for k in keys:
        have = [(rows, m[k]) for rows, m in per_process if k in m]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for _, v in have):
            out[k] = have[0][1]
            continue
        values = [float(v) for _, v in have]
        if any(math.isnan(v) for v in values):
            out[k] = float("nan")
            continue
        out[k] = _reduce_key(k, values, [rows for rows, _ in have])
    return out
