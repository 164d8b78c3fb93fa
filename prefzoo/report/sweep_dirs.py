"""Safe folder names for a sweep's jobs: the ``prefzoo.job_dirname`` resolver of ``hydra.sweep.subdir``.

Hydra's ``hydra.job.override_dirname`` joins a job's overrides as they were typed, so a value with a slash
(``data.path=/a/b/x.jsonl``, a config group ``+recipe/points=...``) nests the job's folder (``0-data.path=`` /
``a`` / ``b`` / ``x.jsonl``) and a report reading the folder names sees only the last one. :func:`job_dirname` does
what override_dirname does (the job's overrides sorted, without ``exclude_keys``, joined with ``kv_sep`` and
``item_sep``), keeps only the overrides of the keys the sweep varies when the sweep folder's ``multirun.yaml`` says
which (:func:`swept_keys`; ``0-algo=dpo,objective.beta=0.1``, not every constant override of the command line),
and then makes each item safe: a value that is a path becomes its last part (``data.path=x.jsonl``;
the full value stays in the job's ``.hydra/overrides.yaml`` and in the report), a group's slash a dot, and any
character other than letters, digits and ``. _ , = + - @ [ ]`` becomes ``_``. A name longer than
:data:`MAX_LENGTH` keeps whole items and says how many it left out.

``prefzoo/conf/config.yaml`` uses it as ``subdir: ${hydra.job.num}-${prefzoo.job_dirname:}``;
:func:`register_resolver` registers it (the ``prefzoo`` command does before Hydra starts, and importing
:mod:`prefzoo.commands` does, for launchers that run jobs in other processes).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from pathlib import Path

__all__ = ["MAX_LENGTH", "job_dirname", "swept_keys", "register_resolver"]

#: the longest folder name made (file systems allow 255 bytes; a shell line or a table cell far fewer)
MAX_LENGTH = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9._,=+@\[\]-]")


def _safe_item(line: str, kv_sep: str) -> str:
    key, eq, value = line.partition("=")
    key = key.replace("/", ".")
    if "/" in value or "\\" in value:  # a path: its last part
        parts = [p for p in re.split(r"[\\/]+", value) if p]
        value = parts[-1] if parts else "root"
    return _UNSAFE.sub("_", key) + (kv_sep if eq else "") + _UNSAFE.sub("_", value)


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def job_dirname(overrides: Sequence[str], exclude_keys: Sequence[str], kv_sep: str = "=", item_sep: str = ",",
                max_length: int = MAX_LENGTH, swept: Collection[str] | None = None) -> str:
    """One safe folder name for a job with these command-line ``overrides`` (see the module docstring): only
    those of the ``swept`` keys when they are known (:func:`swept_keys`), else all of them; ``"run"`` when there
    are none."""
    excluded = {k.lstrip("+~") for k in exclude_keys}
    lines = sorted(o for o in overrides if _key(o) not in excluded)
    if swept:
        lines = [o for o in lines if _key(o) in swept] or lines
    items = [_safe_item(line, kv_sep) for line in lines]
    if not items:
        return "run"
    name = item_sep.join(items)
    if len(name) <= max_length:
        return name
    kept: list[str] = []
    for i, item in enumerate(items):
        rest = f"{item_sep}and_{len(items) - i - 1}_more"
        if len(item_sep.join(kept + [item])) + len(rest) > max_length:
            break
        kept.append(item)
    left = len(items) - len(kept)
    return (item_sep.join(kept) + f"{item_sep}and_{left}_more") if kept else items[0][: max_length]


def swept_keys(multirun_yaml: Path) -> set[str]:
    """The keys a sweep varies, from the ``multirun.yaml`` Hydra's sweeper writes into the sweep folder before its
    jobs start: the command line's sweep overrides (``algo=dpo,simpo``, ``range(...)``, ``choice(...)``) and the
    keys of ``hydra.sweeper.params`` (the recipes'). Empty when the file is missing or unreadable (another sweeper),
    and then a job's name holds all its overrides."""
    try:
        import yaml
        from hydra.core.override_parser.overrides_parser import OverridesParser

        config = yaml.safe_load(Path(multirun_yaml).read_text()) or {}
        hydra = config.get("hydra") or {}
        task = list((hydra.get("overrides") or {}).get("task") or [])
        keys = {o.key_or_group.lstrip("+~") for o in OverridesParser.create().parse_overrides(task)
                if o.is_sweep_override()}
        keys |= {str(k).lstrip("+~") for k in ((hydra.get("sweeper") or {}).get("params") or {})}
        return keys
    except Exception:  # noqa: BLE001 -- a name is still made, from all the overrides
        return set()


def _resolve(*, _root_) -> str:
    """``${prefzoo.job_dirname:}``: the running job's overrides, the sweep's swept keys and
    ``hydra.job.config.override_dirname``'s settings."""
    hydra = _root_.hydra
    settings = hydra.job.config.override_dirname
    swept = swept_keys(Path(str(hydra.sweep.dir)) / "multirun.yaml")
    return job_dirname(list(hydra.overrides.task), list(settings.exclude_keys), settings.kv_sep, settings.item_sep,
                       swept=swept)


def register_resolver() -> None:
    """Register ``prefzoo.job_dirname`` with OmegaConf (once; later calls do nothing)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("prefzoo.job_dirname"):
        OmegaConf.register_new_resolver("prefzoo.job_dirname", _resolve)
