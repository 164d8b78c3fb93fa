"""The report's plots (matplotlib, Agg): the reward-KL frontier, each headline metric and diversity against each
numeric swept setting, reward against diversity, and over-optimisation with its fitted forms; and their captions."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from prefzoo.report.runs import DESCRIPTION, is_number, metric

__all__ = ["plot_frontier", "plot_against", "plot_diversity", "plot_reward_vs_diversity", "plot_overoptimisation",
           "caption"]

D_LABEL = "d = sqrt(KL(π ‖ π_ref)) on held-out samples [sqrt(nats)]"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _frontier_reward(runs: list[dict]) -> str:
    return "sample_reward" if any(metric(r, "sample_reward") is not None for r in runs) else "task_reward"


def plot_frontier(runs: list[dict], path: Path) -> Path | None:
    """Reward after training against sqrt(KL to the reference), one series per algorithm; the reference
    policy (the runs' evaluations before training, best-of-1) at d = 0."""
    name = _frontier_reward(runs)
    series, reference = defaultdict(list), []
    for run in runs:
        kl, reward = metric(run, "kl_k1"), metric(run, name)
        if is_number(kl) and is_number(reward):
            series[run["summary"].get("algo", "?")].append((math.sqrt(max(kl, 0.0)), reward))
        kl0, reward0 = metric(run, "kl_k1", "eval_before"), metric(run, name, "eval_before")
        if is_number(kl0) and is_number(reward0):
            reference.append((math.sqrt(max(kl0, 0.0)), reward0))
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for algo, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-" if algo != "bon" else "s--", label=algo)
    if reference:
        ax.plot([p[0] for p in reference], [p[1] for p in reference], "k*", ms=10, label="before training (π_ref)")
    ax.set_xlabel(D_LABEL)
    ax.set_ylabel(("mean reward of temperature-1 samples" if name == "sample_reward" else "reward of greedy answers")
                  + "\n(run's reward, held-out prompts)")
    ax.set_title("Reward–KL frontier (after training)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path, plt)


def _log_axis(values) -> bool:
    values = [v for v in values if is_number(v)]
    return bool(values) and min(values) > 0 and max(values) / min(values) >= 10


def _lines(runs, key, keys, name):
    lines = defaultdict(list)
    for run in runs:
        x, y = run["overrides"].get(key), metric(run, name)
        if not is_number(x) or not is_number(y):
            continue
        label = ", ".join(f"{k}={run['overrides'].get(k)}" for k in keys if k != key) or name
        lines[label].append((x, y, metric(run, f"{name}_se")))
    return lines


def plot_against(runs: list[dict], key: str, keys: list[str], name: str, path: Path) -> Path | None:
    """``name`` after training against the swept setting ``key``, one line per combination of the others."""
    lines = _lines(runs, key, keys, name)
    if not lines:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in sorted(lines.items()):
        points.sort()
        se = [p[2] if is_number(p[2]) else 0.0 for p in points]
        ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=se, marker="o", capsize=3, label=label)
    if _log_axis([p[0] for pts in lines.values() for p in pts]):
        ax.set_xscale("log")
    ax.set_xlabel(key + (" (log scale)" if ax.get_xscale() == "log" else ""))
    ax.set_ylabel(f"{name} after training")
    ax.set_title(f"{name} against {key} (error bars: ± 1 s.e.)")
    if len(lines) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path, plt)


def plot_diversity(runs: list[dict], key: str, keys: list[str], path: Path) -> Path | None:
    """Distinct-1/2, entropy and KL after training against a numeric swept setting (Kirk et al. 2024)."""
    panels = [("distinct_1", "distinct_2"), ("entropy",), ("kl_k1",)]
    if not any(_lines(runs, key, keys, m) for m in ("distinct_1", "distinct_2", "entropy")):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    logx = _log_axis([r["overrides"].get(key) for r in runs])
    ylabels = ["distinct-n across samples of a prompt", "entropy [nats / token]", "KL(π ‖ π_ref) [nats]"]
    for ax, names, ylabel in zip(axes, panels, ylabels):
        for i, name in enumerate(names):
            for label, points in sorted(_lines(runs, key, keys, name).items()):
                points.sort()
                tag = name if len(keys) <= 1 else f"{name}, {label}"
                ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=f"C{i}", label=tag)
            before = [metric(r, name, "eval_before") for r in runs]
            before = [b for b in before if is_number(b)]
            if before:  # the policy before training (the same for every run of a sweep that shares its seed)
                ax.axhline(sum(before) / len(before), color=f"C{i}", ls="--", lw=1, label=f"{name} before training")
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(key + (" (log scale)" if logx else ""))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"Diversity of temperature-1 samples against {key} (held-out prompts, after training)")
    return _save(fig, path, plt)


def plot_reward_vs_diversity(runs: list[dict], keys: list[str], path: Path) -> Path | None:
    """Reward against distinct-2, one point per run, labelled with its swept values."""
    name = _frontier_reward(runs)
    points = [(metric(r, "distinct_2"), metric(r, name),
               ", ".join(str(r["overrides"].get(k)) for k in keys) or r["dir"].name) for r in runs]
    points = [p for p in points if is_number(p[0]) and is_number(p[1])]
    if len(points) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for x, y, label in points:
        ax.plot([x], [y], "o")
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("distinct-2 across samples of a prompt (higher: more diverse)")
    ax.set_ylabel(("mean reward of temperature-1 samples" if name == "sample_reward" else "reward of greedy answers"))
    ax.set_title("Reward against diversity, one point per run")
    ax.grid(alpha=0.3)
    return _save(fig, path, plt)


def plot_overoptimisation(points: dict, fits: list[dict], path: Path) -> Path | None:
    """Gold (top) and proxy (bottom) reward against d, best-of-n (left) and RL (right), with the fitted forms."""
    if not points["bon"] and not points["rl"]:
        return None
    import numpy as np

    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex="col")
    fitted = {(f["series"], f["reward"]): f["fit"] for f in fits}
    groups = [("best-of-n", [("best-of-n", points["bon"])]), ("RL", list(points["rl"].items()))]
    for col, (title, series) in enumerate(groups):
        for row, (which, idx) in enumerate((("gold", 1), ("proxy", 2))):
            ax = axes[row, col]
            for i, (name, pts) in enumerate(series):
                pts = [p for p in pts if p[idx] is not None]
                if not pts:
                    continue
                color = f"C{i}"
                ax.plot([p[0] for p in pts], [p[idx] for p in pts], "o:" if col else "s", color=color, lw=0.8,
                        label=f"{name}: measured" + (" (in step order)" if col else ""))
                f = fitted.get((name, which))
                if f is not None:
                    grid = np.linspace(0, max(p[0] for p in pts) * 1.05, 200)
                    form = "d(a − b·d)" if f.form == "bon" else "d(a − b·log d)"
                    ax.plot(grid, f(grid), "-", color=color, alpha=0.6,
                            label=f"fit {form}: a={f.a:.3g}, b={f.b:.3g}")
            ax.set_title(f"{title}: {which} reward" + (" (the evaluation's gold reward)" if which == "gold"
                                                        else " (the run's reward = the proxy it optimises)"),
                         fontsize=9)
            ax.set_ylabel(f"{which} reward, mean over temperature-1 samples", fontsize=8)
            if row == 1:
                ax.set_xlabel(D_LABEL + ("\n(best-of-n: analytic log n − (n−1)/n)" if col == 0 else
                                         "\n(RL: k1 estimate, one point per evaluation during training)"), fontsize=8)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle("Overoptimisation (Gao et al. 2023): gold and proxy reward against d = sqrt(KL)")
    return _save(fig, path, plt)


CAPTIONS = {
    "frontier": "Reward–KL frontier: each run's reward after training against d = sqrt(KL(π ‖ π_ref)) on held-out "
                "samples, one line per algorithm (best-of-n: analytic KL); the star is the policy before training.",
    "overoptimisation": "Gold (top) and proxy (bottom) reward against d = sqrt(KL): best-of-n (left, one point per n) "
                        "and RL (right, one point per evaluation during training), with the least-squares fits of "
                        "Gao et al. 2023.",
    "reward_vs_diversity": "Reward against distinct-2 of each run's samples: the reward–diversity trade-off.",
}


def caption(path: Path) -> str:
    stem = path.stem
    if stem in CAPTIONS:
        return CAPTIONS[stem]
    if stem.startswith("diversity_vs_"):
        return (f"Distinct-1/2, entropy and KL of each run's temperature-1 samples after training against "
                f"{stem[len('diversity_vs_'):]}; dashed: the policy before training (Kirk et al. 2024: how much "
                "diversity does training remove, and how much does the KL coefficient keep?).")
    name, _, key = stem.partition("_vs_")
    return f"{name} after training against the swept setting {key}" + (f" ({DESCRIPTION[name]})." if name in
                                                                        DESCRIPTION else ".")
