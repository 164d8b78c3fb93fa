"""Round 4 of bad inputs and faults (issue 46), tried as a new user would on the tiny model: wrong records, tracebacks,
faults that left processes or threads behind, and settings accepted without a word. Each test names the value that
failed before the fix (``Before:``); the config-value refusals and the data file are in tests/test_bad_inputs.py, the
run-folder records in tests/test_bad_inputs_runs.py.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import prefzoo
from prefzoo import cli
from prefzoo.errors import ConfigError, EnvironmentFailure, ModelError, RunFolderError
from prefzoo.models import loading
from prefzoo.training import baseline, loop, setup
from tests.algos.hydra_runs import TINY_RUN, compose
from tests.test_bad_inputs import run_cli

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(ROOT)}
FAULTY = "tests.environments.faulty_envs"
#: GRPO on the tiny model, 2 prompts x 4 samples a step, a checkpoint after every step, no evaluation
GRPO = ["algo=grpo", *[o for o in TINY_RUN if not o.startswith("trainer.save_every")], "trainer.save_every=1",
        "eval.before=false", "eval.after=false"]


def train_py(args: list[str], run: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args, f"hydra.run.dir={run}"], cwd=ROOT, env=env or ENV,
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess | tuple, needle: str) -> str:
    code, stderr = (proc.returncode, proc.stderr) if isinstance(proc, subprocess.CompletedProcess) else proc
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith("prefzoo: error: "), stderr[-3000:]
    assert needle in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------ environments' errors
def test_an_environment_that_fails_in_training_stops_in_one_line_and_keeps_the_checkpoint(tmp_path):
    """``reset`` raises on episode 11: the pre-flight starts 2, step 1 plays 8 (2 prompts x 4), so step 2's first
    episode fails. Exit 2, one line naming the class, the method, the episode and the step, and the checkpoint of step 1
    kept and named. Before: a 40-line RuntimeError traceback after the model loaded."""
    proc = train_py([*GRPO, "trainer.max_steps=3", "env=custom", f"env.target={FAULTY}:ResetFailsLater"],
                    tmp_path / "run", {**ENV, "FAIL_AT_EPISODE": "11"})
    line = one_error_line(proc, "ResetFailsLater.reset raised RuntimeError: the episode server is down")
    assert "in the episode of prompt 1 of 2, sample 1, at its start" in line and "during training step 2" in line
    assert "the last checkpoint (step-000001) is kept" in line
    assert [json.loads(r)["step"] for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_an_environment_that_fails_in_the_evaluation_before_training_is_one_line(tmp_path):
    """``get_reward`` works for the pre-flight's two episodes and raises from the third (the evaluation before
    training). Before: a KeyError traceback."""
    proc = train_py([*[o for o in GRPO if not o.startswith("eval.before")], "env=custom",
                     f"env.target={FAULTY}:RewardFailsLater"], tmp_path / "run")
    line = one_error_line(proc, "RewardFailsLater.get_reward raised KeyError: 'score'")
    assert "at its end" in line and "before training (the evaluation)" in line


def test_get_reward_is_checked_before_the_model_loads(tmp_path):
    """TRL's contract lets an episode end after one turn, so ``get_reward`` must work right after ``reset``: the
    pre-flight calls it once. Before: accepted, then an AttributeError traceback at the first episode's end."""
    proc = train_py([*GRPO, "env=custom", f"env.target={FAULTY}:RewardFailsAtOnce"], tmp_path / "run")
    one_error_line(proc, "RewardFailsAtOnce.get_reward failed on the first training row (AttributeError:")
    assert "checked before the model loads" in proc.stderr


def _eos_everywhere(monkeypatch):
    """Every turn the hf engine samples ends with EOS (the tiny random model almost never draws it): the episode loop
    then hands each turn to the environment's ``step``."""
    from prefzoo.rollout.engine import HFEngine

    real = HFEngine.sample

    def sample(self, model, prompts, num_samples, params, *, eos_token_ids, pad_id, generator=None):
        batch = real(self, model, prompts, num_samples, params, eos_token_ids=eos_token_ids, pad_id=pad_id,
                     generator=generator)
        lengths = batch.completion_mask.sum(-1).clamp(min=1)
        for row, n in enumerate(lengths.tolist()):
            batch.completion_ids[row, n - 1] = eos_token_ids[0]
            batch.completion_mask[row, :n] = True
        batch.truncated = torch.zeros_like(batch.truncated)
        return batch

    monkeypatch.setattr(HFEngine, "sample", sample)


@pytest.mark.parametrize("target,needle", [("StepExits", "StepExits.step raised SystemExit (sys.exit(None))"),
                                           ("StepFails", "StepFails.step raised ValueError: cannot parse")])
def test_an_environment_step_that_raises_or_exits_is_its_error_in_one_line(monkeypatch, tmp_path, capsys, target,
                                                                           needle):
    """A text environment's ``step`` that calls ``sys.exit()`` (or raises) on the first turn of the first step. Before:
    ``sys.exit()`` ended the run with exit status 0 and no message, no metrics, no summary, no adapter (the episode
    loop caught ``Exception`` only); a ValueError was a traceback."""
    _eos_everywhere(monkeypatch)
    monkeypatch.setattr(cli, "run_dir", lambda: tmp_path / "run")
    from tests.test_config import composed

    cfg = composed(*GRPO, "env=custom", f"env.target={FAULTY}:{target}")
    with pytest.raises(SystemExit) as stop:
        cli.run_from_hydra(cfg)
    line = one_error_line((stop.value.code, capsys.readouterr().err), needle)
    assert "at turn 1" in line and "during training step 1" in line


def test_a_tool_that_exits_is_a_failed_call_and_its_error_is_the_observation():
    """TRL's contract: a tool's failure is an observation the policy reads. Before: ``sys.exit(0)`` in a tool ended the
    run with exit status 0."""
    from prefzoo.environments.tools import call_tool
    from tests.environments.faulty_envs import exits

    result = call_tool({"type": "function", "function": {"name": "exits", "arguments": {"code": 0}}},
                       {"exits": exits}, timeout=5.0)
    assert result.error == "SystemExit (sys.exit(0))"
    assert json.loads(result.message["content"]) == {"error": "SystemExit (sys.exit(0))"}


def test_an_environments_error_names_its_episode_in_the_rollout():
    """The episode loop on a scripted engine: ``step`` fails on the first turn of prompt 1's first sample."""
    from types import SimpleNamespace

    from prefzoo.environments import episode_factory
    from prefzoo.rollout.multiturn import MultiTurnEngine, MultiTurnSettings
    from prefzoo.types import SamplingParams
    from tests.rollout.test_multiturn import EOS, TOK, ScriptedEngine, prompts

    env = SimpleNamespace(name="custom", target=f"{FAULTY}:StepFails", tool_timeout=1.0, turn_cost=0.0)
    engine = MultiTurnEngine(ScriptedEngine(["7"]), TOK, episode_factory(env), MultiTurnSettings(3, 200, "trajectory"))
    with pytest.raises(EnvironmentFailure, match=r"StepFails.step raised ValueError: cannot parse '7' at "
                                                 r"faulty_envs.py:\d+, in the episode of prompt 1 of 2, sample 1, at "
                                                 r"turn 1") as err:
        engine.sample(None, prompts(2), 2, SamplingParams(max_new_tokens=8), eos_token_ids=[EOS], pad_id=0)
    assert err.value.method == "StepFails.step" and "\n" not in str(err.value)


def test_two_tools_of_one_name_are_refused_before_anything_loads():
    """Before: the schema showed one ``add`` and the other ran."""
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        compose([*GRPO, "env=custom", f"env.target={FAULTY}:TWO_ADDS"])


# --------------------------------------------------------------------------------------------- tools' timeouts
def test_a_tool_past_its_timeout_is_stopped():
    """A tool that appends a number every 10 ms for 3 s, with a 0.2 s timeout: answered at the timeout, and it appends
    nothing more afterwards. Before: it went on appending (68 numbers in the 0.5 s after the answer, measured), its side
    effects after the policy was told it timed out."""
    from prefzoo.environments.tools import call_tool
    from tests.environments import faulty_envs

    faulty_envs.COUNTED.clear()
    start = time.perf_counter()
    result = call_tool({"function": {"name": "counting", "arguments": {"n": 300}}},
                       {"counting": faulty_envs.counting}, timeout=0.2)
    assert time.perf_counter() - start < 2.0 and "ran past env.tool_timeout=0.2 s and was stopped" in result.error
    time.sleep(0.1)  # the stop lands at the tool's next bytecode (within one 10 ms sleep)
    seen = len(faulty_envs.COUNTED)
    time.sleep(0.5)
    assert len(faulty_envs.COUNTED) == seen < 300


def test_the_process_does_not_wait_for_a_timed_out_tool(tmp_path):
    """A tool blocked in one 60 s ``time.sleep`` (C code: the stop cannot land until it returns), timeout 0.2 s: the
    process still exits at once. Before: its exit waited for the tool (the thread pool's worker was joined at exit)."""
    script = ("from prefzoo.environments.tools import call_tool\n"
              "from tests.environments.faulty_envs import sleeping\n"
              "r = call_tool({'function': {'name': 'sleeping', 'arguments': {'seconds': 60}}}, "
              "{'sleeping': sleeping}, timeout=0.2)\n"
              "print(r.error, flush=True)\n")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "was stopped" in proc.stdout, proc.stderr[-2000:]
    assert time.perf_counter() - start < 30  # (imports: ~5 s; the tool would hold it 60 s)


# ------------------------------------------------------------------------------------------------------ Ctrl-C
def _interrupt_after_first_step(run: Path, extra: list[str]) -> subprocess.Popen:
    # (a pytest-xdist worker ignores SIGINT, and a child inherits an ignored signal: the run gets Python's default)
    proc = subprocess.Popen([sys.executable, "train.py", *GRPO, "trainer.max_steps=200", *extra,
                             f"hydra.run.dir={run}"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any((run / "checkpoints").glob("step-*/trainer_state.pt")):  # (any: older checkpoints are pruned,
            break  # so step 1's may be gone before a look under load sees it; it then ran to the end: exit 0)
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    return proc


@pytest.mark.parametrize("extra", [[], ["rollout.asynchronous=true"]], ids=["sync", "async"])
def test_ctrl_c_is_one_line_and_the_run_resumes(tmp_path, extra):
    """SIGINT after the first checkpoint: exit 130 and ONE stderr line naming the step reached and the checkpoint
    ``trainer.resume=true`` continues from; then the resume trains on, two steps past that checkpoint. Before: a
    151-line (sync) / 69-line (async) KeyboardInterrupt traceback."""
    run = tmp_path / "run"
    proc = _interrupt_after_first_step(run, extra)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith("prefzoo: stopped (Ctrl-C) after "), stderr
    assert "`trainer.resume=true` continues from it" in lines[0] and "step-0000" in lines[0]
    reached = max(int(p.parent.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*/trainer_state.pt"))
    resumed = train_py([*GRPO, f"trainer.max_steps={reached + 2}", *extra, "trainer.resume=true"], run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == reached + 2


# ---------------------------------------------------------------------------------------- the rollout worker
def test_kill_9_of_the_trainer_ends_its_rollout_worker(tmp_path):
    """``kill -9`` of an asynchronous run: its rollout worker notices and exits within seconds. Before: the worker
    lived on as an orphan (682 MB on SmolLM2, the trainer's output pipe held: a caller reading it hung); measured alive
    20 s after the kill on the tiny model."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", *GRPO, "trainer.max_steps=200", "rollout.asynchronous=true",
                             f"hydra.run.dir={run}"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (run / "metrics.jsonl").is_file():
        time.sleep(0.2)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert children, "no worker process was started"
    proc.kill()
    proc.wait()

    def alive(pid: str) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(pid) for pid in children):
        time.sleep(0.2)
    left = [pid for pid in children if alive(pid)]
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    assert left == []


# ------------------------------------------------------------------------------------ the evaluation cache
def _stored(tmp_path: Path) -> tuple[Path, str]:
    key = "arithmetic-0123456789abcdef"
    return tmp_path / "cache", key


GOOD = {"n_problems": 4, "task_reward": 0.25, "task_reward_se": 0.1, "kl_k1": 0.0}


@pytest.mark.parametrize("damage,why", [
    (lambda path: path.write_text(json.dumps({"key": {}, "result": {}})), "its result lacks n_problems, task_reward"),
    (lambda path: path.write_text(json.dumps({"key": {}, "result": {**GOOD, "task_reward": "high"}})),
     "its task_reward is 'high', not a number"),
    (lambda path: path.write_text(json.dumps({"key": {}, "result": {**GOOD, "kl_k1": True}})),
     "its kl_k1 is True, not a number"),
    (lambda path: path.write_text(json.dumps([1, 2])), "its result is a NoneType"),
    (lambda path: path.mkdir(), "IsADirectoryError"),
    (lambda path: (path.parent.rmdir(), path.parent.write_text("x")), None),
], ids=["empty result", "a string", "a bool", "a list", "a folder for the file", "a file for the folder"])
def test_an_unusable_stored_evaluation_is_warned_about_and_computed_again(tmp_path, caplog, damage, why):
    """Before: ``result: {}`` was reused (an eval_before.json without metrics, silently); strings were reused and
    failed later; a folder in the file's place or a file in the folder's place was a raw OSError."""
    root, key = _stored(tmp_path)
    path = baseline.cache_path(root, key)
    path.parent.mkdir(parents=True)
    damage(path)
    with caplog.at_level(logging.WARNING):
        assert baseline.load(root, key) is None
    if why is not None:
        assert f"is not a readable evaluation ({why}" in caplog.text
    with caplog.at_level(logging.WARNING):
        stored = baseline.store(root, key, {}, GOOD, 1.0)
    if stored is None:  # (the folder or the file's place is taken: warned, skipped)
        assert "could not be stored" in caplog.text
    else:
        assert baseline.load(root, key) == (GOOD, stored)


def test_a_read_only_cache_is_warned_about_and_the_run_goes_on(tmp_path, caplog):
    """Before: PermissionError traceback at the end of the evaluation before training."""
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders; the ENOSPC case below stands in for it")
    root, key = _stored(tmp_path)
    (root / "evaluations").mkdir(parents=True)
    (root / "evaluations").chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING):
            assert baseline.store(root, key, {}, GOOD, 1.0) is None
        assert "could not be stored" in caplog.text
    finally:
        (root / "evaluations").chmod(0o700)


def test_a_full_disk_under_the_cache_is_warned_about(tmp_path, caplog, monkeypatch):
    """``write_text`` failing with ENOSPC (a full disk; root can write anywhere, so a read-only folder cannot stand in
    here): a warning, no traceback."""
    root, key = _stored(tmp_path)

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with caplog.at_level(logging.WARNING):
        assert baseline.store(root, key, {}, GOOD, 1.0) is None
    assert "could not be stored" in caplog.text and "No space left on device" in caplog.text


# ---------------------------------------------------------------------------------------- the Python API, files
def test_prefzoo_train_of_something_else_than_overrides_is_one_line():
    """Before: ``prefzoo.train(42)``: TypeError: 'int' object is not iterable."""
    with pytest.raises(ConfigError, match=r"prefzoo.train takes a list of override strings .* got a int \(42\)"):
        prefzoo.train(42)
    with pytest.raises(ConfigError, match="got a list holding a int"):
        prefzoo.train(["algo=dpo", 3])


def test_a_model_folder_of_pickled_weights_is_refused_before_it_loads(tmp_path):
    """Before: torch's UnpicklingError (weights_only) after the run started, advising the dangerous fix."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(1)}, folder / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="its weights are pytorch_model.bin, a pickle .* safetensors format only"):
        compose(["algo=dpo", f"model.name={folder}"])


def test_a_hydra_record_that_cannot_be_written_is_one_line(tmp_path):
    """``.hydra/config.yaml`` on a full disk (a link to /dev/full, where every write fails with ENOSPC). Before:
    Hydra's own write, a traceback."""
    from omegaconf import OmegaConf

    from prefzoo.training.run_folder import write_hydra_files

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    folder = tmp_path / ".hydra"
    folder.mkdir()
    (folder / "config.yaml").symlink_to("/dev/full")
    with pytest.raises(RunFolderError, match=r"cannot write the run's Hydra record into .* \(No space left on device\)"):
        write_hydra_files(folder, OmegaConf.create({"a": 1}), None, ["a=1"])


# ------------------------------------------------------------------------------------- plugins and the pre-flight
def test_a_custom_plugin_named_like_a_builtin_is_refused():
    """Before: ``algo=custom algo.target=...:Impostor`` (its name ``dpo``) trained chosen-only NLL while the run folder,
    summary.json and report said dpo."""
    with pytest.raises(ConfigError, match="the plugin is named 'dpo', a built-in algorithm's name"):
        compose(["algo=custom", "algo.target=tests.faulty_code:Impostor"])


def test_a_plugin_that_calls_sys_exit_is_one_line_not_a_silent_exit_0(tmp_path):
    """Before: ``sys.exit(0)`` inside a custom plugin's loss ended the run with status 0, no message, no summary."""
    fixture = ROOT / "tests" / "fixtures" / "arithmetic_pairs.jsonl"
    proc = train_py(["algo=custom", "algo.target=tests.faulty_code:ExitsInLoss", "model=tiny", "data=file",
                     f"data.path={fixture}", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.micro_batch_size=1",
                     "trainer.num_threads=1", "trainer.progress=false", "eval.before=false", "eval.after=false"],
                    tmp_path / "run")
    line = one_error_line(proc, "your code raised SystemExit (sys.exit(0)) at faulty_code.py:")
    assert "(loss)" in line and "during training step 1" in line


def test_asynchronous_rollouts_under_data_parallelism_are_refused_before_the_model_loads(monkeypatch):
    """Before: refused by the Trainer after the model had loaded (docs/off-policy.md promised the pre-flight)."""
    from prefzoo.training import distributed

    monkeypatch.setattr(distributed, "launched_world_size", lambda: 2)
    with pytest.raises(ConfigError, match=r"rollout.asynchronous=true runs one rollout worker .* \(2 processes\)"):
        compose(["algo=grpo", "rollout.asynchronous=true", "trainer.batch_size=4"])


def test_the_teachers_checks_come_before_the_student_loads(tmp_path, monkeypatch):
    """A teacher of another vocabulary, one whose tokenizer cannot be read, one whose output layer is too small, and an
    adapter trained on another base: each refused by the pre-flight, before any model loads (the tripwire). Before:
    each was found after the student had been built."""
    from transformers import LlamaForCausalLM

    from prefzoo.models.loading import smollm2_tokenizer, tiny_llama_config

    LlamaForCausalLM(tiny_llama_config(100)).save_pretrained(tmp_path / "bare")
    LlamaForCausalLM(tiny_llama_config(100)).save_pretrained(tmp_path / "small")
    smollm2_tokenizer().save_pretrained(tmp_path / "small")
    other = tmp_path / "other"
    LlamaForCausalLM(tiny_llama_config(len(smollm2_tokenizer()) + 64)).save_pretrained(other)
    from transformers import AutoTokenizer

    tok = smollm2_tokenizer()
    tok.add_tokens(["<extra_token_for_the_test>"])
    tok.save_pretrained(other)
    prefzoo.train(["algo=grpo", *TINY_RUN, "trainer.max_steps=1", "model.tiny_hidden_size=32", "eval.before=false",
                   "eval.after=false"], run_dir=tmp_path / "narrow")
    del AutoTokenizer

    def tripwire(*_a, **_k):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(loading, "load_causal_lm", tripwire)
    for teacher, kind, message in [("bare", ConfigError, "its tokenizer cannot be read"),
                                   ("small", ConfigError, "covers 100 tokens"),
                                   ("other", ConfigError, "tokens against the student's"),
                                   ("narrow/adapter", ModelError, "does not load on its base model")]:
        with pytest.raises(kind, match=message) as err:
            compose(["algo=distill", f"algo.teacher={tmp_path / teacher}", *TINY_RUN])
        assert "\n" not in str(err.value)


def test_a_reasoning_gym_task_with_the_arithmetic_reward_written_out_is_refused(caplog):
    """``data=reasoning_gym reward=arithmetic``: the arithmetic reward reads a reply's last number, not the task's
    verifier. Before: silently replaced by reward=reasoning_gym. Left to its default, the reward is replaced with an
    info line saying so."""
    with pytest.raises(ConfigError, match="data=reasoning_gym with reward=arithmetic"):
        prefzoo.train(["data=reasoning_gym", "reward=arithmetic", "model=tiny", "trainer.max_steps=0"],
                      run_dir="/nonexistent/never-written")
    with caplog.at_level(logging.INFO, logger="prefzoo.config"):
        cfg = compose(["data=reasoning_gym", "model=tiny"])
    assert cfg.reward.name == "reasoning_gym" and "scored by the tasks' own verifiers" in caplog.text


def test_maxrl_with_no_positive_group_says_so(caplog):
    """MaxRL (scale_rewards=mean) on rewards <= 0: every advantage is 0, so loss and gradient are 0 at every step.
    Before: nothing said so. Now the rollout logs ``frac_nonpositive_groups`` (1.0 here: both groups' means are < 0)
    and the plugin declares the warning the loop prints after 5 such steps."""
    from prefzoo.algos.online import group_relative_advantages
    from prefzoo.algos.online_settings import MAXRL_WARNING
    from prefzoo.training.plugin import build_algorithm
    from prefzoo.training.watch import MetricWatch

    algo = build_algorithm(compose(["algo=grpo", "algo.scale_rewards=mean", "model=tiny"]))
    assert MAXRL_WARNING in algo.declaration.warnings
    rollout = type("R", (), {"rewards": torch.tensor([-1.0, 0.0, -2.0, 0.0, -0.5, -0.5, 0.0, -1.0])})()
    advantages, extra = group_relative_advantages(algo, rollout, torch.zeros(8, 3))
    assert extra == {"frac_nonpositive_groups": 1.0} and bool((advantages == 0).all())
    watch = MetricWatch(algo.declaration.warnings, 10)
    lines = [line for step in range(1, 6) for line in watch.update(step, {**extra, "reward": -0.5,
                                                                          "frac_zero_std_groups": 0.0})]
    assert len(lines) == 1 and "MaxRL's advantage (r - mean) / mean is 0" in lines[0]


def test_the_reward_check_before_training_is_not_repeated_on_resume(tmp_path):
    """The reward functions are called once on two training prompts with a placeholder completion before the model
    loads. Before: again on every resume (a function counting its calls saw one more each time)."""
    calls = tmp_path / "calls.txt"
    env = {**ENV, "COUNTED_CALLS": str(calls)}
    args = [*GRPO, "reward=sentiment", "reward.functions=[tests.faulty_code:counting_reward]"]
    first = train_py([*args, "trainer.max_steps=1"], tmp_path / "run", env)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train_py([*args, "trainer.max_steps=2", "trainer.resume=true"], tmp_path / "run", env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    placeholders = [line for line in calls.read_text().splitlines() if line == repr(setup.PLACEHOLDER_COMPLETION)]
    assert len(placeholders) == 1 and len(calls.read_text().splitlines()) == 3  # the check, then one call a step


def test_the_beta_doctors_bad_thresholds_are_one_line(tmp_path):
    """Before: ``prefzoo diagnose --kl-budget=-1`` judged every run against a negative budget."""
    from prefzoo.report.diagnose import main

    for flag in ("--kl-budget=-1", "--kl-budget=nan", "--min-steps=0", "--distinct-drop=2"):
        proc = subprocess.run([sys.executable, "-m", "prefzoo", "diagnose", str(tmp_path), flag], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=120)
        one_error_line(proc, f"prefzoo diagnose {flag.split('=')[0]}=")
    assert main([str(tmp_path), "--kl-budget=0"]) == 2


def test_legal_settings_that_cannot_apply_are_warned_about_once(no_model_loaded, caplog):
    """The nine settings round 4 found ignored without a word, and rollout.dtype=float16 on a CPU: each one warning
    line, and the run goes on (to the model-loading tripwire)."""
    for overrides, needle in IGNORED:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            code, stderr = run_cli(overrides)
        assert code is None and stderr == "", (overrides, stderr)
        hits = [r.getMessage() for r in caplog.records if needle in r.getMessage()]
        assert len(hits) == 1, (overrides, [r.getMessage() for r in caplog.records])


IGNORED = [
    (["algo=grpo", "env=calculator", "env.turn_cost=0.1"], "env.turn_cost=0.1 is env=retry's cost"),
    (["algo=grpo", "rollout.correction.weight_kl=false"], "rollout.correction.weight_kl=false weighs nothing"),
    (["algo=dpo", "rollout.log_mismatch=true"], "rollout.log_mismatch=true: algo=dpo samples nothing"),
    (["algo=dpo", "rollout.top_k=20"], "rollout.top_k=20: algo=dpo samples nothing while it trains"),
    (["algo=dpo", "rollout.asynchronous=true"], "rollout.asynchronous=true: algo=dpo samples no training batch"),
    (["algo=grpo", "reward.overlong_penalty=2.0"], "reward.overlong_penalty=2.0 applies over reward.overlong_buffer"),
    (["algo=grpo", "algo.dppo_delta=0.2"], "algo.dppo_delta=0.2: dppo's setting, and algo.policy_loss=clipped: ignored"),
    (["algo=grpo", "algo.policy_loss=sapo", "algo.clip_delta=4"], "algo.clip_delta=4.0: clipped's setting"),
    (["algo=dpo", "trainer.max_steps=3", "eval.steps=[2,5]"], "eval.steps=[2, 5] lists steps past trainer.max_steps=3"),
    (["algo=grpo", "rollout.dtype=float16"], "rollout.dtype=float16 on a CPU"),
]


@pytest.fixture
def no_model_loaded(monkeypatch, tmp_path):
    """The run may read its data and tokenizer, not load a model (tests/test_bad_inputs.py's ``no_model``)."""
    from tests.models.helpers import tokenizer
    from tests.test_bad_inputs import tripwire

    monkeypatch.setattr(loading, "load_causal_lm", tripwire)
    monkeypatch.setattr(loop, "load_tokenizer", lambda name: tokenizer())
    monkeypatch.setattr(cli, "run_dir", lambda: tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loop, "Trainer", tripwire)  # (the config is checked by the pre-flight: nothing need run)
