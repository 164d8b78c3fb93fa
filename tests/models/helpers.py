"""Shared helpers for tests that run the tiny random Llama: its tokenizer, builders, hand-made batches.

The tiny model is ``load_causal_lm("tiny", tokenizer=load_tokenizer("tiny"))`` (SmolLM2's real
tokenizer, 49,152 tokens, 2 layers of width 64). Its default initialisation (std 0.02) gives an almost
uniform next-token distribution that repeats one token under greedy decoding; tests that need the
tokens and log-probs to depend on the context use ``initializer_range=0.2``.

Torch runs these tests on ONE thread (``one_thread``): with 2 cores shared with other processes, the
OpenMP barrier of a multi-threaded 30x64 matmul costs ~15 ms instead of ~6 us, so a 2-layer forward
takes 0.25 s instead of 2 ms.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from prefzoo.types import PromptBatch, SequenceBatch
from prefzoo.config import LoraConfig
from prefzoo.data.preference import pad_rows
from prefzoo.models.loading import load_causal_lm, load_tokenizer

SPREAD = 0.2  # initializer_range that makes the tiny model's predictions depend on the context


@functools.lru_cache(maxsize=1)
def tokenizer():
    """SmolLM2's tokenizer (cached under $PREFZOO_CACHE on first use), shared by the whole session."""
    return load_tokenizer("tiny")


def pad_id() -> int:
    return tokenizer().pad_token_id


def tiny_model(seed: int = 0, initializer_range: float | None = None, dtype: str = "float32", **kwargs):
    """A fresh tiny random Llama (same seed -> same weights)."""
    tiny = {} if initializer_range is None else {"initializer_range": initializer_range}
    return load_causal_lm("tiny", tokenizer=tokenizer(), seed=seed, dtype=dtype, tiny_kwargs=tiny, **kwargs)


def lora_settings(**overrides) -> LoraConfig:
    """prefzoo's ``model.lora`` settings, small by default (r=4 on every linear layer)."""
    return LoraConfig(**{"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, **overrides})


def sequence_batch(prompts: list[list[int]], completions: list[list[int]], extra_left: int = 0,
                   extra_right: int = 0, pad: int | None = None) -> SequenceBatch:
    """Prompts left-padded and completions right-padded, with optional extra padding columns."""
    pad = pad_id() if pad is None else pad
    p_ids, p_mask = pad_rows(prompts, "left", pad)
    c_ids, c_mask = pad_rows(completions, "right", pad)
    n = len(prompts)
    if extra_left:
        p_ids = torch.cat([torch.full((n, extra_left), pad), p_ids], dim=1)
        p_mask = torch.cat([torch.zeros((n, extra_left), dtype=torch.bool), p_mask], dim=1)
    if extra_right:
        c_ids = torch.cat([c_ids, torch.full((n, extra_right), pad)], dim=1)
        c_mask = torch.cat([c_mask, torch.zeros((n, extra_right), dtype=torch.bool)], dim=1)
    return SequenceBatch(p_ids, p_mask, c_ids, c_mask)


def prompt_batch(prompts: list[list[int]]) -> PromptBatch:
    ids, mask = pad_rows(prompts, "left", pad_id())
    return PromptBatch(ids, mask)


def plain_logps(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Independent per-token log-probs of ONE unpadded sequence: run the model on prompt + completion
    (no mask, default positions), take log_softmax(logits / T) in float64 and gather by hand.
    Shape (len(completion),), float32."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    out = []
    for j, token in enumerate(completion):
        row = torch.log_softmax(logits[len(prompt) - 1 + j] / temperature, dim=-1)  # position predicting token j
        out.append(row[token])
    return torch.stack(out).float()


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def one_thread_fixture():
    """Body of the autouse fixtures of the tiny-model test folders (see the module docstring)."""
    with threads(1):
        yield


@contextlib.contextmanager
def float64_rms_norm():
    """Within the block, transformers' LlamaRMSNorm normalises a float64 input in float64 (the same formula).

    As shipped it rounds its input to float32 (an upcast for bf16, a downcast in a float64 model): a float64 model
    is float32 at its five norms, in the forward and (the cast's backward) in the backward. Two float64 paths ~1e-16
    apart then round a state to different float32 numbers with probability ~1e-8 per element (the merged copy
    against the LoRA model: 1.1e-4 per pass, measured from the norms' inputs), which moves logits and gradients by up
    to 3.2e-7 of their largest entry (measured by injecting one float32 ulp): far above a float64 bound. Inputs of
    other dtypes take transformers' own path."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    original = LlamaRMSNorm.forward

    def forward(self, hidden_states):
        if hidden_states.dtype != torch.float64:
            return original(self, hidden_states)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    LlamaRMSNorm.forward = forward
    try:
        yield
    finally:
        LlamaRMSNorm.forward = original
