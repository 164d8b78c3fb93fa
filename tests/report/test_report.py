"""`python train.py -m` over a 2 x 2 grid of tiny runs, then `python -m prefzoo.report` on the sweep folder; the
report's overoptimisation fits on synthetic runs; every recipe composes; a recipe end to end on the tiny model."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prefzoo.report import load_runs, markdown_table, swept_keys, write_report
from tests import background

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "arithmetic_pairs.jsonl"
#: one torch thread in the subprocesses (the tiny model is much faster so on a shared 2-core machine)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def _sweep(base: Path) -> background.Command:
    return background.Command(
        [sys.executable, "train.py", "-m", "model=tiny", "data=file", f"data.path={FIXTURE}",
         "algo=dpo,simpo", "objective.beta=0.1,0.5", "trainer.max_steps=2", "trainer.batch_size=2",
         "trainer.micro_batch_size=2", "trainer.progress=false", "trainer.tensorboard=false",
         "trainer.num_threads=1", "trainer.save_every=0", "eval.max_new_tokens=6", "eval.diversity_prompts=2",
         "eval.diversity_samples=2", f"hydra.sweep.dir={base / 'sweep'}"], ROOT, ENV)


#: `python train.py -m` over the 2 x 2 grid, in the background (tests/background.py)
SWEEP = background.register("report_sweep", __name__, _sweep)


@pytest.fixture(scope="module")
def sweep() -> Path:
    """The 2 x 2 sweep's folder."""
    proc = SWEEP.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.base / "sweep"


def test_multirun_writes_one_summary_per_job(sweep):
    runs = load_runs(sweep)
    assert len(runs) == 4
    assert sorted((r["summary"]["algo"], r["summary"]["beta"]) for r in runs) == [
        ("dpo", 0.1), ("dpo", 0.5), ("simpo", 0.1), ("simpo", 0.5)]
    assert swept_keys(runs) == ["algo", "objective.beta"]


def test_report_table_has_a_row_per_run_and_swept_columns(sweep, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "prefzoo.report", str(sweep), "--out", str(tmp_path)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {tmp_path / 'report.md'}" in proc.stdout
    lines = [line for line in (tmp_path / "report.md").read_text().splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:3] == ["run", "algo", "objective.beta"]
    assert "preference_accuracy" in header
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert len(rows) == 4
    assert sorted((r[1], r[2]) for r in rows) == [("dpo", "0.1"), ("dpo", "0.5"), ("simpo", "0.1"), ("simpo", "0.5")]
    assert (tmp_path / "preference_accuracy_vs_objective.beta.png").is_file()


def test_a_report_into_a_folder_that_cannot_be_written_is_one_line(sweep):
    """Hardening round 3, item 8: ``--out`` to a read-only place gave a traceback (PermissionError from matplotlib
    or mkdir); now one line naming the folder and --out, before any file is written. /sys refuses new folders even to
    root (this test machine runs as root, which ignores chmod)."""
    import os

    if os.geteuid() != 0:
        pytest.skip("runs as root only (uses /sys)")
    proc = subprocess.run([sys.executable, "-m", "prefzoo.report", str(sweep), "--out", "/sys/prefzoo-report"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("prefzoo: error: cannot write the report into /sys/prefzoo-report (")
    assert lines[0].endswith("give a writable folder with --out.")


def test_a_folder_of_separate_runs_is_labelled_by_what_changes_results():
    """A folder of runs made one by one (`prefzoo report <folder>`, no sweep): how a run was executed (thread count,
    the before-training evaluation) is no swept setting, and a run that did not set a key says nothing of it.
    Failing values before: swept ['algo', 'eval.before', 'trainer.num_threads', 'trainer.lr'] and the label
    'None, False, num_threads=1, None' on the frontier plot."""
    from prefzoo.report.plots import run_labels

    runs = [{"dir": Path("kto"), "summary": {}, "overrides": {"algo": "kto", "eval.before": False,
                                                               "trainer.num_threads": 1, "trainer.lr": 5e-5}},
            {"dir": Path("orpo"), "summary": {}, "overrides": {"algo": "orpo", "trainer.num_threads": 2}}]
    keys = swept_keys(runs)
    assert keys == ["algo", "trainer.lr"]
    assert run_labels(runs, ["trainer.lr"], named=True) == ["lr=5e-05", "orpo"]


def test_swept_keys_ignores_constant_overrides():
    runs = [{"dir": Path("a"), "summary": {}, "overrides": {"algo": "dpo", "model": "tiny"}},
            {"dir": Path("b"), "summary": {}, "overrides": {"algo": "simpo", "model": "tiny"}}]
    assert swept_keys(runs) == ["algo"]
    table = markdown_table(runs, ["algo"])
    assert table.splitlines()[2].startswith("| a | dpo |")


def test_a_resumed_run_is_not_a_swept_setting():
    """runs/cmp: one run of thirteen finished with trainer.resume=true (resuming is bit for bit: the same run).
    Before the fix the report added a 'trainer.resume' column (True for that run, – for the rest) as if swept."""
    runs = [{"dir": Path("a"), "summary": {}, "overrides": {"algo": "dpo"}},
            {"dir": Path("b"), "summary": {}, "overrides": {"algo": "gspo", "trainer.resume": True}}]
    assert swept_keys(runs) == ["algo"]


def test_eval_only_runs_do_not_make_max_steps_swept(tmp_path):
    """A folder of GRPO runs on two environments and an eval-only run (``trainer.max_steps=0``: the starting policy
    measured): the number of training steps was not swept. A sweep of max_steps among the training runs still is.
    Failing value before: swept ['env', 'trainer.max_steps']."""
    _fake_run(tmp_path, "retry", {"algo": "grpo"}, ["algo=grpo", "env=retry"])
    _fake_run(tmp_path, "retry_base", {"algo": "grpo", "steps": 0}, ["algo=grpo", "env=retry", "trainer.max_steps=0"])
    _fake_run(tmp_path, "calculator", {"algo": "grpo"}, ["algo=grpo", "env=calculator"])
    runs = load_runs(tmp_path)
    assert swept_keys(runs) == ["env"]
    _fake_run(tmp_path, "retry_40", {"algo": "grpo"}, ["algo=grpo", "env=retry", "trainer.max_steps=40"])
    assert swept_keys(load_runs(tmp_path)) == ["env", "trainer.max_steps"]


def _frontier_lines(runs, keys, monkeypatch, tmp_path) -> dict[str, list[tuple[float, float]]]:
    """The frontier plot's lines, {legend label: [(d, reward), ...]}, read off the figure before it is saved."""
    from prefzoo.report import plots

    drawn = {}

    def keep(fig, path, plt, layout=True):
        for line in fig.axes[0].get_lines():
            if not line.get_label().startswith("_") and not line.get_label().startswith("before"):
                drawn[line.get_label()] = [(float(x), float(y)) for x, y in zip(line.get_xdata(), line.get_ydata())]
        plt.close(fig)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    plots.plot_frontier(runs, tmp_path / "frontier.png", keys)
    return drawn


def test_the_frontier_draws_a_line_per_algorithm_task_and_environment(tmp_path, monkeypatch):
    """GRPO on the calculator environment (3-digit products), GRPO on the retry environment (2-digit sums), GRPO on
    the retry environment after more steps, and DPO on the built-in pairs: three GRPO points, two of which may be
    joined. KL 0.25 and 1.0 nats give d = 0.5 and 1.0. The retry runs are a run of today (summary.json names its task
    and environment) and an older run whose summary does not (its config.yaml does). Failing value before: one line
    'grpo' through all three GRPO points, [(0.5, 0.4), (1.0, 0.7), (1.0, 0.9)]."""
    ev = lambda kl, reward: {"kl_k1": kl, "task_reward": reward}  # noqa: E731
    _fake_run(tmp_path / "runs", "calc", {"algo": "grpo", "task": "arithmetic 3-digit *", "env": "calculator",
                                          "eval_after": ev(1.0, 0.9)}, ["algo=grpo", "env=calculator"])
    _fake_run(tmp_path / "runs", "retry", {"algo": "grpo", "task": "arithmetic 2-digit +", "env": "retry",
                                           "eval_after": ev(0.25, 0.4)}, ["algo=grpo", "env=retry"])
    _fake_run(tmp_path / "runs", "retry_old", {"algo": "grpo", "eval_after": ev(1.0, 0.7)},
              ["algo=grpo", "env=retry", "trainer.max_steps=40"])
    (tmp_path / "runs" / "retry_old" / "config.yaml").write_text(yaml.safe_dump(
        {"data": {"name": "arithmetic", "path": None, "digits": 2, "ops": ["+"], "word_problems": False},
         "env": {"name": "retry"}}))
    _fake_run(tmp_path / "runs", "dpo", {"algo": "dpo", "task": "arithmetic 2-digit +", "env": "none",
                                         "eval_after": ev(0.25, 0.5)}, ["algo=dpo"])
    runs = load_runs(tmp_path / "runs")
    lines = _frontier_lines(runs, swept_keys(runs), monkeypatch, tmp_path)
    assert lines == {"grpo · arithmetic 3-digit * · env=calculator": [(1.0, 0.9)],
                     "grpo · arithmetic 2-digit + · env=retry": [(0.5, 0.4), (1.0, 0.7)],
                     "dpo · arithmetic 2-digit + · env=none": [(0.5, 0.5)]}
    # one task and one environment for every run: the legend names the algorithm alone
    same = [r for r in runs if r["dir"].name in ("retry", "retry_old")]
    assert list(_frontier_lines(same, swept_keys(same), monkeypatch, tmp_path)) == ["grpo"]


def test_every_run_of_the_sweep_has_the_common_results_block(sweep):
    """summary.json's results block has the same keys for DPO and SimPO; both are evaluated on the held-out pairs'
    prompts of the file, so they have a KL to the reference (SimPO: the adapter-disabled model) and a reward."""
    from prefzoo.training.loop import RESULT_KEYS

    for run in load_runs(sweep):
        results = run["summary"]["results"]
        assert tuple(results) == RESULT_KEYS
        assert isinstance(results["kl"], float) and isinstance(results["reward"], float), run["dir"].name


def test_report_has_a_legend_and_the_frontier(sweep, tmp_path):
    result = write_report(sweep, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "Columns (evaluation after training" in text and "`kl_k1`: KL(π ‖ π_ref)" in text
    assert (tmp_path / "frontier.png") in result["plots"] and "## Overoptimisation" not in text
    assert "*Reward–KL frontier:" in text  # every plot has its caption


# ------------------------------------------------------------------------------ overoptimisation (synthetic runs)
def _fake_run(root: Path, name: str, summary: dict, overrides: list[str]) -> None:
    folder = root / name
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (folder / "summary.json").write_text(json.dumps(summary))


def _evaluation(step, kl, gold, proxy, **extra):
    return {"step": step, "kl_k1": kl, "gold_sample_reward": gold, "sample_reward": proxy, **extra}


def test_overoptimisation_section_fits_known_coefficients(tmp_path):
    """Best-of-n points on gold = 0.2 + d(0.8 - 0.3 d) (n = 1..64, d = sqrt(log n - (n-1)/n)) and one RL trajectory on
    gold = 0.2 + d(0.5 - 0.4 log d): the report recovers a, b, the peaks (bon d* = 4/3; rl d* = e^(0.25) = 1.284) and
    draws overoptimisation.png; a reward-model run in the folder (no .hydra) is listed but not fitted."""
    from prefzoo.report.overoptimisation import predict
    from prefzoo.objective import best_of_n_kl

    for n in (1, 2, 4, 8, 16, 64):
        d = math.sqrt(best_of_n_kl(n))
        gold = 0.2 + float(predict("bon", d, 0.8, 0.3))
        ev = _evaluation(0, best_of_n_kl(n), gold, 0.1 + d + 0.1 * d * d, kl_method="analytic")
        _fake_run(tmp_path, f"bon{n}", {"algo": "bon", "beta": 0.0, "algo_settings": {"n": n}, "eval_after": ev,
                                        "eval_history": [ev]}, [f"+recipe/overoptimisation_points=bon_n{n}"])
    history = []
    for step, d in enumerate([0.0, 0.3, 0.6, 1.0, 1.5, 2.0, 2.6, 3.2]):
        history.append(_evaluation(5 * step, d * d, 0.2 + float(predict("rl", d, 0.5, 0.4)), 0.1 + 2 * d))
    _fake_run(tmp_path, "grpo", {"algo": "grpo", "beta": 0.0, "eval_before": history[0], "eval_after": history[-1],
                                 "eval_history": history}, ["+recipe/overoptimisation_points=grpo_beta0"])
    (tmp_path / "reward_model").mkdir()
    (tmp_path / "reward_model" / "summary.json").write_text(json.dumps(
        {"algo": "rm", "eval_after": {"preference_accuracy": 0.8}}))

    result = write_report(tmp_path)
    fits = {(f["series"].split(" ")[0], f["reward"]): f["fit"] for f in result["fits"]}
    bon, rl = fits[("best-of-n", "gold")], fits[("grpo", "gold")]
    # exact data, float64 least squares (kind 1 of tests/bounds.py): rounding ~1e-15, 1e-9 and approx's default rel
    # 1e-6 are far above it (tests/report/test_overoptimisation.py measures the same fits to <= 9e-16)
    assert (bon.a, bon.b, bon.baseline) == pytest.approx((0.8, 0.3, 0.2), abs=1e-9)
    assert (rl.a, rl.b) == pytest.approx((0.5, 0.4), abs=1e-9)
    assert bon.peak[0] == pytest.approx(4 / 3) and rl.peak[0] == pytest.approx(math.exp(0.25))
    assert fits[("best-of-n", "proxy")].peak is None  # the proxy keeps rising: no peak
    text = (tmp_path / "report.md").read_text()
    # exact data: the standard errors are rounding noise (~1e-16, its digits vary with the BLAS), so only their size
    assert "## Overoptimisation: gold vs proxy reward" in text and "| d(a − b·d) | 0.8 ± " in text
    assert re.search(r"\| d\(a − b·d\) \| 0\.8 ± \d(\.\d+)?e-1[5-7] \| 0\.3 ± \d(\.\d+)?e-1[5-7] \|", text)
    assert (tmp_path / "overoptimisation.png") in result["plots"] and (tmp_path / "bon_vs_rl.png") in result["plots"]
    # the measured inverted U: RL's gold starts at 0.2 (d = 0), peaks at step 20 (d = 1.5, gold 0.2 + 1.5 (0.5 - 0.4
    # log 1.5) = 0.707: a rise of 0.507) and ends at d = 3.2 with 0.2 + 3.2 (0.5 - 0.4 log 3.2) = 0.311 (a fall of
    # 0.396) while the proxy 0.1 + 2d rises from 3.1 to 6.5
    assert ("| grpo β=0 (grpo) | 0.200 | 1.500 (2.25; step 20) | 0.707 | 0.507 | 0.311 (3.200) | 0.396 | 3.100 → 6.500 "
            "| yes |") in text
    assert "## Beta sets the speed" not in text  # one RL run: no beta test
    assert result["swept"] == ["recipe/overoptimisation_points"]  # the reward-model run does not count as a job
    assert "| reward_model |" in text


# ------------------------------------------------------------------------------------------------------ recipes
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if not p.stem.startswith("_"))


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from prefzoo.cli import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=overrides, return_hydra_config=True)


def test_every_recipe_has_a_small_variant():
    assert {"beta_sweep", "algo_compare", "divergence_compare", "overoptimisation", "diversity"} <= set(RECIPES)
    for name in RECIPES:
        assert name.endswith("_small") or f"{name}_small" in RECIPES, name


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_every_sweep_point_validates(name, tmp_path):
    """`python train.py -m +recipe=NAME` composes: the sweep folder names the recipe, the report callback is on, and
    each point of the sweep (the product of hydra.sweeper.params) is a valid configuration."""
    import itertools

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from prefzoo.cli import to_typed

    cfg = _compose([f"+recipe={name}"])
    assert f"multirun/{name}/" in cfg.hydra.sweep.dir
    assert cfg.hydra.callbacks.report._target_ == "prefzoo.report.callbacks.WriteReport"
    params = dict(cfg.hydra.sweeper.params or {})
    first = [c for c in (cfg.hydra.callbacks or {}).values() if c._target_ == "prefzoo.report.callbacks.TrainFirst"]
    assert params or first, "a recipe sweeps something, or trains a first run its job starts from (sft_then_grpo)"
    grid = [[f"{k}={v.strip()}" for v in str(values).split(",")] for k, values in params.items()]
    # a recipe whose job starts from a first run's adapter (TrainFirst): that folder exists once the first run has
    # ended, so the job is checked without it, and the first run's own overrides are checked as a job of their own
    later = ["model.adapter_path=null"] if first else []
    for point in itertools.product(*grid):
        job = _compose([f"+recipe={name}", *point, f"hydra.sweep.dir={tmp_path}", *later])
        HydraConfig.instance().set_config(job)  # ${hydra:sweep.dir} resolves as in a job
        runs = [list(c.overrides) for c in job.hydra.callbacks.values()
                if c._target_ == "prefzoo.report.callbacks.TrainFirst"]
        with open_dict(job):
            del job["hydra"]
        typed = to_typed(job)
        assert typed.trainer.max_steps > 0
        for overrides in runs:
            assert to_typed(_strip_hydra(_compose(overrides))).trainer.max_steps > 0


def _strip_hydra(cfg):
    from omegaconf import open_dict

    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def test_a_swept_value_on_the_command_line_replaces_the_recipe_list():
    cfg = _compose(["+recipe=beta_sweep_small"])
    # imported after Hydra's first compose, which (re)imports its core plugins: a class imported before it is not the
    # one the module then holds, and BasicSweeper's super() call failed when this test ran first (-k selections)
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert str(cfg.hydra.sweeper.params["objective.beta"]) == "0.01,0.1,1.0"
    sweeper = BasicSweeper(max_batch_size=None, params=dict(cfg.hydra.sweeper.params))
    args = sweeper._parse_config() + ["objective.beta=0.5,2", "algo=simpo"]
    jobs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)[0]
    assert sorted(" ".join(j) for j in jobs) == ["objective.beta=0.5 algo=simpo", "objective.beta=2 algo=simpo"]


def _overoptimisation_run(base: Path) -> background.Command:
    rm = ["algo=rm", "data=file", f"data.path={FIXTURE}", "data.eval_fraction=0.25", "trainer.max_steps=2",
          "trainer.batch_size=4", "model.name=tiny", "trainer.num_threads=1", "trainer.progress=false",
          "trainer.tensorboard=false", "trainer.save_every=0"]
    cmd = [sys.executable, "train.py", "-m", "+recipe=overoptimisation_small", "model=tiny", "trainer.device=cpu",
           "trainer.tensorboard=false", "eval.gold_reward.functions=[correctness]", "trainer.max_steps=4", "eval.every=2",
           "eval.num_problems=4", "eval.diversity_prompts=4", "eval.max_new_tokens=6", "rollout.max_new_tokens=6",
           "+recipe/overoptimisation_points=bon_n1,bon_n2,grpo_beta0",
           "hydra.callbacks.reward_model.overrides=[" + ",".join(f"'{o}'" for o in rm) + "]",
           f"hydra.sweep.dir={base / 'sweep'}"]
    return background.Command(cmd, ROOT, ENV)


#: the recipe end to end, in the background (tests/background.py)
OVEROPTIMISATION_RUN = background.register("report_overoptimisation_recipe", __name__, _overoptimisation_run)


def test_overoptimisation_recipe_end_to_end_on_the_tiny_model():
    """`python train.py -m +recipe=overoptimisation_small` with the tiny model: the callback trains the proxy reward
    model first (here on the fixture pairs, labelled by the exact-match verifier, the gold), best-of-n and GRPO run
    against it, and the sweep ends with the report: gold/proxy columns, the overoptimisation section and plot."""
    proc = OVEROPTIMISATION_RUN.result()
    tmp_path, stdout = proc.base / "sweep", proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "reward_model" / "value_model.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0-bon", "1-bon", "2-grpo", "reward_model"]
    assert f"report of 4 runs: {tmp_path / 'report.md'}" in stdout
    text = (tmp_path / "report.md").read_text()
    assert "## Overoptimisation: gold vs proxy reward" in text and "gold_sample_reward" in text
    assert (tmp_path / "overoptimisation.png").is_file()
    grpo = json.loads((tmp_path / "2-grpo" / "summary.json").read_text())
    assert [h["step"] for h in grpo["eval_history"]] == [0, 2, 4] and grpo["reward"] == "model"
