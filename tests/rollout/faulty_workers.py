"""Rollout workers that fail on purpose (tests/rollout/test_async_rollouts.py): a builder returns (model, engine) in
the spawned worker process, which imports this module to find it; it imports torch alone, so the worker starts in
seconds."""

from __future__ import annotations

import os
import time

import torch


class FaultyEngine:
    """An engine whose ``sample`` exits the process (``dies``), sleeps past any timeout (``hangs``) or raises."""

    def __init__(self, fault: str):
        self.fault = fault

    def sample(self, model, prompts, num_samples, params, *, eos_token_ids, pad_id, generator=None):
        if self.fault == "dies":
            os._exit(3)
        if self.fault == "hangs":
            time.sleep(3600)
        raise ValueError("the tool server is down")


def faulty(fault: str):
    return torch.nn.Linear(2, 2), FaultyEngine(fault)


def cannot_build():
    raise OSError("no such model folder: /nowhere")
