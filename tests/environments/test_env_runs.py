"""``env=`` from the command line (issue 28): a TRL-style environment class, a gymnasium-style one, a tool list and the
built-in environments train 2 tiny steps; a bad environment or setting stops in one line before the model loads."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefzoo.training.loop import Trainer
from prefzoo.validation import check_environment
from tests.interrupt import run_until_killed
from tests.algos.hydra_runs import TINY_RUN, compose
from tests.test_bad_inputs import assert_one_error_line, no_model, run_cli  # noqa: F401 (no_model: a fixture)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
TINY = [o for o in TINY_RUN if not o.startswith("rollout.max_new_tokens")] + [
    "rollout.max_new_tokens=4", "env.max_turns=2", "eval.pass_k_problems=0", "trainer.max_steps=2"]


def cli(args, tmp_path, name="run"):
    return subprocess.run([sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path / name}"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("target", ["tests.environments.envs:AdderEnv", "tests.environments.envs:GuessEnv",
                                    "tests.environments.envs:TOOLS"], ids=["trl_class", "gym_text", "tool_list"])
def test_a_users_environment_trains_two_tiny_steps_from_the_command_line(target, tmp_path):
    """GRPO, env=custom env.target=<target>, 2 steps on the tiny model: exit 0; every step's rollout logged its
    episodes (episode/turns in [1, 2], the budget of 2 turns); the evaluations report episode_turns."""
    proc = cli(["algo=grpo", "env=custom", f"env.target={target}", *TINY], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(1 <= s["episode/turns"] <= 2 for s in steps)
    after = json.loads((tmp_path / "run" / "eval_after.json").read_text())
    assert 1 <= after["episode_turns"] <= 2 and "episode_frac_cut" in after


def test_ppo_trains_on_per_turn_rewards_from_the_command_line(tmp_path):
    """PPO with GuessEnv's step rewards on their turns (env.reward_placement=turn), 2 tiny steps: exit 0, two steps
    logged with their episodes; with a TRL-style class (no step rewards) the same setting is warned about once."""
    proc = cli(["algo=ppo", "env=custom", "env.target=tests.environments.envs:GuessEnv", "env.reward_placement=turn",
                *TINY], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all("episode/turns" in s for s in steps)
    cfg = compose(["algo=ppo", "env=calculator", "env.reward_placement=turn", *TINY])
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("prefzoo").addHandler(handler)
    try:
        check_environment(cfg, online=True, turn_rewards=True)
    finally:
        logging.getLogger("prefzoo").removeHandler(handler)
    assert [r.getMessage() for r in records if "gives no step rewards" in r.getMessage()] != []


@pytest.mark.parametrize("env", ["retry", "calculator", "retry_chain_sum"])
def test_the_built_in_environments_run_in_process(env, tmp_path):
    """env=retry, env=calculator and a reasoning-gym task over several turns (chain_sum with env=retry, scored by its
    own verifier) with GRPO on the tiny model, 1 step: the run's summary holds the episode metrics of its evaluation;
    calculator's data are 3-digit products."""
    extra = ["reward=reasoning_gym", "data.task=chain_sum"] if env == "retry_chain_sum" else []
    cfg = compose(["algo=grpo", f"env={env.split('_')[0]}", *TINY, "trainer.max_steps=1", *extra])
    if not extra:
        assert (cfg.data.digits, cfg.data.ops) == ((3, ["*"]) if env == "calculator" else (2, ["+"]))
    summary = Trainer(cfg, tmp_path / env).run()
    assert summary["eval_after"]["episode_turns"] >= 1


BAD = [
    (["env=custom"], "env=custom needs env.target"),
    (["env=custom", "env.target=tests.environments.envs:NoReset"], "NoReset has no reset method"),
    (["env=custom", "env.target=tests.environments.envs:NeedsArgs"], "NeedsArgs.__init__ must take no argument"),
    (["env=custom", "env.target=tests.environments.envs:UndocumentedTool"], "tool UndocumentedTool.add has no usable"),
    (["env=custom", "env.target=tests.environments.envs:NOT_A_CLASS"], "is a int, not a class"),
    (["env=custom", "env.target=tests.environments.nowhere:X"], "could not import module"),
    (["env=custom", "env.target=tests.environments.envs:ResetFails"], "ResetFails.reset failed on the first training row"),
    (["env=retry", "env.max_turns=0"], "env.max_turns=0"),
    (["env=retry", "env.tool_timeout=0"], "env.tool_timeout=0"),
    (["env=retry", "algo=dpo"], "samples nothing"),
    (["env=retry", "env.reward_placement=step"], "env.reward_placement='step'; choose one of trajectory, turn"),
    (["env=retry", "env.reward_placement=turn"], "env.reward_placement=turn with algo=grpo: its advantage is one number"),
    (["env=custom", "env.target=tests.environments.envs:HoldsALock", "rollout.asynchronous=true"],
     "rollout.asynchronous=true: a HoldsALock instance cannot be pickled after reset (TypeError: cannot pickle"),
]


#: the cases also run as real ``python train.py`` processes (Hydra, the exit status, stderr); the others run through the
#: command line's entry point in this process (tests/test_bad_inputs.py's ``run_cli``, the model loader a tripwire),
#: which is what ``python train.py`` runs after Hydra, without a process start (about 7 s each) per case
AS_PROCESS = ("could not import module", "ResetFails.reset failed on the first training row")


def _bad_args(extra):
    args = ["algo=grpo", *TINY, *extra]
    return [a for a in args if a != "algo=grpo"] if "algo=dpo" in extra else args


@pytest.mark.parametrize("extra,message", BAD, ids=[m[:30] for _, m in BAD])
def test_a_bad_environment_is_one_line_before_the_model_loads(no_model, extra, message):
    assert_one_error_line(*run_cli(_bad_args(extra)), message)


@pytest.mark.parametrize("extra,message", [b for b in BAD if b[1] in AS_PROCESS], ids=list(AS_PROCESS))
def test_a_bad_environment_is_one_line_from_the_command_line(extra, message, tmp_path):
    proc = cli(_bad_args(extra), tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("prefzoo: error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "adapter").exists()


def test_the_vllm_engine_is_refused_with_an_environment():
    """(Where vLLM is not installed, its absence is reported first on the command line; the check itself:)"""
    from prefzoo.errors import ConfigError

    cfg = compose(["algo=grpo", "env=retry", *TINY])
    cfg.rollout.engine = "vllm"
    with pytest.raises(ConfigError, match="multi-turn episodes run on the hf engine"):
        check_environment(cfg, online=True)


def test_a_multi_turn_run_resumes_bit_for_bit(tmp_path):
    """GRPO with a text environment (GuessEnv) and a reward that varies between samples (the letter share), 4 steps
    with a checkpoint every 2: killed during step 3 and resumed, it logs the same steps and ends with the same adapter
    as the run that was not interrupted (episodes are seeded per prompt, sample and turn)."""
    from safetensors.torch import load_file

    from prefzoo.training.metrics_log import read_metrics
    from tests.algos.hydra_runs import LETTER_REWARD

    args = ["algo=grpo", "env=custom", "env.target=tests.environments.envs:GuessEnv", LETTER_REWARD, *TINY,
            "trainer.max_steps=4", "trainer.save_every=2", "trainer.lr=0.05"]
    Trainer(compose(args), tmp_path / "straight").run()
    run_until_killed(Trainer(compose(args), tmp_path / "resumed"), 3)
    Trainer(compose([*args, "trainer.resume=true"]), tmp_path / "resumed").run()
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/") and "per_second" not in k}  # noqa
                         for r in rows]
    straight, again = (drop(read_metrics(tmp_path / n / "metrics.jsonl")) for n in ("straight", "resumed"))
    assert [r["step"] for r in again] == [1, 2, 3, 4] and straight == again
    assert any(r["grad_norm"] > 0 for r in straight)
    a, b = (load_file(tmp_path / n / "adapter" / "adapter_model.safetensors") for n in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
