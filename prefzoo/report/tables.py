"""The report's markdown: the table of runs, its legend, and the over-optimisation section."""

from __future__ import annotations

import math

from prefzoo.report.runs import DESCRIPTION, HEADLINE, analytic_kl, is_best_of_n, is_number, metric

__all__ = ["fmt", "markdown_table", "legend", "overoptimisation_section"]


def fmt(value, se=None) -> str:
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
        delta = after - before if is_number(before) and is_number(after) else None
        cells = []
        for m in present:
            cell = fmt(metric(run, m), metric(run, f"{m}_se") if m != "kl_k1" or not analytic_kl(run) else None)
            if m in ("kl_k1",) and analytic_kl(run) and cell != "–":
                cell += " (analytic)"
            cells.append(cell)
        train_s = (s.get("results") or {}).get("train_seconds")
        row = [run["dir"].name, *[_setting(run["overrides"].get(k)) for k in keys], s.get("algo"),
               "–" if is_best_of_n(run) else fmt(s.get("beta")), *cells, fmt(delta), fmt(s.get("steps")),
               *([s.get("stop_reason") or "–"] if stops else []), fmt(train_s), fmt(s.get("wall_seconds"))]
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def legend(runs: list[dict], metrics=HEADLINE) -> str:
    present = [m for m in metrics if any(metric(r, m) is not None for r in runs)]
    text = "Columns (evaluation after training, held-out prompts; ± one standard error):\n\n"
    text += "".join(f"- `{m}`: {DESCRIPTION[m]}\n" for m in present if m in DESCRIPTION)
    text += ("- `Δ task`: task_accuracy (else task_reward) after minus before training; `train s`: seconds in "
             "training steps; `wall s`: the whole run after model loading, evaluations included.\n")
    return text


def overoptimisation_section(points: dict, fits: list[dict]) -> str:
    lines = ["## Overoptimisation: gold vs proxy reward\n",
             "Gold = `gold_sample_reward`, proxy = `sample_reward` (the run's reward), both means over temperature-1 "
             "samples of held-out prompts; d = sqrt(KL(π ‖ π_ref)): best-of-n the analytic log n − (n−1)/n, RL the k1 "
             "estimate at each evaluation during training (step 0 = the reference). Fits by least squares on the "
             "rewards minus the reward at d = 0 "
             f"(gold {fmt(points['gold0'])}, proxy {fmt(points['proxy0'])}): best-of-n R(d) = d(a − b·d), "
             "RL R(d) = d(a − b·log d) (Gao et al. 2023, eq. 1–2). Fitted peak: d* = a/(2b) (best-of-n) or "
             "exp(a/b − 1) (RL), reward at the peak = baseline + R(d*); none when b ≤ 0 (still rising).\n",
             "| series | reward | form | a | b | R² | points | fitted peak d* | fitted peak reward | "
             "measured peak (d, reward) | largest d measured |", "|" + "---|" * 11]
    for f in fits:
        fit_ = f["fit"]
        peak = fit_.peak
        peak_d = fmt(peak[0]) if peak else "none (b ≤ 0)"
        peak_r = fmt(peak[1] + fit_.baseline) if peak else "–"
        if peak and peak[0] > 3 * f["d_max"]:
            peak_d += " (extrapolated)"
        form = "d(a − b·d)" if fit_.form == "bon" else "d(a − b·log d)"
        od, orr = f["observed_peak"]
        lines.append(f"| {f['series']} | {f['reward']} | {form} | {fit_.a:.4g} | {fit_.b:.4g} | {fmt(fit_.r2)} | "
                     f"{fit_.n} | {peak_d} | {peak_r} | ({od:.3f}, {orr:.3f}) | {f['d_max']:.3f} |")
    if not fits:
        lines.append("\nNo fit: no series has 2 or more points with d > 0.")
    rows = ["\nMeasured points (d, gold, proxy):\n", "| series | step or n | d | gold | proxy |", "|---|---|---|---|---|"]
    for p in points["bon"]:
        rows.append(f"| best-of-n | n={p[4]} | {p[0]:.3f} | {p[1]:.3f} | {fmt(p[2])} |")
    for name, pts in points["rl"].items():
        for p in pts:
            rows.append(f"| {name} | step {p[3]} | {p[0]:.3f} | {p[1]:.3f} | {fmt(p[2])} |")
    return "\n".join(lines) + "\n" + "\n".join(rows) + "\n"
