"""The one error type of the objective layer, and the small input checks that raise it.

Every check below raises :class:`ObjectiveError` (a ``PrefzooError`` and a ``ValueError``) with a message that says
what was wrong and how to fix it. The checks are cheap (shape/dtype comparisons); the few that
look at tensor values (e.g. "no NaN") say so in the docstring of the function that uses them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from prefzoo.errors import PrefzooError


class ObjectiveError(PrefzooError, ValueError):
    """Bad input to a function of ``prefzoo.objective``.

    A :class:`~prefzoo.errors.PrefzooError` (the CLI prints it as one line) and a ``ValueError``, so callers
    that already catch ``ValueError`` keep working.
    The message names the argument, what it was, and what is expected.

    Source: project convention (DESIGN.md, "Conventions": typed errors that say how to fix).
    """


def check_choice(name: str, value: str, valid: Sequence[str]) -> None:
    """Raise unless ``value`` is one of ``valid``; the message lists the valid names."""
    if value not in valid:
        raise ObjectiveError(
            f"unknown {name} {value!r}; valid {name}s are {', '.join(repr(v) for v in valid)}"
        )


def check_tensor(name: str, x: object) -> None:
    """Raise unless ``x`` is a ``torch.Tensor``."""
    if not isinstance(x, torch.Tensor):
        raise ObjectiveError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Raise unless ``a`` and ``b`` have the same shape; the message names both shapes."""
    check_tensor(name_a, a)
    check_tensor(name_b, b)
    if a.shape != b.shape:
        raise ObjectiveError(
            f"{name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}; "
            "they must be equal (same batch size B and sequence length T)"
        )


def check_mask(mask: torch.Tensor, like: torch.Tensor, like_name: str = "values") -> None:
    """Raise unless ``mask`` is a bool tensor with the shape of ``like``."""
    check_tensor("mask", mask)
    if mask.dtype != torch.bool:
        raise ObjectiveError(
            f"mask must be a bool tensor (True = this token counts), got dtype {mask.dtype}; "
            "convert it with mask.bool() (never pass an inverted or float mask)"
        )
    check_same_shape(like_name, like, "mask", mask)


def check_ndim(name: str, x: torch.Tensor, ndim: int, what: str) -> None:
    """Raise unless ``x.dim() == ndim``; ``what`` describes the expected axes, e.g. ``"(B, T)"``."""
    check_tensor(name, x)
    if x.dim() != ndim:
        raise ObjectiveError(f"{name} must have shape {what}, got shape {tuple(x.shape)}")


def check_floating(name: str, x: torch.Tensor) -> None:
    """Raise unless ``x`` has a floating-point dtype."""
    if not x.is_floating_point():
        raise ObjectiveError(
            f"{name} must be a floating-point tensor, got dtype {x.dtype}; convert with .float()"
        )


def check_number(name: str, value: float, *, low: float | None = None, strict_low: bool = False,
                 high: float | None = None, strict_high: bool = False, hint: str = "") -> float:
    """Return ``float(value)``; raise unless it is finite and inside the given bounds."""
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ObjectiveError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ObjectiveError(f"{name} must be finite, got {v}")
    bad_low = low is not None and (v <= low if strict_low else v < low)
    bad_high = high is not None and (v >= high if strict_high else v > high)
    if bad_low or bad_high:
        lo = "" if low is None else (f"> {low}" if strict_low else f">= {low}")
        hi = "" if high is None else (f"< {high}" if strict_high else f"<= {high}")
        rule = " and ".join(s for s in (lo, hi) if s)
        raise ObjectiveError(f"{name} must be {rule}, got {v}" + (f"; {hint}" if hint else ""))
    return v
