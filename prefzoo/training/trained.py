"""A finished run's model read back: :func:`prefzoo.load_policy`'s policy, and a distillation teacher.

* :func:`trained_run_files` / :func:`saved_model_config`: a run folder's ``config.yaml`` and weights (``adapter/`` or
  ``model/``), refused in one line when something is missing;
* :func:`load_trained_model`: the run's base model rebuilt as the run built it, its adapter loaded, frozen;
* :func:`build_teacher`: ``algo.teacher`` (a run folder, an adapter folder over this run's base model, or a model path or
  id), loaded frozen and checked to share the student's vocabulary (:class:`~prefzoo.models.reference.Reference`).
"""

from __future__ import annotations

import json

import logging
from pathlib import Path

import torch
from omegaconf import OmegaConf

from prefzoo.config import Config, ModelConfig
from prefzoo.errors import ConfigError, ModelError, RunFolderError
from prefzoo.models.loading import load_base_model, load_causal_lm, load_tokenizer
from prefzoo.models.precision import resolve_model_dtype
from prefzoo.models.reference import Reference
from prefzoo.training.layout import ADAPTER_DIR, CONFIG_FILE, MODEL_DIR
from prefzoo.models.files import pickled_adapter

log = logging.getLogger(__name__)

__all__ = ["trained_run_files", "saved_model_config", "load_trained_model", "build_teacher"]


def trained_run_files(run_dir: str | Path, who: str = "prefzoo.load_policy") -> tuple[Path, Path]:
    """(config.yaml, weights folder) of a finished run, or a :class:`PrefzooError` naming the folder and the fix."""
    run_dir = Path(run_dir)
    fix = ("pass the folder a `prefzoo train` / prefzoo.train() run wrote (its summary.json sits beside adapter/ and "
           "config.yaml); a run that stopped early continues with trainer.resume=true hydra.run.dir=<folder>")
    if not run_dir.is_dir():
        raise RunFolderError(f"{who}: {run_dir} is not a folder; {fix}.")
    config = run_dir / CONFIG_FILE
    weights = next((run_dir / w for w in (ADAPTER_DIR, MODEL_DIR) if (run_dir / w).is_dir()), None)
    if weights is None:
        inside = sorted(p.name for p in run_dir.iterdir())[:8]
        raise RunFolderError(f"{who}: {run_dir} holds no adapter/ (the trained LoRA adapter) and no model/ "
                             f"(holds: {', '.join(inside) or 'nothing'}); {fix}.")
    remote = weights / "tinker_checkpoint.json"  # (prefzoo.tinker.backend.CHECKPOINT_FILE)
    if remote.is_file() and not any(weights.glob("*.safetensors")):
        path = json.loads(remote.read_text()).get("path")
        raise RunFolderError(f"{who}: {run_dir} trained on a Tinker server (backend=tinker): its weights are the "
                             f"server's state {path}, not in the folder; sample it with the tinker SDK "
                             "(ServiceClient.create_sampling_client) or continue the run there (trainer.resume=true).")
    if weights.name == ADAPTER_DIR and not (weights / "adapter_config.json").is_file():
        raise RunFolderError(f"{who}: {weights} holds no adapter_config.json (an incomplete adapter); {fix}.")
    unsafe = pickled_adapter(weights) if weights.name == ADAPTER_DIR else None
    if unsafe:
        raise RunFolderError(f"{who}: {weights}: {unsafe}")
    if not config.is_file():
        raise RunFolderError(f"{who}: {run_dir} holds no config.yaml (the run's resolved config, needed to "
                             f"rebuild the base model); {fix}.")
    return config, weights


def saved_model_config(run_dir: str | Path, who: str = "prefzoo.load_policy"):
    """(model settings, seed) of a run folder's ``config.yaml``: what rebuilds its base model (the tiny random model
    from the same seed and shape)."""
    run_dir = Path(run_dir)
    config, _ = trained_run_files(run_dir, who)
    try:
        saved = OmegaConf.load(config)
        model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved.model))
        seed = int(saved.trainer.seed)
    except Exception as err:  # a config.yaml of another tool or version
        raise ModelError(f"{who}: {config} cannot be read as a prefzoo run config: "
                         f"{'; '.join(line.strip() for line in str(err).splitlines() if line.strip())}") from None
    return model, seed


def load_trained_model(run_dir: str | Path, device="cpu", who: str = "prefzoo.load_policy"):
    """``(model, tokenizer, model settings)`` of a finished run: the base model rebuilt from its ``config.yaml`` with
    its LoRA adapter loaded by peft (a ``PeftModel``), or its fully fine-tuned ``model/``; in eval mode, every parameter
    frozen, on ``device``.

    Raises:
        RunFolderError: no ``adapter/`` (or ``model/``) or no ``config.yaml``.
        ModelError: the ``config.yaml`` cannot be read, or the base model cannot be loaded.
    """
    run_dir = Path(run_dir)
    _, weights = trained_run_files(run_dir, who)
    model_cfg, seed = saved_model_config(run_dir, who)
    device = torch.device(device)
    tokenizer = load_tokenizer(model_cfg.name)
    if weights.name == ADAPTER_DIR:
        base = load_base_model(model_cfg, seed, tokenizer, device)
        model = _load_adapter(base, weights, who)
    else:
        model = load_causal_lm(str(weights), dtype=model_cfg.dtype).to(device)
    return _frozen(model), tokenizer, model_cfg


def _load_adapter(base: torch.nn.Module, folder: Path, who: str):
    """peft's ``PeftModel.from_pretrained`` (frozen), its errors (an adapter of another base: a size mismatch) in one
    line."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(base, str(folder), is_trainable=False)
    except (RuntimeError, ValueError, KeyError, OSError) as err:
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ModelError(f"{who}: the adapter {folder} does not load on its base model ({first[:200]}); an adapter "
                         "loads on the model it was trained on (a run folder names its base in config.yaml).") from None


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def build_teacher(cfg: Config, spec: str, tokenizer, device: torch.device) -> Reference:
    """The frozen teacher ``spec`` names (``algo.teacher``), as a :class:`~prefzoo.models.reference.Reference`:

    * a prefzoo run folder (``config.yaml`` beside ``adapter/`` or ``model/``): its model as :func:`load_trained_model`
      rebuilds it, the adapter merged into its base weights (peft's ``merge_and_unload``: one plain model, no adapter
      hooks in its forward);
    * a LoRA adapter folder (``adapter_config.json``): over THIS run's base model (``model.*``), merged;
    * anything else: a model path or Hugging Face id (``model.dtype``), or a built-in name (``smollm2``; ``tiny``: the
      random model of this run's seed and shape).

    The teacher must share the student's vocabulary: a run folder's or a model's tokenizer must be the student's (an
    adapter folder and the built-in names use the student's), and its output layer must have at least as many rows as
    the tokenizer has tokens (a padded embedding: the policy then compares the two over the tokenizer's tokens).

    Raises:
        ConfigError: the vocabularies differ (the message gives both sizes).
        RunFolderError / ModelError: the folder or model cannot be read (one line, naming it).
    """
    who = f"algo.teacher={spec}"
    path = Path(spec).expanduser()
    run_like = path.is_dir() and any((path / name).exists() for name in (CONFIG_FILE, ADAPTER_DIR, MODEL_DIR))
    if run_like and not (path / "adapter_config.json").is_file():  # a run folder: its files, or a one-line refusal
        model, teacher_tok, model_cfg = load_trained_model(path, device, who)
        if teacher_tok.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"{who}: the teacher run's tokenizer ({model_cfg.name}, {len(teacher_tok)} tokens) is not "
                              f"the student's ({cfg.model.name}, {len(tokenizer)} tokens); distillation compares "
                              "next-token distributions over one vocabulary.")
        kind = "run"
    elif path.is_dir() and (path / "adapter_config.json").is_file():
        unsafe = pickled_adapter(path)
        if unsafe:
            raise RunFolderError(f"{who}: {unsafe}")
        model = _load_adapter(load_base_model(cfg.model, cfg.trainer.seed, tokenizer, device), path, who)
        kind = "adapter"
    else:
        name = str(path) if path.exists() else spec
        if name not in ("smollm2", "tiny"):  # (the built-in names use the student's tokenizer)
            try:
                teacher_tok = load_tokenizer(name)
            except ModelError as err:
                raise ConfigError(f"{who}: its tokenizer cannot be read ({err}), so its vocabulary cannot be checked "
                                  "against the student's; give a model folder with its tokenizer files.") from None
            if teacher_tok.get_vocab() != tokenizer.get_vocab():
                raise ConfigError(f"{who}: the teacher's tokenizer ({len(teacher_tok)} tokens) is not the student's "
                                  f"({cfg.model.name}, {len(tokenizer)} tokens); distillation compares next-token "
                                  "distributions over one vocabulary.")
        model = load_causal_lm(name, dtype=resolve_model_dtype(cfg.model, device)[0], tokenizer=tokenizer,
                               seed=cfg.trainer.seed,
                               tiny_kwargs={"hidden_size": cfg.model.tiny_hidden_size,
                                            "num_layers": cfg.model.tiny_layers}).to(device)
        kind = "model"
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model = _frozen(model)
    rows = model.get_output_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        raise ConfigError(f"{who}: the teacher's output layer covers {rows} tokens, the student's tokenizer has "
                          f"{len(tokenizer)}; the teacher must share the student's vocabulary.")
    log.info("teacher: %s (%s), %d parameters, frozen", spec, kind, sum(p.numel() for p in model.parameters()))
    return Reference(model, "copy")
