"""The out-of-distribution half of the held-out evaluation (``eval.ood``; Kirk et al. 2024).

Kirk et al. 2024 ("Understanding the effects of RLHF on LLM generalisation and diversity") compare fine-tuning
methods on two axes at once: how well the policy does on a test distribution SHIFTED from its training one, and how
diverse its outputs are. :class:`OODEvaluator` runs the shared evaluation
(:class:`~prefzoo.evaluation.evaluate.Evaluator`) a second time, with the same policy, rewards, sampling settings and
seed, on the shifted task's prompts (:mod:`prefzoo.data.ood`: problems that share no fact with training), and
returns its metrics under ``ood_<name>`` (:data:`~prefzoo.evaluation.metrics.OOD_PREFIX`), next to the
in-distribution ones of the same evaluation:

    task_accuracy  <->  ood_task_accuracy      (greedy answers, exact match, + _se)
    distinct_2     <->  ood_distinct_2         (temperature-1 samples of the same prompt)
    entropy, kl_k1, sample_reward, completion_length, ...  <->  ood_entropy, ood_kl_k1, ...

``ood_n_problems`` counts the shifted problems and ``ood_task`` says what they ask; pass@k and preference accuracy are in-distribution only (no
shifted preference pairs; pass@k would double the sampling of online runs).
"""

from __future__ import annotations

import copy

from prefzoo.evaluation.evaluate import Evaluator
from prefzoo.evaluation.metrics import OOD_PREFIX

__all__ = ["OODEvaluator", "build_ood_evaluator", "OOD_RESULTS"]

#: ``summary.json``'s ``results`` keys of the shifted task -> the evaluation key each reads, named as the
#: in-distribution ones there (``reward`` <- ``task_reward``, ``kl`` <- ``kl_k1``); None in a run without ``eval.ood``.
OOD_RESULTS = {"ood_reward": "ood_task_reward", "ood_reward_se": "ood_task_reward_se",
               "ood_task_accuracy": "ood_task_accuracy", "ood_task_accuracy_se": "ood_task_accuracy_se",
               "ood_sample_reward": "ood_sample_reward", "ood_kl": "ood_kl_k1", "ood_entropy": "ood_entropy",
               "ood_distinct_1": "ood_distinct_1", "ood_distinct_2": "ood_distinct_2",
               "ood_completion_length": "ood_completion_length"}


class OODEvaluator:
    """The evaluation of ``main``'s policy on ``prompts`` (the shifted task), keys prefixed ``ood_``.

    Args:
        main: the run's in-distribution evaluator; its policy, reward, gold reward, seed and progress are reused.
        prompts: the shifted task's prompts (:class:`~prefzoo.data.prompts.PromptSet`, with an ``answer`` column).
        eval_cfg: the ``eval`` config; ``num_problems`` is taken as ``len(prompts)``.
        correctness_fn: exact match for ``ood_task_accuracy``.
        task: a few words saying what the shifted task asks (``ood_task``, e.g. "3-digit +, - (plain questions)").
    """

    def __init__(self, main: Evaluator, prompts, eval_cfg, correctness_fn, task: str = ""):
        self.task = task
        cfg = copy.copy(eval_cfg)
        cfg.num_problems = len(prompts)
        self.evaluator = Evaluator(main.policy, main.reward_fn, prompts, cfg, correctness_fn=correctness_fn,
                                   num_samples=0, seed=main.seed, progress=main.progress,
                                   gold_reward_fn=main.gold_reward_fn)

    def run(self) -> dict:
        """The shifted task's metrics, each key ``ood_<key of Evaluator.run>``, and ``ood_task``: what it asks."""
        return {OOD_PREFIX + "task": self.task, **{OOD_PREFIX + k: v for k, v in self.evaluator.run().items()}}


def build_ood_evaluator(cfg, main: Evaluator, tokenizer) -> OODEvaluator | None:
    """The run's :class:`OODEvaluator`, or None when ``eval.ood`` sets no shift (checked again: the config's
    validation already raised on a bad one).

    Raises:
        ConfigError: a bad ``eval.ood`` (:func:`prefzoo.data.ood.check_ood`).
        DataError: a shifted prompt longer than ``data.max_prompt_length`` tokens.
    """
    from prefzoo.data.ood import check_ood, ood_task
    from prefzoo.data.prompts import tokenize_prompts
    from prefzoo.rewards.arithmetic import correctness

    settings = check_ood(cfg.data, cfg.eval.ood, cfg.eval.num_problems)
    if settings is None:
        return None
    task = ood_task(settings)
    prompts = tokenize_prompts(task.to_dataset("eval"), tokenizer, cfg.data.max_prompt_length, "error",
                               f"the shifted task (eval.ood: {task!r})")
    return OODEvaluator(main, prompts, cfg.eval, correctness, describe(settings))


def describe(settings) -> str:
    """The shifted task in a few words: ``"3-digit +, - (plain questions)"``."""
    form = "word problems" if settings.word_problems else "plain questions"
    return f"{settings.digits}-digit {', '.join(settings.ops)} ({form})"
