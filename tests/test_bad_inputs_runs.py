"""A sweep of bad inputs around the run folder: resume mismatches of each run-defining key, damaged or unsafe
checkpoints, a locked folder, output folders that are files or read-only, and resume with nothing to resume.

Every case runs the CLI: ``python train.py ...`` in a subprocess (the cases marked ``cli``: output folders, which
fail before Hydra creates them, a locked folder, and one of each other kind), the others in this process through
``prefzoo.cli.run_from_hydra`` on the config ``train.py`` composes (what ``train.py`` calls; the imports are paid
once). Each asserts: an illegal input exits with status 2 and ONE line ``prefzoo: error: ...`` naming the problem
(the needle), no traceback, and nothing in the folder changed (every file as it was,
no model loaded for the in-process refusals); a legal input (resume after damage, nothing to resume, a stale lock,
more steps) exits 0 with a warning naming what happened.

One real run (DPO, tiny model, 2 steps, a checkpoint after each) is prepared once; each case works on a copy. The
subprocesses run one at a time in the background while the in-process cases run: about 65 s of CPU in all (each
``train.py`` refusal of a resume pays ~7 s of imports; an output folder refusal ~2.5 s, before Hydra starts).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from prefzoo import cli
from prefzoo.models import loading
from prefzoo.training import loop
from prefzoo.training.checkpoint import STATE_FILE
from prefzoo.training.run_folder import LOCK_FILE
from tests.models.helpers import threads
from tests.test_config import composed

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = str(ROOT / "tests" / "fixtures" / "arithmetic_pairs.jsonl")
BASE = ["algo=dpo", "model=tiny", "data=file", f"data.path={FIXTURE}", "trainer.max_steps=2", "trainer.batch_size=2",
        "trainer.save_every=1", "trainer.progress=false", "trainer.tensorboard=false", "trainer.num_threads=1",
        "trainer.device=cpu", "model.lora.r=4", "data.max_length=96", "data.max_prompt_length=64",
        "eval.before=false", "eval.after=false"]
RESUME = BASE + ["trainer.resume=true"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HYDRA_FULL_ERROR": "0",
       "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


# ------------------------------------------------------------------------------------------ damaging a run folder
def newest(run: Path) -> Path:
    return run / "checkpoints" / "step-000002"


def cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def pickled_code(run: Path) -> None:
    """A trainer state whose unpickling would create ``<run>/code-ran`` (os.mkdir through __reduce__)."""
    state = torch.load(newest(run) / STATE_FILE, weights_only=False)
    state["payload"] = RunsCode(run / "code-ran")
    torch.save(state, newest(run) / STATE_FILE)


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def all_damaged(run: Path) -> None:
    for state in (run / "checkpoints").glob(f"step-*/{STATE_FILE}"):
        state.write_bytes(b"")


def stale_lock(run: Path) -> None:
    """The lock file a killed run leaves: its details, no process holding the lock."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (run / LOCK_FILE).write_text(f'{{"pid": {proc.pid}, "host": "elsewhere", "started": "2025-01-01T00:00:00"}}\n')


def nothing(run: Path) -> None:
    shutil.rmtree(run)
    run.mkdir()


def only_an_unfinished_checkpoint(run: Path) -> None:
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints" / "step-000004" / "adapter").mkdir(parents=True)  # a save that never finished


def a_file(run: Path) -> None:
    shutil.rmtree(run)
    run.write_text("not a folder")


OPTIMIZER_LR = ("trainer_state.pt was built with other settings, and a resume continues it as saved: trainer.lr: 0.0002 "
                "(checkpoint) vs 0.001 (now). Put them back to continue the run, or start a new run in another folder")


def state_without(checkpoint: Path, key: str) -> None:
    """The checkpoint's trainer state, loadable, without ``key``."""
    state = torch.load(checkpoint / STATE_FILE, weights_only=False)
    del state[key]
    torch.save(state, checkpoint / STATE_FILE)


def without_run_config(run: Path) -> None:
    """Checkpoints as an earlier prefzoo wrote them: no run_config.json."""
    for step in (run / "checkpoints").iterdir():
        (step / "run_config.json").unlink()


def edited_run_config(run: Path) -> None:
    """run_config.json edited by hand to the new learning rate (the optimizer state still holds the old one)."""
    import json

    for step in (run / "checkpoints").iterdir():
        saved = json.loads((step / "run_config.json").read_text())
        saved["trainer.lr"] = 0.001
        (step / "run_config.json").write_text(json.dumps(saved))


def read_only_dir(_run: Path) -> Path:
    """/sys refuses new folders even to root (this test machine runs as root, which ignores chmod)."""
    if os.geteuid() != 0:
        pytest.skip("runs as root only (uses /sys)")
    return Path("/sys/prefzoo-bad-input-run")


@dataclass
class Case:
    name: str
    overrides: list[str]
    needle: str  # in the error line, or in the warning of a legal input
    prepare: Callable[[Path], object] | None = None  # damages the case's copy; may return the run folder to use
    legal: bool = False  # a warning and exit 0, not an error
    cli: bool = False  # a real train.py subprocess
    copy: bool = True  # start from a copy of the prepared run
    extra: dict = field(default_factory=dict)


def overriding(base: list[str], *changes: str) -> list[str]:
    """``base`` with ``changes`` replacing the overrides of the same keys."""
    keys = {c.split("=", 1)[0] for c in changes}
    return [o for o in base if o.split("=", 1)[0] not in keys] + list(changes)


def mismatch(key_value: str, needle: str, **kw) -> Case:
    name = "resume_" + "".join(ch if ch.isalnum() else "_" for ch in key_value)
    return Case(name, overriding(RESUME, key_value), needle, **kw)


CASES = [
    # ---- resume with a run-defining setting changed: refused, listing the key and both values
    mismatch("algo=grpo", "algo.name: 'dpo' (checkpoint) vs 'grpo' (now)", cli=True),
    mismatch("algo=simpo", "algo.name: 'dpo' (checkpoint) vs 'simpo' (now)"),
    mismatch("algo.loss_type=ipo", "algo.loss_type: 'sigmoid' (checkpoint) vs 'ipo' (now)"),
    mismatch("algo.label_smoothing=0.1", "algo.label_smoothing: 0.0 (checkpoint) vs 0.1 (now)"),
    mismatch("objective.beta=0.5", "objective.beta: 0.1 (checkpoint) vs 0.5 (now)"),
    mismatch("objective=forward_kl", "objective.divergence: 'reverse_kl' (checkpoint) vs 'forward_kl' (now)"),
    mismatch("model.lora.r=8", "model.lora.r: 4 (checkpoint) vs 8 (now)"),
    mismatch("model.lora.alpha=16", "model.lora.alpha: 32 (checkpoint) vs 16 (now)"),
    mismatch("model.lora.dropout=0.1", "model.lora.dropout: 0.0 (checkpoint) vs 0.1 (now)"),
    mismatch("model.lora.target_modules=[q_proj]", "model.lora.target_modules: 'all-linear' (checkpoint) vs "
                                                   "['q_proj'] (now)"),
    mismatch("model.lora.enabled=false", "model.lora.enabled: True (checkpoint) vs False (now)"),
    mismatch("model.dtype=bfloat16", "model.dtype: 'float32' (checkpoint) vs 'bfloat16' (now)"),
    mismatch("model.tiny_layers=3", "model.tiny_layers: 2 (checkpoint) vs 3 (now)"),
    mismatch("data.max_length=128", "data.max_length: 96 (checkpoint) vs 128 (now)"),
    mismatch("data.seed=1", "data.seed: 0 (checkpoint) vs 1 (now)"),
    mismatch("data.eval_fraction=0.1", "data.eval_fraction: 0.05 (checkpoint) vs 0.1 (now)"),
    mismatch("trainer.seed=1", "trainer.seed: 0 (checkpoint) vs 1 (now)"),
    mismatch("trainer.lr=1e-3", "trainer.lr: 0.0002 (checkpoint) vs 0.001 (now)"),
    mismatch("trainer.lr_schedule=constant", "trainer.lr_schedule: 'linear' (checkpoint) vs 'constant' (now)"),
    mismatch("trainer.warmup_steps=0", "trainer.warmup_steps: 2 (checkpoint) vs 0 (now)"),
    mismatch("trainer.weight_decay=0.01", "trainer.weight_decay: 0.0 (checkpoint) vs 0.01 (now)"),
    mismatch("trainer.batch_size=4", "trainer.batch_size: 2 (checkpoint) vs 4 (now)"),
    mismatch("trainer.max_grad_norm=0.5", "trainer.max_grad_norm: 1.0 (checkpoint) vs 0.5 (now)"),
    mismatch("rollout.temperature=0.5", "rollout.temperature: 1.0 (checkpoint) vs 0.5 (now)"),
    mismatch("reward.functions=[correctness,format]", "reward.functions: ['correctness'] (checkpoint) vs "
                                                      "['correctness', 'format'] (now)"),
    mismatch("trainer.early_stopping.metric=preference_accuracy",
             "trainer.early_stopping.metric: None (checkpoint) vs 'preference_accuracy' (now)"),
    # ---- hardening round 3, item 2: what the optimizer restores is checked too, without or with an edited run_config
    Case("resume_lr_without_run_config", overriding(RESUME, "trainer.lr=1e-3"), OPTIMIZER_LR,
         prepare=without_run_config),
    Case("resume_lr_with_an_edited_run_config", overriding(RESUME, "trainer.lr=1e-3"), OPTIMIZER_LR,
         prepare=edited_run_config, cli=True),
    Case("resume_two_keys", overriding(RESUME, "trainer.seed=1", "model.lora.r=8"),
         "model.lora.r: 4 (checkpoint) vs 8 (now); trainer.seed: 0 (checkpoint) vs 1 (now)"),
    Case("resume_other_data_file", RESUME, "data.path: ", prepare=lambda run: None,
         extra={"other_data": True}),
    # ---- damaged or unsafe checkpoints
    Case("damaged_truncated_state", overriding(RESUME, "trainer.max_steps=3"), "step-000002 is damaged",
         prepare=lambda run: cut(newest(run) / STATE_FILE), legal=True),
    Case("damaged_garbage_state", overriding(RESUME, "trainer.max_steps=3"), "step-000002 is damaged",
         prepare=lambda run: (newest(run) / STATE_FILE).write_bytes(b"garbage"), legal=True),
    Case("damaged_truncated_adapter", overriding(RESUME, "trainer.max_steps=3"), "step-000002 is damaged",
         prepare=lambda run: cut(newest(run) / "adapter" / "adapter_model.safetensors"), legal=True),
    Case("damaged_run_config", overriding(RESUME, "trainer.max_steps=3"), "step-000002 is damaged",
         prepare=lambda run: (newest(run) / "run_config.json").write_text("{not json"), legal=True),
    Case("damaged_every_checkpoint", RESUME, "every checkpoint in", prepare=all_damaged),
    # hardening round 3, item 8: a trainer state that loads but lacks a key is damaged (the previous checkpoint is
    # used); a torn last line of metrics.jsonl is dropped with a warning (both were tracebacks)
    Case("damaged_state_without_optimizer", overriding(RESUME, "trainer.max_steps=3"),
         "step-000002 is damaged (", prepare=lambda run: state_without(newest(run), "optimizer"), legal=True),
    Case("torn_metrics_line", overriding(RESUME, "trainer.max_steps=3"),
         "metrics.jsonl:3 is not a JSON object (a line cut off when the run was stopped): dropped on resume",
         prepare=lambda run: (run / "metrics.jsonl").open("a").write('{"step": 3, "loss": 0.'), legal=True),
    Case("pickled_code", RESUME, "would run code when loaded (posix.mkdir)", prepare=pickled_code, cli=True),
    Case("pickled_code_in_process", RESUME, "would run code when loaded (posix.mkdir)", prepare=pickled_code),
    # ---- locks
    Case("locked_by_a_live_run", RESUME, "is in use by another run (pid ", cli=True, extra={"holder": True}),
    Case("stale_lock_taken_over", overriding(RESUME, "trainer.max_steps=3"), "which is no longer running",
         prepare=stale_lock, legal=True),
    # ---- output folders
    # ---- a new run in a finished run's folder (hardening round 3, item 3): refused before the model loads
    Case("new_run_in_a_finished_folder", BASE, "holds an earlier run (metrics.jsonl, summary.json, "
         "checkpoints/step-000002): continue it with trainer.resume=true, or start this run in another folder",
         cli=True),
    # round 4: the refused run rewrote the finished run's .hydra/overrides.yaml before its refusal (every file is
    # compared now); a second algorithm in the folder, and a resume with other settings, likewise
    Case("new_run_with_other_settings_in_a_finished_folder", overriding(BASE, "trainer.seed=5", "trainer.max_steps=3"),
         "holds an earlier run", cli=True),
    Case("second_algorithm_resumed_in_a_finished_folder", overriding(RESUME, "algo=simpo"),
         "algo.name: 'dpo' (checkpoint) vs 'simpo' (now)", cli=True),
    Case("new_run_in_a_folder_with_metrics_only", BASE, "holds an earlier run (metrics.jsonl)",
         prepare=lambda run: [shutil.rmtree(run / "checkpoints"), (run / "summary.json").unlink()]),
    Case("output_is_a_file", BASE, "is a file, not a folder", prepare=a_file, cli=True),
    Case("output_under_a_file", BASE, "cannot be created: ", prepare=lambda run: (a_file(run), run / "sub")[1],
         cli=True),
    Case("output_read_only", BASE, "cannot be written", prepare=read_only_dir, cli=True, copy=False),
    # ---- nothing to resume, and what may change
    Case("resume_nothing", overriding(RESUME, "trainer.max_steps=1"), "nothing to resume in", prepare=nothing,
         legal=True, cli=True),
    Case("resume_only_unfinished", overriding(RESUME, "trainer.max_steps=1"), "nothing to resume in",
         prepare=only_an_unfinished_checkpoint, legal=True),
    Case("resume_more_steps", overriding(RESUME, "trainer.max_steps=3", "trainer.log_every=2", "eval.every=5",
                                         "trainer.micro_batch_size=1"), "schedule is rebuilt", legal=True),
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The real run every case starts from (in this process, through run_from_hydra in its folder)."""
    run = tmp_path_factory.mktemp("prepared") / "run"
    with pytest.MonkeyPatch.context() as patch, threads(1):
        in_folder(patch, run)
        cli.run_from_hydra(composed(*BASE))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    return run


def in_folder(patch: pytest.MonkeyPatch, run: Path) -> None:
    """run_from_hydra outside Hydra's main: its run folder is ``run`` (Hydra's would be hydra.run.dir), one job."""
    patch.setattr(cli, "run_dir", lambda: run)
    patch.setattr(cli, "in_multirun", lambda: False)


def case_folder(case: Case, prepared: Path, base: Path) -> tuple[Path, list[str]]:
    """The case's run folder (a copy of the prepared run, damaged by ``prepare``) and its overrides."""
    run = base / case.name / "run"
    run.parent.mkdir(parents=True)
    if case.copy:
        shutil.copytree(prepared, run)
    overrides = list(case.overrides)
    if case.extra.get("other_data"):
        other = base / case.name / "other_pairs.jsonl"
        shutil.copy(FIXTURE, other)
        overrides = [o for o in overrides if not o.startswith("data.path=")] + [f"data.path={other}"]
    if case.prepare is not None:
        other = case.prepare(run)
        run = other if isinstance(other, Path) else run
    return run, overrides


def snapshot(run: Path) -> dict:
    """Every file of the folder and its bytes (``.hydra/``, ``train.log`` and the checkpoints included), but the lock
    file, whose holder's details a run writes while it holds it: a refused run must leave all of it as it was (round 4:
    Hydra used to rewrite ``.hydra/overrides.yaml`` before the refusal)."""
    return {str(f.relative_to(run)): f.read_bytes() for f in sorted(run.rglob("*"))
            if f.is_file() and f.name != LOCK_FILE}


HOLDER = ("import sys, time; from pathlib import Path; from prefzoo.training.run_folder import lock_run_folder; "
          "lock_run_folder(Path(sys.argv[1])); print('locked', flush=True); time.sleep(120)")


def run_cli(case: Case, run: Path, overrides: list[str]) -> tuple[int, str, str]:
    holder = None
    if case.extra.get("holder"):
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                  text=True)
        assert holder.stdout.readline().strip() == "locked"
    try:
        proc = subprocess.run([sys.executable, "train.py", *overrides, f"hydra.run.dir={run}"], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=300)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module", autouse=True)
def cli_runs(prepared, tmp_path_factory):
    """The ``cli`` cases, one subprocess at a time in the background while the in-process cases use the other core;
    {name: (future of (returncode, stdout, stderr), run folder, its files before)}."""
    base = tmp_path_factory.mktemp("cli_cases")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    futures = {}
    for case in CASES:
        if not case.cli:
            continue
        try:
            run, overrides = case_folder(case, prepared, base)
        except pytest.skip.Exception:
            continue
        futures[case.name] = (pool.submit(run_cli, case, run, overrides), run, snapshot(run) if run.is_dir() else {})
    yield futures
    pool.shutdown(wait=True)


def check(case: Case, rc: int, out: str, err: str, run: Path, before: dict) -> None:
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    if case.legal:
        assert rc == 0, err[-3000:]
        assert case.needle in out + err, (out + err)[-3000:]
        assert "prefzoo: error" not in err
        return
    assert rc == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("prefzoo: error: ")]
    assert len(errors) == 1 and errors == lines[-1:], err[-3000:]
    assert case.needle in errors[0], errors[0]
    if run.is_dir():
        after = snapshot(run)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        assert not changed, changed  # every file as it was
    assert not (run / "code-ran").exists() if run.is_dir() else True


@pytest.mark.parametrize("case", [c for c in CASES if not c.cli], ids=lambda c: c.name)
def test_bad_input_in_process(case, prepared, tmp_path, monkeypatch, capsys, caplog):
    run, overrides = case_folder(case, prepared, tmp_path)
    before = snapshot(run)
    if not case.legal:  # refusals come before the trainer is built, so before any model or tokenizer loads
        def tripwire(*_a, **_k):
            raise AssertionError("the trainer, a model or a tokenizer was built before the refusal")

        monkeypatch.setattr(loop, "Trainer", tripwire)
        monkeypatch.setattr(loading, "load_causal_lm", tripwire)
        monkeypatch.setattr(loop, "load_tokenizer", tripwire)
    in_folder(monkeypatch, run)
    rc = 0
    with threads(1), caplog.at_level(logging.WARNING):
        try:
            cli.run_from_hydra(composed(*overrides))
        except SystemExit as exit_:
            rc = exit_.code
    captured = capsys.readouterr()
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    check(case, rc, captured.out + warnings, captured.err, run, before)


@pytest.mark.parametrize("case", [c for c in CASES if c.cli], ids=lambda c: c.name)
def test_bad_input_on_the_command_line(case, cli_runs):
    if case.name not in cli_runs:
        pytest.skip("not available here")
    future, run, before = cli_runs[case.name]
    rc, out, err = future.result()
    if case.extra.get("holder"):  # refused by train.py before Hydra wrote .hydra/ or its log into the folder
        assert not (run / ".hydra").exists()
    check(case, rc, out, err, run, before)


def test_the_sweep_covers_enough_bad_inputs():
    assert len(CASES) >= 25 and len({c.name for c in CASES}) == len(CASES)
