"""The run folder before a run: one run at a time (a lock naming its holder), and an output folder that can be written.

Before these checks: two runs started 1 s apart in one folder both exited 0 with metrics.jsonl steps 1,1,2,2 (no
lock existed); ``hydra.run.dir=<a file>`` gave Hydra's FileExistsError traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from prefzoo.errors import RunFolderError
from prefzoo.training import run_folder
from prefzoo.training.run_folder import (LOCK_FILE, check_not_in_use, check_output_dir, lock_run_folder,
                                         open_run_folder, output_dir_of, unlock_run_folder)

ROOT = Path(__file__).resolve().parents[2]
HOLDER = ("import sys, time; from pathlib import Path; from prefzoo.training.run_folder import lock_run_folder; "
          "lock_run_folder(Path(sys.argv[1])); print('locked', flush=True); time.sleep(120)")


def start_holder(folder: Path) -> subprocess.Popen:
    """Another process that takes the folder's lock and keeps it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_folder_held_by_a_live_run_is_refused_naming_the_holder(tmp_path):
    holder = start_holder(tmp_path)
    try:
        with pytest.raises(RunFolderError) as err:
            lock_run_folder(tmp_path)
        message = str(err.value)
        assert "\n" not in message and "in use by another run" in message and str(tmp_path) in message
        assert f"pid {holder.pid} on host {socket.gethostname()}, started 20" in message
    finally:
        holder.kill()
        holder.wait()


def test_train_py_checks_the_lock_before_hydra_writes_into_the_folder(tmp_path):
    """check_not_in_use (train.py, before Hydra's .hydra/ and log files): refused while held, fine once released."""
    check_not_in_use(tmp_path)  # no lock file: nothing to check
    holder = start_holder(tmp_path)
    try:
        with pytest.raises(RunFolderError, match=f"in use by another run \\(pid {holder.pid} "):
            check_not_in_use(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    check_not_in_use(tmp_path)  # its holder is gone


def test_the_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    holder = start_holder(tmp_path)
    holder.send_signal(signal.SIGKILL)  # kill -9: no clean-up, its details stay in the lock file
    holder.wait()
    with caplog.at_level(logging.WARNING):
        lock_run_folder(tmp_path)
    try:
        assert any(f"left by pid {holder.pid}" in r.message and "no longer running" in r.message
                   for r in caplog.records)
        assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_FILE).read_text()
    finally:
        unlock_run_folder(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text() == ""  # released: no holder recorded


def test_the_lock_is_reentrant_in_one_process_and_released_for_the_next(tmp_path):
    lock_run_folder(tmp_path)
    lock_run_folder(tmp_path)  # the same process again (a Trainer after the CLI): nothing to do
    unlock_run_folder(tmp_path)
    holder = start_holder(tmp_path)  # after release another process can take it
    holder.kill()
    holder.wait()


class FakeDataParallel:
    """Process 1 of 2: the main process's answer (no error, nothing to resume) comes by broadcast."""

    enabled, is_main, rank = True, False, 1

    @staticmethod
    def broadcast_object(obj):
        return None, None


def test_only_the_main_process_takes_the_lock(tmp_path):
    folder = open_run_folder(None, tmp_path / "run", FakeDataParallel())
    assert folder.resume is None
    assert not (tmp_path / "run").exists() and str((tmp_path / "run").resolve()) not in run_folder._held


# ------------------------------------------------------------------------------------------------ output folders
def read_only_folder(tmp_path: Path) -> Path:
    """A folder that cannot be written: chmod 555 for a normal user; as root (which ignores modes), /sys, where
    nobody may create folders (skipped where that is not so)."""
    if os.geteuid() != 0:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(0o555)
        return target / "run"
    target = Path("/sys/prefzoo-test-run")
    try:
        target.mkdir()
    except OSError:
        return target
    target.rmdir()
    pytest.skip("no read-only folder available to root here")


@pytest.mark.parametrize("kind,needle", [("file", "is a file, not a folder"),
                                         ("under_file", "cannot be created: "),
                                         ("read_only", "cannot be written")])
def test_unusable_output_folders_are_refused_in_one_line(tmp_path, kind, needle):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    path = {"file": a_file, "under_file": a_file / "run"}.get(kind) or read_only_folder(tmp_path)
    with pytest.raises(RunFolderError) as err:
        check_output_dir(path)
    assert needle in str(err.value) and str(path) in str(err.value) and "hydra.run.dir=" in str(err.value)
    assert "\n" not in str(err.value)


def test_writable_folders_pass_and_the_probe_leaves_nothing(tmp_path):
    check_output_dir(tmp_path / "new" / "run")
    check_output_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,expected", [
    (["train.py", "algo=dpo", "hydra.run.dir=/x/y"], Path("/x/y")),
    (["train.py", "++hydra.run.dir='/x/y z'"], Path("/x/y z")),
    (["train.py", "algo=dpo"], Path("outputs")),
    (["train.py", "-m", "hydra.sweep.dir=/s", "hydra.run.dir=/r"], Path("/s")),
    (["train.py", "--cfg", "job", "hydra.run.dir=/x"], None),
    (["train.py", "hydra.run.dir=${oc.env:HOME}/x"], None),
])
def test_the_output_folder_of_a_command_line(argv, expected):
    assert output_dir_of(argv) == expected


RACE = ["algo=dpo", "model=tiny", "data=file", f"data.path={ROOT / 'tests' / 'fixtures' / 'arithmetic_pairs.jsonl'}",
        "trainer.max_steps=1", "trainer.batch_size=2", "trainer.progress=false", "trainer.tensorboard=false",
        "trainer.num_threads=1", "trainer.device=cpu", "trainer.save_every=0", "eval.before=false", "eval.after=false"]


def test_two_runs_started_a_second_apart_in_one_folder_keep_the_winners_records(tmp_path):
    """Hardening round 3, item 1. Two ``train.py`` runs in one folder (seed 1, then seed 2 one second later, inside
    the first's start-up, which takes several seconds of imports before any model loads): one trains, the other is
    refused in one line -- and now before Hydra writes anything, so ``.hydra/overrides.yaml``, ``config.yaml`` and
    the model card's command are the winner's. Before: the lock was taken seconds after start, after Hydra had
    written the loser's ``.hydra/`` files over the winner's (a seed-1 run whose card gave ``trainer.seed=2``)."""
    import time

    import yaml

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    start = lambda seed: subprocess.Popen(  # noqa: E731
        [sys.executable, "train.py", *RACE, f"trainer.seed={seed}", f"hydra.run.dir={run}"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = start(1)
    time.sleep(1.0)
    second = start(2)
    results = {seed: (proc.wait(timeout=300), proc.stderr.read()) for seed, proc in ((1, first), (2, second))}
    winners = [seed for seed, (code, _) in results.items() if code == 0]
    assert len(winners) == 1, results
    winner, loser = winners[0], 3 - winners[0]
    code, stderr = results[loser]
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "is in use by another run" in lines[0], stderr
    overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
    assert f"trainer.seed={winner}" in overrides and f"trainer.seed={loser}" not in overrides
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["seed"] == winner
    card = (run / "adapter" / "README.md").read_text()
    assert f"trainer.seed={winner}" in card and f"trainer.seed={loser}" not in card
