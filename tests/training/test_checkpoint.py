"""Tests for prefzoo.training.checkpoint: weights in standard formats, pruning, RNG state round trips."""

import random

import numpy as np
import pytest
import torch
from peft import PeftModel

from prefzoo.models.lora import wrap_trainable
from prefzoo.training.checkpoint import (STATE_FILE, latest_checkpoint, load_weights, rng_state, save_checkpoint,
                                         save_weights, set_rng_state)
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
    # and peft's own loader reads it
    peft = PeftModel.from_pretrained(tiny_model(), str(target))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids).logits, a(input_ids=ids).logits, rtol=0, atol=1e-6)


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
