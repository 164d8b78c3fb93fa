"""The functional forms of reward-model overoptimisation (Gao et al. 2023), fitted by least squares.

Gao et al. 2023 ("Scaling Laws for Reward Model Overoptimization", eq. 1 and 2) measure the GOLD reward of a
policy optimised against a PROXY reward model, as a function of d = sqrt(KL(pi || pi_ref)) (nats^1/2), and
find, with R(0) = 0 (the gold reward of the initial policy subtracted):

    best-of-n:  R_bon(d) = d (a - b d)          a parabola in d:  peak at d* = a / (2b),          R* = a^2 / (4b)
    RL:         R_RL(d)  = d (a - b log d)      peak where a - b (log d + 1) = 0:  d* = exp(a/b - 1),  R* = b d*

Both are linear in (a, b) -- R = a x1 - b x2 with x1 = d and x2 = d^2 (best-of-n) or d log d (RL) -- so the
least-squares fit is an ordinary linear one (numpy ``lstsq``), no iterative optimiser. A fit with b <= 0 has no
peak in d > 0 (the reward still rises over the range measured): ``peak`` then returns ``None``.

Standard errors: those of ordinary least squares with X = [x1, -x2] (n x 2), Cov(a, b) = s^2 (X'X)^-1 with
s^2 = RSS / (n - 2) (nan with n <= 2 points: no residual degree of freedom). They treat the points as independent
with one noise level, which an RL trajectory's successive evaluations are not quite (one policy, correlated
steps); read them as the fit's precision given the scatter of the points. The peak's (d*, R*) standard errors
follow by the delta method: Var f = g' Cov g with g the gradient of f in (a, b) -- best-of-n
d* = a / (2b): g = (1/(2b), -a/(2b^2)); R* = a^2/(4b): g = (a/(2b), -a^2/(4b^2)); RL d* = exp(a/b - 1):
g = d* (1/b, -a/b^2); R* = b d*: g = (d*, d* (1 - a/b)).

From a folder of runs (:mod:`prefzoo.report.runs`): :func:`overoptimisation_points` collects the (d, gold, proxy)
points — best-of-n one per run, RL one per evaluation during training — and :func:`fit_overoptimisation` fits
each series.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from prefzoo.report.runs import eval_history, is_best_of_n, is_number

__all__ = ["FORMS", "Fit", "fit", "predict", "observed_peak", "overoptimisation_points", "fit_overoptimisation",
           "rl_label", "peak_verdict", "gap_at_equal_d", "bon_against_rl", "pooled_series", "preregistered_verdict",
           "PREREGISTERED_Z", "DETECTABLE", "add_pooled"]

#: form name -> the regressor multiplying -b (the one multiplying a is d itself)
FORMS = {"bon": "d^2", "rl": "d log d"}


def _second(form: str, d: np.ndarray) -> np.ndarray:
    if form == "bon":
        return d ** 2
    if form == "rl":
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(d > 0, d * np.log(np.where(d > 0, d, 1.0)), 0.0)  # d log d -> 0 as d -> 0
    raise ValueError(f"unknown functional form {form!r}; choose one of {', '.join(FORMS)}")


def predict(form: str, d, a: float, b: float) -> np.ndarray:
    """R(d) of the form: ``bon``: d (a - b d); ``rl``: d (a - b log d) (0 at d = 0). d >= 0, in sqrt(nats)."""
    d = np.asarray(d, dtype=float)
    return a * d - b * _second(form, d)


@dataclass
class Fit:
    """A least-squares fit of R(d) (see the module docstring).

    Attributes:
        form: ``bon`` or ``rl``.
        a, b: the coefficients (reward units per sqrt(nat); b of ``bon`` per nat).
        r2: coefficient of determination of the fit against the points' mean (nan with < 2 points).
        n: number of points.
        baseline: the reward subtracted from every point before fitting (the reward at d = 0).
        a_se, b_se: their standard errors (nan with fewer than 3 points); cov_ab: their covariance.
    """

    form: str
    a: float
    b: float
    r2: float
    n: int
    baseline: float = 0.0
    a_se: float = float("nan")
    b_se: float = float("nan")
    cov_ab: float = float("nan")

    @property
    def peak_se(self) -> tuple[float, float] | None:
        """Standard errors of :attr:`peak`'s (d*, R*) by the delta method (module docstring); None without a peak."""
        peak = self.peak
        if peak is None:
            return None
        a, b = self.a, self.b
        d_star = peak[0]
        if self.form == "bon":
            grads = ((1 / (2 * b), -a / (2 * b * b)), (a / (2 * b), -a * a / (4 * b * b)))
        else:
            grads = ((d_star / b, -d_star * a / (b * b)), (d_star, d_star * (1 - a / b)))
        cov = np.array([[self.a_se ** 2, self.cov_ab], [self.cov_ab, self.b_se ** 2]])
        out = []
        for g in grads:
            g = np.asarray(g)
            out.append(float(math.sqrt(max(g @ cov @ g, 0.0))) if np.isfinite(cov).all() else float("nan"))
        return out[0], out[1]

    @property
    def peak(self) -> tuple[float, float] | None:
        """(d*, R*) where the fitted reward is highest, R* relative to the baseline; None if b <= 0 (no peak), or
        for ``rl`` if d* = exp(a/b - 1) would exceed e^50 (b ~ 0)."""
        if not self.b > 1e-9 * max(1.0, abs(self.a)):  # b <= 0 (or zero up to rounding): no peak
            return None
        if self.form == "bon":
            return self.a / (2 * self.b), self.a ** 2 / (4 * self.b)
        exponent = self.a / self.b - 1.0
        if exponent > 50:  # a peak beyond d = e^50: none in any range that can be measured
            return None
        d_star = math.exp(exponent)
        return d_star, self.b * d_star

    def __call__(self, d) -> np.ndarray:
        """The fitted reward at d, baseline added back (absolute reward units)."""
        return predict(self.form, d, self.a, self.b) + self.baseline


def fit(form: str, d, reward, baseline: float = 0.0) -> Fit:
    """Least-squares (a, b) of ``reward - baseline = d (a - b d)`` (``bon``) or ``d (a - b log d)`` (``rl``).

    Args:
        form: ``bon`` or ``rl``.
        d: sqrt(KL) of each point, >= 0.
        reward: the reward at each point (same length).
        baseline: the reward at d = 0 (the initial policy's), subtracted so that R(0) = 0 as in Gao et al.
    Raises:
        ValueError: unknown form, lengths differ, fewer than 2 points with d > 0, or a negative d.
    """
    d, r = np.asarray(d, dtype=float), np.asarray(reward, dtype=float) - baseline
    if d.shape != r.shape or d.ndim != 1:
        raise ValueError(f"d {d.shape} and reward {r.shape} must be 1-D and of one length")
    if (d < 0).any() or not np.isfinite(d).all() or not np.isfinite(r).all():
        raise ValueError("d must be finite and >= 0 (d = sqrt(KL)) and rewards finite")
    if (d > 0).sum() < 2:
        raise ValueError(f"fitting {form} needs at least 2 points with d > 0, got {(d > 0).sum()}")
    x = np.stack([d, -_second(form, d)], axis=1)
    (a, b), *_ = np.linalg.lstsq(x, r, rcond=None)
    resid = r - x @ np.array([a, b])
    total = ((r - r.mean()) ** 2).sum()
    # R^2 is undefined for a reward that does not vary; float rounding leaves such a TSS at ~1e-33, not 0
    varies = total > 1e-12 * max(float((r ** 2).sum()), 1e-12)
    r2 = float(1 - (resid ** 2).sum() / total) if len(r) > 1 and varies else float("nan")
    a_se = b_se = cov_ab = float("nan")
    if len(r) > 2:
        cov = (resid ** 2).sum() / (len(r) - 2) * np.linalg.pinv(x.T @ x)
        a_se, b_se, cov_ab = float(math.sqrt(max(cov[0, 0], 0))), float(math.sqrt(max(cov[1, 1], 0))), float(cov[0, 1])
    return Fit(form, float(a), float(b), r2, int(len(r)), float(baseline), a_se, b_se, cov_ab)


def observed_peak(d, reward) -> tuple[float, float]:
    """(d, reward) of the point with the highest reward (the measured peak, no model)."""
    d, r = np.asarray(d, dtype=float), np.asarray(reward, dtype=float)
    i = int(np.argmax(r))
    return float(d[i]), float(r[i])


# ------------------------------------------------------------------------------------------- from runs
def rl_label(run: dict) -> str:
    """An RL run's series name: ``<algo> β=<beta> (<folder>)``."""
    s = run["summary"]
    label = f"{s.get('algo')} β={s.get('beta'):g}" if is_number(s.get("beta")) else str(s.get("algo"))
    return f"{label} ({run['dir'].name})"


def overoptimisation_points(runs: list[dict]) -> dict:
    """Points for best-of-n (one per run: its n) and for each RL run (its evaluations during training), plus the
    baselines (mean rewards of the d = 0 points: the reference policy). A point is the tuple
    ``(d, gold, proxy, step, n, gold_se, proxy_se)``: n is best-of-n's (None for RL), proxy and the standard
    errors None where the evaluation has none."""
    bon, rl = [], {}
    for run in runs:
        s = run["summary"]
        if s.get("algo") == "rm":
            continue
        for e in eval_history(run):
            kl, gold, proxy = e.get("kl_k1"), e.get("gold_sample_reward"), e.get("sample_reward")
            if not (is_number(kl) and is_number(gold)):
                continue
            n = (s.get("algo_settings") or {}).get("n", run["overrides"].get("algo.n")) if is_best_of_n(run) else None
            se = [e.get(f"{k}_se") if is_number(e.get(f"{k}_se")) else None for k in ("gold_sample_reward",
                                                                                        "sample_reward")]
            point = (math.sqrt(max(kl, 0.0)), gold, proxy if is_number(proxy) else None, e.get("step"), n, *se)
            if is_best_of_n(run):
                bon.append(point)
            else:
                rl.setdefault(rl_label(run), []).append(point)
    rl = {k: sorted(v, key=lambda p: p[3] or 0) for k, v in rl.items()}
    # the reference itself: best-of-1, and each RL run before training (step 0; not a later point whose KL estimate
    # happens to be <= 0)
    zero = [p for p in bon if p[4] == 1] + [pts[0] for pts in rl.values() if pts and pts[0][3] == 0]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"bon": sorted(bon, key=lambda p: (p[4] or 0, p[0])),
            "rl": {k: sorted(v, key=lambda p: p[3] or 0) for k, v in rl.items()},
            "gold0": mean([p[1] for p in zero]), "proxy0": mean([p[2] for p in zero if p[2] is not None])}


def fit_overoptimisation(points: dict) -> list[dict]:
    """Least-squares fits (Gao et al. 2023) of gold and proxy reward: best-of-n with d(a - b d) on all BoN
    points, each RL run with d(a - b log d) on its trajectory. Rewards relative to the d = 0 baseline: the series'
    own reference where it has one -- an RL run's evaluation before training, best-of-n's best-of-1 (runs against
    different proxies start from different proxy scores; a shared mean would bend every fit) -- else the mean of all
    d = 0 points (``gold0``, ``proxy0``)."""
    out = []
    series = [("best-of-n", "bon", points["bon"])] + [(name, "rl", pts) for name, pts in points["rl"].items()]
    for name, form, pts in series:
        # the series' own reference: an RL run's step 0, best-of-n's best-of-1 points (one per best-of-1 run)
        own = ([pts[0]] if pts and pts[0][3] == 0 else []) if form == "rl" else [p for p in pts if p[4] == 1]
        for which, col, base in (("gold", 1, points["gold0"]), ("proxy", 2, points["proxy0"])):
            if own and all(p[col] is not None for p in own):
                base = sum(p[col] for p in own) / len(own)
            pts_ok = [p for p in pts if p[col] is not None]
            if sum(p[0] > 0 for p in pts_ok) < 2:
                continue
            d, r = [p[0] for p in pts_ok], [p[col] for p in pts_ok]
            f = fit(form, d, r, baseline=base or 0.0)
            out.append({"series": name, "reward": which, "form": form, "fit": f, "observed_peak": observed_peak(d, r),
                        "d_max": max(d)})
    return out


# ---------------------------------------------------------------------------- the inverted U, and BoN vs RL
#: a rise of gold to its peak, or a fall past it, counts when it exceeds this many standard errors
FALL_Z = 2.0


def peak_verdict(points: list[tuple]) -> dict | None:
    """Does gold rise to a peak at an intermediate KL and fall past it while the proxy keeps rising (Gao et al.'s
    inverted U)? From one series' measured points (no model).

    The start: the point of smallest d (the reference for RL, n = 1 for best-of-n). The peak: the point of highest
    gold. The end: the point of largest d. ``rise`` = gold at the peak - gold at the start, ``fall`` = gold at the
    peak - gold at the end, each with its standard error sqrt(se_1^2 + se_2^2) (the evaluations' standard errors,
    independent samples; nan where a point has none); ``proxy_rise`` = proxy at the end - proxy at the peak. A rise
    or fall counts when it exceeds :data:`FALL_Z` standard errors (or is > 0 without standard errors). ``shape``:
    "inverted U" (both count), "falls" (only the fall: gold best at or near the start), "rises" (only the rise:
    still rising, or level past the peak), "flat" (neither). ``inverted_u``: shape "inverted U" and the proxy rose
    past the peak. None with fewer than 2 points.
    """
    if len(points) < 2:
        return None
    start = min(points, key=lambda p: (p[0], p[3] or 0))
    peak = max(points, key=lambda p: p[1])
    end = max(points, key=lambda p: (p[0], p[3] or 0))

    def change(high, low):
        delta = high[1] - low[1]
        se = math.sqrt(high[5] ** 2 + low[5] ** 2) if high[5] is not None and low[5] is not None else float("nan")
        counts = delta > FALL_Z * se if math.isfinite(se) and se > 0 else delta > 0
        return delta, se, bool(counts)

    rise, rise_se, rose = change(peak, start)
    fall, fall_se, fell = change(peak, end)
    shape = {(True, True): "inverted U", (False, True): "falls", (True, False): "rises"}.get((rose, fell), "flat")
    proxy_rise = end[2] - peak[2] if end[2] is not None and peak[2] is not None else None
    return {"d_peak": peak[0], "gold_peak": peak[1], "gold_peak_se": peak[5], "step_peak": peak[3], "n_peak": peak[4],
            "d_start": start[0], "gold_start": start[1], "rise": rise, "rise_se": rise_se,
            "d_end": end[0], "gold_end": end[1], "fall": fall, "fall_se": fall_se, "proxy_peak": peak[2],
            "proxy_end": end[2], "proxy_rise": proxy_rise, "shape": shape,
            "inverted_u": bool(shape == "inverted U" and proxy_rise is not None and proxy_rise > 0)}


def _curve(points: list[tuple], col: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(d, value) of a series sorted by d (a stable sort: equal d keep their order), for ``np.interp``."""
    pts = sorted((p for p in points if p[col] is not None), key=lambda p: p[0])
    return np.array([p[0] for p in pts], dtype=float), np.array([p[col] for p in pts], dtype=float)


def gap_at_equal_d(first: list[tuple], second: list[tuple], col: int = 1, grid_points: int = 25) -> dict | None:
    """``first`` minus ``second`` at equal d, where both were measured: each series' reward (``col``: 1 gold, 2
    proxy) linearly interpolated in d (points sorted by d) on ``grid_points`` equally spaced d over the overlap
    [max of the two smallest d, min of the two largest]; the mean gap over that grid and the gap at its end.
    None when the overlap is empty (or a series has < 2 points)."""
    (d1, r1), (d2, r2) = _curve(first, col), _curve(second, col)
    if len(d1) < 2 or len(d2) < 2:
        return None
    lo, hi = max(d1.min(), d2.min()), min(d1.max(), d2.max())
    if not hi > lo:
        return None
    grid = np.linspace(lo, hi, grid_points)
    gap = np.interp(grid, d1, r1) - np.interp(grid, d2, r2)
    return {"d_lo": float(lo), "d_hi": float(hi), "mean_gap": float(gap.mean()), "end_gap": float(gap[-1])}


def bon_against_rl(points: dict) -> list[dict]:
    """Best-of-n against each RL run at the same KL (note 004: "best-of-n is more robust at small KL"): gold and
    proxy of best-of-n minus RL at equal d (:func:`gap_at_equal_d`), one entry per RL series that overlaps it."""
    out = []
    for name, pts in points["rl"].items():
        gold, proxy = gap_at_equal_d(points["bon"], pts, 1), gap_at_equal_d(points["bon"], pts, 2)
        if gold is not None:
            out.append({"series": name, "gold": gold, "proxy": proxy})
    return out


# ------------------------------------------------------------------- several runs of one design, pooled
def pooled_series(series: dict[str, list[tuple]]) -> list[tuple] | None:
    """The RL runs of one design pooled point by point: at each evaluation step that EVERY run has, the mean over the
    k runs of d, gold and proxy, and the gold standard error of that mean, sqrt(sum of the runs' se^2) / k (the runs'
    evaluations are independent samples). Points as :func:`overoptimisation_points` makes them,
    ``(d, gold, proxy, step, None, gold_se, None)``; None with fewer than 2 runs.

    Pooling several runs (proxies and policy seeds) is what gives the test its power: on a verifier accuracy of a few
    percent one run's evaluation of 384 samples has an s.e. near 0.006, four runs' mean half that."""
    runs = [pts for pts in series.values() if pts]
    if len(runs) < 2:
        return None
    steps = sorted(set.intersection(*[{p[3] for p in pts} for pts in runs]), key=lambda s: s or 0)
    k = len(runs)
    out = []
    for step in steps:
        at = [next(p for p in pts if p[3] == step) for pts in runs]
        proxies = [p[2] for p in at]
        ses = [p[5] for p in at]
        out.append((sum(p[0] for p in at) / k, sum(p[1] for p in at) / k,
                    sum(proxies) / k if all(x is not None for x in proxies) else None, step, None,
                    math.sqrt(sum(s ** 2 for s in ses)) / k if all(s is not None for s in ses) else None, None))
    return out


#: the pre-registered test's threshold: a rise and a fall each beyond this many combined standard errors
PREREGISTERED_Z = 3.0
#: "refuted with the power to say so": no rise or fall beyond PREREGISTERED_Z s.e., with that bound at most this
#: much gold (a U this high would have shown)
DETECTABLE = 0.02


def preregistered_verdict(points: list[tuple], peak_d: float, z: float = PREREGISTERED_Z,
                          detectable: float = DETECTABLE) -> dict | None:
    """The inverted-U test fixed before the data (recipes/overoptimisation_word.yaml): the PEAK is the point whose d
    is closest to ``peak_d`` (a d* from earlier data), not the point of highest gold, so the rise is not inflated by
    picking the largest of noisy values. start = the point of smallest d, end = the point of largest d;
    rise = gold(peak) - gold(start), fall = gold(peak) - gold(end), each with s.e. sqrt(se_1^2 + se_2^2).

    ``verdict``: ``established`` when rise > z s.e. and fall > z s.e. and the proxy at the end is above the proxy at
    the peak; ``refuted`` when neither |rise| nor |fall| exceeds z s.e. and both bounds z s.e. are at most
    ``detectable`` (``detectable`` in the result is the larger bound); else ``not decided``. None with fewer than 3
    points or without standard errors."""
    if len(points) < 3 or any(p[5] is None for p in points):
        return None
    start = min(points, key=lambda p: (p[0], p[3] or 0))
    end = max(points, key=lambda p: (p[0], p[3] or 0))
    inner = [p for p in points if p is not start and p is not end] or points
    peak = min(inner, key=lambda p: abs(p[0] - peak_d))

    def change(high, low):
        delta, se = high[1] - low[1], math.sqrt(high[5] ** 2 + low[5] ** 2)
        return delta, se, (delta / se if se > 0 else (math.inf if delta > 0 else 0.0))

    rise, rise_se, rise_z = change(peak, start)
    fall, fall_se, fall_z = change(peak, end)
    proxy_up = peak[2] is not None and end[2] is not None and end[2] > peak[2]
    bound = z * max(rise_se, fall_se)
    if rise_z > z and fall_z > z and proxy_up:
        verdict = "established"
    elif abs(rise_z) <= z and abs(fall_z) <= z and bound <= detectable:
        verdict = "refuted"
    else:
        verdict = "not decided"
    return {"peak_d_registered": peak_d, "d_peak": peak[0], "step_peak": peak[3], "gold_peak": peak[1],
            "gold_peak_se": peak[5], "gold_start": start[1], "gold_end": end[1], "d_end": end[0], "rise": rise,
            "rise_se": rise_se, "rise_z": rise_z, "fall": fall, "fall_se": fall_se, "fall_z": fall_z,
            "proxy_peak": peak[2], "proxy_end": end[2], "detectable": bound, "z": z, "verdict": verdict}


def add_pooled(points: dict) -> list[str]:
    """Add to ``points["rl"]`` one pooled series (:func:`pooled_series`) per group of 2 or more RL runs with the same
    algorithm and beta (their label without the folder: ``grpo β=0``), named ``<group> pooled over <k> runs``.
    Returns the names added. (Runs of one group against different proxies pool their proxy values too: read the
    pooled proxy as the runs' mean, each in its own proxy's units.)"""
    groups: dict[str, dict[str, list[tuple]]] = {}
    for name, pts in points["rl"].items():
        groups.setdefault(name.rsplit(" (", 1)[0], {})[name] = pts
    added = []
    for prefix, members in groups.items():
        pooled = pooled_series(members) if len(members) >= 2 else None
        if pooled:
            name = f"{prefix} pooled over {len(members)} runs"
            points["rl"][name] = pooled
            added.append(name)
    return added
