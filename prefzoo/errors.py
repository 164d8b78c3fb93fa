"""Typed errors raised by prefzoo.

Every error the library raises on purpose is a :class:`PrefzooError`, so a caller can catch the
library's complaints in one place. Each concrete error also derives from the built-in exception it
specialises (``ValueError`` for bad input, ``RuntimeError`` for failures while running), so code that
already catches those keeps working.

Convention: a message says what was wrong (with the offending value) and how to fix it.

This module is a leaf: it imports nothing, so every room of the house, :mod:`prefzoo.objective` included, may
import it (the objective layer's :class:`~prefzoo.objective.ObjectiveError` is a :class:`PrefzooError`).
"""

from __future__ import annotations

__all__ = ["PrefzooError", "ConfigError", "DataError", "RewardError", "ModelError", "PluginError",
           "RolloutWorkerError", "RunFolderError", "CheckpointError"]


class PrefzooError(Exception):
    """Base class of every error prefzoo raises on purpose."""


class ConfigError(PrefzooError, ValueError):
    """A configuration value is invalid: unknown name, out-of-range number, inconsistent options."""


class DataError(PrefzooError, ValueError):
    """Input data is malformed: missing columns, empty splits, misaligned lists."""


class RewardError(PrefzooError, RuntimeError):
    """A reward function failed, or returned something other than one finite number per completion."""


class ModelError(PrefzooError, RuntimeError):
    """A model could not be loaded, converted or run as requested."""


class PluginError(PrefzooError, TypeError):
    """An algorithm plugin does not keep the plugin contract (see :mod:`prefzoo.algos.base`)."""


class RolloutWorkerError(PrefzooError, RuntimeError):
    """The asynchronous rollout worker died, failed or stopped answering (``rollout.asynchronous``)."""


class RunFolderError(PrefzooError, RuntimeError):
    """The run folder cannot be used as asked: another run holds it, or it cannot be written."""


class CheckpointError(RunFolderError):
    """A checkpoint cannot be written (disk full) or read (damaged, or holding objects that would run code)."""
