"""Which rows each training step uses: seeded epoch-wise shuffles, resumable mid-epoch."""

from __future__ import annotations

import torch


class IndexSampler:
    """Yields ``batch_size`` row indices per step from ``n`` rows, reshuffling (seeded) every epoch.

    The order depends only on (seed, epoch), so a run resumed from ``state_dict()`` sees exactly the
    batches an uninterrupted run would have seen.
    """

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool = True):
        if n <= 0:
            raise ValueError("cannot sample batches from an empty data set")
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self) -> list[int]:
        """The next batch: ``batch_size`` indices, wrapping into a new (reshuffled) epoch when needed."""
        out = []
        while len(out) < self.batch_size:
            if self.position >= self.n:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation()
            take = min(self.batch_size - len(out), self.n - self.position)
            out += self._order[self.position:self.position + take]
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()
