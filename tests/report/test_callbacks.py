"""The report wing's entry points outside a sweep: ``python -m prefzoo.report`` on a folder without runs, and the
Hydra callbacks (prefzoo.report.callbacks) of the recipes."""

import os
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from prefzoo.report import callbacks

ROOT = Path(__file__).resolve().parents[2]


def test_train_first_runs_prefzoo_train_importable_from_this_checkout():
    """TrainFirst runs ``python -m prefzoo train`` (an installed wheel has no train.py), with this checkout first on
    PYTHONPATH so a clone without an install runs the same code (the folder two above callbacks.py: the root)."""
    assert callbacks.TRAIN_CMD == [sys.executable, "-m", "prefzoo", "train"]
    assert callbacks._env_importing_prefzoo()["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_report_of_a_folder_without_runs_is_one_line_and_exit_status_2(tmp_path):
    """Before: a SystemExit message without the ``prefzoo: error:`` prefix, exit status 1."""
    proc = subprocess.run([sys.executable, "-m", "prefzoo.report", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (f"prefzoo: error: no summary.json under {tmp_path}: point `python -m prefzoo.report` "
                                   "at a run folder or a multirun folder (a run writes summary.json when it finishes).")


def test_write_report_callback_says_there_is_no_report_and_lets_the_sweep_end(tmp_path, capsys):
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    callbacks.WriteReport().on_multirun_end(config)
    out = capsys.readouterr().out.strip()
    assert out.startswith("[prefzoo] no report: no summary.json under") and not (tmp_path / "report.md").exists()
