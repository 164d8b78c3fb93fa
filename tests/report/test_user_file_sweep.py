"""A sweep as a user runs it on preference files of their own (the ecosystem-fit issue, item 6):

    python train.py -m model=tiny data=file data.path=/a/b/x.jsonl,/a/c/y.jsonl algo=dpo,simpo ...

Each run's folder is one safe folder in the sweep folder (a path's slashes made Hydra's ``override_dirname`` nest
them), the sweep ends with its report (every sweep, not only the recipes), the report has plots and the evaluation
says nothing about the default reward's missing ``answer`` column."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from prefzoo.report.sweep_dirs import job_dirname, swept_keys
from tests import background

#: the recipes' end-to-end sweeps (several training jobs each): `make test-recipes`, which CI runs; not `make test`
pytestmark = pytest.mark.recipes

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "arithmetic_pairs.jsonl"


def test_job_dirname_is_one_safe_folder_name():
    """Hydra's override_dirname sorts the job's overrides and joins them; here each value that is a path becomes its
    last part, a group's slash a dot, and characters a folder name should not hold become `_`."""
    overrides = ["data.path=/a/b/x.jsonl", "algo=dpo", "hydra.sweep.dir=/x",
                 "+recipe/overoptimisation_points=bon_n1", "reward.functions=[my.mod:fn]"]
    assert job_dirname(overrides, ["hydra.sweep.dir"]) == (
        "+recipe.overoptimisation_points=bon_n1,algo=dpo,data.path=x.jsonl,reward.functions=[my.mod_fn]")
    assert job_dirname(["data.path=/a/c/y.jsonl"], []) == "data.path=y.jsonl"
    assert job_dirname([], []) == "run"


def test_a_long_dirname_is_cut_at_an_item():
    """At most 100 characters: whole items, then how many were left out (they are in .hydra/overrides.yaml)."""
    overrides = [f"trainer.key_number_{i:02d}=value" for i in range(10)]  # 10 items of 27 characters
    name = job_dirname(overrides, [])
    assert name == ",".join(overrides[:3]) + ",and_7_more" and len(name) <= 100


def test_a_sweep_names_its_jobs_by_what_it_sweeps(tmp_path):
    """The sweep folder's multirun.yaml (written by Hydra's sweeper before the jobs start) holds the command line's
    sweep overrides and the recipe's hydra.sweeper.params: the job's name keeps those keys only."""
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "overrides": {"task": ["model=tiny", "algo=dpo,simpo", "data.path=/a/x.jsonl", "trainer.seed=range(0,3)"]},
        "sweeper": {"params": {"objective.beta": "0.1,1.0"}}}}))
    swept = swept_keys(tmp_path / "multirun.yaml")
    assert swept == {"algo", "trainer.seed", "objective.beta"}
    job = ["model=tiny", "algo=simpo", "data.path=/a/x.jsonl", "trainer.seed=2", "objective.beta=1.0"]
    assert job_dirname(job, [], swept=swept) == "algo=simpo,objective.beta=1.0,trainer.seed=2"
    assert swept_keys(tmp_path / "missing.yaml") == set()  # another sweeper: every override names the job
    assert job_dirname(job, [], swept=set()).startswith("algo=simpo,data.path=x.jsonl,model=tiny,")


def _sweep(root: Path) -> background.Command:
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    paths = []
    for folder, name in (("a/b", "x.jsonl"), ("a/c", "y.jsonl")):  # a user's pairs, without an answer column
        (root / folder).mkdir(parents=True)
        (root / folder / name).write_text("".join(json.dumps({k: v for k, v in r.items() if k != "answer"}) + "\n"
                                                  for r in rows))
        paths.append(str(root / folder / name))
    out = root / "sweep"
    cmd = [sys.executable, "train.py", "-m", "model=tiny", "data=file", f"data.path={','.join(paths)}",
           "algo=dpo,simpo", "trainer.max_steps=1", "trainer.batch_size=2", "trainer.micro_batch_size=2",
           "trainer.progress=false", "trainer.tensorboard=false", "trainer.save_every=0", "trainer.num_threads=1",
           "eval.num_problems=2", "eval.diversity_prompts=2", "eval.diversity_samples=2", "eval.max_new_tokens=6",
           f"hydra.sweep.dir={out}"]
    return background.Command(cmd, ROOT, None, 900)


#: the sweep over two user files, in the background (tests/background.py)
SWEEP = background.register("user_file_sweep", __name__, _sweep)


@pytest.fixture(scope="module")
def sweep() -> Path:
    proc = SWEEP.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = proc.base
    (root / "console.txt").write_text(proc.stdout + proc.stderr)
    return root / "sweep"


def test_each_run_is_one_folder_of_the_sweep(sweep):
    """Before: `0-algo=dpo,data.path=` / `tmp` / ... / `x.jsonl,data=file,...` (one folder level per slash)."""
    folders = sorted(p.parent for p in sweep.rglob("summary.json"))
    assert len(folders) == 4 and all(f.parent == sweep for f in folders), folders
    names = [f.name for f in folders]
    assert names == ["0-algo=dpo,data.path=x.jsonl", "1-algo=simpo,data.path=x.jsonl", "2-algo=dpo,data.path=y.jsonl",
                     "3-algo=simpo,data.path=y.jsonl"]  # the swept overrides only (multirun.yaml says which)


def test_the_sweep_says_nothing_about_the_default_reward(sweep):
    """Before: `reward function 'correctness' raised TypeError: correctness() missing 1 required positional
    argument: 'answer'` twice per run (8 times in this sweep)."""
    console = (sweep.parent / "console.txt").read_text()
    assert "correctness" not in console and "'answer'" not in console


def test_the_sweep_ends_with_a_readable_report(sweep):
    """The report (written by the sweep itself): swept columns algo and data.path once each, the run column each
    folder's (short) name, every named image exists (none before: `## Plots` stood empty)."""
    text = (sweep / "report.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:3] == ["run", "data.path", "algo"] and header.count("algo") == 1  # in command-line order
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    assert [r[0] for r in rows] == ["0-algo=dpo,data.path=x.jsonl", "1-algo=simpo,data.path=x.jsonl",
                                    "2-algo=dpo,data.path=y.jsonl", "3-algo=simpo,data.path=y.jsonl"]
    assert {r[1] for r in rows} == {str(sweep.parent / "a" / "b" / "x.jsonl"), str(sweep.parent / "a" / "c" / "y.jsonl")}
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert images and all((sweep / name).is_file() for name in images)
