"""Controllers for the KL coefficient beta.

A controller owns the current ``beta`` and may change it once per optimisation step from the
measured KL (in nats, per sequence, averaged over the batch). Two kinds:

- :class:`FixedKLController`: beta never changes (GRPO, DPO, most PPO runs).
- :class:`AdaptiveKLController`: the log-space proportional controller of Ziegler et al. 2019,
  which nudges beta so the measured KL tracks a target.

Both expose ``beta``, ``update(kl, n_steps)``, ``state_dict()`` and ``load_state_dict()`` so a
resumed run continues with the same beta.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from .errors import ObjectiveError, check_choice, check_number

__all__ = [
    "KL_CONTROLLERS",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
]

KL_CONTROLLERS = ("fixed", "adaptive")


class KLController(Protocol):
    """What the training loop relies on: a current ``beta`` and an ``update`` hook."""

    beta: float

    def update(self, kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _check_state(state: dict[str, Any], keys: tuple[str, ...], cls: str) -> None:
    if not isinstance(state, dict) or set(state) != set(keys):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ObjectiveError(
            f"{cls}.load_state_dict expects a dict with keys {sorted(keys)}, got {got}; "
            f"pass the dict returned by {cls}.state_dict()"
        )


class FixedKLController:
    """A constant KL coefficient.

    ``update`` does nothing. beta = 0 is allowed (no KL regularisation, the GRPO default).

    Shape: scalars only.
    Units: beta is dimensionless (reward units per nat of KL).

    Raises:
        ObjectiveError: beta negative or not finite.

    Source: Ziegler et al. 2019, sec. 2.2 (fixed-beta variant); Ouyang et al. 2022, eq. 2.
    """

    def __init__(self, beta: float) -> None:
        self.beta = check_number("beta", beta, low=0.0,
                                 hint="beta weights a penalty; use 0 for no KL term")

    def update(self, kl: float, n_steps: int) -> None:
        """Do nothing (beta is fixed)."""

    def state_dict(self) -> dict[str, Any]:
        """The controller's state: ``{"beta": ...}``."""
        return {"beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Raises ObjectiveError on wrong keys or bad beta."""
        _check_state(state, ("beta",), "FixedKLController")
        self.beta = check_number("beta", state["beta"], low=0.0)

    def __repr__(self) -> str:
        return f"FixedKLController(beta={self.beta})"


class AdaptiveKLController:
    """Proportional controller in log space that steers the measured KL toward a target.

    On each ``update(kl, n_steps)``:

        e = clip(kl / kl_target - 1, -clip, clip)
        beta <- beta * (1 + e * n_steps / horizon)

    so beta grows when the KL is above target and shrinks below it, by a factor bounded by
    1 +- clip * n_steps / horizon per update. ``n_steps`` is the number of samples (or steps)
    the measurement covers; ``horizon`` sets the time scale of the adaptation.

    Shape: scalars only.
    Units: kl and kl_target in nats (the same unit: per-sequence KL summed over tokens, as the
        loop logs it); n_steps and horizon in samples (or steps, consistently).

    Raises:
        ObjectiveError: init_beta, kl_target or horizon not > 0; clip not in (0, 1]; in
            ``update``: kl not finite or negative n_steps.

    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
    sec. 2.2: e_t = clip(KL/KL_target - 1, -0.2, 0.2), beta_{t+1} = beta_t (1 + K_beta e_t),
    here with K_beta = n_steps / horizon.
    """

    def __init__(self, init_beta: float, kl_target: float, horizon: float,
                 clip: float = 0.2) -> None:
        self.beta = check_number("init_beta", init_beta, low=0.0, strict_low=True,
                                 hint="the adaptive controller multiplies beta, so it must "
                                      "start > 0 (use FixedKLController for beta = 0)")
        self.kl_target = check_number("kl_target", kl_target, low=0.0, strict_low=True)
        self.horizon = check_number("horizon", horizon, low=0.0, strict_low=True)
        self.clip = check_number("clip", clip, low=0.0, strict_low=True, high=1.0)

    def update(self, kl: float, n_steps: int) -> None:
        """Adapt beta to the measured ``kl`` (nats) over ``n_steps`` samples."""
        kl = float(kl)
        if not math.isfinite(kl):
            raise ObjectiveError(
                f"kl must be finite, got {kl}; the policy has probably diverged from the "
                "reference (check the log-probs), do not feed NaN to the controller"
            )
        n_steps = check_number("n_steps", n_steps, low=0.0)
        error = min(max(kl / self.kl_target - 1.0, -self.clip), self.clip)
        self.beta *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """The controller's state (beta and its settings), JSON-serialisable."""
        return {"beta": self.beta, "kl_target": self.kl_target, "horizon": self.horizon,
                "clip": self.clip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (a resumed run continues with the same beta)."""
        _check_state(state, ("beta", "kl_target", "horizon", "clip"), "AdaptiveKLController")
        restored = AdaptiveKLController(state["beta"], state["kl_target"], state["horizon"],
                                        state["clip"])
        self.__dict__.update(restored.__dict__)

    def __repr__(self) -> str:
        return (f"AdaptiveKLController(beta={self.beta}, kl_target={self.kl_target}, "
                f"horizon={self.horizon}, clip={self.clip})")


def make_kl_controller(kind: str, beta: float, kl_target: float | None = None,
                       horizon: float = 10000) -> FixedKLController | AdaptiveKLController:
    """Build a beta controller from config values.

    ``kind="fixed"`` ignores kl_target and horizon; ``kind="adaptive"`` starts at ``beta`` and
    needs ``kl_target``.

    Shape: scalars only.
    Units: as the controllers (nats for kl_target).

    Raises:
        ObjectiveError: unknown kind (lists KL_CONTROLLERS); adaptive without kl_target; the
            controllers' own checks.

    Source: Ziegler et al. 2019, sec. 2.2.
    """
    check_choice("KL controller kind", kind, KL_CONTROLLERS)
    if kind == "fixed":
        return FixedKLController(beta)
    if kl_target is None:
        raise ObjectiveError(
            "an adaptive KL controller needs kl_target (the KL in nats to steer toward), "
            "e.g. make_kl_controller('adaptive', beta=0.1, kl_target=6.0)"
        )
    return AdaptiveKLController(beta, kl_target, horizon)
