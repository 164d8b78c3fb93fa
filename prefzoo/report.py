"""Compare runs: ``python -m prefzoo.report DIR`` turns a folder of runs (a Hydra multirun) into a table and plots.

It reads every ``summary.json`` under DIR and each run's ``.hydra/overrides.yaml``; the overrides whose
values differ between runs are the swept settings and become the table's first columns. It writes

* ``report.md`` — one row per run: swept values, then the evaluation after training (± standard error),
  KL to the reference, diversity and wall time;
* ``frontier.png`` — reward against sqrt(KL to the reference) per algorithm (the reward-KL frontier;
  Gao et al. 2023 plot reward against d = sqrt(KL));
* ``<metric>_vs_<setting>.png`` — each headline metric against each numeric swept setting, one line per
  value of the other swept settings;

and prints where it wrote them.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import yaml

HEADLINE = ("task_accuracy", "task_reward", "preference_accuracy", "kl_k1", "entropy", "distinct_2")


def _value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def load_runs(root: Path) -> list[dict]:
    """Every run under ``root``: ``{"dir", "summary", "overrides": {key: value}}``, sorted by folder."""
    runs = []
    for summary_path in sorted(Path(root).rglob("summary.json")):
        run_dir = summary_path.parent
        overrides = {}
        over_file = run_dir / ".hydra" / "overrides.yaml"
        if over_file.is_file():
            for item in yaml.safe_load(over_file.read_text()) or []:
                key, _, value = item.partition("=")
                overrides[key.lstrip("+~")] = _value(value)
        runs.append({"dir": run_dir, "summary": json.loads(summary_path.read_text()), "overrides": overrides})
    return runs


def swept_keys(runs: list[dict]) -> list[str]:
    """Override keys whose value is not the same in every run (in first-seen order)."""
    keys: dict[str, set] = {}
    for run in runs:
        for k in run["overrides"]:
            keys.setdefault(k, set())
    for k in keys:
        keys[k] = {json.dumps(run["overrides"].get(k), default=str) for run in runs}
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


def markdown_table(runs: list[dict], keys: list[str], metrics=HEADLINE) -> str:
    present = [m for m in metrics if any(metric(r, m) is not None for r in runs)]
    header = ["run", *keys, "algo", "beta", *[f"{m}" for m in present], "Δ task (after − before)", "steps", "wall s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        s = run["summary"]
        main = "task_accuracy" if metric(run, "task_accuracy") is not None else "task_reward"
        before, after = metric(run, main, "eval_before"), metric(run, main)
        delta = after - before if isinstance(before, (int, float)) and isinstance(after, (int, float)) else None
        cells = [run["dir"].name, *[_setting(run["overrides"].get(k)) for k in keys], s.get("algo"), _fmt(s.get("beta")),
                 *[_fmt(metric(run, m), metric(run, f"{m}_se")) for m in present], _fmt(delta), _fmt(s.get("steps")),
                 _fmt(s.get("wall_seconds"))]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_frontier(runs: list[dict], path: Path) -> Path | None:
    """Reward after training against sqrt(KL to the reference), one series per algorithm."""
    series = defaultdict(list)
    for run in runs:
        kl, reward = metric(run, "kl_k1"), metric(run, "task_reward")
        if kl is None or reward is None:
            continue
        series[run["summary"].get("algo", "?")].append((math.sqrt(max(kl, 0.0)), reward))
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=algo)
    ax.set_xlabel("sqrt(KL(π ‖ π_ref)) on held-out samples [sqrt(nats)]")
    ax.set_ylabel("task reward after training (greedy, held-out)")
    ax.set_title("Reward–KL frontier")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_against(runs: list[dict], key: str, keys: list[str], name: str, path: Path) -> Path | None:
    """``name`` after training against the swept setting ``key``, one line per combination of the others."""
    lines = defaultdict(list)
    for run in runs:
        x, y = run["overrides"].get(key), metric(run, name)
        if not isinstance(x, (int, float)) or isinstance(x, bool) or y is None:
            continue
        label = ", ".join(f"{k}={run['overrides'].get(k)}" for k in keys if k != key) or name
        lines[label].append((x, y, metric(run, f"{name}_se")))
    if not lines:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in sorted(lines.items()):
        points.sort()
        se = [p[2] if isinstance(p[2], (int, float)) and not math.isnan(p[2]) else 0.0 for p in points]
        ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=se, marker="o", capsize=3, label=label)
    ax.set_xlabel(key)
    ax.set_ylabel(f"{name} after training")
    ax.set_title(f"{name} against {key}")
    if len(lines) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    for key in keys:
        for name in HEADLINE:
            p = plot_against(runs, key, keys, name, out / f"{name}_vs_{key.replace('/', '_')}.png")
            if p:
                plots.append(p)
    text = f"# prefzoo report: {root}\n\n{len(runs)} runs; swept: {', '.join(keys) or 'nothing'}.\n\n{table}\n"
    text += "".join(f"![{p.stem}]({p.name})\n" for p in plots)
    (out / "report.md").write_text(text)
    return {"report": out / "report.md", "plots": plots, "runs": len(runs), "swept": keys}


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
