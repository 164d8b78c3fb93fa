"""The names of the held-out evaluation's metrics (:mod:`prefzoo.evaluation.evaluate`), without importing it:
the configuration checks ``trainer.early_stopping.metric`` against them before anything loads.

Which of them a run reports depends on the run (``task_accuracy`` needs an ``answer`` column, ``kl_*`` a
reference, ``preference_accuracy`` held-out pairs, ``pass_at_<k>`` an online algorithm with k samples per
prompt); the evaluation's docstring says when each is there.
"""

from __future__ import annotations

#: Metrics with a standard error ``<name>_se`` next to them.
WITH_SE = ("task_reward", "task_accuracy", "gold_task_reward", "sample_reward", "gold_sample_reward", "kl_k1",
           "kl_k3", "preference_accuracy")
#: Metrics without one.
WITHOUT_SE = ("entropy", "distinct_1", "distinct_2", "completion_length", "max_repeat")


def metric_names(group_size: int = 0) -> list[str]:
    """Every numeric metric an evaluation can report (``pass_at_<group_size>`` when ``group_size > 1``)."""
    names = list(WITH_SE) + list(WITHOUT_SE) + ([f"pass_at_{group_size}"] if group_size > 1 else [])
    return names + [f"{n}_se" for n in names if n in WITH_SE or n.startswith("pass_at_")]
