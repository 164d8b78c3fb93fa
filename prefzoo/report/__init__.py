"""Compare runs: ``python -m prefzoo.report DIR`` turns a folder of runs (a Hydra multirun) into a table and plots.

It reads every ``summary.json`` under DIR and each run's ``.hydra/overrides.yaml``; the overrides whose
values differ between runs are the swept settings and become the table's first columns (an eval-only run's
``trainer.max_steps=0`` sweeps nothing). It writes

* ``report.md`` — one row per run: swept values, then the evaluation after training (± standard error),
  KL to the reference, diversity and times, with a legend saying what each column measures;
* ``frontier.png`` — reward against d = sqrt(KL to the reference), one line per algorithm, task and environment (the
  reward-KL frontier; Gao et al. 2023 plot reward against d), the reference policy at d = 0;
* ``<metric>_vs_<setting>.png`` — each headline metric against each numeric swept setting, one line per
  value of the other swept settings (a log axis when the setting spans a factor of 10 or more);
* ``diversity_vs_<setting>.png`` — distinct-1/2, entropy and KL against a numeric swept setting (Kirk et al.
  2024), and ``reward_vs_diversity.png`` — reward against distinct-2, one point per run;
* ``accuracy_vs_time.png`` — held-out task accuracy at each evaluation against the minutes spent in training steps
  by then, one line per run (which method gets there soonest: distillation against SFT, dynamic sampling);
* ``metrics_per_run.png`` — when no numeric setting was swept (algorithms, files, a single run): each measured
  evaluation key (accuracies, rewards, preference accuracy, KL, entropy, distinct-2), one bar per run;
* with a shifted held-out task in the evaluations (``eval.ood``): a section with in- and out-of-distribution accuracy
  and diversity per run, each against the SFT run (Kirk et al. 2024; :mod:`prefzoo.report.ood`), and ``ood.png``;
* with a gold reward in the evaluations (``eval.gold_reward``): ``overoptimisation.png`` and a section with
  the least-squares fits R_bon(d) = d(a - b d) and R_RL(d) = d(a - b log d) of Gao et al. 2023 (± standard
  errors; :mod:`prefzoo.report.overoptimisation`), where the gold reward peaks and whether it falls past the peak
  while the proxy rises; ``bon_vs_rl.png`` and best-of-n minus RL at equal d (both kinds of run present); and
  ``speed_shape.png`` with the test of "beta sets the speed, not the shape" (an RL algorithm at 2+ betas with a
  repeated seed: :mod:`prefzoo.report.speed_shape`);

and prints where it wrote them; a heading without content is left out. :class:`prefzoo.report.callbacks.WriteReport`
runs it at the end of every Hydra multirun (``prefzoo/conf/config.yaml``).

The package, one idea a module: :mod:`~prefzoo.report.runs` (reading the runs and what was swept),
:mod:`~prefzoo.report.tables` (the markdown), :mod:`~prefzoo.report.plots` (the figures and their captions),
:mod:`~prefzoo.report.ood` (in and out of distribution, Kirk et al. 2024),
:mod:`~prefzoo.report.overoptimisation` (the fits of Gao et al. 2023), :mod:`~prefzoo.report.speed_shape` (beta:
the speed or the shape), :mod:`~prefzoo.report.callbacks` (the
Hydra callbacks that make a recipe one command); this module puts them together (:func:`write_report`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefzoo.errors import DataError, PrefzooError, RunFolderError
from prefzoo.report.ood import has_ood, ood_section, plot_ood
from prefzoo.report.overoptimisation import add_pooled, bon_against_rl, fit_overoptimisation, overoptimisation_points
from prefzoo.report.plots import (caption, plot_accuracy_vs_time, plot_against, plot_bon_vs_rl, plot_diversity,
                                  plot_frontier, plot_overoptimisation, plot_per_run, plot_reward_vs_diversity,
                                  plot_speed_shape, run_labels)
from prefzoo.report.runs import HEADLINE, is_number, load_runs, swept_keys
from prefzoo.report.speed_shape import rl_curves, speed_shape_test
from prefzoo.report.tables import (legend, markdown_table, overoptimisation_section, preregistered_section,
                                   speed_shape_section)

__all__ = ["write_report", "main", "load_runs", "swept_keys", "markdown_table"]


def _check_writable(out: Path) -> None:
    """Create ``out`` and check that files can be written there.

    Raises:
        RunFolderError: one line naming the folder, the reason and ``--out``.
    """
    import os
    import tempfile

    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".prefzoo-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise RunFolderError(f"cannot write the report into {out} ({err.strerror or type(err).__name__}); give a "
                             "writable folder with --out.") from None


def write_report(root: Path, out: Path | None = None, peak_d: float | None = None) -> dict:
    """Write ``report.md`` and the plots for the runs under ``root`` into ``out`` (default: ``root``).

    ``peak_d``: a pre-registered d of gold's peak: the over-optimisation section then also gives the inverted-U test
    at that d on each pooled RL series (:func:`prefzoo.report.overoptimisation.preregistered_verdict`).

    Raises:
        DataError: no ``summary.json`` under ``root`` (no finished run).
    """
    runs = load_runs(root)
    if not runs:
        raise DataError(f"no summary.json under {root}: point `python -m prefzoo.report` at a run folder or a "
                        "multirun folder (a run writes summary.json when it finishes).")
    out = Path(out or root)
    _check_writable(out)
    keys = swept_keys(runs)
    table = markdown_table(runs, keys, base=out)
    plots = [p for p in [plot_frontier(runs, out / "frontier.png", keys)] if p]
    numeric = [k for k in keys if any(is_number(r["overrides"].get(k)) for r in runs)]
    if not numeric:  # a sweep of names (algorithms, files, loss types) or one run: the evaluation per run
        p = plot_per_run(runs, keys, out / "metrics_per_run.png")
        if p:
            plots.append(p)
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
    p = plot_accuracy_vs_time(runs, keys, out / "accuracy_vs_time.png")
    if p:
        plots.append(p)
    text = f"# prefzoo report: {root}\n\n{len(runs)} runs; swept: {', '.join(keys) or 'nothing'}.\n\n{table}\n"
    text += legend(runs, keys=keys) + "\n"
    if has_ood(runs):  # eval.ood: in and out of distribution side by side (Kirk et al. 2024)
        labels = run_labels(runs, keys)
        text += ood_section(runs, labels) + "\n"
        p = plot_ood(runs, labels, out / "ood.png")
        if p:
            plots.insert(0, p)
    fits, shape = [], []
    points = overoptimisation_points(runs)
    if points["bon"] or points["rl"]:
        pooled = add_pooled(points)  # several runs of one design (proxies, seeds): their mean point by point
        fits = fit_overoptimisation(points)
        versus = bon_against_rl(points)
        shape = speed_shape_test(rl_curves(runs))
        for i, p in enumerate([plot_overoptimisation(points, fits, out / "overoptimisation.png"),
                               plot_bon_vs_rl(points, fits, out / "bon_vs_rl.png"),
                               plot_speed_shape(shape, out / "speed_shape.png")]):
            if p:
                plots.insert(i, p)
        text += overoptimisation_section(points, fits, versus) + "\n"
        if peak_d is not None:
            text += preregistered_section({name: points["rl"][name] for name in pooled}, peak_d) + "\n"
        text += speed_shape_section(shape)
    if plots:  # no heading without a plot under it
        text += "## Plots\n\n" + "".join(f"![{p.stem}]({p.name})\n\n*{caption(p)}*\n\n" for p in plots)
    (out / "report.md").write_text(text)
    return {"report": out / "report.md", "plots": plots, "runs": len(runs), "swept": keys, "fits": fits}


def main(argv=None) -> int:
    """``python -m prefzoo.report DIR [--out OUT]``; a prefzoo error is one line on stderr and exit status 2."""
    parser = argparse.ArgumentParser(prog="python -m prefzoo.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="a run folder or a multirun folder")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: DIR)")
    parser.add_argument("--peak-d", type=float, default=None, help="a pre-registered d of the gold peak: the "
                        "inverted-U test at it on the pooled RL runs (3 s.e.; recipes/overoptimisation_word.yaml)")
    args = parser.parse_args(argv)
    try:
        result = write_report(args.dir, args.out, peak_d=args.peak_d)
    except PrefzooError as err:
        print(f"prefzoo: error: {err}", file=sys.stderr)
        return 2
    print(f"{result['runs']} runs, swept: {', '.join(result['swept']) or 'nothing'}")
    print(f"wrote {result['report']}")
    for p in result["plots"]:
        print(f"wrote {p}")
    return 0
