"""The training loop end to end on the tiny model: checkpoints, exact resume, metrics.jsonl.

Runs ``Trainer`` with DPO on tests/fixtures/arithmetic_pairs.jsonl (38 train, 2 held-out pairs), LoRA
with dropout 0.1 (so the RNG state must be restored too), AdamW with warm-up and linear decay.

Tolerances: none. Resuming is exact, not close: the resumed run restores the adapter, AdamW's moments, the schedule,
the sampler and the RNG bit for bit and then does the same arithmetic as the straight run (same process, same
one-row micro-batches, the thread count pinned by trainer.num_threads=1), so weights, metrics and logits are compared
with ``==`` (measured 2026-12-06: every gap 0; the bounds were 1e-6 and 1e-5, round numbers that would have let a
rounding-sized difference in the restored state through).
"""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from prefzoo.algos.dpo import DPOConfig
from prefzoo.config import Config, DataConfig, EvalConfig, ModelConfig, TrainerConfig, validate
from prefzoo.training import loop
from prefzoo.training.checkpoint import STATE_FILE, complete_checkpoints
from prefzoo.training.metrics_log import read_metrics
from tests.interrupt import run_until_killed
from tests.models.helpers import lora_settings, tiny_model

FIXTURE = str(Path(__file__).resolve().parents[1] / "fixtures" / "arithmetic_pairs.jsonl")


def config(resume=False, max_steps=6, save_every=3, **trainer) -> Config:
    return validate(Config(
        algo=DPOConfig(),
        model=ModelConfig(name="tiny", lora=lora_settings(dropout=0.1)),
        data=DataConfig(name="file", path=FIXTURE),
        eval=EvalConfig(batch_size=4, max_new_tokens=6, diversity_prompts=2, diversity_samples=2),  # small: no check reads it
        trainer=TrainerConfig(max_steps=max_steps, save_every=save_every, batch_size=2, micro_batch_size=1, lr=5e-3,
                              warmup_steps=1, resume=resume, progress=False, tensorboard=False, device="cpu",
                              num_threads=1, **trainer),
    ))


def adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    trainer = loop.Trainer(config(), run_dir)
    summary = trainer.run()
    return run_dir, trainer, summary


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Steps 1-4, killed during step 5 (the last checkpoint is step 3), then trainer.resume=true to step 6."""
    run_dir = tmp_path_factory.mktemp("resumed")
    run_until_killed(loop.Trainer(config(), run_dir), 5)
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000003"]
    summary = loop.Trainer(config(resume=True), run_dir).run()
    return run_dir, summary


def test_resumed_run_ends_with_the_same_adapter_weights(uninterrupted, resumed):
    a, b = adapter_tensors(uninterrupted[0]), adapter_tensors(resumed[0])
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # training moved the adapter


def test_resumed_metrics_have_each_step_once_and_match(uninterrupted, resumed):
    straight = read_metrics(uninterrupted[0] / "metrics.jsonl")
    again = read_metrics(resumed[0] / "metrics.jsonl")
    assert [r["step"] for r in straight] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(straight, again):
        for key in ("loss", "rewards/margins", "grad_norm", "lr"):
            assert y[key] == x[key], (x["step"], key)
    assert resumed[1]["steps"] == 6


def test_metrics_jsonl_has_the_promised_keys(uninterrupted):
    first = read_metrics(uninterrupted[0] / "metrics.jsonl")[0]
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected", "log_ratio/chosen", "log_ratio/rejected", "grad_norm", "lr", "tokens_per_second"):
        assert key in first, key
    lrs = [r["lr"] for r in read_metrics(uninterrupted[0] / "metrics.jsonl")]
    # warm-up: (s + 1) / 2 for s = 0; then linear decay (6 - s) / (6 - 1) for optimizer steps s = 1..5 (float64
    # schedule against float64 products: ~3e-16 relative; rel 1e-12 leaves 3000x, kind 1 of tests/bounds.py)
    assert lrs == pytest.approx([5e-3 / 2, 5e-3, 5e-3 * 4 / 5, 5e-3 * 3 / 5, 5e-3 * 2 / 5, 5e-3 * 1 / 5], rel=1e-12)


def test_checkpoint_folder_is_standard_peft_plus_trainer_state(uninterrupted):
    run_dir, trainer, summary = uninterrupted
    ckpts = complete_checkpoints(run_dir)
    assert [p.name for p in ckpts] == ["step-000003", "step-000006"]
    last = ckpts[-1]
    assert (last / "adapter" / "adapter_config.json").is_file()
    assert (last / "adapter" / "adapter_model.safetensors").is_file()
    state = torch.load(last / STATE_FILE, weights_only=False)
    assert state["step"] == 6 and {"optimizer", "scheduler", "sampler", "rng"} <= state.keys()
    # loadable with peft's own loader on a fresh base model: same outputs as the trained policy
    loaded = PeftModel.from_pretrained(tiny_model(seed=0), str(last / "adapter")).eval()
    ids = torch.tensor([[1, 100, 200, 300, 2]])
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits,
                                   rtol=0, atol=0)
    assert json.loads((last / "adapter" / "adapter_config.json").read_text())["r"] == 4
    # the final weights and the run's files
    torch.testing.assert_close(adapter_tensors(run_dir), adapter_tensors(last), rtol=0, atol=0)
    for name in ("metrics.jsonl", "summary.json", "eval_before.json", "eval_after.json"):
        assert (run_dir / name).is_file(), name
    assert summary["steps"] == 6 and summary["algo"] == "dpo"
    assert "preference_accuracy" in summary["eval_after"]


def test_precomputed_reference_logps_give_the_same_first_step(tmp_path, uninterrupted):
    """The cache is computed on one-row batches (trainer.micro_batch_size=1), as the step computes them: the same
    sums, so the same first step exactly (measured 0; the bound was 1e-5)."""
    cfg = config(max_steps=1, save_every=0)
    cfg.algo.precompute_ref_logps = True
    cfg.eval.before = cfg.eval.after = False
    trainer = loop.Trainer(cfg, tmp_path)
    assert trainer.ref_cache is not None and len(trainer.ref_cache) == 38
    trainer.run()
    first = read_metrics(tmp_path / "metrics.jsonl")[0]
    straight = read_metrics(uninterrupted[0] / "metrics.jsonl")[0]
    for key in ("loss", "log_ratio/chosen", "log_ratio/rejected"):
        assert first[key] == straight[key], key
