"""The shifted held-out task of the out-of-distribution evaluation (``eval.ood``).

Kirk et al. 2024 ("Understanding the effects of RLHF on LLM generalisation and diversity", ICLR 2024) train on
one distribution and test on a shifted one as well: RLHF generalises better out of distribution than SFT while it
lowers the diversity of the outputs. Here the training distribution is the built-in arithmetic task
(:class:`~prefzoo.data.tasks.ArithmeticTask` with ``data.digits``, ``data.ops``, ``data.word_problems``); the
shifted one is the same generator with some of those settings changed: ``eval.ood.digits``, ``eval.ood.ops``,
``eval.ood.word_problems`` (null: the training task's value), ``eval.ood.num_problems`` of them (null:
``eval.num_problems``). E.g. train on two-digit sums and evaluate also on three-digit sums and differences::

    eval.ood.digits=3 'eval.ood.ops=[+,-]'

**Disjoint from training by construction.** A problem is one arithmetic fact: an operator and its two operands,
both with the same number of digits. The training task only ever draws facts whose operator is in ``data.ops`` and
whose operands have ``data.digits`` digits (its support: the train split and the in-distribution held-out split
both lie in it). A shift must leave that support entirely, in one of two ways:

* ``eval.ood.digits != data.digits``: every operand of a shifted problem lies in [10**(d-1), 10**d - 1] for
  another d, a range disjoint from the training operands' (two digits: 10..99; three: 100..999);
* or every operator of ``eval.ood.ops`` is outside ``data.ops``: no shifted problem uses an operator that training
  asks.

So no shifted problem is a training (or in-distribution held-out) problem, whatever the seeds and the split sizes;
:func:`check_ood` refuses a shift that would draw facts of the training support (same digits and an operator in
common, or only the wording changed with ``eval.ood.word_problems``: the same facts told as stories).

**Deterministic.** The shifted problems are ``ArithmeticTask(digits, ops, num_train=0, num_eval=num_problems,
seed=data.seed, word_problems)``'s held-out split: drawn with ``random.Random(data.seed)`` alone, so the same
settings give the same problems on every machine and Python run, and fewer problems give a prefix of more.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefzoo.data.tasks import _MAX_DIGITS, ARITHMETIC_OPS, ArithmeticTask
from prefzoo.errors import ConfigError

__all__ = ["OODTask", "ood_enabled", "check_ood", "ood_task"]


@dataclass(frozen=True)
class OODTask:
    """The resolved settings of the shifted task (every null of ``eval.ood`` filled in)."""

    digits: int
    ops: tuple[str, ...]
    word_problems: bool
    num_problems: int
    seed: int


def ood_enabled(ood) -> bool:
    """Whether ``eval.ood`` asks for a shifted evaluation: any of ``digits``, ``ops``, ``word_problems`` is set."""
    return ood is not None and any(getattr(ood, k) is not None for k in ("digits", "ops", "word_problems"))


def check_ood(data, ood, num_problems: int) -> OODTask | None:
    """The shifted task's settings, checked; None when ``eval.ood`` sets no shift.

    Args:
        data: the ``data`` config (the training task: ``name``, ``path``, ``digits``, ``ops``, ``word_problems``,
            ``seed``).
        ood: the ``eval.ood`` config (``digits``, ``ops``, ``word_problems``, ``num_problems``; null: as ``data``).
        num_problems: ``eval.num_problems``, the default of ``eval.ood.num_problems``.

    Raises:
        ConfigError: naming the ``eval.ood`` key and how to fix it: a count without a shift; a training task that is
            not the built-in arithmetic task; digits or operators out of range; a shift that stays inside the training
            task's support (see the module docstring); more problems than the shifted task has.
    """
    if not ood_enabled(ood):
        if ood is not None and ood.num_problems is not None:
            raise ConfigError(f"eval.ood.num_problems={ood.num_problems} is set but eval.ood shifts nothing; set "
                              "eval.ood.digits and/or eval.ood.ops (e.g. eval.ood.digits=3), or drop it.")
        return None
    if data.name != "arithmetic" or data.path:
        raise ConfigError(f"eval.ood shifts the built-in arithmetic task, but the run trains on data={data.name}"
                          f"{' (data.path=' + str(data.path) + ')' if data.path else ''}; use data=arithmetic, or "
                          "drop eval.ood.")
    digits = data.digits if ood.digits is None else ood.digits
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= _MAX_DIGITS:
        raise ConfigError(f"eval.ood.digits={digits!r} is invalid: digits per operand, an integer from 1 to "
                          f"{_MAX_DIGITS}.")
    ops = tuple(dict.fromkeys(data.ops if ood.ops is None else ood.ops))
    bad = [op for op in ops if op not in ARITHMETIC_OPS]
    if not ops or bad:
        raise ConfigError(f"eval.ood.ops={list(ops)!r} is invalid: a non-empty list drawn from {list(ARITHMETIC_OPS)}, "
                          "e.g. 'eval.ood.ops=[-]'.")
    word_problems = bool(data.word_problems if ood.word_problems is None else ood.word_problems)
    shared = [op for op in ops if op in data.ops]
    if digits == data.digits and shared:
        other_digits = data.digits + 1 if data.digits < _MAX_DIGITS else data.digits - 1
        other_ops = [op for op in ARITHMETIC_OPS if op not in data.ops]
        fix = f"eval.ood.digits={other_digits}"
        if other_ops:
            fix += f", or use only operators outside data.ops: 'eval.ood.ops=[{other_ops[0]}]'"
        raise ConfigError(
            f"eval.ood (digits={digits}, ops={list(ops)}) would ask problems of the training task (data.digits="
            f"{data.digits}, data.ops={list(data.ops)}): with the same digits, the operators {shared} draw training "
            f"facts (changing eval.ood.word_problems alone only rewords them). Shift the task: {fix}.")
    n = num_problems if ood.num_problems is None else ood.num_problems
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"eval.ood.num_problems={n!r} is invalid: the number of shifted problems, an integer >= 1.")
    span = 9 * 10 ** (digits - 1)
    capacity = len(ops) * span * (span + 1) // 2
    if n > capacity:
        raise ConfigError(f"eval.ood.num_problems={n}: the shifted task (digits={digits}, ops={list(ops)}) has only "
                          f"{capacity} distinct problems; lower eval.ood.num_problems or add operators.")
    return OODTask(digits, ops, word_problems, n, data.seed)


def ood_task(settings: OODTask) -> ArithmeticTask:
    """The shifted problems: the held-out split of an :class:`~prefzoo.data.tasks.ArithmeticTask` with no training
    split (``task.eval()``, ``task.to_dataset("eval")``)."""
    return ArithmeticTask(digits=settings.digits, ops=settings.ops, num_train=0, num_eval=settings.num_problems,
                          seed=settings.seed, word_problems=settings.word_problems)
