"""`python train.py -m` over a 2 x 2 grid of tiny runs, then `python -m prefzoo.report` on the sweep folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prefzoo.report import load_runs, markdown_table, swept_keys

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "arithmetic_pairs.jsonl"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    cmd = [sys.executable, "train.py", "-m", "model=tiny", "data=file", f"data.path={FIXTURE}",
           "algo=dpo,simpo", "objective.beta=0.1,0.5", "trainer.max_steps=2", "trainer.batch_size=2",
           "trainer.micro_batch_size=2", "trainer.progress=false", "trainer.tensorboard=false",
           f"hydra.sweep.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_multirun_writes_one_summary_per_job(sweep):
    runs = load_runs(sweep)
    assert len(runs) == 4
    assert sorted((r["summary"]["algo"], r["summary"]["beta"]) for r in runs) == [
        ("dpo", 0.1), ("dpo", 0.5), ("simpo", 0.1), ("simpo", 0.5)]
    assert swept_keys(runs) == ["algo", "objective.beta"]


def test_report_table_has_a_row_per_run_and_swept_columns(sweep, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "prefzoo.report", str(sweep), "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
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


def test_swept_keys_ignores_constant_overrides():
    runs = [{"dir": Path("a"), "summary": {}, "overrides": {"algo": "dpo", "model": "tiny"}},
            {"dir": Path("b"), "summary": {}, "overrides": {"algo": "simpo", "model": "tiny"}}]
    assert swept_keys(runs) == ["algo"]
    table = markdown_table(runs, ["algo"])
    assert table.splitlines()[2].startswith("| a | dpo |")
