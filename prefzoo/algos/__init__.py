"""Algorithm plugins, registered by name: ``algo=<name>`` on the command line.

Adding an algorithm = one module here (a subclass of :class:`~prefzoo.algos.base.Algorithm` decorated with
:func:`register`, with its typed config) and one yaml in ``conf/algo/``. Plugins import only
:mod:`prefzoo.objective`.
"""

from __future__ import annotations

from prefzoo.algos.base import Algorithm

REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make ``cls`` available as ``algo=<cls.name>``."""
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"two algorithms are registered as {cls.name!r}")
    REGISTRY[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    """The plugin class called ``name``.

    Raises:
        KeyError: unknown name; the message lists the registered ones.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; valid: {', '.join(sorted(REGISTRY))}") from None


def _load_builtin() -> None:
    import importlib

    for module in ("dpo", "simpo", "grpo", "ppo", "rm", "bon"):
        try:
            importlib.import_module(f"prefzoo.algos.{module}")
        except ModuleNotFoundError as err:  # a plugin not written yet
            if err.name != f"prefzoo.algos.{module}":
                raise


_load_builtin()
