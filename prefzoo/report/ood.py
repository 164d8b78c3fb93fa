"""In and out of distribution, side by side (Kirk et al. 2024): the report's section and plot for runs evaluated with
``eval.ood`` (a shifted held-out task, :mod:`prefzoo.data.ood`).

Kirk et al. 2024 ("Understanding the effects of RLHF on LLM generalisation and diversity", ICLR 2024) find that RLHF
generalises better than SFT to test inputs shifted from the training distribution, and that it produces less diverse
outputs than SFT. For each run this module reads the evaluation after training: accuracy (greedy exact match, ± one
standard error) and diversity (distinct-2 and entropy of temperature-1 samples of each prompt) on the in-distribution
held-out prompts and on the shifted ones (the ``ood_*`` keys), and writes

* :func:`ood_section`: a table of both per run, the OOD - ID gap, and each run against the SFT run (when the sweep
  has one): OOD accuracy minus SFT's ± the combined standard error sqrt(se_a^2 + se_b^2), and distinct-2 on the shifted
  prompts minus SFT's; "better OOD" when the accuracy difference exceeds :data:`Z` standard errors, "less diverse"
  when the distinct-2 difference is below 0 (distinct-2 carries no standard error here: it is one number per run),
  and "Kirk et al.'s pattern" when both hold;
* :func:`plot_ood` (``ood.png``): OOD against ID accuracy, one point per run (left), and distinct-2 in and out of
  distribution per run (right).

The policy before training is one more row where the runs were evaluated before training (``eval.before``), and the
run that trains nothing (``trainer.max_steps=0``) is that policy too.
"""

from __future__ import annotations

import math
from pathlib import Path

from prefzoo.report.runs import is_number, metric

__all__ = ["has_ood", "ood_rows", "ood_section", "plot_ood", "Z"]

#: standard errors an OOD accuracy difference must exceed to count as a difference
Z = 2.0


def has_ood(runs: list[dict]) -> bool:
    """Whether any run's evaluation after training has the shifted task's accuracy."""
    return any(is_number(metric(r, "ood_task_accuracy")) for r in runs)


def _row(label: str, algo: str, steps, ev: dict) -> dict:
    get = ev.get
    return {"label": label, "algo": algo, "steps": steps, "acc": get("task_accuracy"), "acc_se": get("task_accuracy_se"),
            "ood_acc": get("ood_task_accuracy"), "ood_acc_se": get("ood_task_accuracy_se"),
            "d2": get("distinct_2"), "ood_d2": get("ood_distinct_2"), "ent": get("entropy"), "ood_ent": get("ood_entropy"),
            "kl": get("kl_k1"), "ood_kl": get("ood_kl_k1"), "kl_method": get("kl_method")}


def ood_rows(runs: list[dict], labels: list[str]) -> list[dict]:
    """One row per run with an OOD evaluation after training (``labels[i]`` names ``runs[i]``), led by the policy
    before training (the first run evaluated before training with ``eval.ood``), if any."""
    rows = []
    before = next((r for r in runs if is_number(metric(r, "ood_task_accuracy", "eval_before"))), None)
    if before is not None:
        rows.append(_row("before training (π_ref)", "–", 0, before["summary"]["eval_before"]))
    for run, label in zip(runs, labels):
        if is_number(metric(run, "ood_task_accuracy")):
            s = run["summary"]
            rows.append(_row(label, str(s.get("algo")), s.get("steps"), s["eval_after"]))
    return rows


def _f(value, se=None) -> str:
    if not is_number(value):
        return "–"
    return f"{value:.3f}" + (f" ± {se:.3f}" if is_number(se) else "")


def _gap(a, b, se_a=None, se_b=None) -> str:
    """``a - b`` (± the combined standard error when both have one)."""
    if not (is_number(a) and is_number(b)):
        return "–"
    se = math.sqrt(se_a ** 2 + se_b ** 2) if is_number(se_a) and is_number(se_b) else None
    return f"{a - b:+.3f}" + (f" ± {se:.3f}" if se is not None else "")


def _sft_row(rows: list[dict]) -> dict | None:
    """The SFT run that trained (the first, when there are several)."""
    return next((r for r in rows if r["algo"] == "sft" and (r["steps"] or 0) > 0), None)


def _against_sft(row: dict, sft: dict) -> str:
    """OOD accuracy and distinct-2 minus SFT's, and their reading (see the module docstring)."""
    if not all(is_number(row[k]) and is_number(sft[k]) for k in ("ood_acc", "ood_d2")):
        return "–"
    diff = row["ood_acc"] - sft["ood_acc"]
    se = math.sqrt((row["ood_acc_se"] or 0.0) ** 2 + (sft["ood_acc_se"] or 0.0) ** 2)
    better = "better OOD" if diff > Z * se else "worse OOD" if diff < -Z * se else f"OOD within {Z:g} s.e."
    diverse = "less diverse" if row["ood_d2"] < sft["ood_d2"] else "as or more diverse"
    both = " (Kirk et al.'s pattern)" if better == "better OOD" and diverse == "less diverse" else ""
    numbers = (f"accuracy {_gap(row['ood_acc'], sft['ood_acc'], row['ood_acc_se'], sft['ood_acc_se'])}, "
               f"distinct-2 {_gap(row['ood_d2'], sft['ood_d2'])}")
    return f"{numbers}: {better}, {diverse}{both}"


def ood_section(runs: list[dict], labels: list[str]) -> str:
    """The report's markdown section (empty without an OOD evaluation)."""
    rows = ood_rows(runs, labels)
    if not rows:
        return ""
    shift = next((metric(r, "ood_task") for r in runs if metric(r, "ood_task")), None)
    sft = _sft_row(rows)
    lines = ["## In and out of distribution (Kirk et al. 2024)\n",
             "In distribution (ID): the held-out split of the training task; out of distribution (OOD): the shifted task "
             f"of `eval.ood`{f' ({shift})' if shift else ''}, which shares no problem with training (prefzoo/data/ood.py). "
             "Accuracy: exact match of the greedy answer, ± one standard error; distinct-2 and entropy (nats per "
             "token): temperature-1 samples of each prompt, averaged over prompts; KL: KL(π ‖ π_ref) on the ID samples "
             "(nats per completion). Kirk et al. 2024: RLHF generalises better out of distribution than SFT and is less "
             "diverse than SFT.\n",
             "| run | algo | steps | ID accuracy | OOD accuracy | OOD − ID | ID distinct-2 | OOD distinct-2 | ID entropy "
             "| OOD entropy | KL |" + (" against SFT |" if sft else ""), "|" + "---|" * (11 + bool(sft))]
    for r in rows:
        kl = _f(r["kl"]) + (" (analytic)" if r["kl_method"] == "analytic" and is_number(r["kl"]) else "")
        cells = [r["label"], r["algo"], "–" if r["steps"] is None else str(r["steps"]), _f(r["acc"], r["acc_se"]),
                 _f(r["ood_acc"], r["ood_acc_se"]), _gap(r["ood_acc"], r["acc"], r["ood_acc_se"], r["acc_se"]),
                 _f(r["d2"]), _f(r["ood_d2"]), _f(r["ent"]), _f(r["ood_ent"]), kl]
        if sft:
            cells.append("–" if r is sft else _against_sft(r, sft))
        lines.append("| " + " | ".join(cells) + " |")
    if sft:
        lines.append(f"\n`against SFT` ({sft['label']}): OOD accuracy minus SFT's (± the combined standard error) and OOD "
                     f"distinct-2 minus SFT's; beyond {Z:g} standard errors the accuracy reads as better / worse OOD, a "
                     "distinct-2 below SFT's as less diverse (one number per run without a standard error: with few "
                     "sampled prompts a small difference is noise).")
    return "\n".join(lines) + "\n"


def plot_ood(runs: list[dict], labels: list[str], path: Path) -> Path | None:
    """``ood.png``: OOD against ID accuracy (± 1 s.e. both ways), one point per run coloured by algorithm, the dotted
    diagonal OOD = ID (left); distinct-2 of each run's samples in (filled) and out of (open) distribution (right)."""
    rows = ood_rows(runs, labels)
    points = [r for r in rows if is_number(r["acc"]) and is_number(r["ood_acc"])]
    if not points:
        return None
    from prefzoo.report.labels import place_labels
    from prefzoo.report.plots import _plt, _save, algo_styles

    plt = _plt()
    style = algo_styles(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 4.8), gridspec_kw={"width_ratios": [1.1, 1]})
    look = {r["label"]: (style.get(r["algo"], {"color": "0.5", "marker": "*", "ms": 12})) for r in rows}
    for algo in sorted({r["algo"] for r in points}):
        mine = [r for r in points if r["algo"] == algo]
        st = style.get(algo, {"color": "0.5", "marker": "*", "ms": 12})
        left.errorbar([r["acc"] for r in mine], [r["ood_acc"] for r in mine],
                      xerr=[r["acc_se"] or 0.0 for r in mine], yerr=[r["ood_acc_se"] or 0.0 for r in mine],
                      fmt=st["marker"], ms=st["ms"], color=st["color"], capsize=3, ls="none",
                      label="before training" if algo == "–" else algo)
    top = max(max(r["acc"] for r in points), max(r["ood_acc"] for r in points))
    lim = min(1.03, max(0.1, 1.15 * top + 0.02))
    left.plot([0, lim], [0, lim], ":", color="0.5", lw=1, label="OOD = ID")
    left.set_xlim(-0.02, lim)
    left.set_ylim(-0.02, lim)
    left.set_xlabel("in-distribution accuracy (greedy, held-out split of the training task)")
    left.set_ylabel("out-of-distribution accuracy (greedy, eval.ood)")
    left.set_title("Generalisation: OOD against ID accuracy (± 1 s.e.)", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(fontsize=7, loc="upper left")
    xs = list(range(len(rows)))
    for x, r in zip(xs, rows):
        colour = look[r["label"]]["color"]
        if is_number(r["d2"]):
            right.plot([x - 0.12], [r["d2"]], "o", color=colour, ms=8)
        if is_number(r["ood_d2"]):
            right.plot([x + 0.12], [r["ood_d2"]], "s", mfc="white", color=colour, ms=8, mew=1.5)
    right.plot([], [], "o", color="0.3", label="in distribution")
    right.plot([], [], "s", mfc="white", color="0.3", mew=1.5, label="out of distribution")
    right.set_xticks(xs)
    right.set_xticklabels([r["label"] for r in rows], rotation=25, ha="right", fontsize=8)
    right.set_xlim(-0.6, len(rows) - 0.4)
    right.set_ylabel("distinct-2 across temperature-1 samples of a prompt")
    right.set_title("Diversity: distinct-2 per run (higher: more diverse)", fontsize=10)
    right.grid(alpha=0.3, axis="y")
    right.legend(fontsize=7)
    fig.suptitle("In and out of distribution (Kirk et al. 2024): accuracy and diversity after training")
    fig.tight_layout()
    place_labels(left, [r["acc"] for r in points], [r["ood_acc"] for r in points], [r["label"] for r in points])
    return _save(fig, path, plt, layout=False)
