"""Tests for prefzoo.training.checkpoint: weights in standard formats, pruning, RNG state round trips."""

import errno
import random
import shutil

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors import SafetensorError

from prefzoo.errors import CheckpointError
from prefzoo.models.lora import wrap_trainable
from prefzoo.training import checkpoint
from prefzoo.training.checkpoint import (STATE_FILE, DamagedCheckpoint, latest_checkpoint, load_trainer_state,
                                         load_weights, rng_state, save_checkpoint, save_weights, set_rng_state)
from tests.models.helpers import lora_settings, tiny_model


def lora(seed):
    torch.manual_seed(seed)
    model = wrap_trainable(tiny_model(), lora_settings(), quantized=False, adapter_path=None,
                           gradient_checkpointing=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed * 1000 + len(n)))
    return model


def test_adapter_round_trip(tmp_path):
    a, b = lora(1), lora(2)
    target = save_weights(a, tmp_path)
    assert target == tmp_path / "adapter"
    assert {p.name for p in target.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    load_weights(b, tmp_path)
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=0)
    # and peft's own loader reads it: the same weights (a bit-exact copy, above) through the same PeftModel forward,
    # in the same process and thread count: the same arithmetic, so the same logits bit for bit (measured 0 at 1 and
    # 2 threads; the bound was 1e-6)
    peft = PeftModel.from_pretrained(tiny_model(), str(target))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids).logits, a(input_ids=ids).logits, rtol=0, atol=0)


def test_full_model_round_trip_with_tied_embeddings(tmp_path):
    a, b = tiny_model(seed=1), tiny_model(seed=2)
    assert save_weights(a, tmp_path) == tmp_path / "model"
    load_weights(b, tmp_path)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(vb, va, rtol=0, atol=0, msg=k)
    assert b.lm_head.weight.data_ptr() == b.model.embed_tokens.weight.data_ptr()  # still tied


def test_checkpoints_keep_the_newest_two_and_ignore_unfinished_ones(tmp_path):
    model = lora(1)
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, model, {"step": step})
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-000004", "step-000006"]
    (tmp_path / "checkpoints" / "step-000008" / "adapter").mkdir(parents=True)  # interrupted save: no state file
    assert latest_checkpoint(tmp_path).name == "step-000006"
    assert torch.load(latest_checkpoint(tmp_path) / STATE_FILE)["step"] == 6
    assert latest_checkpoint(tmp_path / "elsewhere") is None


def test_rng_state_round_trip():
    gen = torch.Generator().manual_seed(5)
    state = rng_state(gen)
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=gen)))
    set_rng_state(state, gen)
    again = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=gen)))
    assert first == again


def test_unexpected_adapter_keys_are_refused(tmp_path):
    a = lora(1)
    save_weights(a, tmp_path)
    other = wrap_trainable(tiny_model(), lora_settings(target_modules=["q_proj"]), quantized=False, adapter_path=None,
                           gradient_checkpointing=False)
    with pytest.raises(RuntimeError, match="unexpected keys"):
        load_weights(other, tmp_path)


# ------------------------------------------------------------------ failed writes keep the previous checkpoint
def full_disk(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    """Before: the OSError itself, and a half-written step-000004 folder (adapter/ only) left behind."""
    model = lora(1)
    save_checkpoint(tmp_path, 2, model, {"step": 2})
    monkeypatch.setattr(checkpoint, "write_trainer_state", full_disk)
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path, 4, model, {"step": 4})
    assert str(err.value).startswith(f"no space left on {tmp_path / 'checkpoints'}: checkpoint step-000004")
    assert "step-000002 is kept" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002"]  # no partial folder
    assert load_trainer_state(latest_checkpoint(tmp_path))["step"] == 2


@pytest.mark.parametrize("free,needle", [(0, "no space left on"), (10 * 2**30, "could not write checkpoint")])
def test_torch_zip_writer_failure_is_no_space_only_on_a_full_disk(tmp_path, monkeypatch, free, needle):
    """torch.save on a full disk fails with RuntimeError "unexpected pos 118528 vs 118416" (no errno): "no space left"
    when the disk is then full (shutil.disk_usage), else the writer's own message."""
    def short_write(*_a, **_k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 118528 vs 118416")

    monkeypatch.setattr(checkpoint, "write_trainer_state", short_write)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(100, 100 - free, free))
    with pytest.raises(CheckpointError, match=needle):
        save_checkpoint(tmp_path, 1, lora(1), {"step": 1})
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_full_disk_while_writing_weights_is_one_error(tmp_path, monkeypatch):
    """safetensors reports ENOSPC in its message (SafetensorError ... "No space left on device (os error 28)")."""
    model = lora(1)

    def fails(*_a, **_k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(model, "save_pretrained", fails)
    with pytest.raises(CheckpointError, match=r"no space left on .*: the weights \(adapter/\) could not be written"):
        save_weights(model, tmp_path)
    with pytest.raises(CheckpointError, match="no space left on"):
        save_checkpoint(tmp_path, 1, model, {"step": 1})


def test_saving_a_step_again_replaces_its_checkpoint_whole(tmp_path):
    model = lora(1)
    save_checkpoint(tmp_path, 3, model, {"step": 3, "tag": "first"}, run_config={"algo.name": "dpo"})
    save_checkpoint(tmp_path, 3, model, {"step": 3, "tag": "second"})
    assert load_trainer_state(latest_checkpoint(tmp_path))["tag"] == "second"
    assert not (latest_checkpoint(tmp_path) / "run_config.json").exists()  # nothing of the first one is left
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000003"]


# ------------------------------------------------------------------ reading: weights_only, damaged files
def test_the_trainer_state_of_earlier_versions_still_loads(tmp_path):
    """Earlier checkpoints held numpy's RNG state as numpy's own tuple (an ndarray): read through the numpy
    allow-list, with weights_only=True, and restored."""
    np.random.seed(3)
    old = {"step": 1, "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                              "torch": torch.get_rng_state()}}
    expected = float(np.random.rand())
    (tmp_path / "step").mkdir()
    torch.save(old, tmp_path / "step" / STATE_FILE)
    state = load_trainer_state(tmp_path / "step")
    set_rng_state(state["rng"], None)
    assert float(np.random.rand()) == expected


@pytest.mark.parametrize("content", [b"", b"garbage", "truncated"])
def test_a_damaged_trainer_state_is_named(tmp_path, content):
    model = lora(1)
    folder = save_checkpoint(tmp_path, 1, model, {"step": 1, "t": torch.zeros(1000)})
    data = (folder / STATE_FILE).read_bytes()
    (folder / STATE_FILE).write_bytes(data[:len(data) // 2] if content == "truncated" else content)
    with pytest.raises(DamagedCheckpoint) as err:
        load_trainer_state(folder)
    assert str(err.value).startswith(f"{folder / STATE_FILE} cannot be read") and "\n" not in str(err.value)


def test_numpy_values_in_the_trainer_state_are_stored_as_plain_numbers(tmp_path):
    """A plugin state or metric that is a numpy scalar or array would need numpy's pickling globals; it is stored as a
    Python number / list so the file still loads with weights_only=True (load_trainer_state)."""
    folder = save_checkpoint(tmp_path, 1, lora(1), {"step": 1, "algo": {"beta": np.float64(0.25),
                                                                        "history": np.arange(3)}})
    state = torch.load(folder / STATE_FILE, weights_only=True)
    assert state["algo"] == {"beta": 0.25, "history": [0, 1, 2]} and type(state["algo"]["beta"]) is float
