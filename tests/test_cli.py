"""The command line: ``python train.py ...`` in a subprocess (cwd = the repository root).

The command lines run in the background from the session's start (tests/background.py: each pays ~2-8 s of
imports, while the in-process tests use the other core). That a bad value fails BEFORE any model loads is shown
in-process, for more values: ``run_from_hydra`` gets the composed config with the model loader, the
tokenizer loader and the Trainer replaced by tripwires (tests/test_config.py checks every message).
"""

import json
import os
import sys
from pathlib import Path

import pytest

from prefzoo import cli
from prefzoo.models import loading
from prefzoo.training import loop
from tests import background
from tests.shared_runs import FIXTURE, ROOT, TINY_RUN  # noqa: F401 (imported from here by other modules)
from tests.test_config import composed

QUICK = {
    "cfg_job": ["--cfg", "job", "algo=dpo", "model=tiny"],
    "bad_beta": ["model=tiny", "objective.beta=-1"],
    "bad_algo": ["model=tiny", "algo=nope"],
}


def _quick(name: str):
    def prepare(base: Path) -> background.Command:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HYDRA_FULL_ERROR": "0"}
        return background.Command([sys.executable, "train.py", *QUICK[name], f"hydra.run.dir={base / name}"], ROOT,
                                  env, 300)
    return prepare


#: the quick command lines (the ones that stop at the configuration), in the background (tests/background.py)
QUICK_RUNS = {name: background.register(f"cli_{name}", __name__, _quick(name)) for name in QUICK}


@pytest.fixture(scope="module")
def runs():
    """{name: (returncode, stdout, stderr, run_dir)} of the quick command lines."""
    out = {}
    for name, job in QUICK_RUNS.items():
        result = job.result()
        out[name] = (result.returncode, result.stdout, result.stderr, result.base / name)
    return out


@pytest.fixture(scope="module")
def tiny_run(tiny_cli_run):
    """The session's ``python train.py RUN`` (tests/shared_runs.py: TINY_RUN with trainer.lr=0.05; tests/test_api.py
    compares it with the API run)."""
    result = tiny_cli_run.result()
    return result.returncode, result.stdout, result.stderr, result.base / "run"


def cfg_job(*overrides: str) -> str:
    """What ``python train.py --cfg job <overrides>`` prints, in this process: Hydra's ``--cfg job`` is
    ``OmegaConf.to_yaml`` of the composed config without its ``hydra`` node, which is what ``compose`` returns
    (test_cfg_job_prints_the_composed_config runs the real command)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(composed(*overrides))


def test_cfg_job_of_orpo_and_of_a_weighted_dpo_sum():
    stdout = cfg_job("algo=orpo")
    assert "algo:\n  name: orpo\n" in stdout and "\n  default_beta: 0.1\n" in stdout
    stdout = cfg_job("algo=dpo", "algo.loss_type=[sigmoid,sft]", "algo.loss_weights=[1.0,0.5]")
    assert "\n  loss_type:\n  - sigmoid\n  - sft\n  loss_weights:\n  - 1.0\n  - 0.5\n" in stdout


def test_cfg_job_prints_the_composed_config(runs):
    rc, stdout, stderr, _ = runs["cfg_job"]
    assert rc == 0, stderr
    assert stdout == cfg_job("algo=dpo", "model=tiny")  # what cfg_job() stands for elsewhere
    assert "algo:\n  name: dpo\n" in stdout and "\n  loss_type: sigmoid\n" in stdout
    assert "model:\n  name: tiny" in stdout
    for group in ("data:", "reward:", "objective:", "trainer:"):
        assert f"\n{group}" in stdout


@pytest.mark.parametrize("name,needles", [
    ("bad_beta", ["objective.beta=-1.0", ">= 0"]),
])
def test_bad_values_fail_with_the_valid_values_and_exit_2(runs, name, needles):
    rc, stdout, stderr, run_dir = runs[name]
    assert rc == 2
    assert stderr.startswith("prefzoo: error: ")
    for needle in needles:
        assert needle in stderr
    assert "Traceback" not in stderr
    assert not (run_dir / "config.yaml").exists()  # stopped before the run was even set up


def test_unknown_algorithm_lists_the_valid_ones(runs):
    rc, stdout, stderr, _ = runs["bad_algo"]
    assert rc != 0
    assert "Could not find 'algo/nope'" in stderr
    for name in ("dpo", "grpo", "simpo"):
        assert f"\t{name}\n" in stderr


@pytest.mark.parametrize("overrides,needle", [
    (["objective.beta=-1"], "must be >= 0"),
    (["objective.divergence=foo"], "choose one of: reverse_kl, forward_kl, js, alpha"),
    (["data.on_bad_row=maybe"], "choose one of: error, skip"),
    (["algo=dpo", "algo.loss_type=nope"], "choose one of sigmoid, ipo, hinge"),
])
def test_bad_values_fail_before_any_model_loads(monkeypatch, capsys, overrides, needle):
    def tripwire(*_a, **_k):
        raise AssertionError("a model or tokenizer was loaded / the trainer was built before validation")

    monkeypatch.setattr(loading, "load_causal_lm", tripwire)
    monkeypatch.setattr(loop, "load_tokenizer", tripwire)
    monkeypatch.setattr(loop, "Trainer", tripwire)
    with pytest.raises(SystemExit) as exit_:
        cli.run_from_hydra(composed("model=tiny", *overrides))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("prefzoo: error: ") and needle in err


@pytest.mark.slow  # ~8 s of CPU: imports, data, 2 steps, 2 evaluations; more on a loaded machine
def test_tiny_run_writes_its_files_into_the_hydra_run_dir(tiny_run):
    rc, stdout, stderr, run_dir = tiny_run
    assert rc == 0, stderr[-3000:]
    assert f"[prefzoo] run folder: {run_dir}" in stdout
    assert "eval before training" in stdout and "eval after training" in stdout
    config_text = (run_dir / "config.yaml").read_text()
    assert "name: tiny" in config_text and "max_steps: 2" in config_text
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    assert all(isinstance(r["loss"], float) for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["algo"] == "dpo" and summary["model"] == "tiny"
    for name in ("eval_before.json", "eval_after.json"):
        assert "preference_accuracy" in json.loads((run_dir / name).read_text())
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert (run_dir / "checkpoints" / "step-000002" / "trainer_state.pt").is_file()


@pytest.mark.parametrize("overrides,needle", [
    (["algo=grpo", "reward.functions=[tests.rewards.helpers:no_columns]"],
     "reward.functions: reward 'tests.rewards.helpers:no_columns' (prompts, completions) cannot be called with this "
     "data's columns [answer"),
    (["algo=grpo", "eval.gold_reward.functions=[tests.rewards.helpers:one_argument]"],
     "eval.gold_reward.functions: reward 'tests.rewards.helpers:one_argument' has the signature (completions)"),
])
def test_reward_function_errors_come_before_the_model_loads(monkeypatch, capsys, tmp_path, overrides, needle):
    """Issue 17, item 14. Before: the model loaded first (the tripwire fired): the gold reward is built with the
    evaluator, and a function that takes no columns fails at its first call (the first evaluation warns, the first
    training step raises)."""
    def tripwire(*_a, **_k):
        raise AssertionError("a model was loaded before the reward functions were checked")

    monkeypatch.setattr(loading, "load_causal_lm", tripwire)
    monkeypatch.setattr(cli, "run_dir", lambda: tmp_path)  # (outside Hydra; whatever another test left in HydraConfig)
    with pytest.raises(SystemExit) as exit_:
        cli.run_from_hydra(composed("model=tiny", "trainer.device=cpu", "trainer.tensorboard=false", *overrides))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("prefzoo: error: ") and needle in err and err.count("\n") == 1


def _default_data_run(base: Path) -> background.Command:
    """``python train.py model=tiny algo=dpo`` (fewer prompts and steps) in a cache of its own (base/cache, holding
    the tokenizer only), its run folder base/run."""
    from prefzoo.models.loading import TOKENIZER_CACHE_NAME, cache_dir

    cache = base / "cache"
    cache.mkdir()
    (cache / TOKENIZER_CACHE_NAME).symlink_to(cache_dir() / TOKENIZER_CACHE_NAME)
    args = ["model=tiny", "algo=dpo", "data.pairs.num_prompts=8", "data.pairs.eval_prompts=4",
            "data.pairs.max_new_tokens=8", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.progress=false",
            "trainer.tensorboard=false", "trainer.device=cpu", "trainer.num_threads=1", "trainer.save_every=0",
            "eval.num_problems=4", "eval.max_new_tokens=8", "eval.diversity_prompts=2", "eval.diversity_samples=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PREFZOO_CACHE": str(cache)}
    return background.Command([sys.executable, "train.py", *args, f"hydra.run.dir={base / 'run'}"], ROOT, env)


#: in the background (tests/background.py)
DEFAULT_DATA_RUN = background.register("cli_default_data", __name__, _default_data_run)


@pytest.mark.slow  # ~15 s of CPU: the tiny model samples 8 + 4 prompts, 2 DPO steps, 2 evaluations
def test_tiny_dpo_on_the_default_data_runs():
    """Issue 17, item 15: ``python train.py model=tiny algo=dpo``, the first thing a newcomer tries (here with
    fewer prompts and steps, in a cache of its own). The random model never answers right, so the built-in pairs
    take the known answer as chosen, and the log says so. Before: the empty pair set was cached and the run ended
    in a StopIteration traceback from datasets."""
    proc = DEFAULT_DATA_RUN.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train preference pairs: model=tiny gave no pair of its own (sample accuracy 0.0% over 48 samples): 8 " \
           "pairs use the task's known answer as chosen" in proc.stdout + proc.stderr
    assert json.loads((proc.base / "run" / "summary.json").read_text())["steps"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--port", "abc"], "argument --port: invalid int value: 'abc' (prefzoo serve --help lists the options)"),
    (["--max-lora-rank", "1000", "--print-command"], "--max-lora-rank 1000: vLLM serves LoRA ranks up to 512."),
    (["--port", "70000", "--print-command"], "--port 70000: must be 1..65535."),
    (["--model", "tiny", "--tiny-hidden-size", "30", "--print-command"], "--tiny-hidden-size 30: the tiny model has 4"),
    (["--model", "/nonexistent/folder", "--print-command"], "--model /nonexistent/folder: no model folder there"),
    (["--print-command", "--", "--logprobs-mode", "raw_logprobs"],
     "--logprobs-mode after --: prefzoo serve sets --logprobs-mode itself (always processed_logprobs"),
    # --api tinker (issue 50): prefzoo's own Tinker server, in this process; vLLM's options refused
    (["--api", "grpc"], "argument --api: invalid choice: 'grpc' (choose from 'vllm', 'tinker')"),
    (["--api", "tinker", "--max-lora-rank", "32"], "--max-lora-rank is an option of vLLM's server; --api tinker"),
    (["--api", "tinker", "--print-command"], "--print-command is an option of vLLM's server; --api tinker"),
    (["--api", "tinker", "--", "--enforce-eager"], "--enforce-eager after --: --api tinker passes nothing on"),
    (["--api", "tinker", "--session-timeout", "0"], "--session-timeout 0.0: must be > 0 seconds"),
    (["--api", "tinker", "--max-models", "0"], "--max-models 0: must be >= 1."),
    (["--api", "tinker", "--checkpoint-dir", "pyproject.toml"], "--checkpoint-dir pyproject.toml: is a file"),
    (["--api", "tinker", "--model", "/nonexistent/folder"], "--model /nonexistent/folder: no model folder there"),
])
def test_prefzoo_serve_refuses_bad_options_in_one_line(argv, message, capsys):
    """`prefzoo serve` (issue 31): a bad option is one line naming it, exit 2, before any model is built or vLLM is
    looked for (the reserved vLLM options after -- are the ones the trainer relies on)."""
    from prefzoo.serve import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prefzoo serve: error: {message}") and err.count("\n") == 1


def test_prefzoo_serve_prints_the_vllm_command_with_what_the_trainer_relies_on(capsys):
    """--print-command starts nothing and builds nothing: the vLLM server module on the tiny model's folder, served
    under the name the run checks (tiny-h128-l2-s3), LoRA at run time (the environment variable), two adapters at
    once, the processed log-probs, and what follows -- unchanged."""
    from prefzoo.serve import main

    assert main(["--model", "tiny", "--seed", "3", "--port", "8123", "--print-command", "--", "--enforce-eager"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True ")
    for part in ("--served-model-name tiny-h128-l2-s3", "--enable-lora", "--max-loras 2",
                 "--logprobs-mode processed_logprobs", "--port 8123", "served/tiny-h128-l2-s3"):
        assert part in out, part
    assert out.endswith("--enforce-eager")


def test_the_tinker_api_without_its_extra_is_one_line(monkeypatch, capsys):
    """Where prefzoo was installed without the tinker extra: `prefzoo serve --api tinker` and `backend=tinker` each say
    in one line what is missing and how to install it, before any model is built (before: an ImportError's traceback
    from inside the server's module or the backend's)."""
    import importlib.util

    from types import SimpleNamespace

    from prefzoo.config.schema import BackendConfig
    from prefzoo.errors import ConfigError
    from prefzoo.serve import main
    from prefzoo.validation.backend import check_backend_server

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tinker", "fastapi", "uvicorn") else real(name, *a))
    assert main(["--api", "tinker", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err == ("prefzoo serve: error: --api tinker needs the tinker extra (tinker, fastapi, uvicorn not installed): "
                   "pip install 'prefzoo[tinker]'\n")
    cfg = SimpleNamespace(backend=BackendConfig(name="tinker", url="http://127.0.0.1:9"))
    with pytest.raises(ConfigError, match=r"^backend=tinker talks to the server through the tinker SDK, which is not "
                                          r"installed: pip install 'prefzoo\[tinker\]'$"):
        check_backend_server(cfg)
