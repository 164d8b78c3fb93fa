"""Checkpoints: the peft adapter in its standard format plus everything needed to resume exactly.

Layout of a run folder::

    checkpoints/step-000020/adapter/          adapter_config.json + adapter_model.safetensors (peft format)
                           /model/            full weights instead, when LoRA is off
                           /trainer_state.pt  optimizer, scheduler, data position, RNG states, plugin state
    adapter/ (or model/)                      the final weights

``trainer_state.pt`` is written last, so a checkpoint folder without it (an interrupted save) is ignored.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"


def save_weights(model, folder: Path) -> Path:
    """Save the trainable weights: the adapter (peft format) under LoRA, else the whole model."""
    target = folder / ("adapter" if isinstance(model, PeftModel) else "model")
    model.save_pretrained(target)
    return target


def load_weights(model, folder: Path) -> None:
    """Load weights saved by :func:`save_weights` into ``model`` in place."""
    if isinstance(model, PeftModel):
        state = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model, state)
        if getattr(result, "unexpected_keys", None):
            raise RuntimeError(f"adapter checkpoint has unexpected keys: {result.unexpected_keys[:5]}")
    else:
        files = sorted((folder / "model").glob("*.safetensors"))
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
        if missing or unexpected:
            raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def rng_state(generator: torch.Generator | None) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict, generator: torch.Generator | None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


def save_checkpoint(run_dir: Path, step: int, model, trainer_state: dict, keep: int = 2) -> Path:
    """Write ``checkpoints/step-XXXXXX`` and keep only the newest ``keep`` complete checkpoints."""
    folder = run_dir / "checkpoints" / f"step-{step:06d}"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    save_weights(model, folder)
    torch.save(trainer_state, folder / (STATE_FILE + ".tmp"))
    (folder / (STATE_FILE + ".tmp")).rename(folder / STATE_FILE)
    done = complete_checkpoints(run_dir)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders with a finished ``trainer_state.pt``, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def load_trainer_state(folder: Path) -> dict:
    return torch.load(folder / STATE_FILE, weights_only=False)
