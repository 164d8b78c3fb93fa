"""The evaluation before training computed once per setting (prefzoo.training.baseline): the starting policy's
metrics are reused from an evaluation with the same settings, which changes nothing but the time.

Before this module every run evaluated its starting policy again: the default DPO run spent 112 s of SmolLM2 (2
threads, idle machine: greedy answers 66 s, samples and their KL passes 37 s, preference pairs 9.5 s) before its first
step, and so did every run of a sweep.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from prefzoo.training import baseline, evaluations, loop
from prefzoo.training.loop import Trainer
from tests.algos.hydra_runs import TINY_RUN, compose
from tests.test_config import typed

ROOT = Path(__file__).resolve().parents[2]
ENV = {"torch": "2.13.0+cpu", "transformers": "5.24.0", "device": "cpu", "threads": 2}


def key(overrides=(), reference=True, num_samples=0, env=ENV):
    return baseline.starting_key(typed(*overrides), reference=reference, num_samples=num_samples, env=env)[0]


#: settings that change what the starting policy answers, or how the answers are scored or sampled
CHANGES = [["model.lora.r=8"], ["model.dtype=bfloat16"], ["model.fast.fused_logps=false"], ["model=tiny"],
           ["data.digits=3"], ["data.seed=1"], ["data.num_eval=100"], ["data.answer_format=number"],
           ["reward.functions=[format]"], ["eval.num_problems=100"], ["eval.max_new_tokens=32"],
           ["eval.diversity_samples=8"], ["eval.gold_reward.functions=[correctness]"], ["eval.ood.digits=3"],
           ["rollout.kv_cache=dynamic"], ["rollout.dtype=bfloat16"], ["trainer.seed=1"], ["algo=simpo"],
           ["eval.sampler_logps=true"]]
#: settings that do not: how the policy trains, when it is evaluated, the pairs it trains on
KEEPS = [["trainer.lr=1e-4"], ["objective.beta=0.3"], ["trainer.max_steps=80"], ["eval.after=false"],
         ["eval.every=10"], ["eval.steps=[1,2]"], ["data.pairs.num_prompts=640"], ["data.pairs.seed=3"],
         ["rollout.vllm.request_timeout=30"], ["rollout.vllm.adapter_dir=/shared/adapters"], ["algo.loss_type=ipo"],
         ["trainer.batch_size=8"],
         ["trainer.num_threads=2"], ["trainer.kl_metric_every=0"]]


@pytest.mark.parametrize("overrides", CHANGES, ids=lambda o: o[0])
def test_a_setting_that_changes_the_starting_evaluation_changes_the_key(overrides):
    assert key(overrides) != key()


@pytest.mark.parametrize("overrides", KEEPS, ids=lambda o: o[0])
def test_a_setting_that_cannot_change_it_keeps_the_key(overrides):
    assert key(overrides) == key()


def test_the_server_engine_is_in_the_key_but_not_the_servers_addresses(monkeypatch):
    """rollout.engine=vllm_server samples on other numerics than the hf engine (a key of its own); which servers draw
    the samples does not change them (the same base and adapter, per-prompt seeds). (No server runs here: the
    pre-flight's question to the servers is skipped.)"""
    import prefzoo.rollout.vllm_server as server

    monkeypatch.setattr(server, "check_servers", lambda *args, **kwargs: [])
    one = key(["rollout.engine=vllm_server", "rollout.servers=[http://127.0.0.1:8000]"])
    two = key(["rollout.engine=vllm_server", "rollout.servers=[http://10.0.0.1:8000,http://10.0.0.2:8001]"])
    assert one == two != key()


def test_the_reference_pass_k_and_the_environment_are_in_the_key():
    """KL keys exist only with a reference; pass@k's k; each part of the environment can change the rounding."""
    assert key(reference=False) != key() and key(num_samples=4) != key()
    for part, value in [("torch", "2.14.1"), ("transformers", "5.25.0"), ("device", "cuda"), ("threads", 1)]:
        assert key(env={**ENV, part: value}) != key(), part


def test_a_local_model_folder_is_keyed_by_its_files(tmp_path):
    """A folder keeps its name when its weights are replaced: the key holds each file's size and modification time."""
    (tmp_path / "model.safetensors").write_bytes(b"0" * 10)
    before = key([f"model.name={tmp_path}"])
    (tmp_path / "model.safetensors").write_bytes(b"0" * 11)
    assert key([f"model.name={tmp_path}"]) != before


@pytest.mark.parametrize("overrides,reason", [
    (["eval.reuse_before=false"], "eval.reuse_before=false"),
    (["model.adapter_path=/some/adapter"], "model.adapter_path"),
    (["data=file", "data.path=tests/fixtures/arithmetic_pairs.jsonl"], "data.path"),
    (['reward.functions=["tests.algos.hydra_runs:letter_share"]'], "the user's own"),
    (["eval.gold_reward.functions=[tests.algos.hydra_runs:letter_share]"], "the user's own"),
    (["model.name=HuggingFaceTB/SmolLM2-360M-Instruct"], "hub id"),
])
def test_what_the_key_cannot_see_is_computed_every_time(overrides, reason):
    cfg = typed(*overrides) if "adapter_path" not in overrides[0] else dataclasses.replace(
        typed(), model=dataclasses.replace(typed().model, adapter_path="/some/adapter"))
    assert reason in baseline.not_reusable(cfg)
    assert baseline.not_reusable(typed()) is None


class CountingEvaluations:
    """Counts the starting-policy evaluations a trainer computes."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = evaluations.RunEvaluations.policy_metrics

        def counted(run_evaluations):
            self.calls += 1
            return real(run_evaluations)

        monkeypatch.setattr(evaluations.RunEvaluations, "policy_metrics", counted)


#: DPO on the tiny model's built-in pairs (its sampled answers against the known ones), 2 steps at a rate that moves it
RUN = ["algo=dpo", "trainer.max_steps=2", "trainer.lr=0.05", "data.pairs.num_prompts=8", "data.pairs.eval_prompts=4",
       "data.pairs.max_new_tokens=6", *TINY_RUN]


def test_a_second_run_reuses_the_first_ones_evaluation_and_trains_bit_for_bit_alike(tmp_path, monkeypatch, caplog):
    """Three tiny DPO runs (2 steps) in one cache: the first computes and stores the evaluation before training, the
    second reuses it (one policy evaluation instead of two: after training only), the third (eval.reuse_before=false)
    computes it again. The three give the same evaluation before training, the same training metrics and the same
    adapter to the last bit: the reuse changes nothing but the time."""
    monkeypatch.setattr(evaluations, "cache_dir", lambda: tmp_path / "cache")
    count = CountingEvaluations(monkeypatch)
    runs = {}
    for name, extra in [("first", []), ("second", []), ("computed", ["eval.reuse_before=false"])]:
        count.calls = 0
        with caplog.at_level(logging.INFO, logger="prefzoo.training"):
            caplog.clear()
            Trainer(compose([*RUN, *extra]), tmp_path / name).run()
        runs[name] = (count.calls, caplog.text)
    assert [runs[n][0] for n in ("first", "second", "computed")] == [2, 1, 2]
    assert "reused (cached in" in runs["second"][1] and "reused" not in runs["first"][1] + runs["computed"][1]
    stored = list((tmp_path / "cache" / "evaluations").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["key"]["algo"] == "dpo"

    def read(name, file):
        return json.loads((tmp_path / name / file).read_text())

    first = read("first", "eval_before.json")
    second = read("second", "eval_before.json")
    assert second.pop("reused_from") == str(stored[0]) and "reused_from" not in first
    drop = lambda d: {k: v for k, v in d.items() if k != "seconds"}  # noqa: E731
    assert drop(first) == drop(second) == drop(read("computed", "eval_before.json"))
    assert "preference_accuracy" in second and "preference_accuracy" not in json.loads(stored[0].read_text())["result"]
    metrics = {n: [{k: v for k, v in json.loads(line).items() if not k.startswith("time/") and "per_second" not in k}
                   for line in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in runs}
    assert all(m["grad_norm"] > 0 for m in metrics["first"])  # it trains
    assert metrics["first"] == metrics["second"] == metrics["computed"]
    from safetensors.torch import load_file

    weights = {n: load_file(tmp_path / n / "adapter" / "adapter_model.safetensors") for n in runs}
    for name in weights["first"]:
        assert torch.equal(weights["first"][name], weights["second"][name])
        assert torch.equal(weights["first"][name], weights["computed"][name])


def test_a_damaged_stored_evaluation_is_computed_again_and_replaced(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(evaluations, "cache_dir", lambda: tmp_path / "cache")
    Trainer(compose([*RUN, "trainer.max_steps=1"]), tmp_path / "a").run()
    (stored,) = (tmp_path / "cache" / "evaluations").glob("*.json")
    stored.write_text('{"key": {}, "result": ')  # torn
    count = CountingEvaluations(monkeypatch)
    with caplog.at_level(logging.WARNING):
        Trainer(compose([*RUN, "trainer.max_steps=1"]), tmp_path / "b").run()
    assert count.calls == 2 and "is not a readable evaluation" in caplog.text
    assert "result" in json.loads(stored.read_text())


def test_the_settings_of_make_train_name_a_shipped_evaluation_made_where_make_train_runs(monkeypatch):
    """`make train` (python train.py, no override) finds the shipped evaluation on a machine like the one that made it:
    the key of the default settings under the shipped file's environment is the file's name, that environment's
    torch is the Makefile's, and the file holds the metrics a DPO evaluation reports (without the preference accuracy,
    computed every time). The file was made on a CPU without bf16 units, where the default model.dtype=auto is
    float32 (resolved as the run resolves it, before the key); on one with them the run evaluates its bf16 start."""
    import prefzoo.models.precision as precision
    from prefzoo.training.setup import resolve_precision

    files = sorted(baseline.SHIPPED.glob("*.json"))
    assert files, baseline.SHIPPED
    shipped = json.loads(files[0].read_text())
    cfg = typed()
    assert cfg.model.dtype == "auto"
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    resolve_precision(cfg, torch.device("cpu"))
    assert shipped["key"]["model"]["dtype"] == cfg.model.dtype == "float32"
    name, _ = baseline.starting_key(cfg, reference=True, num_samples=0, env=shipped["key"]["environment"])
    assert [f.stem for f in files] == [name]
    spec = re.search(r"^TORCH_SPEC \?= torch==(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert shipped["key"]["environment"]["torch"].split("+")[0] == spec
    assert {"task_accuracy", "task_accuracy_se", "kl_k1", "entropy", "distinct_2"} <= set(shipped["result"])
    assert "preference_accuracy" not in shipped["result"] and shipped["result"]["n_problems"] == 200


@pytest.mark.real_model
@pytest.mark.slow
def test_the_shipped_evaluation_is_what_the_default_run_computes(tmp_path, monkeypatch):
    """On the real model (marker real_model, ~2 min on 2 threads), in the environment the shipped file records: the
    default run's starting policy evaluated again (eval.reuse_before=false) gives the shipped numbers: the greedy
    answers exactly, the sampled metrics to 1e-6."""
    (path,) = baseline.SHIPPED.glob("*.json")
    shipped = json.loads(path.read_text())
    wanted = shipped["key"]["environment"]
    torch.set_num_threads(wanted["threads"])
    if baseline.environment("cpu") != wanted:  # another machine's rounding draws other samples (prefzoo.runtime)
        pytest.skip(f"the shipped evaluation was computed with {wanted}; this machine: {baseline.environment('cpu')}")
    monkeypatch.setattr(evaluations, "cache_dir", lambda: tmp_path / "cache")
    trainer = Trainer(compose(["eval.reuse_before=false", "trainer.progress=false"]), tmp_path / "run")
    computed = trainer.policy_metrics()
    assert computed["greedy_examples"] == shipped["result"]["greedy_examples"]
    assert computed["task_accuracy"] == shipped["result"]["task_accuracy"]
    # the same arithmetic in the same numerics environment (torch, transformers, threads, instruction set), but
    # possibly another CPU model whose BLAS picks other kernels: the float32 forwards may then differ by ~1e-7
    # relative, and the sampled tokens with them. 1e-6 is NOT a derived bound (kind 3 unmeasured: the real model is
    # skipped in the suite); a miss here means "another machine's rounding", as the skip above already says
    for k, v in shipped["result"].items():
        if isinstance(v, float):
            assert computed[k] == pytest.approx(v, rel=1e-6, abs=1e-6), k
