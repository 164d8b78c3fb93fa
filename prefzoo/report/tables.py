"""The report's markdown: the table of runs, its legend, and the over-optimisation section."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from urllib.parse import quote

from prefzoo.report.runs import DESCRIPTION, HEADLINE, analytic_kl, is_best_of_n, is_number, metric

__all__ = ["fmt", "run_cell", "markdown_table", "legend", "overoptimisation_section", "speed_shape_section"]

#: a run folder named longer than this shows its job number (linked to the folder) in the table
RUN_NAME_WIDTH = 32


def fmt(value, se=None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        text = f"{value:.3f}".replace("-0.000", "0.000")  # no negative zero
        if se is not None and not (isinstance(se, float) and math.isnan(se)):
            text += f" ± {se:.3f}"
        return text
    return str(value)


def _setting(value) -> str:
    """A swept value as the user wrote it on the command line."""
    return "–" if value is None else str(value)


def _seconds(value) -> str:
    return f"{value:.1f}" if is_number(value) else "–"


def run_cell(run: dict, base: Path | None = None) -> str:
    """The run's folder, relative to ``base`` (where the report is): as it is when short, else its job number
    (``<n>-...`` of a sweep) or its beginning, linked to the folder; a folder outside ``base`` shows its own name,
    linked."""
    folder = Path(run["dir"])
    rel = Path(os.path.relpath(folder, base)).as_posix() if base is not None else folder.name
    outside = rel.startswith("../")  # a report written elsewhere (--out): the run's own name, linked
    if len(rel) <= RUN_NAME_WIDTH and not outside:
        return rel
    name = folder.name if outside else rel
    number = re.match(r"(\d+)-", name)
    text = name if len(name) <= RUN_NAME_WIDTH else number.group(1) if number else name[:RUN_NAME_WIDTH - 3] + "..."
    return f"[{text}]({quote(rel, safe='/=,+@[]')})"


def _resolved_beta_is_swept(runs: list[dict], keys: list[str]) -> bool:
    """``objective.beta`` is swept and every run's value is its resolved beta (then the beta column says nothing
    more)."""
    if "objective.beta" not in keys:
        return False
    values = [(r["overrides"].get("objective.beta"), r["summary"].get("beta")) for r in runs]
    return all(is_number(v) and is_number(b) and math.isclose(v, b) for v, b in values)


def _deltas(runs: list[dict]) -> list[float | None]:
    """Each run's task_accuracy (else task_reward) after minus before training, None where either is missing."""
    out = []
    for run in runs:
        main = "task_accuracy" if metric(run, "task_accuracy") is not None else "task_reward"
        before, after = metric(run, main, "eval_before"), metric(run, main)
        out.append(after - before if is_number(before) and is_number(after) else None)
    return out


def markdown_table(runs: list[dict], keys: list[str], metrics=HEADLINE, base: Path | None = None) -> str:
    """One row per run: its folder (:func:`run_cell`), the swept settings, the algorithm and its beta (unless
    swept), the evaluation after training, the change of the task metric, steps (and stop reasons) and times. A
    column that would be empty in every row is left out."""
    present = [m for m in metrics if any(metric(r, m) is not None for r in runs)]
    stops = any(r["summary"].get("stop_reason") not in (None, "max_steps") for r in runs)
    deltas = _deltas(runs)
    fixed = [*([] if "algo" in keys else ["algo"]), *([] if _resolved_beta_is_swept(runs, keys) else ["beta"])]
    delta = any(d is not None for d in deltas)
    header = ["run", *keys, *fixed, *present, *(["Δ task (after − before)"] if delta else []), "steps",
              *(["stop"] if stops else []), "train s", "wall s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run, d in zip(runs, deltas):
        s = run["summary"]
        cells = []
        for m in present:
            cell = fmt(metric(run, m), metric(run, f"{m}_se") if m != "kl_k1" or not analytic_kl(run) else None)
            if m in ("kl_k1",) and analytic_kl(run) and cell != "–":
                cell += " (analytic)"
            cells.append(cell)
        beta = "–" if is_best_of_n(run) or s.get("beta") is None else fmt(s.get("beta"))  # no KL term there
        train_s = (s.get("results") or {}).get("train_seconds")
        row = [run_cell(run, base), *[_setting(run["overrides"].get(k)) for k in keys],
               *[s.get("algo") if c == "algo" else beta for c in fixed], *cells, *([fmt(d)] if delta else []),
               fmt(s.get("steps")), *([s.get("stop_reason") or "–"] if stops else []), _seconds(train_s),
               _seconds(s.get("wall_seconds"))]
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def legend(runs: list[dict], metrics=HEADLINE, keys: list[str] = ()) -> str:
    present = [m for m in metrics if any(metric(r, m) is not None for r in runs)]
    text = "Columns (evaluation after training, held-out prompts; ± one standard error):\n\n"
    notes = {"kl_k1": " (k1 is unbiased but noisy: on few samples of a policy still close to π_ref it can come out "
                      "slightly below 0)"}
    text += "".join(f"- `{m}`: {DESCRIPTION[m]}{notes.get(m, '')}\n" for m in present if m in DESCRIPTION)
    delta = ("`Δ task`: task_accuracy (else task_reward) after minus before training; "
             if any(d is not None for d in _deltas(runs)) else "")
    beta = ("" if _resolved_beta_is_swept(runs, list(keys)) else
            "`beta`: the KL coefficient the run used (its algorithm's default unless set); ")
    stop = ("`stop`: why the run ended (max_steps; kl_budget: objective.kl_budget reached; early_stopping; "
            "no_training: best-of-n trains nothing); "
            if any(r["summary"].get("stop_reason") not in (None, "max_steps") for r in runs) else "")
    text += ("- `run`: the run's folder (a long name shows its job number, linked to the folder); "
             f"{beta}{delta}`steps`: training steps; {stop}`train s`: seconds in training steps; `wall s`: the whole "
             "run after model loading, evaluations included.\n")
    return text


def _pm(value: float, se: float | None, digits: int = 4) -> str:
    """``value ± se`` with ``digits`` significant digits (the s.e. left out where it is nan or None)."""
    text = f"{value:.{digits}g}"
    return text + (f" ± {se:.2g}" if se is not None and math.isfinite(se) else "")


def overoptimisation_section(points: dict, fits: list[dict], bon_vs_rl: list[dict] = ()) -> str:
    from prefzoo.report.overoptimisation import FALL_Z, peak_verdict

    lines = ["## Overoptimisation: gold vs proxy reward\n",
             "Gold = `gold_sample_reward`, proxy = `sample_reward` (the run's reward), both means over temperature-1 "
             "samples of held-out prompts; d = sqrt(KL(π ‖ π_ref)): best-of-n the analytic log n − (n−1)/n, RL the k1 "
             "estimate at each evaluation during training (step 0 = the reference). Fits by least squares on the "
             "rewards minus the reward at d = 0 (an RL run's own evaluation before training, best-of-n's best-of-1; "
             f"without one, the mean of the d = 0 points: gold {fmt(points['gold0'])}, proxy {fmt(points['proxy0'])}): "
             "best-of-n R(d) = d(a − b·d), "
             "RL R(d) = d(a − b·log d) (Gao et al. 2023, eq. 1–2), ± one standard error (least squares: "
             "s²(XᵀX)⁻¹, s² = RSS/(n − 2); the peak's by the delta method). Fitted peak: d* = a/(2b) (best-of-n) or "
             "exp(a/b − 1) (RL), reward at the peak = baseline + R(d*); none when b ≤ 0 (still rising).\n",
             "| series | reward | form | a | b | R² | points | fitted peak d* | fitted peak reward | "
             "measured peak (d, reward) | largest d measured |", "|" + "---|" * 11]
    for f in fits:
        fit_ = f["fit"]
        peak, peak_se = fit_.peak, fit_.peak_se
        peak_d = _pm(peak[0], peak_se[0]) if peak else "none (b ≤ 0)"
        peak_r = _pm(peak[1] + fit_.baseline, peak_se[1]) if peak else "–"
        if peak and peak[0] > 3 * f["d_max"]:
            peak_d += " (extrapolated)"
        form = "d(a − b·d)" if fit_.form == "bon" else "d(a − b·log d)"
        od, orr = f["observed_peak"]
        lines.append(f"| {f['series']} | {f['reward']} | {form} | {_pm(fit_.a, fit_.a_se)} | {_pm(fit_.b, fit_.b_se)} | "
                     f"{fmt(fit_.r2)} | {fit_.n} | {peak_d} | {peak_r} | ({od:.3f}, {orr:.3f}) | {f['d_max']:.3f} |")
    if not fits:
        lines.append("\nNo fit: no series has 2 or more points with d > 0.")
    verdicts = [("best-of-n", peak_verdict(points["bon"]))] + [(k, peak_verdict(v)) for k, v in points["rl"].items()]
    verdicts = [(k, v) for k, v in verdicts if v is not None]
    if verdicts:
        lines += ["\n### Does gold fall past its peak while the proxy rises?\n",
                  "Measured points, no model: the start is the point of smallest d, the peak the point of highest "
                  "gold, the end the point of largest d; rise = gold at the peak − gold at the start, fall = gold at "
                  "the peak − gold at the end (each ± its s.e. from the two evaluations), each counted when it "
                  f"exceeds {FALL_Z:g} s.e.; an inverted U when both count and the proxy rose past the peak (falls: "
                  "gold best at the start; rises: still rising; flat: neither).\n",
                  "| series | gold at the start | gold peak at d (KL nats) | gold at the peak | rise | gold at the end (d) "
                  "| fall | proxy peak → end | inverted U |", "|" + "---|" * 9]
        for name, v in verdicts:
            where = f"n={v['n_peak']}" if v["n_peak"] is not None else f"step {v['step_peak']}"
            proxy = (f"{fmt(v['proxy_peak'])} → {fmt(v['proxy_end'])}" if v["proxy_rise"] is not None else "–")
            verdict = "yes" if v["inverted_u"] else f"no ({v['shape']})"
            lines.append(f"| {name} | {v['gold_start']:.3f} | {v['d_peak']:.3f} ({v['d_peak'] ** 2:.3g}; {where}) | "
                         f"{fmt(v['gold_peak'], v['gold_peak_se'])} | {fmt(v['rise'], v['rise_se'])} | "
                         f"{v['gold_end']:.3f} ({v['d_end']:.3f}) | {fmt(v['fall'], v['fall_se'])} | {proxy} | {verdict} |")
    if bon_vs_rl:
        lines += ["\n### Best-of-n against RL at the same KL\n",
                  "Best-of-n minus RL at equal d: each series' reward linearly interpolated in d over the range both "
                  "measured, the mean over 25 equally spaced d and the gap at the range's end (note 004: best-of-n is "
                  "more robust at small KL, i.e. a positive gold gap). Plot: bon_vs_rl.png.\n",
                  "| RL series | common d range | gold: mean gap | gold: gap at the end | proxy: mean gap |",
                  "|---|---|---|---|---|"]
        for g in bon_vs_rl:
            gold, proxy = g["gold"], g["proxy"]
            proxy_gap = f"{proxy['mean_gap']:+.3f}" if proxy else "–"
            lines.append(f"| {g['series']} | {gold['d_lo']:.3f}–{gold['d_hi']:.3f} | {gold['mean_gap']:+.3f} | "
                         f"{gold['end_gap']:+.3f} | {proxy_gap} |")
    rows = ["\nMeasured points (d, gold, proxy):\n", "| series | step or n | d | gold | proxy |", "|---|---|---|---|---|"]
    for p in points["bon"]:
        rows.append(f"| best-of-n | n={p[4]} | {p[0]:.3f} | {fmt(p[1], p[5])} | {fmt(p[2], p[6])} |")
    for name, pts in points["rl"].items():
        for p in pts:
            rows.append(f"| {name} | step {p[3]} | {p[0]:.3f} | {fmt(p[1], p[5])} | {fmt(p[2], p[6])} |")
    return "\n".join(lines) + "\n" + "\n".join(rows) + "\n"


def speed_shape_section(results: list[dict]) -> str:
    """Markdown of :func:`prefzoo.report.speed_shape.speed_shape_test`: one table row per algorithm, each run's
    speed, and the verdict; empty when no algorithm was run at 2 betas with a repeated seed."""
    from prefzoo.report.speed_shape import RATIO_LIMIT

    if not results:
        return ""
    lines = ["## Beta sets the speed, not the shape\n",
             "The same RL run at several KL coefficients (note 004; Gao et al. 2023): gold against d, compared at equal "
             "d over the range every run reached (linear interpolation, 25 points). Beta spread S_β: the root-mean "
             "(over d) across-beta standard deviation of the curves; seed spread S_seed: the same within the betas "
             "run with 2+ seeds (pooled). ρ = S_β / S_seed ≈ 1 when the betas' curves differ only as seeds do; "
             f"ρ ≤ {RATIO_LIMIT:g} is read as consistent with the claim (a rule of thumb: one seed pair leaves the seed "
             "spread itself uncertain). Definitions: prefzoo/report/speed_shape.py. Plot: speed_shape.png.\n",
             "| algorithm | betas (seeds) | common d range | largest d | S_β | S_seed | ρ | consistent |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        betas = ", ".join(f"{b:g} ({', '.join(map(str, r['seeds'][b]))})" for b in r["betas"])
        verdict = ("–" if r["consistent"] is None else "yes" if r["consistent"] else "no: beta changed the shape "
                   "(or chance: more seeds tell)")
        lines.append(f"| {r['algo']} | {betas} | {r['d_lo']:.3f}–{r['d_hi']:.3f} | {r['d_max']:.3f} | "
                     f"{fmt(r['beta_spread'])} | {fmt(r['seed_spread'])} | {fmt(r['ratio'])} | {verdict} |")
        if r["reason"]:
            lines.append(f"\nNo number for {r['algo']}: {r['reason']}.")
        share = (r["d_hi"] - r["d_lo"]) / r["d_max"] if r["d_max"] > 0 else float("nan")
        lines.append(f"\nThe common range covers {share:.0%} of the largest d reached. Speed (d at the last evaluation "
                     "per training step, sqrt(nats)/step): "
                     + ", ".join(f"{c.label} {r['speeds'][c.label]:.3g}" for c in r["curves"]) + ".\n")
    return "\n".join(lines) + "\n"


def preregistered_section(pooled: dict[str, list[tuple]], peak_d: float) -> str:
    """The pre-registered inverted-U test (:func:`prefzoo.report.overoptimisation.preregistered_verdict`) on each pooled
    RL series, at the pre-registered peak d."""
    from prefzoo.report.overoptimisation import DETECTABLE, PREREGISTERED_Z, preregistered_verdict

    lines = ["### The pre-registered test (pooled runs)\n",
             f"The peak is fixed in advance at the evaluation whose pooled d is closest to d = {peak_d:g} (not the "
             f"point of highest gold); rise = gold(peak) − gold(start), fall = gold(peak) − gold(end), each ± its "
             f"combined s.e. Established: both beyond {PREREGISTERED_Z:g} s.e. and the proxy higher at the end than "
             f"at the peak; refuted: neither beyond {PREREGISTERED_Z:g} s.e. with {PREREGISTERED_Z:g} s.e. at most "
             f"{DETECTABLE:g} (a U that high would have shown); else not decided.\n",
             "| series | peak (step, d) | gold start → peak → end | rise (z) | fall (z) | proxy peak → end | "
             f"{PREREGISTERED_Z:g} s.e. | verdict |", "|" + "---|" * 8]
    if not pooled:
        return "\n".join(lines[:2]) + "\nNo pooled series: fewer than 2 RL runs of one algorithm and beta.\n"
    for name, pts in pooled.items():
        v = preregistered_verdict(pts, peak_d)
        if v is None:
            continue
        proxy = f"{fmt(v['proxy_peak'])} → {fmt(v['proxy_end'])}" if v["proxy_end"] is not None else "–"
        lines.append(f"| {name} | step {v['step_peak']}, {v['d_peak']:.3f} | {v['gold_start']:.4f} → "
                     f"{fmt(v['gold_peak'], v['gold_peak_se'])} → {v['gold_end']:.4f} | {fmt(v['rise'], v['rise_se'])} "
                     f"({v['rise_z']:.1f}) | {fmt(v['fall'], v['fall_se'])} ({v['fall_z']:.1f}) | {proxy} | "
                     f"{v['detectable']:.4f} | **{v['verdict']}** |")
    return "\n".join(lines) + "\n"
