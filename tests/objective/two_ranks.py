"""Two data-parallel ranks simulated with threads, for testing the ``all_reduce`` hooks of the objective layer."""

from __future__ import annotations

import threading
from typing import Callable

from torch import Tensor


def run_on_two_ranks(fn: Callable[[int, Callable[[Tensor], Tensor]], Tensor]) -> tuple[list[Tensor], list[int]]:
    """Run ``fn(rank, all_reduce)`` for ranks 0 and 1 in two threads; ``all_reduce`` sums the two ranks' tensors
    (a barrier pairs the calls). Returns (each rank's result, how many times each rank called all_reduce)."""
    barrier, slots, results, calls = threading.Barrier(2), [None, None], [None, None], [0, 0]

    def make_all_reduce(rank):
        def all_reduce(t):
            calls[rank] += 1
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # nobody overwrites a slot before both have read
            return total
        return all_reduce

    def run(rank):
        results[rank] = fn(rank, make_all_reduce(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return results, calls
