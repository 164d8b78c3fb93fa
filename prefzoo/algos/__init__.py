"""Algorithm plugins, registered by name: ``algo=<name>`` on the command line.

Adding an algorithm = one module here (a subclass of :class:`~prefzoo.algos.base.Algorithm` decorated with
:func:`register`, with its typed config) and one yaml in ``conf/algo/``; see ``docs/adding-an-algorithm.md``.
Plugins import only :mod:`prefzoo.objective` and :mod:`prefzoo.types`; only the training loop, the lab and the
CLI import this package.

A user's own algorithm loads without editing prefzoo, either

* by import path: ``algo=custom algo.target=my_pkg.algos:MyAlgo`` (plus ``algo.<field>=...`` for its config), or
* from an installed package's entry point in the group ``prefzoo.algorithms``
  (``[project.entry-points."prefzoo.algorithms"] my_algo = "my_pkg.algos:MyAlgo"``), then ``algo=my_algo``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration
from prefzoo.errors import ConfigError, PluginError

__all__ = ["REGISTRY", "register", "get_algorithm", "load_target", "entry_point_algorithms", "AlgoConfig",
           "Algorithm", "Declaration", "ENTRY_POINT_GROUP", "BUILTIN", "algorithm_class"]

REGISTRY: dict[str, type[Algorithm]] = {}
ENTRY_POINT_GROUP = "prefzoo.algorithms"
BUILTIN = ("dpo", "simpo", "orpo", "sft", "kto", "grpo", "ppo", "rm", "bon", "rloo", "reinforce_pp", "gspo", "cispo",
           "online_dpo", "distill", "teacher_reward")


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make ``cls`` available as ``algo=<cls.name>``.

    Raises:
        PluginError: not an :class:`Algorithm` subclass with a ``name`` and an :class:`AlgoConfig` config class,
            or a second class under a registered name.
    """
    check_plugin(cls, f"{cls.__module__}.{cls.__qualname__}")
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise PluginError(f"two algorithms are registered as {cls.name!r}: {REGISTRY[cls.name].__module__} and "
                          f"{cls.__module__}; rename one (its class attribute `name`).")
    REGISTRY[cls.name] = cls
    return cls


def check_plugin(cls: object, where: str) -> None:
    """Raise :class:`PluginError` unless ``cls`` keeps the plugin contract's static part."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise PluginError(f"{where} is not an algorithm plugin: it must be a subclass of prefzoo.algos.Algorithm.")
    if not isinstance(cls.__dict__.get("name"), str) or not cls.__dict__["name"]:
        raise PluginError(f"{where} has no algo= name: give its config dataclass a name (name: str = \"my_algo\") and "
                          "set config_class, or set the class attribute name = \"my_algo\".")
    if not (isinstance(cls.config_class, type) and issubclass(cls.config_class, AlgoConfig)):
        raise PluginError(f"{where}.config_class must be a dataclass subclassing prefzoo.algos.AlgoConfig.")
    if cls.declare is Algorithm.declare or cls.loss is Algorithm.loss:
        raise PluginError(f"{where} must implement declare() and loss() (see docs/adding-an-algorithm.md).")


def load_target(target: str) -> type[Algorithm]:
    """The plugin class named by an import path ``package.module:ClassName`` (or ``package.module.ClassName``),
    registered under its ``name``.

    Raises:
        ConfigError: malformed path, missing module or attribute (one line naming it).
        PluginError: the object found is not a plugin.
    """
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"algo.target={target!r}: give an import path like my_pkg.algos:MyAlgo.")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ConfigError(f"algo.target={target!r}: module {err.name!r} not found; is the package installed or on "
                          "PYTHONPATH?") from None
    except Exception as err:  # the module itself raised while it was imported: the error is in its code
        where = next((f" ({f.filename}, line {f.lineno})" for f in reversed(_traceback_frames(err))
                      if not f.filename.startswith("<")), "")
        raise ConfigError(f"algo.target={target!r}: importing module {module_name!r} failed with "
                          f"{type(err).__name__}: {err}{where}; fix the module.") from None
    try:
        cls = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"algo.target={target!r}: module {module_name!r} has no attribute {attr!r}.") from None
    check_plugin(cls, f"algo.target={target!r}")
    REGISTRY.setdefault(cls.name, cls)
    return cls


def _traceback_frames(err: BaseException) -> list:
    import traceback

    return traceback.extract_tb(err.__traceback__)


def entry_point_algorithms() -> dict[str, str]:
    """``{name: "module:Class"}`` of the algorithms installed packages declare in :data:`ENTRY_POINT_GROUP`."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def get_algorithm(name: str) -> type[Algorithm]:
    """The plugin class called ``name``: a built-in, one registered already, or an installed entry point.

    Raises:
        ConfigError: unknown name; the message lists the valid ones.
    """
    if name in REGISTRY:
        return REGISTRY[name]
    installed = entry_point_algorithms()
    if name in installed:
        cls = load_target(installed[name])
        REGISTRY[name] = cls
        return cls
    valid = sorted(set(REGISTRY) | set(installed) | {"custom"})
    raise ConfigError(f"unknown algorithm {name!r}; valid: {', '.join(valid)} "
                      "(custom: algo=custom algo.target=my_pkg.algos:MyAlgo).")


def algorithm_class(cfg: AlgoConfig) -> type[Algorithm]:
    """The plugin class of a typed algorithm config: its ``target`` (a user's plugin by import path) or its name."""
    return load_target(cfg.target) if cfg.target else get_algorithm(cfg.name)


def _load_builtin() -> None:
    for module in BUILTIN:
        importlib.import_module(f"prefzoo.algos.{module}")


_load_builtin()
