"""The names a run goes by in what it writes and in the report: the algorithm the user chose (:func:`algo_name`: its
run folder, summary.json's ``algo``, the progress bar), and what its rewards were measured on (:func:`task_name`).
Imports nothing of prefzoo: the report reads old run folders with it without loading the loop.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["algo_name", "register_algo_name_resolver", "task_name"]


def algo_name(algo) -> str:
    """The algorithm a run is named by: the ``conf/algo/`` preset the user chose (``algo.preset``: ``rpo``, the DPO
    plugin with ``loss_type=[sigmoid, sft]``), else the plugin's name (``algo.name``). ``algo``: the algorithm's config
    (a dataclass or a mapping)."""
    if isinstance(algo, Mapping):  # a saved config.yaml's, or Hydra's composed node (algo=custom's has no preset)
        return str(algo.get("preset") or algo.get("name"))
    return str(algo.preset or algo.name)


def register_algo_name_resolver() -> None:
    """Register ``${prefzoo.algo_name:}`` with OmegaConf (once): :func:`algo_name` of the composed config's ``algo``,
    for Hydra's run folder (``conf/config.yaml``: ``outputs/<date>/<time>-<algo>``)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("prefzoo.algo_name"):
        OmegaConf.register_new_resolver("prefzoo.algo_name", lambda *, _root_: algo_name(_root_.algo))


def task_name(data) -> str:
    """The run's task in a few words, from its ``data`` config (a config object or the mapping of a saved
    ``config.yaml``): the file's name for ``data.path`` (or the dataset's id), the reasoning-gym task(s) (``chain_sum``,
    ``chain_sum+basic_arithmetic``), ``arithmetic <digits>-digit <ops>`` (``words`` for word problems), else the
    data's name (``sentiment``). Two runs with different names here measure rewards on different problems: the report
    never joins them in one line (:func:`prefzoo.report.plots.plot_frontier`)."""
    get = data.get if isinstance(data, Mapping) else (lambda key: getattr(data, key, None))
    name, path = get("name"), get("path")
    if path:
        return str(path).rstrip("/").rsplit("/", 1)[-1] or str(path)
    if name == "reasoning_gym" and get("task"):
        task = get("task")
        return task if isinstance(task, str) else "+".join(map(str, task))  # one task, or a mix (a list)
    if name == "arithmetic" and get("digits") is not None:
        return f"arithmetic {get('digits')}-digit {''.join(map(str, get('ops') or []))}" + (
            " words" if get("word_problems") else "")
    return str(name)
