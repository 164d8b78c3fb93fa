"""What a person sees in a sweep's report (the ecosystem-fit issue, item 6), on synthetic run folders (fast):
plots for every sweep, no empty heading, each column once, a readable ``run`` column, labels that do not overlap."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from matplotlib.text import Text

from prefzoo.report import write_report
from prefzoo.report import plots as plots_module


def _fake_run(root: Path, name: str, summary: dict, overrides: list[str]) -> Path:
    folder = root / name
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def _offline_eval(pref: float, kl: float) -> dict:
    """The evaluation of a DPO/SimPO run on a user's preference file without an ``answer`` column and without a
    reward that applies (as written by the loop: preference accuracy, KL, diversity; no task or reward metric)."""
    return {"n_problems": 2, "preference_accuracy": pref, "preference_accuracy_se": 0.05, "kl_k1": kl,
            "kl_k1_se": 0.01, "kl_k3": abs(kl), "kl_method": "sampled", "entropy": 10.79, "distinct_1": 0.95,
            "distinct_2": 0.99, "completion_length": 64.0}


def _offline_sweep(root: Path, names=("0-dpo", "1-simpo")) -> None:
    for name, algo, beta, pref, kl in zip(names, ("dpo", "simpo"), (0.1, 2.0), (0.8, 0.6), (0.02, 0.05)):
        _fake_run(root, name, {"algo": algo, "beta": beta, "steps": 2, "stop_reason": "max_steps",
                               "wall_seconds": 4.5, "results": {"train_seconds": 0.1},
                               "eval_before": _offline_eval(0.5, 0.0), "eval_after": _offline_eval(pref, kl)},
                  ["model=tiny", "data=file", "data.path=/home/me/prefs.jsonl", f"algo={algo}"])


def _table(text: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return cells[0], cells[1:]


def test_the_algo_column_appears_once_when_algo_is_swept(tmp_path):
    """Before: `| run | algo | algo | beta | ...` (the swept key and the fixed column); after: once, then beta."""
    _offline_sweep(tmp_path)
    write_report(tmp_path)
    header, rows = _table((tmp_path / "report.md").read_text())
    assert header.count("algo") == 1, header
    assert header[:3] == ["run", "algo", "beta"]
    assert [r[1] for r in rows] == ["dpo", "simpo"]


def test_an_offline_sweep_without_a_reward_has_plots_per_run(tmp_path):
    """A DPO/SimPO sweep on a user's file (only `algo` swept, no reward, no answers): before, no plot was written and
    `## Plots` was an empty heading. Now one figure with a panel per measured metric (preference accuracy, KL,
    entropy, distinct-2), one bar per run; every image the report names exists."""
    _offline_sweep(tmp_path)
    result = write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert result["plots"], "no plot written"
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert images and all((tmp_path / name).is_file() for name in images)
    assert "metrics_per_run.png" in images
    assert text.index("## Plots") < text.index("![")


def test_no_heading_is_left_empty(tmp_path):
    """Runs with no evaluation after training (eval.after=false): nothing to plot, so no `## Plots` heading (before:
    the heading stood alone at the end of the file); and no table column that is `–` in every row (`Δ task`)."""
    for i, algo in enumerate(("dpo", "simpo")):
        _fake_run(tmp_path, f"{i}-{algo}", {"algo": algo, "beta": 0.1, "steps": 2, "wall_seconds": 4.5,
                                            "results": {"train_seconds": 0.1}}, [f"algo={algo}"])
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "## Plots" not in text
    headings = [i for i, line in enumerate(text.splitlines()) if line.startswith("#")]
    body = text.splitlines()
    for i in headings:  # every heading has text before the next heading or the end
        following = body[i + 1:next((j for j in headings if j > i), len(body))]
        assert any(line.strip() for line in following), body[i]
    header, _ = _table(text)
    assert not any(h.startswith("Δ task") for h in header)


def test_the_run_column_names_each_folder_readably(tmp_path):
    """A sweep made before the folder names were made safe: `data.path=/tmp/x.jsonl` in Hydra's override_dirname
    nested each run in folders `0-algo=dpo,data.path=` / `tmp` / `x.jsonl,data=file`, and the run column showed the
    last one, `x.jsonl,data=file` (the same for both runs). Now the run column shows the job number, linked to the
    run's folder relative to the report; and seconds are written with one decimal, as measured (4.5, not 4.500)."""
    for i, algo in enumerate(("dpo", "simpo")):
        _fake_run(tmp_path, f"{i}-algo={algo},data.path=/tmp/x.jsonl,data=file",
                  {"algo": algo, "beta": 0.1, "steps": 2, "wall_seconds": 4.5, "results": {"train_seconds": 0.1},
                   "eval_after": _offline_eval(0.7, 0.01)}, [f"algo={algo}", "data.path=/tmp/x.jsonl"])
    write_report(tmp_path)
    header, rows = _table((tmp_path / "report.md").read_text())
    runs = [r[0] for r in rows]
    assert runs == ["[0](0-algo=dpo,data.path=/tmp/x.jsonl,data=file)",
                    "[1](1-algo=simpo,data.path=/tmp/x.jsonl,data=file)"], runs
    assert rows[0][header.index("wall s")] == "4.5" and rows[0][header.index("train s")] == "0.1"


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_point_labels_do_not_overlap(tmp_path, monkeypatch):
    """Six runs at the same reward and distinct-2 but one (a tiny-model sweep gives such ties): before, every label sat
    4 points up and right of its point, the five tied ones on top of each other (10 overlapping pairs). Now the labels are placed
    apart (with a line to their point) and inside the figure: no two label boxes overlap."""
    for i, beta in enumerate((0.01, 0.03, 0.1, 0.3, 1.0, 3.0)):
        ev = dict(_offline_eval(0.6, 0.01), sample_reward=0.25 if i else 0.5, distinct_2=0.99 if i else 0.9)
        _fake_run(tmp_path, f"{i}-dpo", {"algo": "dpo", "beta": beta, "steps": 2, "eval_after": ev},
                  [f"objective.beta={beta}", f"trainer.seed={i % 2}"])
    figures = {}
    real_save = plots_module._save

    def keep(fig, path, plt, layout=True):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        figures[Path(path).name] = [Text.get_window_extent(t, renderer) for t in fig.axes[0].texts]  # text only
        fig_box = fig.bbox
        figures[Path(path).name + ":fig"] = fig_box
        return real_save(fig, path, plt, layout)

    monkeypatch.setattr(plots_module, "_save", keep)
    write_report(tmp_path)
    boxes = figures["reward_vs_diversity.png"]
    assert len(boxes) == 6
    overlapping = [(i, j) for i in range(6) for j in range(i + 1, 6) if _overlaps(boxes[i], boxes[j])]
    assert overlapping == []
    fig_box = figures["reward_vs_diversity.png:fig"]
    assert all(b.x0 >= fig_box.x0 and b.x1 <= fig_box.x1 and b.y0 >= fig_box.y0 and b.y1 <= fig_box.y1 for b in boxes)


def test_a_report_written_elsewhere_names_each_run_by_its_folder(tmp_path):
    """``prefzoo report runs/cmp --out /tmp/cmp_report``: before the fix the run column read
    ``../../work/runs/cmp/dpo`` (the path from the report to the run, shown as text). Now it shows the run's folder
    name, linked to that relative path."""
    _offline_sweep(tmp_path / "sweep", names=("dpo", "simpo"))
    out = tmp_path / "elsewhere" / "report"
    write_report(tmp_path / "sweep", out)
    _, rows = _table((out / "report.md").read_text())
    assert [r[0] for r in rows] == ["[dpo](../../sweep/dpo)", "[simpo](../../sweep/simpo)"], rows


def test_every_algorithm_of_the_zoo_gets_its_own_colour():
    """runs/cmp's report (13 algorithms): matplotlib's default cycle has 10 colours, so cispo and sft were both orange,
    dpo and simpo both green, on the frontier. Now 13 algorithms get 13 distinct colours (and the first ten keep the
    default cycle's, so smaller sweeps look as before)."""
    import matplotlib.colors as mcolors

    names = ["bon", "cispo", "dpo", "grpo", "gspo", "kto", "online_dpo", "orpo", "ppo", "reinforce_pp", "rloo", "sft",
             "simpo"]
    styles = plots_module.algo_styles([{"summary": {"algo": a}} for a in names])
    rgb = {a: mcolors.to_hex(st["color"]) for a, st in styles.items()}
    assert len(set(rgb.values())) == 13, rgb
    assert [styles[a]["color"] for a in names[:10]] == [f"C{i}" for i in range(10)]


def test_overoptimisation_plot_has_no_empty_panels(tmp_path, monkeypatch):
    """R21 (an RL run alone, no best-of-n point): overoptimisation.png drew two empty best-of-n panels beside the RL
    ones. A kind of series without points gets no column: RL alone gives 2 panels, both with data; both kinds give 4."""
    titles = {}
    real_save = plots_module._save

    def keep(fig, path, plt, layout=True):
        titles[Path(path).name] = [(ax.get_title(), len(ax.lines)) for ax in fig.axes]
        return real_save(fig, path, plt, layout)

    monkeypatch.setattr(plots_module, "_save", keep)
    rl = {"grpo β=0": [(0.0, 0.0, 4.3, 0), (0.45, 0.05, 4.1, 2), (1.2, 0.01, 6.7, 4)]}
    plots_module.plot_overoptimisation({"bon": [], "rl": rl}, [], tmp_path / "rl_only.png")
    assert [t.split(":")[0] for t, _ in titles["rl_only.png"]] == ["RL", "RL"]
    assert all(n > 0 for _, n in titles["rl_only.png"])
    bon = [(0.0, 0.05, -3.3, None), (0.8, 0.01, -1.1, None)]
    plots_module.plot_overoptimisation({"bon": bon, "rl": rl}, [], tmp_path / "both.png")
    assert sorted(t.split(":")[0] for t, _ in titles["both.png"]) == ["RL", "RL", "best-of-n", "best-of-n"]
