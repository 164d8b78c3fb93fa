"""Procedural reasoning tasks from reasoning-gym (Apache-2.0), with each task's own verifier as the reward.

``data=reasoning_gym`` (``reward=reasoning_gym`` implies it) builds prompts from one task of the
``reasoning-gym`` package (``countdown``, ``basic_arithmetic``, ``chain_sum``, ``letter_counting``, ... 100+)
or from several mixed with weights (reasoning-gym's ``composite`` dataset):

    data.task            a task name, or a list of names to mix
    data.task_config     the task's arguments to ``reasoning_gym.create_dataset``, keyed by task name
                         ({countdown: {...}, chain_sum: {...}}; entries of tasks not in data.task are ignored, so a
                         yaml may hold settings for several tasks); with one task, flat keys are its arguments too
                         (over its keyed entry): ``+data.task_config.max_terms=2``
    data.task_weights    one positive weight per task when mixing (None: equal weights)
    data.answer_format   how the model states its final answer, and so how it is read back (ANSWER_FORMATS):
                         ``tags`` (reasoning-gym's ``<answer>...</answer>``, read by its ``extract_answer``) or
                         ``number`` (the reply's last number; for tasks whose answers are numbers)
    data.system_prompt   null: the answer format's own (``tags``: reasoning-gym's ``direct`` prompt, which asks for
                         the tags; ``number``: none); a name of ``reasoning_gym.utils.SYSTEM_PROMPTS`` ("direct",
                         "default", ...); text of your own; or "" (no system message: the model's default one)
    data.seed, data.num_train, data.num_eval    the splits (``size`` and ``seed`` of create_dataset)

Splits. One dataset of the given seed is generated; the held-out split is its first ``num_eval`` entries
(indices 0 .. num_eval-1), the training split the entries from index ``num_eval`` on, skipping any whose question
text equals a held-out question. So the splits share no index and no question, and a smaller ``num_eval`` gives a
prefix of a larger one. (Two datasets of seeds s and s+1 would not do: reasoning-gym seeds entry i with
``Random(seed + i)``, so seed s+1's entry i is seed s's entry i+1.)

Rows. Each row has ``prompt`` (chat messages: the system prompt, then the task's question as the user message),
``question``, ``answer`` (the task's oracle answer, a string), ``task`` (the task that drew the row), ``task_config``
(that task's arguments, JSON text), ``entry`` (the reasoning-gym entry -- question, answer, metadata -- as JSON
text: what ``score_answer(answer, entry)`` reads), ``answer_format`` and ``answer_completion`` (the oracle answer
written in that format, e.g. ``<answer>42</answer>``: the known answer the pair builder falls back on).

Answer formats (:data:`ANSWER_FORMATS`). ``tags`` is reasoning-gym's own: the final answer between ``<answer>`` and
``</answer>``, read back by ``reasoning_gym.utils.extract_answer`` (the last such span), asked for by the ``direct``
system prompt. SmolLM2-135M-Instruct never writes the tags (0 of 32 chain_sum replies, with any of four prompts
tried, even with ``<answer>`` pre-filled), so ``number`` asks for just the number (the question, then "Reply with just
the number.", no system prompt) and reads the reply's last number, as the arithmetic task does; it is refused for a
task whose answers are not numbers (countdown's are expressions). See :mod:`prefzoo.rewards.reasoning_gym`.

Refused: ``gsm_symbolic`` (derived from a CC-BY-NC-ND data set). ``reasoning_gym`` is imported only when a task is
built (about 2 s: it imports sympy and matplotlib); it generates everything locally, no download.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import time
from numbers import Real
from typing import Any

from prefzoo.data.tasks import PLAIN_INSTRUCTION, _GeneratedTask, _check_count, _check_seed
from prefzoo.errors import ConfigError, DataError

log = logging.getLogger(__name__)

__all__ = ["REFUSED_TASKS", "ANSWER_FORMATS", "task_names", "ReasoningGymTask", "reasoning_gym_task",
           "answer_completion", "check_reward_choice", "cache_key_parts"]

#: Tasks prefzoo will not build, with why.
REFUSED_TASKS = {
    "gsm_symbolic": "its generators are derived from the GSM-Symbolic templates, licensed CC-BY-NC-ND 4.0 "
                    "(non-commercial, no derivatives); choose another task",
}
#: ``data.answer_format`` -> the default system prompt (a SYSTEM_PROMPTS name, or "" for none), the instruction
#: appended to each question, and how a known answer is written as a completion. The reward reads the answer back
#: accordingly (prefzoo.rewards.reasoning_gym.extract_answer).
ANSWER_FORMATS: dict[str, dict[str, str]] = {
    "tags": {"system_prompt": "direct", "instruction": "", "completion": "<answer>{answer}</answer>"},
    "number": {"system_prompt": "", "instruction": PLAIN_INSTRUCTION, "completion": "{answer}"},
}
_RESERVED_KEYS = {"seed": "data.seed", "size": "data.num_train / data.num_eval"}


def _registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's task name -> (dataset class, config dataclass), the package imported on first use."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as err:  # a runtime dependency; absent only in a broken install
        raise ConfigError(f"data=reasoning_gym needs the reasoning-gym package ({err}); install it with "
                          "`pip install reasoning-gym`.") from err
    return DATASETS


def task_names() -> list[str]:
    """The reasoning-gym tasks prefzoo builds (all registered ones but ``composite`` and :data:`REFUSED_TASKS`)."""
    return sorted(n for n in _registry() if n != "composite" and n not in REFUSED_TASKS)


def check_task_name(name: Any, key: str = "data.task") -> str:
    """``name`` if it is a reasoning-gym task prefzoo builds.

    Raises:
        ConfigError: a refused task (one line saying why), or an unknown one (with the closest names).
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{key}={name!r} is not a task name; give one, e.g. {key}=chain_sum.")
    if name in REFUSED_TASKS:
        raise ConfigError(f"{key}={name}: prefzoo does not use this task: {REFUSED_TASKS[name]}.")
    names = task_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else f"there are {len(names)}, e.g. {', '.join(names[:8])}, ..."
        raise ConfigError(f"{key}={name!r} is not a reasoning-gym task; {hint} (reasoning_gym.factory.DATASETS "
                          "lists them all)")
    return name


def _plain(value: Any) -> Any:
    """An OmegaConf container as plain dicts and lists (typed configs hold plain ones already)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def check_task_config(name: str, config: Any, key: str = "data.task_config") -> dict[str, Any]:
    """The arguments of task ``name``, checked against its config dataclass (names) and its own ``validate``
    (values).

    Raises:
        ConfigError: not a dict; ``seed`` or ``size`` (set by data.seed, data.num_train, data.num_eval); a key the
            task's config does not have (the message lists those it has); a value its ``validate`` rejects.
    """
    import dataclasses

    config = _plain(config) if config is not None else {}
    if not isinstance(config, dict):
        raise ConfigError(f"{key}={config!r} must be a dict of task {name!r}'s arguments, e.g. {key}={{max_terms: 2}}.")
    for k in config:
        if k in _RESERVED_KEYS:
            raise ConfigError(f"{key}.{k}={config[k]!r}: prefzoo sets the {k} of task {name!r} from "
                              f"{_RESERVED_KEYS[k]}; set those instead.")
    config_cls = _registry()[name][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in _RESERVED_KEYS]
    for k, v in config.items():
        if k not in fields:
            close = difflib.get_close_matches(str(k), fields, n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"{key}.{k}={v!r}: task {name!r} has no setting {k!r}{hint}; its settings are: "
                              f"{', '.join(fields)}.")
    try:
        made = config_cls(**config)
        if hasattr(made, "validate"):
            made.validate()
    except (AssertionError, ValueError, TypeError) as err:
        raise ConfigError(f"{key}={json.dumps(config)} is not valid for task {name!r}: "
                          f"{err or type(err).__name__}.") from None
    return config


def _tasks_and_configs(task: Any, task_config: Any, weights: Any) -> tuple[list[str], list[dict], list[float]]:
    """(names, configs, weights) of ``data.task`` / ``data.task_config`` / ``data.task_weights``, checked."""
    task, task_config, weights = _plain(task), _plain(task_config), _plain(weights)
    if task is None:
        raise ConfigError("data=reasoning_gym needs data.task=<name> (e.g. data.task=chain_sum) or a list of tasks to "
                          "mix (data.task=[chain_sum,letter_counting]).")
    names = [task] if isinstance(task, str) else task
    if not isinstance(names, list) or not names:
        raise ConfigError(f"data.task={task!r} must be a task name or a non-empty list of them.")
    names = [check_task_name(n, "data.task" if isinstance(task, str) else f"data.task[{i}]") for i, n in enumerate(names)]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"data.task={names} names {', '.join(repeated)} more than once; give each task once and "
                          "weigh it with data.task_weights.")
    if weights is None:
        weights = [1.0] * len(names)
    if not isinstance(weights, list) or len(weights) != len(names):
        raise ConfigError(f"data.task_weights={weights!r} does not match data.task={names}: give one weight per task "
                          f"({len(names)}), e.g. data.task_weights=[{','.join(['1'] * len(names))}].")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, Real) or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"data.task_weights[{i}]={w!r} (task {names[i]!r}) must be a positive number.")
    task_config = task_config if task_config is not None else {}
    if not isinstance(task_config, dict):
        raise ConfigError(f"data.task_config={task_config!r} must be a dict (the task's arguments, or a dict keyed by "
                          "task name).")
    per_task = {k: v for k, v in task_config.items() if k in _registry() and isinstance(v, dict)}
    flat = {k: v for k, v in task_config.items() if k not in per_task}
    for k in per_task:
        check_task_name(k, f"data.task_config.{k}")
    if flat and len(names) > 1:
        k = next(iter(flat))
        raise ConfigError(f"data.task_config.{k}={flat[k]!r}: with several tasks (data.task={names}), data.task_config "
                          "is keyed by task name, e.g. data.task_config.chain_sum.max_terms=2.")
    configs = []
    for n in names:
        own = check_task_config(n, per_task.get(n, {}), f"data.task_config.{n}")
        if len(names) == 1 and flat:  # a flat dict: the one task's arguments, over its keyed entry
            own = {**own, **check_task_config(n, flat, "data.task_config")}
        configs.append(own)
    return names, configs, [float(w) for w in weights]


def check_answer_format(answer_format: Any) -> str:
    if answer_format not in ANSWER_FORMATS:
        raise ConfigError(f"data.answer_format={answer_format!r} is not an answer format; choose one of: "
                          f"{', '.join(ANSWER_FORMATS)}.")
    return answer_format


def _system_prompt(system_prompt: str | None, answer_format: str) -> str | None:
    if system_prompt is None:
        system_prompt = ANSWER_FORMATS[answer_format]["system_prompt"]
    if not system_prompt:
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    check_system_prompt(system_prompt)
    return SYSTEM_PROMPTS.get(system_prompt, system_prompt)


def check_system_prompt(system_prompt: str | None) -> None:
    """``data.system_prompt`` is null, "" (none), a name of reasoning-gym's ``SYSTEM_PROMPTS``, or a prompt's text.
    A single word that is not a name (``direkt``) is a misspelt name, not a prompt: refused, so that it does not
    become the system message of every training prompt.

    Raises:
        ConfigError: naming the key, its value and the valid names.
    """
    import re

    from reasoning_gym.utils import SYSTEM_PROMPTS

    if system_prompt and system_prompt not in SYSTEM_PROMPTS and re.fullmatch(r"[A-Za-z_][\w-]*", system_prompt):
        raise ConfigError(f"data.system_prompt={system_prompt!r} is not a name of reasoning-gym's system prompts "
                          f"({', '.join(SYSTEM_PROMPTS)}); give one of those names, a prompt's own text (a sentence), "
                          "or data.system_prompt=null for the answer format's own.")


def answer_completion(answer: Any, answer_format: str = "tags") -> str:
    """The oracle ``answer`` written as a completion in ``answer_format`` (:data:`ANSWER_FORMATS`)."""
    return ANSWER_FORMATS[answer_format]["completion"].format(answer=answer)


def _entry_json(entry: dict, where: str) -> str:
    try:
        return json.dumps(entry)
    except (TypeError, ValueError) as err:
        raise DataError(f"{where}: the reasoning-gym entry cannot travel as a JSON column ({err}); this task is not "
                        "supported, choose another.") from None


class ReasoningGymTask(_GeneratedTask):
    """Prompts of one reasoning-gym task, or of several mixed, with disjoint train and held-out splits.

    Args:
        task: a task name, or a list of them (then mixed with reasoning-gym's composite dataset).
        task_config: the task's arguments (a dict), or a dict keyed by task name (see the module docstring).
        weights: one positive weight per task (None: equal); a row's task is drawn with probability
            weight / sum(weights), independently per row (the composite dataset's ``rng.choices``).
        num_train, num_eval, seed: the splits (module docstring).
        answer_format: ``"tags"`` or ``"number"`` (:data:`ANSWER_FORMATS`).
        system_prompt: None (the answer format's own), a ``reasoning_gym.utils.SYSTEM_PROMPTS`` name, text, or ""
            (no system message).

    Raises:
        ConfigError: an unknown or refused task, a bad config key or value, weights not matching the tasks, an
            unknown answer format (or ``number`` for a task whose answers are not numbers), or a task with too few
            distinct questions for the splits.
    """

    name = "reasoning_gym"
    columns = ("prompt", "question", "answer", "task", "task_config", "entry", "answer_format", "answer_completion")

    def __init__(self, task: Any, task_config: Any = None, weights: Any = None, num_train: int = 2000,
                 num_eval: int = 200, seed: int = 0, answer_format: str = "tags",
                 system_prompt: str | None = None) -> None:
        self.tasks, self.configs, self.weights = _tasks_and_configs(task, task_config, weights)
        self.num_train = _check_count("num_train", num_train)
        self.num_eval = _check_count("num_eval", num_eval)
        self.seed = _check_seed(seed)
        self.answer_format = check_answer_format(answer_format)
        self.system_prompt = _system_prompt(system_prompt, answer_format)
        self.instruction = ANSWER_FORMATS[answer_format]["instruction"]
        config_of = {n: json.dumps(c, sort_keys=True) for n, c in zip(self.tasks, self.configs)}
        budget = num_eval + 2 * num_train + 16  # indices drawn at most: room to skip questions held out
        start = time.perf_counter()
        dataset = self._dataset(budget)
        self._eval = [self._row(dataset[i], config_of, i) for i in range(num_eval)]
        held_out = {row["question"] for row in self._eval}
        self._train, index = [], num_eval
        while len(self._train) < num_train:
            if index >= budget:
                raise ConfigError(f"{self!r}: among {budget - num_eval} entries after the held-out ones only "
                                  f"{len(self._train)} ask a question not held out, fewer than data.num_train="
                                  f"{num_train}; the task has few distinct questions: widen its data.task_config, or "
                                  "lower data.num_train / data.num_eval.")
            entry = dataset[index]
            if entry["question"] not in held_out:
                self._train.append(self._row(entry, config_of, index))
            index += 1
        self._check_numeric(self._eval + self._train)
        seconds = time.perf_counter() - start
        (log.info if seconds > 5 else log.debug)("reasoning-gym %s: %d train + %d held-out problems in %.1f s",
                                                 "+".join(self.tasks), num_train, num_eval, seconds)

    def _dataset(self, size: int):
        import reasoning_gym

        if len(self.tasks) == 1:
            return reasoning_gym.create_dataset(self.tasks[0], seed=self.seed, size=size, **self.configs[0])
        from reasoning_gym.composite import DatasetSpec

        specs = [DatasetSpec(name=n, weight=w, config=dict(c)) for n, w, c in zip(self.tasks, self.weights, self.configs)]
        return reasoning_gym.create_dataset("composite", seed=self.seed, size=size, datasets=specs)

    def _row(self, entry: dict, config_of: dict[str, str], index: int) -> dict[str, Any]:
        task = entry.get("metadata", {}).get("source_dataset", self.tasks[0])
        if task not in config_of:  # (a composite entry names the task that drew it)
            task = self.tasks[0]
        content = entry["question"]
        if self.instruction:  # on a line of its own after a question of several lines, else after a space
            content = content.rstrip()
            content += ("\n" if "\n" in content else " ") + self.instruction
        messages = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return {"prompt": messages, "question": entry["question"], "answer": str(entry["answer"]), "task": task,
                "task_config": config_of[task], "entry": _entry_json(entry, f"task {task!r}, entry {index}"),
                "answer_format": self.answer_format,
                "answer_completion": answer_completion(entry["answer"], self.answer_format)}

    def _check_numeric(self, rows: list[dict]) -> None:
        """``number`` reads the reply's last number: refuse it for a task whose answers are not numbers."""
        if self.answer_format != "number":
            return
        from prefzoo.text import NUMBER_PATTERN

        for row in rows:
            if not NUMBER_PATTERN.fullmatch(row["answer"].strip()):
                raise ConfigError(f"data.answer_format=number: task {row['task']!r} answers {row['answer']!r}, not a "
                                  "number; use data.answer_format=tags for it.")

    def __repr__(self) -> str:
        task = self.tasks[0] if len(self.tasks) == 1 else self.tasks
        return (f"ReasoningGymTask(task={task!r}, weights={self.weights}, num_train={self.num_train}, "
                f"num_eval={self.num_eval}, seed={self.seed})")


def reasoning_gym_task(data) -> ReasoningGymTask:
    """The task of a ``DataConfig`` (``data.task``, ``data.task_config``, ``data.task_weights``, ``data.seed``,
    ``data.num_train``, ``data.num_eval``, ``data.answer_format``, ``data.system_prompt``)."""
    return ReasoningGymTask(data.task, data.task_config, data.task_weights, num_train=data.num_train,
                            num_eval=data.num_eval, seed=data.seed, answer_format=data.answer_format,
                            system_prompt=data.system_prompt)


def check_reward_choice(data_name: str, reward_name: str) -> None:
    """``data=reasoning_gym`` is scored by the tasks' verifiers, ``reward=reasoning_gym`` (whose functions may be
    changed); the default ``reward=arithmetic`` would read the last number of a reply instead.

    Raises:
        ConfigError: data=reasoning_gym with reward=arithmetic.
    """
    if data_name == "reasoning_gym" and reward_name == "arithmetic":
        raise ConfigError("data=reasoning_gym with reward=arithmetic: the tasks are scored by their own verifiers; "
                          "choose reward=reasoning_gym (it implies data=reasoning_gym).")


def cache_key_parts(data) -> dict[str, Any]:
    """What of a ``DataConfig`` fixes a reasoning-gym task's prompts, for cache keys (the on-policy pairs): the
    task(s), their config(s) and weights, the system prompt and the reasoning-gym version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        rg_version = version("reasoning-gym")
    except PackageNotFoundError:
        rg_version = None
    return {"task": _plain(data.task), "task_config": _plain(data.task_config), "task_weights": _plain(data.task_weights),
            "answer_format": data.answer_format, "system_prompt": data.system_prompt, "reasoning_gym": rg_version}
