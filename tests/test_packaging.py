"""prefzoo as a package (issue 14, item 1): the wheel holds the configs and the ``prefzoo`` console script, and the
installed wheel trains from a folder outside the repository; ``python -m prefzoo`` is the same command.

The wheel is built from a copy of the sources (pyproject.toml, README.md, prefzoo/) with the venv's own setuptools
(``--no-build-isolation``: no network), so the worktree gets no build/ or egg-info. It is installed with
``pip install --no-deps --target`` (the dependencies are the project venv's: installing torch and transformers into
a fresh venv needs the network); PYTHONPATH puts the target first, so the installed copy is the one imported, and
the run starts in a temporary folder that has no conf/ and no train.py.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "arithmetic_pairs.jsonl"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HYDRA_FULL_ERROR": "0"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "prefzoo", src / "prefzoo", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("prefzoo-*.whl")
    return whl


def test_the_wheel_holds_every_config_file_and_the_console_script(wheel):
    """Expected: every yaml under prefzoo/conf/ of the sources (globbed here, recipes included: they are real files
    since recipes/ moved into prefzoo/conf/recipe), at the same path in the wheel, as regular files, and the
    console script ``prefzoo = prefzoo.commands:main``. Before: the wheel had no prefzoo/conf/config.yaml (the first
    missing name) and no entry_points.txt."""
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "prefzoo" / "conf").rglob("*.yaml")}
    assert "prefzoo/conf/config.yaml" in expected and "prefzoo/conf/algo/dpo.yaml" in expected
    assert "prefzoo/conf/recipe/algo_compare_small.yaml" in expected
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        missing = sorted(expected - names)
        assert missing == []
        for name in expected:  # a symlink in a zip has the S_IFLNK bits in its external attributes
            assert (z.getinfo(name).external_attr >> 16) & 0o170000 != 0o120000, name
        (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "prefzoo = prefzoo.commands:main" in z.read(ep).decode()
        assert "prefzoo/__main__.py" in names
        shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / "prefzoo" / "data" / "shipped_pairs").rglob("*.json*")}
        assert len(shipped) >= 4 and sorted(shipped - names) == []  # the built-in pairs make train uses
        evaluations = {p.relative_to(ROOT).as_posix() for p in (ROOT / "prefzoo" / "evaluation" / "shipped").glob("*.json")}
        assert len(evaluations) >= 1 and sorted(evaluations - names) == []  # ... and its evaluation before training


@pytest.mark.slow  # ~40 s of CPU: install, 2 DPO steps of the tiny model with one evaluation, the report
def test_the_installed_wheel_trains_and_reports_outside_the_repository(wheel, tmp_path):
    """``prefzoo train algo=dpo model=tiny trainer.max_steps=2`` through the installed console script in a folder
    without conf/ or train.py: exit status 0, summary.json with 2 steps (the max_steps given), the run folder's
    train.log (hydra.job.name=train, whatever the entry point), and the Python that ran it imported prefzoo from the
    installed copy, not this checkout. Then ``prefzoo report RUN`` writes report.md there."""
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = target / "bin" / "prefzoo"
    assert script.is_file()
    work = tmp_path / "elsewhere"
    work.mkdir()
    data = work / "pairs.jsonl"
    shutil.copy(FIXTURE, data)  # the user's own file, beside them
    env = {**ENV, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import prefzoo; print(prefzoo.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True)
    assert Path(where.stdout.strip()).is_relative_to(target)
    run = work / "run"
    args = ["train", "algo=dpo", "model=tiny", "trainer.max_steps=2", "data=file", f"data.path={data}",
            "trainer.batch_size=2", "trainer.progress=false", "trainer.device=cpu", "trainer.num_threads=1",
            "trainer.save_every=0", "model.lora.r=4", "data.max_length=96", "data.max_prompt_length=64",
            "eval.num_problems=2", "eval.max_new_tokens=4", "eval.diversity_prompts=0", f"hydra.run.dir={run}"]
    proc = subprocess.run([str(script), *args], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert (run / "train.log").is_file()
    assert not (work / "conf").exists() and not (work / "train.py").exists()
    proc = subprocess.run([str(script), "report", str(run)], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "report.md").is_file()


def test_python_m_prefzoo_train_composes_the_packaged_config(tmp_path):
    """``python -m prefzoo train --cfg job algo=grpo``, run from a folder without conf/: Hydra prints the composed
    job config, whose algo is the one asked for (grpo, not the default dpo of config.yaml) and whose model is the
    default smollm2 of config.yaml (so the packaged defaults list was read). Before: ``No module named
    prefzoo.__main__``."""
    env = {**ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "prefzoo", "train", "--cfg", "job", "algo=grpo"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "algo:\n  name: grpo\n" in proc.stdout and "name: smollm2" in proc.stdout


def test_python_m_prefzoo_without_a_command_is_one_line_and_exit_status_2(tmp_path):
    """No command, and an unknown one: exit status 2, one stderr line naming the commands; ``--help`` lists them."""
    env = {**ENV, "PYTHONPATH": str(ROOT)}
    for argv in ([], ["trian"]):
        proc = subprocess.run([sys.executable, "-m", "prefzoo", *argv], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.startswith("prefzoo: error: ") and proc.stderr.count("\n") == 1
        assert "train, pairs, report, diagnose, conformance, toy" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "prefzoo", "--help"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    assert all(f"prefzoo {c}" in proc.stdout for c in ("train", "pairs", "report", "diagnose", "conformance", "toy"))


def test_a_config_folder_of_ones_own_is_added_with_config_dir(tmp_path):
    """``prefzoo train --config-dir MY_CONF model=mytiny``: a model yaml that exists only in the user's folder (a
    copy of prefzoo's tiny.yaml under another name) composes beside prefzoo's packaged groups (algo=dpo from them),
    without copying prefzoo's configs: the job config's model is tiny's (name: tiny)."""
    mine = tmp_path / "my_conf" / "model"
    mine.mkdir(parents=True)
    shutil.copy(ROOT / "prefzoo" / "conf" / "model" / "tiny.yaml", mine / "mytiny.yaml")
    env = {**ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "prefzoo", "train", "--config-dir", str(tmp_path / "my_conf"),
                           "model=mytiny", "algo=dpo", "--cfg", "job"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model:\n  name: tiny\n" in proc.stdout and "algo:\n  name: dpo\n" in proc.stdout
