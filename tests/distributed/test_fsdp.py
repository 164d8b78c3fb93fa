"""FSDP2 training end to end: 2 CPU processes (gloo) with sharded parameters against 1 process on the same global batch.

The launches run side by side in a module fixture (2 processes each, the tiny model, one thread each), the
one-process references in this process meanwhile:

* DPO with LoRA through ``accelerate launch --config_file accelerate/fsdp2.yaml`` (the config users get), 4 pairs
  per step, micro-batches of 1, 3 steps, checkpoints at steps 2 and 3, held-out evaluation before and after;
* GRPO with LoRA through ``torchrun ... trainer.fsdp=true`` (4 prompts x 4 samples, whole groups per process, the
  reward std over the global batch): rollouts, old and reference log-probs from the gathered shards;
* PPO (the value head on the policy's backbone, trained beside the adapter: a replicated parameter under FSDP);
* DPO with full fine-tuning (every weight trains; the reference is a frozen copy, sharded too; the embeddings stay
  whole and their gradients are averaged as under DDP);
* GRPO stopped after 2 steps and resumed to 3 under FSDP, and the same checkpoint resumed by ONE process;
* DPO on two "nodes" (two torchrun launches of one process, c10d rendezvous on loopback).

What is compared, and why these tolerances. Mathematically a 2-process step is the 1-process step: each process's
gradient of its half, summed by the reduce-scatter and halved (the losses are scaled by 2), both exact in binary;
numerically the sums are taken in another order, a few 1e-7 relative. The bounds are tests/distributed/
test_data_parallel.py's, kind 3 of tests/bounds.py (a measured spread with a stated factor): every adapter tensor
within 1e-4 of its size (``ADAPTER_BOUND``; measured here 2026-12-06: DPO 5.9e-7, GRPO 9.8e-7, PPO 1.7e-6), full
fine-tuning's weights within 1e-4 of their UPDATE (measured 1.4e-6: a weight of size 1 moves by 1e-2, so its own size
says nothing of the update), step metrics within ``METRIC_REL`` / ``METRIC_ABS``. Online runs: at temperature 1 the tiny
model draws the same tokens for 2-3 steps despite the 1e-7 gaps (later a uniform eventually lands on the other side of
a CDF step, and the runs part: PPO is compared over 2 steps for that reason).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prefzoo.training import loop
from prefzoo.training.metrics_log import read_metrics
from tests.algos.hydra_runs import compose
from tests.bounds import relative_difference
from tests.distributed.test_data_parallel import (ADAPTER_BOUND, FIXTURE, QUIET, ROOT, adapter, assert_same_adapter,
                                                  assert_same_metrics, free_port, start, two_threads)

#: several training processes per test (`make test-launches`, run by CI); `make test` leaves them out
pytestmark = pytest.mark.launches

DPO = ["algo=dpo", "data=file", f"data.path={FIXTURE}", "data.max_length=96", "data.max_prompt_length=64",
       "trainer.batch_size=4", "trainer.micro_batch_size=1", "trainer.save_every=2", *QUIET,
       "model.fast.merged_rollout=false"]  # (as under FSDP, which samples from the gathered LoRA model: below)
DPO_EVAL = [o for o in DPO if not o.startswith("eval.")] + ["eval.before=true", "eval.after=true", "eval.num_problems=4"]
GRPO = ["algo=grpo", "data=arithmetic", "data.num_train=16", "data.num_eval=2",
        "reward.functions=[tests.distributed.rewards:length]", "algo.num_samples=4", "algo.scale_rewards=batch",
        "rollout.max_new_tokens=8", "rollout.temperature=1.0", "trainer.batch_size=4", "trainer.micro_batch_size=8",
        "trainer.save_every=1", *QUIET, "model.fast.merged_rollout=false"]
PPO = ["algo=ppo", "data=arithmetic", "data.num_train=16", "data.num_eval=2",
       "reward.functions=[tests.distributed.rewards:length]", "rollout.max_new_tokens=8", "rollout.temperature=1.0",
       "trainer.batch_size=4", "trainer.micro_batch_size=2", "trainer.save_every=0",
       *[o for o in QUIET if not o.startswith("trainer.max_steps")], "trainer.max_steps=2",
       "model.fast.merged_rollout=false"]
FULL = [*[o for o in DPO if o != "trainer.lr=5e-3"], "model.lora.enabled=false", "trainer.lr=1e-4",
        "trainer.save_every=0"]
TWO_STEPS = [*[o for o in GRPO if not o.startswith("trainer.max_steps")], "trainer.max_steps=2"]


def torchrun(overrides: list[str], folder: Path) -> subprocess.Popen:
    return start([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2",
                  str(ROOT / "train.py"), *overrides, "trainer.fsdp=true", f"hydra.run.dir={folder}"], ROOT)


def wait(proc: subprocess.Popen, name: str) -> str:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{stderr[-3000:]}"
    return stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: run folder} of the FSDP launches and the one-process references."""
    base = tmp_path_factory.mktemp("fsdp")
    first = {
        "dpo": start([str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
                      str(ROOT / "accelerate/fsdp2.yaml"), "--main_process_port", str(free_port()),
                      str(ROOT / "train.py"), *DPO_EVAL, f"hydra.run.dir={base / 'dpo'}"], ROOT),
        "grpo": torchrun(GRPO, base / "grpo"),
        "resumed": torchrun(TWO_STEPS, base / "resumed"),
    }
    out = {"dpo_ref": base / "dpo_ref", "grpo_ref": base / "grpo_ref", "ppo_ref": base / "ppo_ref",
           "full_ref": base / "full_ref"}
    two_threads(lambda: loop.Trainer(compose(DPO_EVAL), out["dpo_ref"]).run())
    loop.Trainer(compose(GRPO), out["grpo_ref"]).run()
    out["stdout"] = {name: wait(proc, name) for name, proc in first.items()}
    second = {"ppo": torchrun(PPO, base / "ppo"), "full": torchrun(FULL, base / "full"),
              "resumed": torchrun([*GRPO, "trainer.resume=true"], base / "resumed")}
    port = free_port()  # two "nodes" of one process each, meeting at torchrun's c10d rendezvous on loopback
    for node in (0, 1):
        second[f"node{node}"] = start([str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2",
                                       "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                                       "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "prefzoo-test",
                                       str(ROOT / "train.py"), *DPO_EVAL, "trainer.fsdp=true",
                                       f"hydra.run.dir={base / 'nodes'}"], ROOT)
    # the FSDP run's step-2 checkpoint, resumed by one process (its own copy of the folder)
    shutil.copytree(base / "grpo", base / "one", ignore=shutil.ignore_patterns("step-000003"))
    for name in ("metrics.jsonl", "summary.json"):
        (base / "one" / name).unlink(missing_ok=True)
    loop.Trainer(compose(PPO), out["ppo_ref"]).run()
    loop.Trainer(compose(FULL), out["full_ref"]).run()
    cfg = compose([*GRPO, "trainer.resume=true"])
    loop.Trainer(cfg, base / "one").run()
    out["stdout"].update({name: wait(proc, name) for name, proc in second.items()})
    out.update({name: base / name for name in ("dpo", "grpo", "ppo", "full", "resumed", "one", "nodes")})
    return out


def test_dpo_under_fsdp2_through_accelerate_matches_one_process(runs):
    assert_same_adapter(runs["dpo_ref"], runs["dpo"])
    assert_same_metrics(runs["dpo_ref"], runs["dpo"], ("loss", "grad_norm", "rewards/margins", "logps/chosen"))
    log = (runs["dpo"] / "train.log").read_text()
    assert "process 0 of 2 on cpu (FSDP2)" in log


def test_the_main_process_evaluates_the_gathered_model_and_writes_whole_checkpoints(runs):
    """The held-out evaluation (before and after, on the gathered shards) gives the one-process numbers; the
    checkpoints hold the whole adapter in peft's format and one process's optimizer layout."""
    for tag in ("before", "after"):
        one = json.loads((runs["dpo_ref"] / f"eval_{tag}.json").read_text())
        two = json.loads((runs["dpo"] / f"eval_{tag}.json").read_text())
        assert two["n_problems"] == one["n_problems"] > 0
        # the same greedy answers, so the same rewards, exactly (the reward reads the text)
        assert [e["completion"] for e in two["greedy_examples"]] == [e["completion"] for e in one["greedy_examples"]]
        assert two["task_reward"] == one["task_reward"]
    ckpt = runs["dpo"] / "checkpoints" / "step-000003"
    assert sorted(p.name for p in ckpt.iterdir()) == ["adapter", "run_config.json", "trainer_state.pt"]
    whole = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    final = adapter(runs["dpo"])
    assert whole.keys() == final.keys() and all(torch.equal(whole[k], final[k]) for k in whole)
    one_state = torch.load(runs["dpo_ref"] / "checkpoints" / "step-000003" / "trainer_state.pt", weights_only=True)
    two_state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    a, b = one_state["optimizer"], two_state["optimizer"]
    assert sorted(a["state"]) == sorted(b["state"]) and len(a["state"]) == len(final)
    for i in a["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert b["state"][i][key].shape == a["state"][i][key].shape  # whole, not a shard
            # the moments follow gradients that agree to a few 1e-7 of their size: compared as the adapter is, per
            # tensor relative to its size (ADAPTER_BOUND)
            assert relative_difference(b["state"][i][key], a["state"][i][key]) <= ADAPTER_BOUND, (i, key)


def test_grpo_under_fsdp2_matches_one_process(runs):
    assert_same_adapter(runs["grpo_ref"], runs["grpo"])
    assert_same_metrics(runs["grpo_ref"], runs["grpo"], ("reward", "completion_length", "grad_norm"))


def test_ppo_with_its_value_head_under_fsdp2_matches_one_process(runs):
    assert_same_adapter(runs["ppo_ref"], runs["ppo"])
    assert_same_metrics(runs["ppo_ref"], runs["ppo"], ("reward", "value_loss", "grad_norm"))


def test_full_finetuning_under_fsdp2_matches_one_process(runs):
    """Every weight of the 2-process run within ADAPTER_BOUND of the 1-process run's UPDATE of it (the starting
    weights: the tiny model of trainer.seed 0, rebuilt here), norms per tensor; a weight that did not move in one run did
    not move in the other."""
    from prefzoo.models.loading import load_causal_lm, load_tokenizer

    a = load_file(str(runs["full_ref"] / "model" / "model.safetensors"))
    b = load_file(str(runs["full"] / "model" / "model.safetensors"))
    start = load_causal_lm("tiny", seed=0, tokenizer=load_tokenizer("tiny")).state_dict()
    assert a.keys() == b.keys() and len(a) > 10 and set(a) <= set(start)
    for k in a:
        update = float((a[k].double() - start[k].double()).norm())
        gap = float((b[k].double() - a[k].double()).norm())
        assert gap <= ADAPTER_BOUND * update, (k, gap, update)
    assert_same_metrics(runs["full_ref"], runs["full"], ("loss", "grad_norm", "rewards/margins"))
    margins = [r["rewards/margins"] for r in read_metrics(runs["full"] / "metrics.jsonl")]
    assert margins[0] == 0.0 and abs(margins[-1]) > 1e-3  # it trained (pi = pi_ref at first: exactly, same weights)


def test_a_resumed_fsdp2_run_continues_as_the_uninterrupted_one(runs):
    """Stopped after 2 steps, resumed to 3 under FSDP: the adapter and every step's metrics are the uninterrupted
    one-process run's (the in-flight state: optimizer, scheduler, sampler, RNG per process)."""
    assert [r["step"] for r in read_metrics(runs["resumed"] / "metrics.jsonl")] == [1, 2, 3]
    assert_same_adapter(runs["grpo_ref"], runs["resumed"])
    assert_same_metrics(runs["grpo_ref"], runs["resumed"], ("reward", "grad_norm"))


def test_an_fsdp2_checkpoint_resumes_in_one_process(runs):
    """The gathered checkpoint of step 2 (2 processes) loads into one unsharded process, which trains step 3 to the
    same adapter as the uninterrupted runs: the optimizer state is in one process's layout."""
    assert [r["step"] for r in read_metrics(runs["one"] / "metrics.jsonl")] == [3]
    assert_same_adapter(runs["grpo_ref"], runs["one"])


def test_two_nodes_through_torchrun_rendezvous_match_one_process(runs):
    """``torchrun --nnodes 2 --rdzv_backend c10d`` (two launches, one process each, as on two machines): the same
    DPO update and evaluation as one process, the main process alone writing."""
    assert_same_adapter(runs["dpo_ref"], runs["nodes"])
    assert_same_metrics(runs["dpo_ref"], runs["nodes"], ("loss", "grad_norm", "rewards/margins"))
    one = json.loads((runs["dpo_ref"] / "eval_after.json").read_text())
    two = json.loads((runs["nodes"] / "eval_after.json").read_text())
    assert two["task_reward"] == one["task_reward"]  # the same greedy answers (the text decides the reward)
    assert json.loads((runs["nodes"] / "summary.json").read_text())["num_processes"] == 2
