"""Compare runs: ``python -m prefzoo.report DIR`` turns a folder of runs (a Hydra multirun) into a table and plots.

It reads every ``summary.json`` under DIR and each run's ``.hydra/overrides.yaml``; the overrides whose
values differ between runs are the swept settings and become the table's first columns. It writes

* ``report.md`` — one row per run: swept values, then the evaluation after training (± standard error),
  KL to the reference, diversity and times, with a legend saying what each column measures;
* ``frontier.png`` — reward against d = sqrt(KL to the reference) per algorithm (the reward-KL frontier;
  Gao et al. 2023 plot reward against d), the reference policy at d = 0;
* ``<metric>_vs_<setting>.png`` — each headline metric against each numeric swept setting, one line per
  value of the other swept settings (a log axis when the setting spans a factor of 10 or more);
* ``diversity_vs_<setting>.png`` — distinct-1/2, entropy and KL against a numeric swept setting (Kirk et al.
  2024), and ``reward_vs_diversity.png`` — reward against distinct-2, one point per run;
* with a gold reward in the evaluations (``eval.gold_reward``): ``overoptimisation.png`` and a section with
  the least-squares fits R_bon(d) = d(a - b d) and R_RL(d) = d(a - b log d) of Gao et al. 2023
  (:mod:`prefzoo.report.overoptimisation`) and where the gold reward peaks;

and prints where it wrote them. :class:`prefzoo.report.callbacks.WriteReport` runs it at the end of a Hydra multirun.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import yaml

HEADLINE = ("task_accuracy", "task_reward", "sample_reward", "gold_task_reward", "gold_sample_reward",
            "preference_accuracy", "kl_k1", "entropy", "distinct_1", "distinct_2")

#: what each evaluation key measures (table legend, axis labels)
DESCRIPTION = {
    "task_accuracy": "exact-match accuracy of the greedy answer to each held-out prompt",
    "task_reward": "the run's reward of the greedy answer (the PROXY when a gold reward is evaluated)",
    "sample_reward": "the run's reward, mean over temperature-1 samples (the proxy when a gold reward is evaluated)",
    "gold_task_reward": "the gold reward (eval.gold_reward) of the greedy answer",
    "gold_sample_reward": "the gold reward, mean over temperature-1 samples",
    "preference_accuracy": "held-out pairs ranked right by the implicit (or reward-model) reward; ties count 1/2",
    "kl_k1": "KL(π ‖ π_ref) in nats per completion: k1 estimate on temperature-1 samples; best-of-n: the analytic "
             "log n − (n−1)/n (exact without reward ties, an upper bound otherwise)",
    "entropy": "mean per-token entropy of the policy on its samples (nats); none for best-of-n",
    "distinct_1": "distinct unigrams / all unigrams across the samples of one prompt, averaged over prompts",
    "distinct_2": "distinct bigrams / all bigrams across the samples of one prompt, averaged over prompts",
}

D_LABEL = "d = sqrt(KL(π ‖ π_ref)) on held-out samples [sqrt(nats)]"


def _value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def load_runs(root: Path) -> list[dict]:
    """Every run under ``root``: ``{"dir", "summary", "overrides": {key: value}, "job": bool}``, sorted by folder.

    ``job``: the run has Hydra's ``.hydra/overrides.yaml`` (a job of the sweep); a run without one (e.g. a
    recipe's prerequisite run, :class:`prefzoo.report.callbacks.TrainFirst`) is listed but does not decide which
    settings were swept."""
    runs = []
    for summary_path in sorted(Path(root).rglob("summary.json")):
        run_dir = summary_path.parent
        overrides = {}
        over_file = run_dir / ".hydra" / "overrides.yaml"
        if over_file.is_file():
            for item in yaml.safe_load(over_file.read_text()) or []:
                key, _, value = item.partition("=")
                overrides[key.lstrip("+~")] = _value(value)
        runs.append({"dir": run_dir, "summary": json.loads(summary_path.read_text()), "overrides": overrides,
                     "job": over_file.is_file()})
    return runs


def swept_keys(runs: list[dict]) -> list[str]:
    """Override keys whose value is not the same in every run of the sweep (in first-seen order)."""
    jobs = [r for r in runs if r.get("job", True)] or runs
    keys: dict[str, set] = {}
    for run in jobs:
        for k in run["overrides"]:
            keys.setdefault(k, set())
    for k in keys:
        keys[k] = {json.dumps(run["overrides"].get(k), default=str) for run in jobs}
    return [k for k, values in keys.items() if len(values) > 1]


def _fmt(value, se=None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        text = f"{value:.3f}"
        if se is not None and not (isinstance(se, float) and math.isnan(se)):
            text += f" ± {se:.3f}"
        return text
    return str(value)


def _setting(value) -> str:
    """A swept value as the user wrote it on the command line."""
    return "–" if value is None else str(value)


def metric(run: dict, name: str, when: str = "eval_after"):
    return (run["summary"].get(when) or {}).get(name)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not (isinstance(x, float) and math.isnan(x))


def _is_bon(run: dict) -> bool:
    return run["summary"].get("algo") == "bon"


def _analytic(run: dict) -> bool:
    return metric(run, "kl_method") == "analytic"


def markdown_table(runs: list[dict], keys: list[str], metrics=HEADLINE) -> str:
    present = [m for m in metrics if any(metric(r, m) is not None for r in runs)]
    stops = any(r["summary"].get("stop_reason") not in (None, "max_steps") for r in runs)
    header = ["run", *keys, "algo", "beta", *present, "Δ task (after − before)", "steps",
              *(["stop"] if stops else []), "train s", "wall s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        s = run["summary"]
        main = "task_accuracy" if metric(run, "task_accuracy") is not None else "task_reward"
        before, after = metric(run, main, "eval_before"), metric(run, main)
        delta = after - before if _number(before) and _number(after) else None
        cells = []
        for m in present:
            cell = _fmt(metric(run, m), metric(run, f"{m}_se") if m != "kl_k1" or not _analytic(run) else None)
            if m in ("kl_k1",) and _analytic(run) and cell != "–":
                cell += " (analytic)"
            cells.append(cell)
        train_s = (s.get("results") or {}).get("train_seconds")
        row = [run["dir"].name, *[_setting(run["overrides"].get(k)) for k in keys], s.get("algo"),
               "–" if _is_bon(run) else _fmt(s.get("beta")), *cells, _fmt(delta), _fmt(s.get("steps")),
               *([s.get("stop_reason") or "–"] if stops else []), _fmt(train_s), _fmt(s.get("wall_seconds"))]
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def legend(runs: list[dict], metrics=HEADLINE) -> str:
    present = [m for m in metrics if any(metric(r, m) is not None for r in runs)]
    text = "Columns (evaluation after training, held-out prompts; ± one standard error):\n\n"
    text += "".join(f"- `{m}`: {DESCRIPTION[m]}\n" for m in present if m in DESCRIPTION)
    text += ("- `Δ task`: task_accuracy (else task_reward) after minus before training; `train s`: seconds in "
             "training steps; `wall s`: the whole run after model loading, evaluations included.\n")
    return text


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
        if _number(kl) and _number(reward):
            series[run["summary"].get("algo", "?")].append((math.sqrt(max(kl, 0.0)), reward))
        kl0, reward0 = metric(run, "kl_k1", "eval_before"), metric(run, name, "eval_before")
        if _number(kl0) and _number(reward0):
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
    values = [v for v in values if _number(v)]
    return bool(values) and min(values) > 0 and max(values) / min(values) >= 10


def _lines(runs, key, keys, name):
    lines = defaultdict(list)
    for run in runs:
        x, y = run["overrides"].get(key), metric(run, name)
        if not _number(x) or not _number(y):
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
        se = [p[2] if _number(p[2]) else 0.0 for p in points]
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
            before = [b for b in before if _number(b)]
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
    points = [p for p in points if _number(p[0]) and _number(p[1])]
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


# ------------------------------------------------------------------------------------------- overoptimisation
def _history(run: dict) -> list[dict]:
    """The run's evaluations in step order: ``eval_history`` or, for older runs, before and after."""
    s = run["summary"]
    if s.get("eval_history"):
        return s["eval_history"]
    return [e for e in (s.get("eval_before"), s.get("eval_after")) if e]


def overoptimisation_points(runs: list[dict]) -> dict:
    """Points (d, gold, proxy) for best-of-n (one point per run: its n) and for each RL run (its evaluations
    during training), plus the baselines (mean rewards of the d = 0 points: the reference policy)."""
    bon, rl = [], {}
    for run in runs:
        s = run["summary"]
        if s.get("algo") == "rm":
            continue
        for e in _history(run):
            kl, gold, proxy = e.get("kl_k1"), e.get("gold_sample_reward"), e.get("sample_reward")
            if not (_number(kl) and _number(gold)):
                continue
            point = (math.sqrt(max(kl, 0.0)), gold, proxy if _number(proxy) else None, e.get("step"))
            if _is_bon(run):
                bon.append(point + ((s.get("algo_settings") or {}).get("n", run["overrides"].get("algo.n")),))
            else:
                label = f"{s.get('algo')} β={s.get('beta'):g}" if _number(s.get("beta")) else str(s.get("algo"))
                rl.setdefault(f"{label} ({run['dir'].name})", []).append(point)
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
    points, each RL run with d(a - b log d) on its trajectory. Rewards relative to the d = 0 baseline."""
    from prefzoo.report.overoptimisation import fit, observed_peak

    out = []
    series = [("best-of-n", "bon", points["bon"])] + [(name, "rl", pts) for name, pts in points["rl"].items()]
    for name, form, pts in series:
        for which, col, base in (("gold", 1, points["gold0"]), ("proxy", 2, points["proxy0"])):
            pts_ok = [p for p in pts if p[col] is not None]
            if sum(p[0] > 0 for p in pts_ok) < 2:
                continue
            d, r = [p[0] for p in pts_ok], [p[col] for p in pts_ok]
            f = fit(form, d, r, baseline=base or 0.0)
            out.append({"series": name, "reward": which, "form": form, "fit": f, "observed_peak": observed_peak(d, r),
                        "d_max": max(d)})
    return out


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


def overoptimisation_section(points: dict, fits: list[dict]) -> str:
    lines = ["## Overoptimisation: gold vs proxy reward\n",
             "Gold = `gold_sample_reward`, proxy = `sample_reward` (the run's reward), both means over temperature-1 "
             "samples of held-out prompts; d = sqrt(KL(π ‖ π_ref)): best-of-n the analytic log n − (n−1)/n, RL the k1 "
             "estimate at each evaluation during training (step 0 = the reference). Fits by least squares on the "
             "rewards minus the reward at d = 0 "
             f"(gold {_fmt(points['gold0'])}, proxy {_fmt(points['proxy0'])}): best-of-n R(d) = d(a − b·d), "
             "RL R(d) = d(a − b·log d) (Gao et al. 2023, eq. 1–2). Fitted peak: d* = a/(2b) (best-of-n) or "
             "exp(a/b − 1) (RL), reward at the peak = baseline + R(d*); none when b ≤ 0 (still rising).\n",
             "| series | reward | form | a | b | R² | points | fitted peak d* | fitted peak reward | "
             "measured peak (d, reward) | largest d measured |", "|" + "---|" * 11]
    for f in fits:
        fit_ = f["fit"]
        peak = fit_.peak
        peak_d = _fmt(peak[0]) if peak else "none (b ≤ 0)"
        peak_r = _fmt(peak[1] + fit_.baseline) if peak else "–"
        if peak and peak[0] > 3 * f["d_max"]:
            peak_d += " (extrapolated)"
        form = "d(a − b·d)" if fit_.form == "bon" else "d(a − b·log d)"
        od, orr = f["observed_peak"]
        lines.append(f"| {f['series']} | {f['reward']} | {form} | {fit_.a:.4g} | {fit_.b:.4g} | {_fmt(fit_.r2)} | "
                     f"{fit_.n} | {peak_d} | {peak_r} | ({od:.3f}, {orr:.3f}) | {f['d_max']:.3f} |")
    if not fits:
        lines.append("\nNo fit: no series has 2 or more points with d > 0.")
    rows = ["\nMeasured points (d, gold, proxy):\n", "| series | step or n | d | gold | proxy |", "|---|---|---|---|---|"]
    for p in points["bon"]:
        rows.append(f"| best-of-n | n={p[4]} | {p[0]:.3f} | {p[1]:.3f} | {_fmt(p[2])} |")
    for name, pts in points["rl"].items():
        for p in pts:
            rows.append(f"| {name} | step {p[3]} | {p[0]:.3f} | {p[1]:.3f} | {_fmt(p[2])} |")
    return "\n".join(lines) + "\n" + "\n".join(rows) + "\n"


# ------------------------------------------------------------------------------------------------- the report
CAPTIONS = {
    "frontier": "Reward–KL frontier: each run's reward after training against d = sqrt(KL(π ‖ π_ref)) on held-out "
                "samples, one line per algorithm (best-of-n: analytic KL); the star is the policy before training.",
    "overoptimisation": "Gold (top) and proxy (bottom) reward against d = sqrt(KL): best-of-n (left, one point per n) "
                        "and RL (right, one point per evaluation during training), with the least-squares fits of "
                        "Gao et al. 2023.",
    "reward_vs_diversity": "Reward against distinct-2 of each run's samples: the reward–diversity trade-off.",
}


def _caption(path: Path) -> str:
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


def write_report(root: Path, out: Path | None = None) -> dict:
    """Write ``report.md`` and the plots for the runs under ``root`` into ``out`` (default: ``root``)."""
    runs = load_runs(root)
    if not runs:
        raise SystemExit(f"prefzoo.report: no summary.json under {root}: point it at a run or multirun folder.")
    out = Path(out or root)
    out.mkdir(parents=True, exist_ok=True)
    keys = swept_keys(runs)
    table = markdown_table(runs, keys)
    plots = [p for p in [plot_frontier(runs, out / "frontier.png")] if p]
    numeric = [k for k in keys if any(_number(r["overrides"].get(k)) for r in runs)]
    for key in numeric:
        for name in HEADLINE:
            p = plot_against(runs, key, keys, name, out / f"{name}_vs_{key.replace('/', '_')}.png")
            if p:
                plots.append(p)
        p = plot_diversity(runs, key, keys, out / f"diversity_vs_{key.replace('/', '_')}.png")
        if p:
            plots.append(p)
    p = plot_reward_vs_diversity(runs, keys, out / "reward_vs_diversity.png")
    if p:
        plots.append(p)
    text = f"# prefzoo report: {root}\n\n{len(runs)} runs; swept: {', '.join(keys) or 'nothing'}.\n\n{table}\n"
    text += legend(runs) + "\n"
    fits = []
    points = overoptimisation_points(runs)
    if points["bon"] or points["rl"]:
        fits = fit_overoptimisation(points)
        p = plot_overoptimisation(points, fits, out / "overoptimisation.png")
        if p:
            plots.insert(0, p)
        text += overoptimisation_section(points, fits) + "\n"
    text += "## Plots\n\n" + "".join(f"![{p.stem}]({p.name})\n\n*{_caption(p)}*\n\n" for p in plots)
    (out / "report.md").write_text(text)
    return {"report": out / "report.md", "plots": plots, "runs": len(runs), "swept": keys, "fits": fits}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prefzoo.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="a run folder or a multirun folder")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: DIR)")
    args = parser.parse_args(argv)
    result = write_report(args.dir, args.out)
    print(f"{result['runs']} runs, swept: {', '.join(result['swept']) or 'nothing'}")
    print(f"wrote {result['report']}")
    for p in result["plots"]:
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
