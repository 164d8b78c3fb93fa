"""Typed errors raised by prefzoo.

Every error the library raises on purpose is a :class:`PrefzooError`, so a caller can catch the
library's complaints in one place. Each concrete error also derives from the built-in exception it
specialises (``ValueError`` for bad input, ``RuntimeError`` for failures while running), so code that
already catches those keeps working.

Convention: a message says what was wrong (with the offending value) and how to fix it.

This module is a leaf: it imports nothing of prefzoo (only the standard library), so every room of the house, :mod:`prefzoo.objective` included, may
import it (the objective layer's :class:`~prefzoo.objective.ObjectiveError` is a :class:`PrefzooError`).
"""

from __future__ import annotations

import os
import sys

__all__ = ["PrefzooError", "ConfigError", "DataError", "RewardError", "ModelError", "PluginError",
           "RolloutWorkerError", "RunFolderError", "CheckpointError", "EnvironmentFailure", "UserCodeError",
           "is_interrupt", "describe_error", "raised_at", "user_code_frame"]


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


class EnvironmentFailure(PrefzooError, RuntimeError):
    """A user's environment (``env=``: its constructor, ``reset``, ``step``, ``get_reward``; skyrl-gym's ``init``)
    raised during a run: the run stops with one line naming the class, the method and the episode.

    Attributes:
        method: ``MyEnv.step``, the method that raised.
        cause: what it raised, on one line (:func:`describe_error`, with where).
    """

    def __init__(self, message: str, method: str = "", cause: str = ""):
        super().__init__(message)
        self.method, self.cause = method, cause


class UserCodeError(PrefzooError, RuntimeError):
    """User code run by the loop (a plugin, a reward function, an environment) raised ``SystemExit`` or another
    ``BaseException`` that is not a Ctrl-C: an error of that code, reported as one (never a silent exit 0)."""


def is_interrupt(err: BaseException) -> bool:
    """Whether ``err`` is a real Ctrl-C (``KeyboardInterrupt``), the one ``BaseException`` user code may pass through:
    everything else user code raises (``SystemExit`` included) is that code's error."""
    return isinstance(err, KeyboardInterrupt)


def describe_error(err: BaseException) -> str:
    """``ValueError: the message`` (``SystemExit``: ``SystemExit (sys.exit(<code>))``), on one line."""
    if isinstance(err, SystemExit):
        return f"SystemExit (sys.exit({err.code!r}))"
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def raised_at(err: BaseException) -> str:
    """``file.py:line`` of the innermost frame of ``err``'s traceback (where it was raised), or ``""``."""
    tb = err.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}"


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = tuple(sorted({os.path.abspath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}))
_ENTRY = os.path.join(os.path.dirname(_PACKAGE.rstrip(os.sep)), "train.py")  # the checkout's shim: prefzoo's own


def user_code_frame(err: BaseException) -> str | None:
    """``file.py:line (function)`` of the innermost frame of ``err``'s traceback that is the user's code -- not
    prefzoo's package, not the interpreter's or an installed library's (under ``sys.prefix``) -- or None when every
    frame is prefzoo's or a library's (then it is not the user's error, but prefzoo's or the library's)."""
    tb, found = err.__traceback__, None
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not (path.startswith(_PACKAGE) or path.startswith(_LIBRARIES) or path.startswith("<") or path == _ENTRY):
            found = f"{path.rsplit(os.sep, 1)[-1]}:{tb.tb_lineno} ({tb.tb_frame.f_code.co_name})"
        tb = tb.tb_next
    return found
