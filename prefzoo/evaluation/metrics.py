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


#: The shifted task's metrics (``eval.ood``, :mod:`prefzoo.evaluation.ood`) are these under ``OOD_PREFIX + name``
#: (``ood_task_accuracy``, ``ood_distinct_2``, ...): the task and sampled metrics, no preference accuracy or pass@k.
OOD_PREFIX = "ood_"
OOD_METRICS = tuple(n for n in WITH_SE + WITHOUT_SE if n != "preference_accuracy")


def metric_names(num_samples: int = 0, ood: bool = False) -> list[str]:
    """Every numeric metric an evaluation can report (``pass_at_<num_samples>`` when ``num_samples > 1``; the shifted
    task's ``ood_*`` when ``ood``)."""
    names = list(WITH_SE) + list(WITHOUT_SE) + ([f"pass_at_{num_samples}"] if num_samples > 1 else [])
    names += [OOD_PREFIX + n for n in OOD_METRICS] if ood else []
    with_se = set(WITH_SE) | {OOD_PREFIX + n for n in WITH_SE}
    return names + [f"{n}_se" for n in names if n in with_se or n.startswith("pass_at_")]
