"""The names a run goes by in what it writes and in the report: what its rewards were measured on (:func:`task_name`).
Imports nothing of prefzoo: the report reads old run folders with it without loading the loop.
"""

from __future__ import annotations

__all__ = ["task_name"]


def task_name(data) -> str:
    """The run's task in a few words, from its ``data`` config (a config object or the mapping of a saved
    ``config.yaml``): the file's name for ``data.path`` (or the dataset's id), the reasoning-gym task(s) (``chain_sum``,
    ``chain_sum+basic_arithmetic``), ``arithmetic <digits>-digit <ops>`` (``words`` for word problems), else the
    data's name (``sentiment``). Two runs with different names here measure rewards on different problems: the report
    never joins them in one line (:func:`prefzoo.report.plots.plot_frontier`)."""
    get = data.get if isinstance(data, dict) else (lambda key: getattr(data, key, None))
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
