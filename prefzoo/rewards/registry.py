"""Finding reward functions by name, and combining several into one checked, weighted reward.

A reward function is a plain callable

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

called on a batch of B samples: ``prompts[i]`` is the prompt text of sample i, ``completions[i]`` the
generated text, and each column (``answer=[...]``, ``subject=[...]``) a list of B values aligned with
them. It returns B finite floats, one per completion (higher is better). A function ignores the
columns it does not need through ``**_``.

:class:`CombinedReward` is what a trainer calls: it resolves the functions, calls each one, checks
what came back, remembers each function's scores in ``last_components`` (for per-function metrics)
and returns the weighted sum ``r_i = sum_j w_j * r_j(x_i, y_i)``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

from prefzoo.errors import ConfigError, DataError, RewardError, describe_error, is_interrupt
from prefzoo.rewards.arithmetic import correctness, format_reward

log = logging.getLogger(__name__)
from prefzoo.rewards.reasoning_gym import reasoning_gym, reasoning_gym_accuracy
from prefzoo.rewards.sentiment import fluent_sentiment, sentiment

__all__ = ["RewardFn", "BUILTIN_REWARDS", "resolve_reward", "reward_name", "check_reward_signature", "CombinedReward",
           "make_reward"]

RewardFn = Callable[..., list[float]]

#: Built-in reward names -> functions.
BUILTIN_REWARDS: dict[str, RewardFn] = {
    "correctness": correctness,
    "format": format_reward,
    "sentiment": sentiment,
    "fluent_sentiment": fluent_sentiment,
    "reasoning_gym": reasoning_gym,
    "reasoning_gym_accuracy": reasoning_gym_accuracy,
}

_PREVIEW_CHARS = 80


def _preview(text: Any) -> str:
    text = str(text)
    if len(text) > _PREVIEW_CHARS:
        text = text[: _PREVIEW_CHARS - 3] + "..."
    return repr(text)


def _import_reward(spec: str) -> RewardFn:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ConfigError(
            f"bad reward import path {spec!r}; write it as 'package.module:function'."
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ModuleNotFoundError, or an error raised while the module runs
        raise ConfigError(
            f"reward {spec!r}: could not import module {module_name!r} ({type(err).__name__}: {err}); "
            f"check the module path and that its package is installed or on PYTHONPATH."
        ) from err
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"reward {spec!r}: module {module_name!r} has no attribute {attr_path!r}; check the name "
                f"after the ':'."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(
            f"reward {spec!r}: {attr_path!r} is not callable (it is {type(obj).__name__} {obj!r}); point "
            f"the path at a function fn(prompts, completions, **columns) -> list[float]."
        )
    return obj


def resolve_reward(spec: str | RewardFn) -> RewardFn:
    """The reward function named by ``spec``.

    Args:
        spec: a built-in name (``"correctness"``, ``"format"``, ``"sentiment"``, ``"reasoning_gym"``), an import path
            ``"package.module:function"`` (the attribute may be dotted, ``"mod:Class.method"``), or a
            callable (returned as is).

    Raises:
        ConfigError: an unknown name; an import path whose module cannot be imported, whose
            attribute is missing, or which names something not callable; a spec of another type.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(
            f"a reward must be a name, an import path 'package.module:function' or a callable; "
            f"got {type(spec).__name__} {spec!r}."
        )
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" in spec:
        return _import_reward(spec)
    raise ConfigError(
        f"unknown reward {spec!r}; built-in rewards are {sorted(BUILTIN_REWARDS)}, or give an import "
        f"path 'package.module:function'."
    )


_CALL = "fn(prompts, completions, **columns) -> list[float]"
_TRL_CALL = "or, as TRL calls them, with keywords prompts=, completions=, completion_ids= and every column"


def check_reward_signature(spec: str | RewardFn, fn: RewardFn, columns: Sequence[str] | None = None) -> None:
    """Check, without calling it, that ``fn`` can be called in prefzoo's positional form
    ``fn(prompts, completions, **columns)`` or TRL's keyword form (:mod:`prefzoo.rewards.protocol`).

    Args:
        spec: how the function was named (for the message).
        columns: the data's column names, passed as keywords; None checks only the shape (a required parameter
            after prompts and completions may still be filled by a column).

    Raises:
        ConfigError: ``fn`` takes neither form (e.g. one positional argument and no ``**kwargs``), or (with
            ``columns``) cannot take these columns (an unexpected one, or a required one missing).
    """
    from prefzoo.rewards.protocol import bind_error, keyword_shape, positional_shape

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without an introspectable signature: nothing to check
        return
    name = spec if isinstance(spec, str) else reward_name(spec)
    if not (positional_shape(sig) or keyword_shape(sig)):
        raise ConfigError(f"reward {name!r} has the signature {sig}, but a reward function is called as {_CALL} "
                          f"({_TRL_CALL}); give it (prompts, completions, **columns) or (completions, **kwargs) "
                          "parameters.")
    if columns is None:
        return
    err = bind_error(sig, list(columns))
    if err is not None:
        hint = ("add **columns (or **_) to its parameters for the columns it does not use"
                if "unexpected keyword" in str(err) else "give the data that column, or drop the reward")
        raise ConfigError(f"reward {name!r} {sig} cannot be called with this data's columns "
                          f"[{', '.join(columns)}] ({err}); it is called as {_CALL}: {hint} ({_TRL_CALL} "
                          "works too: fn(completions, **kwargs)).") from None


def reward_name(spec: str | RewardFn) -> str:
    """A short name for ``spec``, used as its key in ``CombinedReward.last_components`` and in metrics.

    A built-in name stays as it is; an import path gives its last attribute ("pkg.mod:fn" -> "fn");
    a callable gives its ``__name__`` (a ``functools.partial`` the wrapped function's, any other
    object its class name).
    """
    if isinstance(spec, str):
        return spec.rpartition(":")[2].rpartition(".")[2] if ":" in spec else spec
    while isinstance(spec, functools.partial):
        spec = spec.func
    return getattr(spec, "__name__", type(spec).__name__)


class CombinedReward:
    """A weighted sum of reward functions, with every output checked.

    Args:
        functions: non-empty list of reward specs (see :func:`resolve_reward`).
        weights: one finite weight per function; None weighs each by 1.0.

    Attributes:
        names: one name per function (:func:`reward_name`; repeats get a suffix "_2", "_3", ...).
        weights: the weights, as floats.
        last_components: name -> the B raw scores that function returned on the last call.

    Calling it as ``reward(prompts, completions, **columns)`` returns B floats,
    ``sum_j weights[j] * scores_j[i]``. Every function is called, also one with weight 0 (so its
    metric is still recorded).

    Raises:
        ConfigError: (on construction) an empty or non-list ``functions``, an unresolvable spec, a
            ``weights`` list of another length, or a weight that is not a finite number.
        DataError: (on call) ``prompts``, ``completions`` or a list column differ in length.
        RewardError: (on call) a function raised (chained), returned a wrong number of scores, or
            returned a score that is not a finite number; the message names the function and, for a
            bad score, the sample index and its completion (first 80 characters).
    """

    def __init__(self, functions: Sequence[str | RewardFn], weights: Sequence[float] | None = None) -> None:
        if isinstance(functions, str) or callable(functions) or not isinstance(functions, Sequence):
            raise ConfigError(
                f"functions must be a list of reward specs, got {functions!r}; wrap a single one in a list."
            )
        if len(functions) == 0:
            raise ConfigError(
                f"functions is empty; give at least one reward, e.g. {sorted(BUILTIN_REWARDS)[0]!r}."
            )
        self.functions = [resolve_reward(spec) for spec in functions]
        self.names = self._unique_names([reward_name(spec) for spec in functions])
        if weights is None:
            weights = [1.0] * len(self.functions)
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
            raise ConfigError(f"weights must be a list of numbers, got {weights!r}.")
        if len(weights) != len(self.functions):
            raise ConfigError(
                f"got {len(weights)} weights for {len(self.functions)} reward functions {self.names}; "
                f"give one weight per function, or none for equal weights of 1.0."
            )
        for name, weight in zip(self.names, weights):
            if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight):
                raise ConfigError(f"the weight of reward {name!r} is {weight!r}; use a finite number.")
        self.weights = [float(w) for w in weights]
        self.last_components: dict[str, list[float | None]] = {}
        self.last_missing: dict[str, int] = {}  # name -> samples it returned None for on the last call
        self.num_calls = 0
        self.warned_unscored = False  # the once-per-run warning that some samples got None from every function
        self._styles: dict[tuple, str | None] = {}  # (function index, column names) -> call style, found once

    @staticmethod
    def _unique_names(names: list[str]) -> list[str]:
        seen: dict[str, int] = {}
        unique = []
        for name in names:
            seen[name] = seen.get(name, 0) + 1
            unique.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
        return unique

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
        from prefzoo.rewards.protocol import COMPLETION_IDS, COMPLETION_MESSAGES, ENVIRONMENTS, PROMPT_MESSAGES

        messages = columns.pop(PROMPT_MESSAGES, None)  # conversational prompts: TRL-style functions get messages
        completion_ids = columns.pop(COMPLETION_IDS, None)
        conversations = columns.pop(COMPLETION_MESSAGES, None)  # multi-turn episodes: the whole conversation ...
        environments = columns.pop(ENVIRONMENTS, None)  # ... and the environment that played it (TRL's environments=)
        batch = len(completions)
        if len(prompts) != batch:
            raise DataError(
                f"got {len(prompts)} prompts but {batch} completions; pass one prompt per completion "
                f"(repeat a prompt for each of its samples)."
            )
        for key, column in columns.items():
            if isinstance(column, (list, tuple)) and len(column) != batch:
                raise DataError(
                    f"column {key!r} has {len(column)} values but there are {batch} completions; "
                    f"columns must be aligned with the completions (one value per sample)."
                )
        self.num_calls += 1
        components = {}
        for j, (name, fn) in enumerate(zip(self.names, self.functions)):
            components[name] = self._call_one(j, name, fn, prompts, completions, columns, messages, completion_ids,
                                              conversations, environments)
        self.last_components = components
        self.last_missing = {name: sum(s is None for s in scores) for name, scores in components.items()}
        unscored = sum(all(components[name][i] is None for name in self.names) for i in range(batch))
        if unscored and not self.warned_unscored:  # TRL warns alike: those samples get reward 0, silently otherwise
            self.warned_unscored = True
            log.warning("every reward function (%s) returned None for %d of the %d samples of this batch: None means "
                        "'does not apply to this sample' (TRL's convention), so they get reward 0. Check that each "
                        "function returns a number for the samples it applies to (warned once per run).",
                        ", ".join(self.names), unscored, batch)
        totals = [0.0] * batch
        for name, weight in zip(self.names, self.weights):
            for i, score in enumerate(components[name]):
                if score is not None:  # missing (the function does not apply to this sample): left out, as in TRL
                    totals[i] += weight * score
        return totals

    def probe(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> None:
        """Call every function once, every output checked as in a real call, leaving the run's state (call count,
        last components, the once-per-run warning) as it was: the check before training on placeholder completions.

        Raises:
            RewardError: as a call does (a function raised, returned the wrong number of scores, a non-number or a
                non-finite score), the message saying that this was the check before training.
        """
        state = (self.num_calls, self.last_components, self.last_missing, self.warned_unscored)
        self.warned_unscored = True  # placeholders say nothing about the run's own samples
        try:
            self(prompts, completions, **columns)
        except RewardError as err:
            raise RewardError(f"the reward, called once before training on {len(completions)} training prompts with "
                              f"the placeholder completion {_preview(completions[0])}: {err}") from err
        finally:
            self.num_calls, self.last_components, self.last_missing, self.warned_unscored = state

    def _call_one(self, j, name, fn, prompts, completions, columns, messages=None,
                  completion_ids=None, conversations=None, environments=None) -> list[float | None]:
        from prefzoo.rewards.protocol import KEYWORD, call_style, keyword_arguments

        batch = len(completions)
        where = f"on call {self.num_calls}, a batch of {batch} samples"
        key = (j, tuple(columns))
        if key not in self._styles:
            self._styles[key] = call_style(fn, tuple(columns))
        try:
            if self._styles[key] == KEYWORD:
                scores = fn(**keyword_arguments(fn, prompts, completions, columns, messages, completion_ids,
                                                conversations, environments))
            else:  # prefzoo's positional form (and anything else: its TypeError names what is wrong)
                scores = fn(list(prompts), list(completions), **columns)
        except BaseException as err:  # SystemExit included: the function's error, never the run's silent end
            if is_interrupt(err):
                raise
            first = f" starting with completion {_preview(completions[0])}" if batch else ""
            raise RewardError(
                f"reward function {name!r} raised {describe_error(err)} ({where}{first}); "
                f"fix the function or remove it from the reward list."
            ) from err
        if hasattr(scores, "tolist"):  # numpy array or torch tensor
            scores = scores.tolist()
        if not isinstance(scores, (list, tuple)):
            raise RewardError(
                f"reward function {name!r} returned a {type(scores).__name__} ({where}); it must return a "
                f"list of {batch} floats, one per completion."
            )
        if len(scores) != batch:
            raise RewardError(
                f"reward function {name!r} returned {len(scores)} scores, expected {batch} (one per "
                f"completion, {where}); return exactly one float per completion."
            )
        checked = []
        for i, score in enumerate(scores):
            if score is None:  # TRL's convention: the function does not apply to this sample
                checked.append(None)
                continue
            if isinstance(score, Real) and math.isfinite(score):
                checked.append(float(score))
                continue
            problem = "a non-finite value" if isinstance(score, Real) else f"a non-number ({type(score).__name__})"
            raise RewardError(
                f"reward function {name!r} returned {problem} {score!r} for sample {i} ({where}), "
                f"completion {_preview(completions[i])}; every score must be a finite float (or None where the "
                f"function does not apply)."
            )
        return checked

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}*{w:g}" for n, w in zip(self.names, self.weights))
        return f"CombinedReward({parts})"


def make_reward(
    functions: Sequence[str | RewardFn] | str | RewardFn, weights: Sequence[float] | None = None
) -> CombinedReward:
    """A :class:`CombinedReward` of ``functions`` (a single spec is taken as a list of one).

    Raises:
        ConfigError: as :class:`CombinedReward`.
    """
    if isinstance(functions, str) or callable(functions):
        functions = [functions]
    return CombinedReward(functions, weights)
