"""The vLLM server engine against real vLLM servers (issue 31 item 2): two ``prefzoo serve`` servers on loopback.

Marker ``vllm``: run by ``make test-vllm`` in .venv-vllm (vLLM's CPU build); skipped where vLLM is not installed.
The module starts two servers of the tiny model (widened to 128: vLLM's CPU attention needs a head size >= 32; seed
0, the run's trainer.seed) with ``prefzoo serve`` -- the command a user runs -- one OpenMP thread each, and a GRPO
Trainer whose policy samples on both (``rollout.engine=vllm_server``). The client's logic alone (splitting, versions,
failover) is tested against stand-in servers in tests/rollout/test_vllm_server_client.py.

Tolerance: the servers' float32 log-probs and the trainer's recomputation differ only by their float32 log-softmax
and kernel rounding: the in-process vLLM engine's derived bound, LOGP_TOL = 2.9e-4 nats per token (max over tokens,
tests/rollout/test_vllm_engine.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed "
                                 "(make test-vllm builds .venv-vllm with it)")]

from tests.rollout.test_vllm_engine import LOGP_TOL, greedy_around_grpo_steps, prompts  # noqa: E402 -- the engine's
START_SECONDS = 900  # a server's start on a shared 2-core machine (measured 60-120 s alone)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two ``prefzoo serve --model tiny`` servers on free loopback ports: [(url, process), ...]."""
    logs = tmp_path_factory.mktemp("servers")
    started = []
    for i in range(2):
        port = free_port()
        log = open(logs / f"server{i}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "prefzoo", "serve", "--model", "tiny", "--tiny-hidden-size", "128",
                                 "--seed", "0", "--max-lora-rank", "8", "--max-model-len", "512", "--port", str(port),
                                 "--threads", "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started.append((f"http://127.0.0.1:{port}", proc, logs / f"server{i}.log"))
    deadline = time.monotonic() + START_SECONDS
    try:
        for url, proc, path in started:
            while not answers(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prefzoo serve did not start ({url}): {path.read_text()[-2000:]}")
                time.sleep(2)
        yield [(url, proc) for url, proc, _ in started]
    finally:
        for _, proc, _ in started:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for _, proc, _ in started:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)


RUN = ["algo=grpo", "model.tiny_hidden_size=128", "model.lora.r=8", "rollout.correction.mode=token_truncate",
       "rollout.correction.clip_max=2.0", "trainer.lr=0.05", "trainer.warmup_steps=0", "trainer.lr_schedule=constant",
       "algo.num_samples=4", "rollout.temperature=1.0", 'reward.functions=["tests.algos.hydra_runs:letter_share"]',
       "reward=sentiment", "rollout.engine=vllm_server"]


@pytest.fixture(scope="module")
def trainer(servers, tmp_path_factory):
    """A GRPO Trainer on the tiny model whose policy samples on both servers (the pre-flight checked them first)."""
    from prefzoo.training.loop import Trainer
    from prefzoo.validation import check_rollout_servers
    from tests.algos.hydra_runs import TINY_RUN, compose
    from tests.models.helpers import threads

    urls = ",".join(url for url, _ in servers)
    cfg = compose(TINY_RUN + RUN + [f"rollout.servers=[{urls}]"])
    check_rollout_servers(cfg)
    with threads(1):
        t = Trainer(cfg, tmp_path_factory.mktemp("server-run"))
        yield t
    t.policy.engine.close()


def test_the_two_servers_sample_with_the_trainers_log_probs(trainer, servers):
    """4 prompts x 4 samples at temperature 0.7 over the two servers (2 prompts each): the servers' log-prob of each
    sampled token equals the trainer's recomputation (policy.logps at 0.7 on the servers' ids) within LOGP_TOL; rows
    right-padded, a row not truncated ends with an EOS id; each server drew two prompts' samples."""
    from prefzoo.rollout.vllm_server import VLLMServerEngine
    from prefzoo.types import SamplingParams

    policy = trainer.policy
    assert isinstance(policy.engine, VLLMServerEngine) and policy.engine.live == [u for u, _ in servers]
    before = policy.engine.requests
    s = policy.sample(prompts(trainer, [0, 1, 2, 3], [5, 6, 7, 8]), 4, SamplingParams(temperature=0.7,
                                                                                      max_new_tokens=12))
    assert policy.engine.requests == before + 4 and s.completion_ids.shape[0] == 16
    trainer_logps = policy.logps(s, 0.7)[0].detach()
    delta = (trainer_logps - s.sample_logps)[s.completion_mask].abs()
    assert delta.max().item() < LOGP_TOL, delta.max().item()
    assert bool((s.sample_logps[s.completion_mask] < 0).all())
    lengths = s.completion_mask.sum(-1)
    for r in range(16):
        assert bool(s.truncated[r]) == (int(s.completion_ids[r, lengths[r] - 1]) not in policy.eos_token_ids)


def test_a_prompts_samples_do_not_depend_on_the_server(trainer, servers):
    """Prompt 3 with seed 77, drawn by the first server alone and by the second alone: the same 4 samples (the same
    base, adapter and seed), and 4 different ones (vLLM gives sample j the seed 77 + j)."""
    from prefzoo.rollout.vllm_server import VLLMServerEngine
    from prefzoo.types import SamplingParams

    policy, params = trainer.policy, SamplingParams(temperature=1.0, max_new_tokens=6)
    batch = prompts(trainer, [3], [77])
    policy.sample(batch, 1, params)  # (the trainer's engine pushes the current adapter to both)
    version = policy.engine.version
    drawn = []
    for url, _ in servers:
        engine = VLLMServerEngine([url], model_name=policy.engine.model_name, is_main=False)  # reads, pushes nothing
        engine.version, engine._stamp, engine.run_id = version, policy.engine._stamp, policy.engine.run_id
        drawn.append(engine.sample(policy.model, batch, 4, params, eos_token_ids=policy.eos_token_ids,
                                   pad_id=policy.pad_id).completion_ids)
        engine.close()
    assert torch.equal(drawn[0], drawn[1]) and len({tuple(r) for r in drawn[0].tolist()}) == 4


def test_grpo_steps_push_every_update_and_the_servers_follow(trainer):
    """3 GRPO steps (lr 0.05, so that greedy answers move): each step's rollout logs the mismatch (below LOGP_TOL) and
    IS weights of 1 up to it; the servers got one adapter version per optimizer step; and then their greedy answers
    equal the hf engine's on the same weights while differing from those before training."""
    from prefzoo.types import SamplingParams

    policy = trainer.policy
    policy.sample(prompts(trainer, [0]), 1, SamplingParams(max_new_tokens=1))  # (the current version pushed)
    version = policy.engine.version
    before, after_hf, after_server = greedy_around_grpo_steps(trainer, 3, LOGP_TOL)
    assert policy.engine.version == version + 3
    assert not torch.equal(after_hf, before)
    assert torch.equal(after_server, after_hf)
    for url in policy.engine.live:  # each server holds this run's current adapter only
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
            names = [m["id"] for m in json.load(r)["data"]]
        assert [n for n in names if n.startswith(f"policy-{policy.engine.run_id}-")] == [policy.engine.adapter_name]


def test_a_run_from_the_command_line_trains_on_the_servers(servers, tmp_path):
    """`python train.py ... rollout.engine=vllm_server rollout.servers=[...]`: 2 GRPO steps on both servers, exit 0,
    the summary written; the log names the servers."""
    from tests.algos.hydra_runs import TINY_RUN

    urls = ",".join(url for url, _ in servers)
    overrides = [o for o in TINY_RUN if not o.startswith("trainer.num_threads")] + RUN + [
        f"rollout.servers=[{urls}]", "trainer.max_steps=2", "trainer.num_threads=1", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run([sys.executable, "-m", "prefzoo", "train", *overrides], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2
    assert "vLLM server(s)" in (tmp_path / "train.log").read_text()


def test_two_data_parallel_processes_share_the_servers(servers, tmp_path):
    """`torchrun --nproc_per_node 2 train.py ... rollout.engine=vllm_server` (DDP over gloo, one thread each): both
    processes sample their share of each step's prompts on the servers; the main process pushes each adapter, the
    other waits for it. 2 GRPO steps end with exit 0 and the summary; each step's rollout logs the engine/trainer
    mismatch below LOGP_TOL (the other process sampled with the version the main process pushed, or its tokens'
    log-probs would not match its own weights)."""
    from pathlib import Path

    from tests.algos.hydra_runs import TINY_RUN

    urls = ",".join(url for url, _ in servers)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    overrides = TINY_RUN + RUN + [f"rollout.servers=[{urls}]", "trainer.max_steps=2", "trainer.batch_size=4",
                                  f"hydra.run.dir={tmp_path}"]
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(root / "train.py"), *overrides],
                          capture_output=True, text=True, timeout=900, cwd=root,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() or "Error" in line]
    assert done.returncode == 0, "\n".join(errors[:20]) + "\n...\n" + done.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "engine/logp_diff_max" in m]
    assert len(steps) == 2 and all(m["engine/logp_diff_max"] < LOGP_TOL for m in steps), steps


def test_a_server_that_dies_mid_run_leaves_the_rollouts_to_the_other(trainer, servers):
    """The second server is killed: the next rollout goes to the first alone (a warning names the dead one) and its
    samples are the ones both would have drawn (seeded); a GRPO step still runs. (Last in the module: it stops a
    server.)"""
    from prefzoo.types import SamplingParams

    policy = trainer.policy
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    batch = prompts(trainer, [0, 1, 2, 3], [11, 12, 13, 14])
    both = policy.sample(batch, 2, params).completion_ids
    url, proc = servers[1]
    os.killpg(proc.pid, 9)
    proc.wait(timeout=60)
    alone = policy.sample(batch, 2, params).completion_ids
    assert torch.equal(both, alone) and policy.engine.live == [servers[0][0]]
    trainer.train_step()
