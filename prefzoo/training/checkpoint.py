"""Checkpoints: the peft adapter in its standard format plus everything needed to resume exactly.

Layout of a run folder::

    checkpoints/step-000020/adapter/          adapter_config.json + adapter_model.safetensors (peft format)
                           /model/            full weights instead, when LoRA is off
                           /run_config.json   the settings that define the run (see prefzoo.training.resume)
                           /trainer_state.pt  optimizer, scheduler, data position, RNG states, plugin state
    adapter/ (or model/)                      the final weights

A checkpoint is written into ``checkpoints/.step-000020.partial`` and renamed to ``step-000020`` once complete, so a
failed or interrupted write (a full disk, a kill) leaves the previous checkpoints as they were; a write that fails
raises :class:`~prefzoo.errors.CheckpointError` ("no space left on <dir>" for a full disk).

``trainer_state.pt`` holds only tensors, plain numbers, strings, lists and dicts (numpy's RNG state as a list), and is
read with ``torch.load(weights_only=True)``: loading a checkpoint never runs code from it. A file that holds anything
else is refused (:class:`UnsafeCheckpoint`); one that cannot be read is :class:`DamagedCheckpoint`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from prefzoo.errors import CheckpointError
from prefzoo.tinker.backend import CHECKPOINT_FILE as REMOTE_CHECKPOINT_FILE  # backend=tinker: the server's state
from prefzoo.training.layout import ADAPTER_DIR, CHECKPOINTS_DIR, MODEL_DIR, RUN_CONFIG_FILE, STATE_FILE

log = logging.getLogger(__name__)

#: what every trainer state the loop writes holds, and a resume reads (a state without one is damaged)
REQUIRED_STATE = ("step", "optimizer", "scheduler", "sampler", "algo", "rng")
PARTIAL_PREFIX = "."  # checkpoints/.step-XXXXXX.partial while being written (complete_checkpoints ignores it)

_reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
#: What numpy's RNG state, as checkpoints of earlier prefzoo versions stored it (an ndarray), needs to be read with
#: ``weights_only=True``: arrays of plain numbers, nothing that runs code.
NUMPY_STATE_GLOBALS = [_reconstruct, (_reconstruct, "numpy.core.multiarray._reconstruct"),
                       (_reconstruct, "numpy._core.multiarray._reconstruct"), np.ndarray, np.dtype,
                       type(np.dtype(np.uint32))]


class DamagedCheckpoint(CheckpointError):
    """A checkpoint file that cannot be read (truncated, empty, not what it should be)."""


class UnsafeCheckpoint(CheckpointError):
    """A ``trainer_state.pt`` that holds objects whose loading would run code (refused, never loaded)."""


_WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def _no_space(err: BaseException, folder: Path) -> bool:
    """Whether a failed write ran out of disk space: ENOSPC / EDQUOT anywhere in the chain, the message of
    safetensors ("No space left"), or torch's zip writer after a short write ("unexpected pos") on a full disk."""
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left" in str(seen) or "StorageFull" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    if "unexpected pos" in str(err):
        try:
            return shutil.disk_usage(folder).free < 64 * 2**20
        except OSError:
            return False
    return False


@contextlib.contextmanager
def guarded_write(folder: Path, what: str, kept: str = ""):
    """Turn a failed write under ``folder`` into one :class:`CheckpointError` line: "no space left on <folder>"
    for a full disk, else the reason; ``kept`` says what is left intact."""
    try:
        yield
    except CheckpointError:
        raise
    except _WRITE_ERRORS as err:
        tail = f"; {kept}" if kept else ""
        if _no_space(err, folder):
            raise CheckpointError(f"no space left on {folder}: {what} could not be written{tail}. Free some space, "
                                  "then continue the run with trainer.resume=true.") from err
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"could not write {what} in {folder}: {reason}{tail}.") from err


def save_weights(model, folder: Path, state_dict: dict | None = None) -> Path:
    """Save the trainable weights: the adapter (peft format) under LoRA, else the whole model. ``state_dict``: the
    model's whole state when its own is sharded (FSDP: :func:`prefzoo.training.fsdp.full_model_state`), else None."""
    target = weights_folder(model, folder)
    with guarded_write(folder, f"the weights ({target.name}/)"):
        _save_pretrained(model, target, state_dict)
    return target


def _save_pretrained(model, target: Path, state_dict: dict | None) -> None:
    if state_dict is None:
        model.save_pretrained(target)
    else:
        model.save_pretrained(target, state_dict=state_dict)


def weights_folder(model, folder: Path) -> Path:
    return folder / (ADAPTER_DIR if isinstance(model, PeftModel) else MODEL_DIR)


def load_weights(model, folder: Path) -> None:
    """Load weights saved by :func:`save_weights` into ``model`` in place.

    Raises:
        CheckpointError: the weights do not fit the model (other adapter keys or shapes), or cannot be read.
    """
    try:
        if isinstance(model, PeftModel):
            state = load_file(str(folder / ADAPTER_DIR / "adapter_model.safetensors"))
            result = set_peft_model_state_dict(model, state)
            if getattr(result, "unexpected_keys", None):
                raise CheckpointError(f"adapter checkpoint {folder / ADAPTER_DIR} has unexpected keys: "
                                      f"{result.unexpected_keys[:5]}")
        else:
            files = sorted((folder / MODEL_DIR).glob("*.safetensors"))
            state = {}
            for f in files:
                state.update(load_file(str(f)))
            missing, unexpected = model.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
            if missing or unexpected:
                raise CheckpointError(f"checkpoint {folder} does not match the model: missing {missing[:5]}, "
                                      f"unexpected {unexpected[:5]}")
    except (RuntimeError, OSError, SafetensorError) as err:
        if isinstance(err, CheckpointError):
            raise
        first = str(err).strip().splitlines()
        detail = next((line.strip() for line in first if "size mismatch" in line), first[0] if first else "")
        raise CheckpointError(f"the weights in {folder} do not fit this model ({detail[:300]}); it was made with "
                              "other model settings.") from err


def check_weights(folder: Path) -> None:
    """Read the header of every weights file of a checkpoint (cheap): a truncated or missing file raises
    :class:`DamagedCheckpoint`."""
    files = sorted((folder / ADAPTER_DIR).glob("*.safetensors")) + sorted((folder / MODEL_DIR).glob("*.safetensors"))
    if not files and (folder / MODEL_DIR / REMOTE_CHECKPOINT_FILE).is_file():  # backend=tinker: the server's state
        return
    if not files:
        raise DamagedCheckpoint(f"{folder} has no weights (adapter/ or model/ *.safetensors)")
    for f in files:
        try:
            with safe_open(str(f), "pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as err:
            raise DamagedCheckpoint(f"{f} cannot be read ({_first_line(err)})") from err


def rng_state(generator: torch.Generator | None) -> dict:
    """The RNG states as tensors and plain values (numpy's as ``[name, keys list, pos, has_gauss, cached]``), so a
    checkpoint holding them loads with ``weights_only=True``."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict, generator: torch.Generator | None) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    name, keys, pos, has_gauss, cached = state["numpy"]  # a list, or numpy's own tuple (older checkpoints)
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


def write_trainer_state(state: dict, path: Path) -> None:
    """``torch.save`` the trainer state (tensors and plain values) to ``path``."""
    torch.save(state, path)


def plain_values(value):
    """``value`` with numpy scalars and arrays turned into Python numbers and lists (dicts, lists, tuples walked;
    tensors kept), so that it loads with ``weights_only=True``."""
    if isinstance(value, dict):
        return {k: plain_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_values(v) for v in value)
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return value


def save_checkpoint(run_dir: Path, step: int, model, trainer_state: dict, keep: int = 2,
                    run_config: dict | None = None, state_dict: dict | None = None) -> Path:
    """Write ``checkpoints/step-XXXXXX`` and keep only the newest ``keep`` complete checkpoints.

    The checkpoint is written into ``checkpoints/.step-XXXXXX.partial`` and renamed when complete; ``run_config``
    (the run-defining settings) goes to ``run_config.json``.

    Raises:
        CheckpointError: the write failed ("no space left on <dir>" for a full disk); the partial folder is removed
            and the checkpoints written before are untouched.
    """
    root = run_dir / CHECKPOINTS_DIR
    name = f"step-{step:06d}"
    folder, partial = root / name, root / f"{PARTIAL_PREFIX}{name}.partial"
    previous = complete_checkpoints(run_dir)
    kept = f"the previous checkpoint {previous[-1].name} is kept" if previous else "there was no earlier checkpoint"
    try:
        with guarded_write(root, f"checkpoint {name}", kept):
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(f"{PARTIAL_PREFIX}step-*"):  # left by an interrupted write
                shutil.rmtree(stale, ignore_errors=True)
            partial.mkdir()
            _save_pretrained(model, weights_folder(model, partial), state_dict)
            if run_config is not None:
                (partial / RUN_CONFIG_FILE).write_text(json.dumps(run_config, indent=1, sort_keys=True))
            write_trainer_state(plain_values(trainer_state), partial / STATE_FILE)
            if folder.exists():  # the same step again (a resumed run that had passed it): swap
                old = root / f"{PARTIAL_PREFIX}{name}.old"
                folder.rename(old)
                partial.rename(folder)
                shutil.rmtree(old, ignore_errors=True)
            else:
                partial.rename(folder)
    except CheckpointError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    done = complete_checkpoints(run_dir)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders with a finished ``trainer_state.pt``, oldest first."""
    root = run_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def load_trainer_state(folder: Path) -> dict:
    """Read ``trainer_state.pt`` with ``weights_only=True`` (no code from the file runs).

    Raises:
        UnsafeCheckpoint: the file holds objects other than tensors and plain values (it names them).
        DamagedCheckpoint: the file cannot be read (truncated, empty, not a checkpoint).
    """
    path = folder / STATE_FILE
    try:
        with torch.serialization.safe_globals(NUMPY_STATE_GLOBALS):
            state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        refused = sorted(set(re.findall(r"GLOBAL ([\w.]+)", str(err))))
        if refused:
            raise UnsafeCheckpoint(
                f"{path} holds objects that would run code when loaded ({', '.join(refused)}), not only tensors and "
                "plain values; prefzoo never loads such a file. Resume only from run folders you made, or start a new "
                "run (trainer.resume=false in another folder).") from None
        raise DamagedCheckpoint(f"{path} cannot be read: not a trainer state ({_first_line(err)})") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise DamagedCheckpoint(f"{path} cannot be read (truncated or not written completely: {_first_line(err)})") \
            from None
    if not isinstance(state, dict) or "step" not in state:
        raise DamagedCheckpoint(f"{path}: not a trainer state (no step)")
    return state


def check_resumable(folder: Path, state: dict) -> None:
    """A resume reads every part of :data:`REQUIRED_STATE` from a trainer state: one without a part (written by
    something other than the loop, or edited) is damaged, so the previous checkpoint is used.

    Raises:
        DamagedCheckpoint: naming the file and the missing keys.
    """
    missing = [key for key in REQUIRED_STATE if key not in state]
    if missing:
        raise DamagedCheckpoint(f"{folder / STATE_FILE}: a trainer state without {', '.join(repr(k) for k in missing)} "
                                "(not one the loop wrote)")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0][:200] if text else "") or f"{type(err).__name__}: an empty or cut-off file"


def load_run_config(folder: Path) -> dict | None:
    """The run-defining settings stored with a checkpoint (None: a checkpoint of an earlier prefzoo, without them).

    Raises:
        DamagedCheckpoint: ``run_config.json`` is there but is not a JSON object.
    """
    path = folder / RUN_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DamagedCheckpoint(f"{path} cannot be read ({_first_line(err)})") from None
    if not isinstance(stored, dict):
        raise DamagedCheckpoint(f"{path}: not a JSON object")
    return stored
