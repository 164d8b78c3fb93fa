"""Environments that fail after the pre-flight, as a new user's might (round 4 of bad inputs, issue 46): each passes the
checks before the model loads (its first two ``reset`` calls and ``get_reward`` work) and fails later, in a rollout.

The counters are class attributes, so that "the third episode" counts over every instance of the class in a process.
"""

from __future__ import annotations

import os
import sys
import time


class _Counted:
    episodes = 0

    def __init__(self):
        self.answer = None

    def _next(self) -> int:
        type(self).episodes += 1
        return type(self).episodes


class ResetFailsOnThirdEpisode(_Counted):
    """``reset`` raises on the third episode (the pre-flight starts two)."""

    def reset(self, **kwargs) -> str | None:
        if self._next() == 3:
            raise RuntimeError("the episode server is down")
        return None

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return str(a + b)


class ResetFailsLater(_Counted):
    """``reset`` raises from the episode ``$FAIL_AT_EPISODE`` on (counted in this process, the pre-flight's two
    included)."""

    def reset(self, **kwargs) -> str | None:
        if self._next() >= int(os.environ.get("FAIL_AT_EPISODE", "3")):
            raise RuntimeError("the episode server is down")
        return None

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return str(a + b)


class StepFails:
    """A text environment whose ``step`` raises (the pre-flight never calls ``step``)."""

    def reset(self) -> str:
        return "Answer with a number."

    def step(self, text: str):
        raise ValueError(f"cannot parse {text[:10]!r}")


class StepExits:
    """A text environment whose ``step`` calls ``sys.exit()`` (round 4: the run used to end with exit 0, no message,
    no metrics, no summary)."""

    def reset(self) -> str:
        return "Answer with a number."

    def step(self, text: str):
        sys.exit()


class RewardFailsLater(_Counted):
    """``get_reward`` works for the pre-flight's two episodes, then raises."""

    def reset(self, **kwargs) -> str | None:
        self.n = self._next()
        return None

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return str(a + b)

    def get_reward(self) -> float:
        if self.n > 2:
            raise KeyError("score")
        return 0.0


class RewardFailsAtOnce:
    """``get_reward`` raises right after ``reset``: the pre-flight calls it and names it."""

    def reset(self, **kwargs) -> str | None:
        return None

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return str(a + b)

    def get_reward(self) -> float:
        raise AttributeError("'RewardFailsAtOnce' object has no attribute 'result'")


def exits(code: int) -> str:
    """A tool that calls sys.exit.

    Args:
        code: the exit code
    """
    sys.exit(code)


#: the side effects of :func:`counting`, which runs far past any timeout
COUNTED: list[int] = []


def counting(n: int) -> str:
    """Append 0..n-1 to COUNTED, one every 10 ms.

    Args:
        n: how many
    """
    for i in range(n):
        time.sleep(0.01)
        COUNTED.append(i)
    return "done"


def sleeping(seconds: float) -> str:
    """Sleep in one call.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "slept"


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return str(a + b)


def _other_add(a: int, b: int) -> str:
    """Add two integers, wrongly.

    Args:
        a: the first integer
        b: the second integer
    """
    return str(a - b)


_other_add.__name__ = "add"
#: two tools named ``add``: the schema shows one, the other would run
TWO_ADDS = [add, _other_add]
