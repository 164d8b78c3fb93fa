"""The three ways a user's environment reaches prefzoo, each turned into one episode interface (:class:`Episode`).

1. **TRL's ``environment_factory`` class** (TRL 1.16's contract, :class:`ToolEpisode`): ``__init__()`` takes no
   argument; ``reset(**row)`` is called at the start of each episode with every dataset column and returns None or a
   text that is appended to the last user message; every other public method (not starting with ``_``, not
   ``reset`` / ``get_reward``) is a tool -- type hints and an ``Args:`` docstring give its schema; an optional
   ``get_reward()`` returns the episode's reward (a float), which then adds to the reward functions' with weight 1.
   A tool that raises is answered with its error message (TRL's behaviour). One instance per episode.
2. **A list of tool functions** (TRL's ``tools=[fn, ...]``, :class:`ToolEpisode` without state): the same loop,
   stateless tools.
3. **A gymnasium-style text environment** (:class:`TextEpisode`): ``reset()`` (or ``reset(**row)``) returns the
   first observation (appended to the last user message, or None), ``step(text)`` returns ``(observation, reward,
   done)`` (a fourth and fifth item, gymnasium's ``truncated`` and ``info``, are accepted). The observation comes
   back as a user message; rewards add up over the episode (or, with ``env.reward_placement=turn``, each lands on the
   turn it rewards). A skyrl-gym environment (``__init__(env_config,
   extras)``, ``init(prompt) -> (prompt, metadata)``, ``step(action) -> {"observations", "reward", "done", ...}``) is
   read through :class:`SkyRLEpisode`.

The episode loop (:mod:`prefzoo.rollout.multiturn`) asks an episode for its tools (schemas) and first text
(:meth:`start`), hands it each policy turn (:meth:`respond`: the decoded text and the parsed assistant message) and
reads its reward at the end (:meth:`reward`). Every failure of a TOOL (a tool that raises, ``SystemExit`` included,
times out or returns a non-string; an unknown tool; malformed arguments) becomes an observation and a count, never a
crash: the policy called it, and a wrong call is part of what it learns from (TRL's behaviour). A failure of the
ENVIRONMENT itself (its constructor, ``reset``, ``step``, ``get_reward``, skyrl-gym's ``init``: anything it raises but
a Ctrl-C, ``SystemExit`` included) stops the run with one line naming the class, the method and the episode
(:class:`~prefzoo.errors.EnvironmentFailure`): scoring such an episode as failed would train on the environment's bug
as if it were the policy's; the last checkpoint is kept and ``trainer.resume=true`` continues once it is fixed (the
same as TRL, whose environment errors end the run). :func:`check_environment_class` checks a class's shape before any
model loads, and the pre-flight runs ``reset`` and ``get_reward`` once on the first training rows.
"""

from __future__ import annotations

import inspect
import math
from numbers import Real
from typing import Any, Callable

from prefzoo.environments.tools import call_tool, tool_schema
from prefzoo.errors import ConfigError, DataError, EnvironmentFailure, PrefzooError, describe_error, is_interrupt, raised_at
from prefzoo.types import Reply

__all__ = ["Episode", "ToolEpisode", "TextEpisode", "SkyRLEpisode", "tool_methods", "check_environment_class",
           "episode_kind", "call_environment"]

_NOT_TOOLS = ("reset", "get_reward")


class Episode:
    """One episode of an environment: what the multi-turn rollout talks to (subclasses below).

    Attributes:
        tools: name -> callable, the episode's tools ({} for a text environment).
        schemas: their JSON schemas (:func:`~prefzoo.environments.tools.tool_schema`), for the chat template.
        instance: the user's object (TRL's reward functions receive these as ``environments=``), or None.
    """

    tools: dict[str, Callable] = {}
    schemas: list[dict] = []
    instance: Any = None

    def start(self, row: dict) -> str | None:
        """Begin the episode for the dataset row ``row``; the text to append to the last user message, or None."""
        return None

    def respond(self, text: str, message: dict) -> Reply:
        """The environment's answer to the policy's turn (``text`` decoded; ``message`` parsed, with ``tool_calls``)."""
        raise NotImplementedError

    def reward(self) -> float | None:
        """The environment's own reward for the finished episode, or None when it keeps none."""
        return None


def call_environment(fn: Callable, name: str, *args, **kwargs):
    """``fn(*args, **kwargs)``, a method of the user's environment called ``name`` (``MyEnv.step``).

    Raises:
        EnvironmentFailure: it raised anything but a Ctrl-C (``SystemExit`` included): one line naming it, what it
            raised and where. prefzoo's own errors (a wrong return type) pass as they are; a Ctrl-C passes.
    """
    try:
        return fn(*args, **kwargs)
    except PrefzooError:
        raise
    except BaseException as err:
        if is_interrupt(err):
            raise
        at = raised_at(err)
        cause = f"{describe_error(err)}{f' at {at}' if at else ''}"
        raise EnvironmentFailure(f"{name} raised {cause}", method=name, cause=cause) from None


def tool_methods(instance) -> dict[str, Callable]:
    """The public methods of ``instance`` that are tools: not starting with ``_``, not ``reset`` / ``get_reward``."""
    return {name: member for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
            if not name.startswith("_") and name not in _NOT_TOOLS}


def _checked_reward(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise DataError(f"{where} returned {value!r}; an environment's reward must be a finite number.")
    return float(value)


class ToolEpisode(Episode):
    """An episode of a TRL ``environment_factory`` instance (``instance``) or of a tool list (``functions``): each
    policy turn's tool calls are run and answered with ``role: tool`` messages; a turn without a call ends it.

    Args:
        instance: a fresh instance of the user's class, or None for plain tools.
        functions: the tools of a ``tools=[...]`` list (with an instance: added to its methods).
        timeout: seconds a tool may run (``env.tool_timeout``).
    """

    def __init__(self, instance=None, functions: list[Callable] = (), timeout: float = 10.0):
        self.instance = instance
        self.tools = {**{fn.__name__: fn for fn in functions}, **(tool_methods(instance) if instance is not None else {})}
        self.schemas = [tool_schema(fn) for fn in self.tools.values()]
        self.timeout = timeout

    def start(self, row: dict) -> str | None:
        if self.instance is None:
            return None
        text = call_environment(self.instance.reset, f"{type(self.instance).__name__}.reset", **row)
        if text is not None and not isinstance(text, str):
            raise DataError(f"{type(self.instance).__name__}.reset returned a {type(text).__name__}; it must return a "
                            "string (appended to the last user message) or None.")
        return text

    def respond(self, text: str, message: dict) -> Reply:
        calls = message.get("tool_calls") or []
        if not calls:
            return Reply(messages=[], done=True)
        results = [call_tool(call, self.tools, self.timeout) for call in calls]
        return Reply(messages=[r.message for r in results], tool_calls=len(results),
                     tool_errors=sum(r.error is not None for r in results))

    def reward(self) -> float | None:
        get = getattr(self.instance, "get_reward", None) if self.instance is not None else None
        if get is None:
            return None
        name = f"{type(self.instance).__name__}.get_reward"
        return _checked_reward(call_environment(get, name), f"{name}()")


class TextEpisode(Episode):
    """An episode of a gymnasium-style text environment: ``reset`` gives the first observation, every policy turn is
    one ``step``; the rewards of the steps add up (:meth:`reward`)."""

    def __init__(self, instance):
        self.instance, self.total = instance, 0.0
        self._reset_takes_row = _takes_keywords(instance.reset)

    def start(self, row: dict) -> str | None:
        self.total = 0.0
        name = f"{type(self.instance).__name__}.reset"
        first = (call_environment(self.instance.reset, name, **row) if self._reset_takes_row
                 else call_environment(self.instance.reset, name))
        if isinstance(first, tuple):  # gymnasium: (observation, info)
            first = first[0]
        if first is not None and not isinstance(first, str):
            raise DataError(f"{type(self.instance).__name__}.reset returned a {type(first).__name__}; a text "
                            "environment's observation must be a string or None.")
        return first

    def respond(self, text: str, message: dict) -> Reply:
        name = f"{type(self.instance).__name__}.step"
        out = call_environment(self.instance.step, name, text)
        if not isinstance(out, tuple) or len(out) not in (3, 4, 5):
            raise DataError(f"{name} returned {type(out).__name__}; it must return (observation, reward, done) "
                            "(or gymnasium's (observation, reward, terminated, truncated, info)).")
        observation, reward, done = out[0], out[1], bool(out[2]) or (len(out) == 5 and bool(out[3]))
        reward = _checked_reward(reward, name)
        self.total += reward
        if done:
            return Reply(messages=[], done=True, reward=reward)
        if not isinstance(observation, str):
            raise DataError(f"{name} returned an observation of type {type(observation).__name__}; it must be text.")
        return Reply(messages=[{"role": "user", "content": observation}], reward=reward)

    def reward(self) -> float | None:
        return self.total


class SkyRLEpisode(TextEpisode):
    """A skyrl-gym text environment (``skyrl_gym.envs.base_text_env.BaseTextEnv``): built per episode as skyrl-gym's
    trainers build it, ``cls(env_config=None, extras=row)``, where ``extras`` is the dataset row (a skyrl-format row
    carries ``reward_spec`` / ``extra_info`` itself; otherwise ``reward_spec.ground_truth`` is the row's ``answer``);
    then ``init(prompt)`` and one ``step(action) -> {"observations": [messages], "reward", "done", ...}`` per policy
    turn, the observations appended as they are, the rewards summed. ``init``'s returned conversation is not used:
    the prompt is the dataset's, rendered by the rollout."""

    def __init__(self, cls):
        self.cls, self.instance, self.total = cls, None, 0.0

    def start(self, row: dict) -> str | None:
        self.total = 0.0
        extras = dict(row)
        if "reward_spec" not in extras and "answer" in extras:
            extras["reward_spec"] = {"ground_truth": str(extras["answer"])}
        extras.setdefault("extra_info", {})
        self.instance = call_environment(self.cls, f"{self.cls.__name__}.__init__", env_config=None, extras=extras)
        call_environment(self.instance.init, f"{self.cls.__name__}.init", row.get("prompt") or [])
        return None

    def respond(self, text: str, message: dict) -> Reply:
        name = f"{type(self.instance).__name__}.step"
        out = call_environment(self.instance.step, name, text)
        if not isinstance(out, dict) or "reward" not in out or "done" not in out:
            raise DataError(f"{name} returned {type(out).__name__}; a skyrl-gym step returns {{'observations', "
                            "'reward', 'done', 'metadata'}.")
        reward = _checked_reward(out["reward"], name)
        self.total += reward
        if out["done"]:
            return Reply(messages=[], done=True, reward=reward)
        return Reply(messages=[{"role": m.get("role", "user"), "content": m["content"]}
                               for m in out.get("observations") or []], reward=reward)


def _takes_keywords(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.VAR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def episode_kind(cls) -> str:
    """``tools`` (TRL's contract: ``reset`` and tool methods), ``text`` (``reset`` / ``step``) or ``skyrl``
    (``init`` / ``step``), from the class's methods; TRL's when it has ``reset`` but no ``step``."""
    has = {name for name in ("reset", "step", "init") if callable(getattr(cls, name, None))}
    if "init" in has and "step" in has and "reset" not in has:
        return "skyrl"
    if "step" in has and "reset" in has:
        return "text"
    return "tools"


def check_environment_class(cls, where: str) -> str:
    """Check the shape of a user's environment class before any model loads; its :func:`episode_kind`.

    Raises:
        ConfigError: not a class, an ``__init__`` that needs arguments, no ``reset`` (TRL's and gymnasium's) or
            ``init`` / ``step`` (skyrl-gym's), a tool without a schema, or a class with neither tools nor ``step``;
            the message names the class and the method.
    """
    if not inspect.isclass(cls):
        raise ConfigError(f"{where} is a {type(cls).__name__}, not a class: an environment is a class whose instances "
                          "run one episode each (TRL's environment_factory), e.g. env.target=my_pkg.envs:MyEnv.")
    name = cls.__qualname__
    kind = episode_kind(cls)
    if kind == "skyrl":  # skyrl-gym builds its environments with (env_config, extras): the row
        return kind
    try:
        inspect.signature(cls).bind()
    except TypeError as err:
        raise ConfigError(f"{where}: {name}.__init__ must take no argument (TRL's contract: {err}); capture "
                          "settings from the module or the class.") from None
    except ValueError:
        pass
    if kind == "tools":
        if not callable(getattr(cls, "reset", None)):
            raise ConfigError(f"{where}: {name} has no reset method; an environment needs reset(**row) (TRL's "
                              "environment_factory) or reset() and step(text) (a text environment).")
        tools = [m for n, m in inspect.getmembers(cls, predicate=inspect.isfunction)
                 if not n.startswith("_") and n not in _NOT_TOOLS]
        if not tools:
            raise ConfigError(f"{where}: {name} has reset but no tool method and no step; give it public methods "
                              "(the tools) or step(text).")
        for fn in tools:
            tool_schema(fn)  # raises naming the tool
    return kind
