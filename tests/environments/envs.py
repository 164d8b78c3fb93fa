"""Environments written here from the documented contracts, as a user would write them for TRL or gymnasium.

* :class:`AdderEnv` follows TRL 1.16's ``environment_factory`` documentation (docs/source/openenv.md, "Environment class
  requirements"): ``__init__`` without arguments; ``reset(self, **kwargs)`` receives the dataset columns and returns a
  string (appended to the last user message) or None; every other public method with type hints and an ``Args:``
  docstring is a tool; ``get_reward()`` returns the episode's reward.
* :data:`TOOLS`, a plain list of tool functions (TRL's ``tools=[...]``).
* :class:`GuessEnv`, a gymnasium-style text environment: ``reset() -> observation``, ``step(text) -> (observation,
  reward, done)``.
* Broken ones, each missing one part of a contract (the pre-flight names the class and the method).
"""

from __future__ import annotations

import time


class AdderEnv:
    """Counts the additions asked; its reward is 1 when the last reply holds the row's answer."""

    def __init__(self):
        self.reward = 0.0

    def reset(self, **kwargs) -> str | None:
        self.answer, self.calls, self.reward = kwargs.get("answer"), 0, 0.0
        return "You may use the add tool."

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        self.calls += 1
        return str(a + b)

    def fail(self, reason: str) -> str:
        """A tool that always raises.

        Args:
            reason: what to say
        """
        raise ValueError(reason)

    def slow(self, seconds: float) -> str:
        """A tool that takes its time.

        Args:
            seconds: how long to sleep
        """
        time.sleep(seconds)
        return "done"

    def nothing(self, x: int) -> str:
        """A tool that returns no text.

        Args:
            x: ignored
        """
        return None

    def get_reward(self) -> float:
        return 1.0 + 0.5 * self.calls


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return str(a * b)


TOOLS = [multiply]


class GuessEnv:
    """Guess the row's answer: 'higher' / 'lower' until right (reward 1 at the right guess, -0.1 per wrong one)."""

    def reset(self, **row):
        self.answer = int(row.get("answer", 7))
        return "Guess the number."

    def step(self, text: str):
        digits = "".join(ch for ch in text if ch.isdigit())
        guess = int(digits) if digits else None
        if guess == self.answer:
            return "right", 1.0, True
        return ("higher" if guess is None or guess < self.answer else "lower"), -0.1, False


class NoReset:
    def add(self, a: int) -> str:
        """Args:
            a: a number
        """
        return str(a)


class NeedsArgs:
    def __init__(self, url):
        self.url = url

    def reset(self, **row):
        return None

    def ping(self) -> str:
        """Ping."""
        return "pong"


class UndocumentedTool:
    def reset(self, **row):
        return None

    def add(self, a, b):
        return a + b


class ResetFails:
    def reset(self, **row):
        raise RuntimeError("cannot reach the server")

    def ping(self) -> str:
        """Ping."""
        return "pong"


class HoldsALock(GuessEnv):
    """GuessEnv with a lock taken in ``reset``: it plays synchronously, and cannot be pickled (asynchronous rollouts
    send each episode's environment from the worker to the trainer)."""

    def reset(self, **row):
        import threading

        self.lock = threading.Lock()
        return super().reset(**row)


NOT_A_CLASS = 42
