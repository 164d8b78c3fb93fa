"""Multi-turn environments and tools: what answers the policy between its turns (issue 28).

``env=`` on the command line chooses one, like every other part of a run:

* ``env=none`` (the default): single-turn rollouts, as before;
* ``env=retry``: arithmetic with feedback (:class:`~prefzoo.environments.builtin.RetryEnvironment`);
* ``env=calculator``: 3-digit products with a calculator tool (:class:`~prefzoo.environments.builtin.CalculatorEnvironment`);
* ``env=custom env.target=my_pkg.envs:MyEnv``: a user's class written to TRL's ``environment_factory`` contract, a
  gymnasium-style text environment or a skyrl-gym one (:mod:`prefzoo.environments.contract`), or
  ``env.target=my_pkg.tools:TOOLS``, a list of tool functions (TRL's ``tools=[...]``). The same import-path rule as
  custom plugins and reward functions (``package.module:attribute``).

:func:`episode_factory` turns ``cfg.env`` into a zero-argument callable giving one fresh episode, checked before any
model loads (:func:`check_env`); the rollout (:class:`~prefzoo.rollout.multiturn.MultiTurnEngine`) calls it once per
episode.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

from prefzoo.environments.builtin import CalculatorEnvironment, RetryEnvironment
from prefzoo.environments.contract import (SkyRLEpisode, TextEpisode, ToolEpisode, call_environment,
                                          check_environment_class)
from prefzoo.environments.tools import tool_schema
from prefzoo.errors import ConfigError

log = logging.getLogger("prefzoo")

__all__ = ["BUILTIN_ENVIRONMENTS", "ENV_NAMES", "episode_factory", "check_env", "import_target"]

#: ``env=`` name -> the class it plays
BUILTIN_ENVIRONMENTS = {"retry": RetryEnvironment, "calculator": CalculatorEnvironment}
ENV_NAMES = ("none", *BUILTIN_ENVIRONMENTS, "custom")
#: ``env.reward_placement``: where a text environment's step rewards land (``trajectory``: summed into the episode's
#: reward; ``turn``: each on the last token of the turn it rewards, for plugins with per-token returns)
REWARD_PLACEMENTS = ("trajectory", "turn")


def import_target(spec: str) -> Any:
    """The object ``package.module:attribute`` names (the attribute may be dotted).

    Raises:
        ConfigError: a malformed path, a module that cannot be imported (with its error) or a missing attribute.
    """
    module_name, _, attr_path = str(spec).partition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"env.target={spec!r} is not an import path; write it as 'package.module:ClassName'.")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:  # ModuleNotFoundError, or an error raised while the module runs
        raise ConfigError(f"env.target={spec!r}: could not import module {module_name!r} ({type(err).__name__}: "
                          f"{err}); check the path and that the package is installed or on PYTHONPATH.") from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"env.target={spec!r}: module {module_name!r} has no attribute {attr_path!r}.")
        obj = getattr(obj, part)
    return obj


def _factory_of(target: Any, where: str, timeout: float) -> Callable[[], Any]:
    if isinstance(target, (list, tuple)):
        if not target or not all(callable(fn) for fn in target):
            raise ConfigError(f"{where} is a list, but not of functions: a tool list is [fn, ...] (TRL's tools=).")
        names = [fn.__name__ for fn in target]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"{where}: two tools are named {twice[0]!r}; the policy calls a tool by its name, so only "
                              "one of them could ever run. Rename one (tools are named by their function's __name__).")
        for fn in target:
            tool_schema(fn)
        functions = list(target)
        return lambda: ToolEpisode(None, functions, timeout)
    kind = check_environment_class(target, where)
    build = f"{target.__qualname__}.__init__"
    if kind == "text":
        return lambda: TextEpisode(call_environment(target, build))
    if kind == "skyrl":
        return lambda: SkyRLEpisode(target)
    return lambda: ToolEpisode(call_environment(target, build), (), timeout)


def episode_factory(env_cfg) -> Callable[[], Any] | None:
    """A zero-argument callable giving a fresh episode of ``env_cfg`` (``cfg.env``), or None for ``env=none``.

    Raises:
        ConfigError: an unknown name, ``env=custom`` without ``env.target``, or a target that is not an environment
            class or a tool list (:func:`~prefzoo.environments.contract.check_environment_class` says why).
    """
    name = env_cfg.name
    if name == "none":
        return None
    if name in BUILTIN_ENVIRONMENTS:
        cls = BUILTIN_ENVIRONMENTS[name]
        factory = _factory_of(cls, f"env={name}", env_cfg.tool_timeout)
        if cls is not RetryEnvironment:
            return factory
        cost = float(env_cfg.turn_cost)

        def retry_episode():  # env.turn_cost on the instance: its class stays importable, so it pickles (async)
            episode = factory()
            episode.instance.turn_cost = cost
            return episode

        return retry_episode
    if name != "custom":
        raise ConfigError(f"env={name!r} is not an environment; choose one of {', '.join(ENV_NAMES)}.")
    if not env_cfg.target:
        raise ConfigError("env=custom needs env.target=package.module:ClassName (an environment class) or "
                          "package.module:TOOLS (a list of tool functions).")
    return _factory_of(import_target(env_cfg.target), f"env.target={env_cfg.target}", env_cfg.tool_timeout)


def check_env(cfg) -> None:
    """The pre-flight's checks of ``cfg.env`` (before any model loads): the environment can be built (its class's
    shape, its tools' schemas), the budget holds a turn, and the run can play it.

    Raises:
        ConfigError: as :func:`episode_factory`; ``env.max_turns`` < 1; ``env.max_tokens`` < 1; ``env.tool_timeout``
            <= 0; an unknown ``env.reward_placement``; an offline algorithm (it samples nothing to play with). Warns when
            ``env.reward_placement=turn`` meets an environment without step rewards (TRL's contract, a tool list).
    """
    if cfg.env.name == "none":
        return
    e = cfg.env
    if e.max_turns < 1:
        raise ConfigError(f"env.max_turns={e.max_turns}: an episode needs at least one policy turn.")
    if e.max_tokens < 1:
        raise ConfigError(f"env.max_tokens={e.max_tokens} cannot hold one policy turn; give at least "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}.")
    if not e.tool_timeout > 0:
        raise ConfigError(f"env.tool_timeout={e.tool_timeout} must be > 0 (seconds a tool may run).")
    if e.turn_cost < 0:
        raise ConfigError(f"env.turn_cost={e.turn_cost} must be >= 0 (the reward lost per extra attempt).")
    if e.reward_placement not in REWARD_PLACEMENTS:
        raise ConfigError(f"env.reward_placement={e.reward_placement!r}; choose one of {', '.join(REWARD_PLACEMENTS)}.")
    episode_factory(e)
    target = BUILTIN_ENVIRONMENTS.get(e.name) or import_target(e.target)
    where = f"env={e.name}" if e.name != "custom" else f"env.target={e.target}"
    if e.reward_placement == "turn" and (isinstance(target, (list, tuple))
                                         or check_environment_class(target, where) == "tools"):
        log.warning("env.reward_placement=turn: %s gives no step rewards (a TRL class's get_reward() and the reward "
                    "functions score the whole episode), so every reward lands on the last token as with the default "
                    "placement.", where)
