"""The report's plots (matplotlib, Agg): the reward-KL frontier, each headline metric and diversity against each
numeric swept setting, the evaluation per run (a sweep of names: algorithms, files), reward against diversity, and
over-optimisation with its fitted forms; and their captions. Point labels are placed apart
(:func:`prefzoo.report.labels.place_labels`)."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

from prefzoo.report.labels import place_labels
from prefzoo.report.runs import DESCRIPTION, eval_history, is_number, metric, training_seconds

__all__ = ["plot_frontier", "plot_against", "plot_diversity", "plot_per_run", "plot_reward_vs_diversity",
           "accuracy_against_time", "plot_accuracy_vs_time",
           "plot_overoptimisation", "plot_bon_vs_rl", "plot_speed_shape", "caption", "run_labels", "AXIS_LABELS"]

D_LABEL = "d = sqrt(KL(π ‖ π_ref)) on held-out samples [sqrt(nats)]"

#: y-axis label (with its unit) of each evaluation key
AXIS_LABELS = {
    "task_accuracy": "task accuracy (exact match of greedy answers)",
    "task_reward": "reward of greedy answers",
    "sample_reward": "mean reward of temperature-1 samples",
    "gold_task_reward": "gold reward of greedy answers",
    "gold_sample_reward": "gold reward, mean over temperature-1 samples",
    "preference_accuracy": "held-out preference accuracy (chance 0.5)",
    "kl_k1": "KL(π ‖ π_ref) [nats / completion]",
    "entropy": "entropy [nats / token]",
    "distinct_1": "distinct-1 across samples of a prompt",
    "distinct_2": "distinct-2 across samples of a prompt",
    "ood_task_accuracy": "out-of-distribution task accuracy (eval.ood, greedy)",
    "ood_distinct_2": "distinct-2 across samples of a shifted prompt (eval.ood)",
}


def algo_styles(runs: list[dict]) -> dict[str, dict]:
    """One colour, marker and size per algorithm of ``runs`` (sorted by name: the same in every plot of a report);
    the sizes shrink along the list, so a point drawn over another of the same value leaves a ring of it visible."""
    algos = sorted({str(r["summary"].get("algo")) for r in runs})
    return {a: {"color": _colour(i), "marker": "osD^v<>p"[i % 8], "ms": max(4.0, 10.0 - 1.5 * i)}
            for i, a in enumerate(algos)}


#: after the default cycle's 10 colours (C0-C9): the light variants of tab20, then black and greys
EXTRA_COLOURS = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5",
                 "#000000", "#555555", "#aaaaaa")


def _colour(i: int) -> str:
    """The i-th series colour: C0-C9, then :data:`EXTRA_COLOURS` (the zoo has 13 algorithms), then the cycle again."""
    if i < 10:
        return f"C{i}"
    return EXTRA_COLOURS[i - 10] if i - 10 < len(EXTRA_COLOURS) else f"C{i % 10}"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["axes.formatter.useoffset"] = False  # 10.79 on the axis, not "1e-5 + 1.07898e1" and 9.3
    return plt


#: an axis spans at least this share of its values' size (nearly equal values are not blown up into noise)
MIN_RELATIVE_SPAN = 0.02


def _readable_limits(ax) -> None:
    """Widen each axis whose span is below :data:`MIN_RELATIVE_SPAN` of its values' size (linear axes only)."""
    for get, set_, scale in ((ax.get_xlim, ax.set_xlim, ax.get_xscale), (ax.get_ylim, ax.set_ylim, ax.get_yscale)):
        if scale() != "linear":
            continue
        lo, hi = get()
        need = MIN_RELATIVE_SPAN * max(abs(lo), abs(hi)) or 1e-3
        if hi - lo < need:
            mid = (lo + hi) / 2
            set_(mid - need / 2, mid + need / 2)


def _save(fig, path: Path, plt, layout: bool = True) -> Path:
    """Write ``fig`` to ``path`` (laid out first unless ``layout`` is False: labels were placed on the final
    layout) and close it."""
    if layout:
        for ax in fig.axes:
            _readable_limits(ax)
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _frontier_reward(runs: list[dict]) -> str:
    return "sample_reward" if any(metric(r, "sample_reward") is not None for r in runs) else "task_reward"


def run_labels(runs: list[dict], keys: list[str], skip: tuple[str, ...] = (), named: bool = False) -> list[str]:
    """Each run's swept values (without the keys in ``skip``), as short as they stay distinct: a number as
    ``beta=0.1`` (the key's last part; a lone key's number bare unless ``named``), a name as it is (``dpo``,
    ``bon_n4``), a path as its file name when the file names differ; a run that is no job of the sweep (a recipe's
    reward model) or a sweep of nothing by its folder name."""
    keys = [k for k in keys if k not in skip]
    shown = {}
    for k in keys:
        full = [str(r["overrides"].get(k)) for r in runs]
        short = [v.rstrip("/").rsplit("/", 1)[-1] if "/" in v else v for v in full]
        shown[k] = short if len(set(short)) == len(set(full)) else full
    out = []
    for i, run in enumerate(runs):
        if not keys or all(run["overrides"].get(k) is None for k in keys):
            out.append(run["dir"].name)
            continue
        parts = []
        for k in keys:
            value = run["overrides"].get(k)
            if value is None:  # this run did not set the key (a folder of separate runs): nothing to say
                continue
            number = is_number(value) or isinstance(value, bool)
            parts.append(f"{re.split(r'[./]', k)[-1]}={shown[k][i]}" if number and (named or len(keys) > 1)
                         else shown[k][i])
        out.append(", ".join(parts))
    return out


#: keys whose values make another task or environment: the frontier's legend names them, not its point labels
CONTEXT_KEYS = ("env", "data", "data.task", "data.path", "data.digits", "data.ops", "data.word_problems")
#: the line style of each (task, environment) of a frontier, in sorted order (the colour is the algorithm's), and the
#: marker of its policy before training
CONTEXT_STYLES = ("-", ":", "-.", (0, (5, 1, 1, 1)))
REFERENCE_MARKERS = ("*", "P", "X", "h")


def frontier_contexts(runs: list[dict]) -> tuple[dict[int, tuple], bool, bool]:
    """Each run's (task, environment) (``load_runs``' ``task`` and ``env``; None where unknown), by ``id(run)``, and
    whether the runs span more than one task / more than one environment (then the frontier's legend says which)."""
    context = {id(r): (r.get("task"), r.get("env")) for r in runs}
    return (context, len({c[0] for c in context.values()}) > 1, len({c[1] for c in context.values()}) > 1)


def plot_frontier(runs: list[dict], path: Path, keys: list[str] = ()) -> Path | None:
    """Reward after training against sqrt(KL to the reference), one line per algorithm, task and environment (the
    rewards of two tasks or environments are not on one scale: a line never joins them; the legend names the task and
    the environment where the runs span several, ``grpo · arithmetic 3-digit * · env=calculator``), each point labelled
    with its other swept values; the reference policy (the runs' evaluations before training, best-of-1) at d = 0, one
    star per task and environment."""
    name = _frontier_reward(runs)
    series, reference = defaultdict(list), defaultdict(list)
    context, tasks, envs = frontier_contexts(runs)
    shown = [k for k in keys if k != "algo" and not (k in CONTEXT_KEYS and (tasks or envs))]
    labels = dict(zip((id(r) for r in runs), run_labels(runs, shown, named=True) if shown else
                      [str(r["summary"].get("algo")) for r in runs]))

    def named(first: str, where: tuple) -> str:  # an unknown task or environment (a run of an earlier prefzoo): "?"
        task, env = ("?" if w is None else str(w) for w in where)
        return " · ".join([first, *([task] if tasks else []), *([f"env={env}"] if envs else [])])

    for run in runs:
        kl, reward = metric(run, "kl_k1"), metric(run, name)
        where = context[id(run)]
        if is_number(kl) and is_number(reward):
            series[(str(run["summary"].get("algo", "?")), *where)].append(
                (math.sqrt(max(kl, 0.0)), reward, labels[id(run)]))
        kl0, reward0 = metric(run, "kl_k1", "eval_before"), metric(run, name, "eval_before")
        if is_number(kl0) and is_number(reward0):
            reference[where].append((math.sqrt(max(kl0, 0.0)), reward0))
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    order = sorted({k[1:] for k in series} | set(reference), key=str)  # the (task, env) pairs: one line style each
    for where, points in sorted(reference.items(), key=lambda item: str(item[0])):
        # one star per task and environment, under the runs' points: every run of a sweep starts from one policy
        marker = REFERENCE_MARKERS[order.index(where) % len(REFERENCE_MARKERS)]
        ax.plot([sum(p[0] for p in points) / len(points)], [sum(p[1] for p in points) / len(points)], marker,
                color="0.6", ms=14 if marker == "*" else 10, zorder=1, label=named("before training (π_ref)", where))
    style = algo_styles(runs)
    for (algo, *where), points in sorted(series.items(), key=lambda item: str(item[0])):
        points.sort()
        line = CONTEXT_STYLES[order.index(tuple(where)) % len(CONTEXT_STYLES)]
        ax.plot([p[0] for p in points], [p[1] for p in points], zorder=2, label=named(algo, tuple(where)),
                ls="--" if algo == "bon" and line == "-" else line, **style[algo])
    ax.set_xlabel(D_LABEL)
    ax.set_ylabel(("mean reward of temperature-1 samples" if name == "sample_reward" else "reward of greedy answers")
                  + "\n(run's reward, held-out prompts)")
    ax.set_title("Reward–KL frontier (after training)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    pts = [p for points in series.values() for p in points]
    coincide = len({(round(p[0], 3), round(p[1], 3)) for p in pts}) < len(pts)  # points hidden under others
    labelled = len(pts) <= 30 and (bool(shown) or coincide)
    if labelled:
        _pad_limits(ax)
    _readable_limits(ax)
    lo, hi = ax.get_xlim()
    ax.set_xlim(max(lo, -0.05 * hi), hi)  # d >= 0: no room for negative values
    if labelled:
        fig.tight_layout()
        place_labels(ax, [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts])
        return _save(fig, path, plt, layout=False)
    return _save(fig, path, plt)


def _pad_limits(ax, share: float = 0.15) -> None:
    """Widen the axes' limits by ``share`` of their span on each side (room for point labels); a zero span (every
    point alike) gets a span of its own."""
    _readable_limits(ax)
    for get, set_ in ((ax.get_xlim, ax.set_xlim), (ax.get_ylim, ax.set_ylim)):
        lo, hi = get()
        span = hi - lo
        set_(lo - share * span, hi + share * span)


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


MARKERS = "osD^v<>p"


def _dodge(xs: list[float], i: int, n: int, logx: bool, span: tuple[float, float]) -> list[float]:
    """x positions of line ``i`` of ``n`` shifted sideways a little (1.5% of the axis per line), so that lines with
    the same values stay visible side by side."""
    if n <= 1:
        return xs
    share = 0.015 * (i - (n - 1) / 2)
    lo, hi = span
    if logx:
        return [x * (hi / lo) ** share for x in xs]
    return [x + share * ((hi - lo) or 1.0) for x in xs]


def _xspan(runs: list[dict], key: str) -> tuple[float, float]:
    xs = [r["overrides"].get(key) for r in runs if is_number(r["overrides"].get(key))]
    return (min(xs), max(xs)) if xs else (0.0, 1.0)


def plot_against(runs: list[dict], key: str, keys: list[str], name: str, path: Path) -> Path | None:
    """``name`` after training against the swept setting ``key``, one line per combination of the others (each
    its own colour and marker, shifted sideways a little so that equal lines stay visible)."""
    lines = _lines(runs, key, keys, name)
    if not lines:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    logx = _log_axis([p[0] for pts in lines.values() for p in pts])
    for i, (label, points) in enumerate(sorted(lines.items())):
        points.sort()
        se = [p[2] if is_number(p[2]) else 0.0 for p in points]
        xs = _dodge([p[0] for p in points], i, len(lines), logx, _xspan(runs, key))
        ax.errorbar(xs, [p[1] for p in points], yerr=se, marker=MARKERS[i % len(MARKERS)], capsize=3, label=label)
    if logx:
        ax.set_xscale("log")
    if name in ("task_accuracy", "preference_accuracy", "ood_task_accuracy"):
        ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel(key + (" (log scale)" if logx else ""))
    ax.set_ylabel(f"{AXIS_LABELS.get(name, name)}\nafter training")
    ax.set_title(f"{name} against {key} (error bars: ± 1 s.e.)")
    if len(lines) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path, plt)


def plot_diversity(runs: list[dict], key: str, keys: list[str], path: Path) -> Path | None:
    """Distinct-1/2, entropy and KL after training against a numeric swept setting (Kirk et al. 2024): one colour
    per combination of the other swept settings, one marker and line style per metric; grey: before training."""
    panels = [("distinct_1", "distinct_2"), ("entropy",), ("kl_k1",)]
    if not any(_lines(runs, key, keys, m) for m in ("distinct_1", "distinct_2", "entropy")):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    logx = _log_axis([r["overrides"].get(key) for r in runs])
    span = _xspan(runs, key)
    ylabels = ["distinct-n across samples of a prompt", "entropy [nats / token]", "KL(π ‖ π_ref) [nats / completion]"]
    groups = sorted({label for m in ("distinct_1", "distinct_2", "entropy", "kl_k1")
                     for label in _lines(runs, key, keys, m)})
    styles = ("-", "--")
    for ax, names, ylabel in zip(axes, panels, ylabels):
        for i, name in enumerate(names):
            lines = _lines(runs, key, keys, name)
            for label, points in sorted(lines.items()):
                points.sort()
                g = groups.index(label)
                tag = name if len(keys) <= 1 else f"{name}, {label}"
                ax.plot(_dodge([p[0] for p in points], g, len(groups), logx, span), [p[1] for p in points],
                        marker=MARKERS[i], ls=styles[i], color=f"C{g}", label=tag)
            before = [metric(r, name, "eval_before") for r in runs]
            before = [b for b in before if is_number(b)]
            if before:  # the policy before training (the same for every run of a sweep that shares its seed)
                ax.axhline(sum(before) / len(before), color="0.45", ls=(":" if i else "-."), lw=1,
                           label=f"{name} before training")
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
    points = [(metric(r, "distinct_2"), metric(r, name), label, str(r["summary"].get("algo")))
              for r, label in zip(runs, run_labels(runs, keys, named=True))]
    points = [p for p in points if is_number(p[0]) and is_number(p[1])]
    if len(points) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    style = algo_styles(runs)
    algos = sorted({p[3] for p in points})
    for algo in algos:
        mine = [p for p in points if p[3] == algo]
        ax.plot([p[0] for p in mine], [p[1] for p in mine], ls="none", label=algo, **style[algo])
    if len(algos) > 1:
        ax.legend(fontsize=8)
    ax.set_xlabel("distinct-2 across samples of a prompt (higher: more diverse)")
    ax.set_ylabel(("mean reward of temperature-1 samples" if name == "sample_reward" else "reward of greedy answers"))
    ax.set_title("Reward against diversity, one point per run (after training)")
    ax.grid(alpha=0.3)
    _pad_limits(ax)
    lo, hi = ax.get_xlim()
    ax.set_xlim(lo, min(hi, 1.0 + 0.05 * (hi - lo)))  # distinct-2 <= 1
    fig.tight_layout()
    place_labels(ax, [p[0] for p in points], [p[1] for p in points], [p[2] for p in points])
    return _save(fig, path, plt, layout=False)


#: the panels of :func:`plot_per_run`, in order, with their titles
PER_RUN = {"task_accuracy": "task accuracy (exact match)", "task_reward": "reward of greedy answers",
           "sample_reward": "reward of samples (mean)", "gold_sample_reward": "gold reward of samples",
           "preference_accuracy": "preference accuracy (held-out pairs)", "kl_k1": "KL(π ‖ π_ref) [nats / completion]",
           "entropy": "entropy [nats / token]", "distinct_2": "distinct-2 across samples"}


def plot_per_run(runs: list[dict], keys: list[str], path: Path) -> Path | None:
    """One panel per evaluation key measured (:data:`PER_RUN`), one point per run (± 1 s.e.), labelled by its swept
    values and coloured by algorithm; a black bar marks the run's value before training."""
    names = [m for m in PER_RUN if any(is_number(metric(r, m)) for r in runs)]
    if not names:
        return None
    from matplotlib.lines import Line2D

    labels = run_labels(runs, keys)
    style = algo_styles(runs)
    algos = list(style)
    colour = {a: st["color"] for a, st in style.items()}
    plt = _plt()
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    width = max(3.0, 0.5 * len(runs) + 1.6)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, 3.2 * rows + 1.0), squeeze=False)
    xs = list(range(len(runs)))
    rotate = sum(len(label) for label in labels) > 5 * width
    for ax, name in zip(axes.flat, names):
        for x, run in zip(xs, runs):
            value, se, before = metric(run, name), metric(run, f"{name}_se"), metric(run, name, "eval_before")
            if is_number(before):
                ax.plot([x], [before], "_", color="k", ms=16, mew=2)
            if is_number(value):
                st = style[str(run["summary"].get("algo"))]
                ax.errorbar([x], [value], yerr=[se] if is_number(se) else None, fmt=st["marker"], ms=7, capsize=3,
                            color=st["color"])
            else:
                ax.annotate("not measured", (x, 0.5), xycoords=("data", "axes fraction"), rotation=90, ha="center",
                            va="center", fontsize=7, color="0.4")
        if name in ("task_accuracy", "preference_accuracy"):
            ax.set_ylim(-0.03, 1.03)
        if name == "preference_accuracy":
            ax.axhline(0.5, color="0.5", ls=":", lw=1)
        ax.set_xlim(-0.6, len(runs) - 0.4)
        ax.set_title(PER_RUN[name], fontsize=9)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=30 if rotate else 0, ha="right" if rotate else "center", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    handles = [Line2D([], [], color="k", marker="_", ms=12, mew=2, ls="none", label="before training")]
    handles += [Line2D([], [], color=colour[a], marker=style[a]["marker"], ls="none", label=a)
                for a in algos]
    if "preference_accuracy" in names:
        handles.append(Line2D([], [], color="0.5", ls=":", label="chance (0.5)"))
    fig.suptitle("Held-out evaluation per run" + (f" (swept: {', '.join(keys)})" if keys else "")
                 + "; error bars ± 1 s.e.", fontsize=10)
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.3 / fig.get_figheight()))
    for ax in axes.flat:
        _readable_limits(ax)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.55 / fig.get_figheight()))
    return _save(fig, path, plt, layout=False)


def accuracy_against_time(run: dict) -> list[tuple[float, float, float | None]]:
    """A run's held-out ``task_accuracy`` against the training time it had cost: ``[(minutes, accuracy, s.e. or
    None)]`` in step order, one per evaluation of ``eval_history`` (before training at 0 minutes), minutes from
    :func:`~prefzoo.report.runs.training_seconds` (time in training steps; the evaluations' own time is left out).
    Empty when the run measured no accuracy or its ``metrics.jsonl`` gives no step times; an evaluation whose step has
    no logged time (a step beyond the file) is left out."""
    seconds = training_seconds(run)
    if seconds is None:
        return []
    points = []
    for e in eval_history(run):
        step, acc = e.get("step"), e.get("task_accuracy")
        if isinstance(step, int) and step in seconds and is_number(acc):
            se = e.get("task_accuracy_se")
            points.append((seconds[step] / 60.0, float(acc), float(se) if is_number(se) else None))
    return points


def plot_accuracy_vs_time(runs: list[dict], keys: list[str], path: Path) -> Path | None:
    """``accuracy_vs_time.png``: held-out task accuracy (± 1 s.e.) against minutes of training, one line per run
    (:func:`accuracy_against_time`), labelled by its swept values: which method reaches an accuracy soonest, and
    where each levels off. None when fewer than two points in all were measured (nothing to compare)."""
    series = [(label, accuracy_against_time(run)) for run, label in zip(runs, run_labels(runs, keys))]
    series = [s for s in series if s[1]]
    if sum(len(points) for _, points in series) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    for i, (label, points) in enumerate(series):
        xs, ys, ses = zip(*points)
        ax.errorbar(xs, ys, yerr=[0.0 if se is None else se for se in ses], marker="osD^v<>p"[i % 8], ms=5,
                    capsize=3, color=_colour(i), label=label)
    ax.set_xlabel("training time [minutes in training steps; evaluations excluded]")
    ax.set_ylabel(AXIS_LABELS["task_accuracy"])
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title("Held-out task accuracy against training time; error bars ± 1 s.e.", fontsize=10)
    return _save(fig, path, plt)


def plot_overoptimisation(points: dict, fits: list[dict], path: Path) -> Path | None:
    """Gold (top) and proxy (bottom) reward against d, best-of-n (left) and RL (right), with the fitted forms; a kind
    with no points (e.g. an RL run without best-of-n) gets no column."""
    if not points["bon"] and not points["rl"]:
        return None
    import numpy as np

    plt = _plt()
    groups = [g for g in (("best-of-n", [("best-of-n", points["bon"])] if points["bon"] else []),
                          ("RL", list(points["rl"].items()))) if g[1]]
    fig, axes = plt.subplots(2, len(groups), figsize=(8.5 * len(groups), 8), sharex="col", squeeze=False)
    fitted = {(f["series"], f["reward"]): f["fit"] for f in fits}
    for col, (title, series) in enumerate(groups):
        rl = title == "RL"
        for row, (which, idx) in enumerate((("gold", 1), ("proxy", 2))):
            ax = axes[row, col]
            for i, (name, pts) in enumerate(series):
                gold_peak = max(pts, key=lambda p: p[1]) if pts else None
                pts = [p for p in pts if p[idx] is not None]
                if not pts:
                    continue
                color = f"C{i}"
                if gold_peak is not None and gold_peak[0] < max(p[0] for p in pts):  # gold's peak before the end
                    ax.axvline(gold_peak[0], color=color, ls="--", lw=0.8, alpha=0.7,
                               label=f"gold peak (measured), d={gold_peak[0]:.2f}")
                ses = [p[5] if which == "gold" and len(p) > 5 and is_number(p[5]) else 0.0 for p in pts]
                ax.errorbar([p[0] for p in pts], [p[idx] for p in pts], yerr=ses if any(ses) else None,
                            fmt="o:" if rl else "s", color=color, lw=0.8, capsize=2, elinewidth=0.6,
                            label=f"{name}: measured" + (" (in step order)" if rl else "")
                            + (" ± 1 s.e." if any(ses) else ""))
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
                ax.set_xlabel(D_LABEL + ("\n(best-of-n: analytic log n − (n−1)/n)" if not rl else
                                         "\n(RL: k1 estimate, one point per evaluation during training)"), fontsize=8)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # beside the panel: inside, it hid the points
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.suptitle("Overoptimisation (Gao et al. 2023):" + (" " if len(groups) > 1 else "\n")
                 + "gold and proxy reward against d = sqrt(KL)")
    return _save(fig, path, plt)


def plot_bon_vs_rl(points: dict, fits: list[dict], path: Path) -> Path | None:
    """Best-of-n and RL on one d axis (note 004: "best-of-n is more robust at small KL"): gold (left) and proxy
    (right), measured points and fitted forms; None unless both best-of-n and an RL run have points."""
    if not points["bon"] or not points["rl"]:
        return None
    import numpy as np

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    fitted = {(f["series"], f["reward"]): f["fit"] for f in fits}
    series = [("best-of-n", points["bon"], "s-")] + [(name, pts, "o:") for name, pts in points["rl"].items()]
    for ax, (which, idx) in zip(axes, (("gold", 1), ("proxy", 2))):
        for i, (name, pts, style) in enumerate(series):
            pts = sorted((p for p in pts if p[idx] is not None), key=lambda p: (p[3] or 0, p[0]))
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[idx] for p in pts], style[0], color=f"C{i}", ls="none", label=name)
            f = fitted.get((name, which))
            if f is not None:  # over the series' own range (a fit extrapolated far says little)
                grid = np.linspace(0, max(p[0] for p in pts) * 1.05, 200)
                ax.plot(grid, f(grid), "-", color=f"C{i}", alpha=0.6, lw=1)
        ax.set_title(f"{which} reward" + (" (the evaluation's gold reward)" if which == "gold"
                                          else " (the proxy the runs optimise)"), fontsize=9)
        ax.set_ylabel(f"{which} reward, mean over temperature-1 samples", fontsize=8)
        ax.set_xlabel(D_LABEL + "\n(best-of-n: analytic; RL: k1 estimate per evaluation)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Best-of-n against RL at the same KL (points measured; lines: the fitted forms of Gao et al. 2023)")
    return _save(fig, path, plt)


def plot_speed_shape(results: list[dict], path: Path) -> Path | None:
    """Gold against d for each RL run of the beta test (left; colour: beta, line style: seed; shaded: the common range
    compared) and d against training step (right: the speed); one row per algorithm tested."""
    if not results:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4.5 * len(results)), squeeze=False)
    styles = ("-", "--", ":", "-.")
    for (left, right), r in zip(axes, results):
        colour = {b: f"C{i}" for i, b in enumerate(r["betas"])}
        for c in r["curves"]:
            ls = styles[r["seeds"][c.beta].index(c.seed) % len(styles)]
            tag = f"β={c.beta:g}, seed {c.seed}"
            left.plot(c.d, c.gold, marker="o", ms=3, ls=ls, color=colour[c.beta], label=tag)
            right.plot(c.steps, c.d_by_step, marker="o", ms=3, ls=ls, color=colour[c.beta], label=tag)
        if r["d_hi"] > r["d_lo"]:
            left.axvspan(r["d_lo"], r["d_hi"], color="0.85", alpha=0.5, label="common range (compared)")
        ratio = "–" if r["ratio"] != r["ratio"] else f"{r['ratio']:.2f}"
        left.set_title(f"{r['algo']}: gold against d; S_β = {r['beta_spread']:.3g}, S_seed = {r['seed_spread']:.3g}, "
                       f"ρ = {ratio}", fontsize=9)
        left.set_xlabel(D_LABEL, fontsize=8)
        left.set_ylabel("gold reward, mean over temperature-1 samples", fontsize=8)
        right.set_title(f"{r['algo']}: d against training step (the speed)", fontsize=9)
        right.set_xlabel("training step", fontsize=8)
        right.set_ylabel("d = sqrt(KL) [sqrt(nats)]", fontsize=8)
        for ax in (left, right):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Beta sets the speed, not the shape? The same RL run at several betas (and seeds)")
    return _save(fig, path, plt)


CAPTIONS = {
    "accuracy_vs_time": "Held-out task accuracy (greedy, ± 1 s.e.) at each evaluation against the minutes the run had "
                        "spent in training steps by then (metrics.jsonl's time/step summed; evaluations excluded), one "
                        "line per run. Times are the machine's as the runs met it: compare runs taken under the same "
                        "load.",
    "frontier": "Reward–KL frontier: each run's reward after training against d = sqrt(KL(π ‖ π_ref)) on held-out "
                "samples, one line per algorithm, task and environment (best-of-n: analytic KL; a k1 estimate below 0 "
                "is drawn at d = 0); the grey star is the policy before training (one marker per task and environment).",
    "overoptimisation": "Gold (top) and proxy (bottom) reward against d = sqrt(KL): best-of-n (left, one point per n) "
                        "and RL (right, one point per evaluation during training), with the least-squares fits of "
                        "Gao et al. 2023; dashed verticals: where each series' gold peaks (measured), drawn in the "
                        "proxy panels too, so a proxy still rising past gold's peak shows.",
    "bon_vs_rl": "Best-of-n and RL against the same d = sqrt(KL): gold (left) and proxy (right), measured points "
                 "and the fitted forms; the report's table gives best-of-n minus RL at equal d.",
    "speed_shape": "The same RL run at several betas (and seeds): gold against d (left; shaded: the range every run "
                   "reached, where the curves are compared) and d against training step (right). Beta sets the speed, "
                   "not the shape, when the curves lie on one another (ρ = S_β / S_seed near 1).",
    "reward_vs_diversity": "Reward against distinct-2 of each run's samples: the reward–diversity trade-off.",
    "ood": "In and out of distribution (Kirk et al. 2024): each run's accuracy on the shifted task of eval.ood against "
           "its accuracy on the training task's held-out split (left; dotted: OOD = ID), and the distinct-2 of its "
           "temperature-1 samples in (filled) and out of (open) distribution (right).",
    "metrics_per_run": "Each run's held-out evaluation after training, one point per run (± 1 standard error), one "
                       "panel per measured metric; black bars: the same run before training.",
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
