"""Tests for prefzoo.models.lora: LoRA adapters, 4-bit nf4 QLoRA on CPU, and full fine-tuning."""

import pytest
import torch
from peft import PeftModel

from prefzoo.algos.dpo import DPOConfig
from prefzoo.config import Config, ModelConfig
from prefzoo.errors import ConfigError
from prefzoo.models.lora import count_parameters, trainable_outside_adapter, wrap_trainable
from prefzoo.models.loading import load_base_model
from tests.models.helpers import lora_settings, tiny_model, tokenizer

IDS = torch.tensor([[1, 17, 400, 9000, 23], [5, 6, 7, 8, 9]])


def lm_loss(model) -> torch.Tensor:
    return model(input_ids=IDS, labels=IDS).loss


def test_lora_wraps_and_only_adapter_weights_train():
    base = tiny_model()
    with torch.no_grad():
        before = base(input_ids=IDS).logits.clone()
    model = wrap_trainable(base, lora_settings(), quantized=False, adapter_path=None, gradient_checkpointing=False)
    assert isinstance(model, PeftModel)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert trainable_outside_adapter(model) == []
    # all-linear: q, k, v, o, gate, up, down in each of the 2 layers, never lm_head
    assert len(trainable) == 2 * 7 * 2 and not any("lm_head" in n for n in trainable)
    n_train, n_total = count_parameters(model)
    # r=4: A is r x in, B is out x r; per layer q(64,64) k(64,32) v(64,32) o(64,64) gate/up(64,128) down(128,64)
    per_layer = sum(4 * (i + o) for i, o in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)])
    assert n_train == 2 * per_layer
    assert n_total > 3_000_000
    with torch.no_grad():  # B starts at 0: the wrapped model is the base model (adds exactly 0: kind 1, exact)
        torch.testing.assert_close(model(input_ids=IDS).logits, before, rtol=0, atol=0)
    lm_loss(model).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_lora_target_modules_and_modules_to_save():
    model = wrap_trainable(tiny_model(), lora_settings(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
                           quantized=False, adapter_path=None, gradient_checkpointing=False)
    adapted = {n.split(".")[-4] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}
    outside = trainable_outside_adapter(model)
    assert outside and all("lm_head" in n for n in outside)


def test_full_fine_tuning_when_lora_is_off():
    base = tiny_model()
    for p in base.parameters():
        p.requires_grad_(False)
    model = wrap_trainable(base, lora_settings(enabled=False), quantized=False, adapter_path=None,
                           gradient_checkpointing=False)
    assert model is base and not isinstance(model, PeftModel)
    assert all(p.requires_grad for p in model.parameters())
    n_train, n_total = count_parameters(model)
    assert n_train == n_total
    lm_loss(model).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.model.layers[1].mlp.down_proj.weight.grad.abs().sum() > 0


def test_adapter_path_needs_lora():
    with pytest.raises(ConfigError, match="lora.enabled=true"):
        wrap_trainable(tiny_model(), lora_settings(enabled=False), quantized=False, adapter_path="somewhere",
                       gradient_checkpointing=False)


@pytest.mark.numerics
def test_gradient_checkpointing_gives_the_same_gradients():
    """Non-reentrant checkpointing recomputes each layer's forward, the same operations on the same inputs, and the
    backward runs the original graph's nodes on the recomputed tensors: the gradients are equal bit for bit (kind 1,
    no rounding differs; measured 0 at 1 and 2 threads, 2026-12-06). Before: rtol 1e-5, atol 1e-7, not derived."""
    def grads(checkpointing):
        torch.manual_seed(0)  # peft draws lora_A from the global RNG
        model = wrap_trainable(tiny_model(), lora_settings(), quantized=False, adapter_path=None,
                               gradient_checkpointing=checkpointing)
        with torch.no_grad():  # make B non-zero so that A gets a gradient too
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
        model.train()
        lm_loss(model).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain, ckpt = grads(False), grads(True)
    assert plain.keys() == ckpt.keys()
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=0, atol=0)
    assert any(float(g.abs().max()) > 0 for g in plain.values())  # (gradients that can differ)


def test_4bit_nf4_lora_forward_and_backward_on_cpu():
    """QLoRA (model.quantization=4bit) through the same path train.py takes: load_base_model, then
    wrap_trainable. The linear layers are bitsandbytes nf4; only the adapter trains, with finite
    non-zero gradients; one optimizer step lowers the loss on the batch."""
    import bitsandbytes as bnb

    cfg = Config(algo=DPOConfig(), model=ModelConfig(name="tiny", quantization="4bit", lora=lora_settings()))
    base = load_base_model(cfg.model, cfg.trainer.seed, tokenizer(), torch.device("cpu"))
    q_proj = base.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, bnb.nn.Linear4bit)
    assert q_proj.weight.quant_state.quant_type == "nf4"
    model = wrap_trainable(base, cfg.model.lora, quantized=True, adapter_path=None, gradient_checkpointing=False)
    model.train()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    loss = lm_loss(model)
    assert torch.isfinite(loss)
    loss.backward()
    b_grads = [p.grad for n, p in trainable.items() if "lora_B" in n]
    assert all(g is not None and torch.isfinite(g).all() for g in b_grads)
    assert sum(float(g.abs().sum()) for g in b_grads) > 0  # B starts at 0, so only B has a gradient at first
    opt = torch.optim.SGD(trainable.values(), lr=0.5)
    opt.step()
    with torch.no_grad():
        assert float(lm_loss(model)) < float(loss)
