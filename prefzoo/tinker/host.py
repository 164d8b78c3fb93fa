"""The models a Tinker server trains and samples: one base model, one peft LoRA adapter per training model.

A :class:`ModelHost` loads the base model once (``smollm2``, ``tiny``, a folder or a hub id, resolved as a run resolves
``model.name``) and wraps it in one ``peft.PeftModel`` that holds every client's adapter under its own name; work on a
model activates its adapter (``set_adapter``), so two clients' models share the frozen weights and never each other's
LoRA weights, gradients or optimizer. Every method runs on the server's single worker thread, one request at a time.

* ``create``: a LoRA adapter of the client's rank on the attention / MLP / output layers it asks for
  (:func:`prefzoo.models.lora.peft_lora_config` with prefzoo's ``model.lora`` defaults otherwise: alpha 32, no
  dropout), initialised under ``torch.manual_seed(seed)`` (peft's init: A Kaiming-uniform, B = 0), and its AdamW.
* ``forward_backward``: each datum's per-position log-probs of its ``target_tokens`` (float32), the loss
  (:mod:`prefzoo.tinker.losses`), summed, and its gradient ADDED to the adapter's ``.grad``: gradients accumulate over
  calls until ``optim_step``, as the SDK expects.
* ``optim_step``: ``torch.optim.AdamW`` with the request's AdamParams (learning rate, betas, eps, decoupled weight
  decay; ``grad_clip_norm`` > 0 clips the global norm first), then the gradients are zeroed.
* ``save`` / ``load``: the adapter as peft writes it (``adapter_config.json`` + ``adapter_model.safetensors``, loadable
  with ``PeftModel.from_pretrained``), and with the optimizer, ``optimizer.pt`` (AdamW's state) beside it.
* ``sample_many``: several requests' prompts in one batch of prefzoo's hf rollout engine
  (:func:`prefzoo.rollout.generate.sample_completions`) on a snapshot of an adapter (or the base model), loaded into a
  sampler adapter of the same shape.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from prefzoo.errors import PrefzooError
from prefzoo.objective import token_logps

__all__ = ["ModelHost", "TrainingModel", "LoraShape", "HostError", "SampleResult"]


class HostError(PrefzooError):
    """A request the models cannot serve: an unknown model or checkpoint, a bad shape, a full server."""


@dataclass(frozen=True)
class LoraShape:
    """What an adapter is: its rank and which layer groups carry it (the SDK's ``LoraConfig``)."""

    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass
class TrainingModel:
    """One client's model: its adapter's name in the PeftModel, its shape, optimizer and counters."""

    model_id: str
    adapter: str
    shape: LoraShape
    seed: int | None
    optimizer: torch.optim.Optimizer
    params: list[tuple[str, nn.Parameter]]
    steps: int = 0
    pending_grads: int = 0
    created: float = field(default_factory=time.time)


@dataclass
class SampleResult:
    """One prompt's samples: per sequence its tokens, their log-probs and why it stopped; prompt log-probs if asked."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    stop_reasons: list[str]
    prompt_logprobs: list[float] | None


def _linear_groups(model: nn.Module) -> dict[str, set[str]]:
    """The base model's linear layers by group, as peft target names (the last name component): ``attn`` (names
    under an attention block), ``unembed`` (the output layer), ``mlp`` (the rest)."""
    out_layer = model.get_output_embeddings()
    groups: dict[str, set[str]] = {"attn": set(), "mlp": set(), "unembed": set()}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if module is out_layer:
            groups["unembed"].add(leaf)
        elif "attn" in name or "attention" in name:
            groups["attn"].add(leaf)
        else:
            groups["mlp"].add(leaf)
    return groups


class ModelHost:
    """The base model and every client's adapter (see the module docstring).

    Args:
        name: the served model's name as clients give it (``base_model``); also accepted: ``aliases``.
        folder: where the model and tokenizer lie (what ``get_tokenizer`` loads: the SDK's ``tokenizer_id``).
        model: the base causal LM (frozen); tokenizer: its tokenizer.
        max_models: how many training models may live at once (more is refused in one line).
    """

    def __init__(self, name: str, folder: str, model: nn.Module, tokenizer, *, aliases: tuple[str, ...] = (),
                 max_models: int = 4, seed: int = 0):
        self.name = name
        self.folder = folder
        self.aliases = set(aliases) | {name, folder}
        self.tokenizer = tokenizer
        self.base = model.eval()
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.groups = _linear_groups(self.base)
        self.peft = None  # the PeftModel, built with the first adapter
        self.models: dict[str, TrainingModel] = {}
        self.max_models = max_models
        self._counter = 0
        self._sampler_slots: dict[tuple, str] = {}  # adapter shape -> sampler adapter name
        self._slot_loaded: dict[str, object] = {}  # sampler adapter -> the snapshot it holds now
        self.generator = torch.Generator().manual_seed(seed)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = [eos] if eos is not None else []
        #: the longest sequence the model takes (its position table): longer data and prompts are refused
        self.max_length = getattr(model.config, "max_position_embeddings", None) or 2048

    # --- adapters -------------------------------------------------------------------------------------------------

    def _peft_config(self, shape: LoraShape):
        from prefzoo.config.schema import LoraConfig
        from prefzoo.models.lora import peft_lora_config

        targets = sorted(set().union(*(self.groups[g] for g, on in (("attn", shape.train_attn),
                                                                      ("mlp", shape.train_mlp),
                                                                      ("unembed", shape.train_unembed)) if on)))
        if not targets:
            raise HostError("the LoRA config trains no layer: set one of train_attn, train_mlp, train_unembed.")
        return peft_lora_config(LoraConfig(r=shape.rank, target_modules=targets))

    def _add_adapter(self, adapter: str, shape: LoraShape, seed: int | None) -> None:
        from peft import get_peft_model

        import warnings

        config = self._peft_config(shape)
        # peft warns when a tied output layer carries LoRA: the adapter changes the output layer's product only (the
        # input embedding is untouched, frozen and still tied), and this server never merges adapters into the weights
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*", category=UserWarning)
            if seed is not None:
                torch.manual_seed(seed)
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=adapter)
            else:
                self.peft.add_adapter(adapter, config)

    def _activate(self, adapter: str) -> nn.Module:
        self.peft.set_adapter(adapter)
        return self.peft

    def _adapter_params(self, adapter: str) -> list[tuple[str, nn.Parameter]]:
        marker = f".{adapter}."
        return [(n, p) for n, p in self.peft.named_parameters() if marker in n + "."]

    def resolve(self, base_model: str) -> None:
        """HostError unless ``base_model`` names the served model."""
        if base_model not in self.aliases:
            raise HostError(f"base_model {base_model!r} is not served here; this server serves {self.name!r} "
                            "(get_server_capabilities lists it).")

    def create(self, model_id: str, base_model: str, shape: LoraShape, seed: int | None) -> TrainingModel:
        """A new training model: its adapter (seeded), its AdamW; HostError for another base model, a rank < 1, or a
        full server."""
        self.resolve(base_model)
        if shape.rank < 1:
            raise HostError(f"LoRA rank {shape.rank}: must be >= 1.")
        if len(self.models) >= self.max_models:
            raise HostError(f"this server holds {self.max_models} training models already (--max-models); close a "
                            "client (or let its session expire) first.")
        adapter = f"m{self._counter}"
        self._counter += 1
        self._add_adapter(adapter, shape, seed)
        params = self._adapter_params(adapter)
        optimizer = torch.optim.AdamW([p for _, p in params], lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        model = TrainingModel(model_id, adapter, shape, seed, optimizer, params)
        self.models[model_id] = model
        return model

    def get(self, model_id: str) -> TrainingModel:
        if model_id not in self.models:
            raise HostError(f"unknown model {model_id!r} (never created here, or freed when its session ended or "
                            "expired); create a training client.")
        return self.models[model_id]

    def free(self, model_id: str) -> None:
        """Drop a training model: its adapter, gradients and optimizer state."""
        model = self.models.pop(model_id, None)
        if model is None:
            return
        for _, p in model.params:
            p.grad = None
        model.optimizer.state.clear()
        if self.models:
            self.peft.delete_adapter(model.adapter)
        else:  # the last one: take every LoRA layer out (the sampler slots too): the base model as it was loaded
            self.base = self.peft.unload()
            self.peft = None
            self._sampler_slots.clear()
            self._slot_loaded.clear()

    # --- training ---------------------------------------------------------------------------------------------------

    def _datum_logps(self, module: nn.Module, tokens: list[int], targets: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long)
        logits = module(input_ids=ids, use_cache=False).logits
        return token_logps(logits, targets[None].long())

    def forward_backward(self, model_id: str, data: list[tuple[list[int], dict[str, torch.Tensor]]], loss_fn: str,
                         config: dict[str, float], forward_only: bool) -> tuple[list[torch.Tensor], dict[str, float]]:
        """Per datum the log-probs of its targets (Shape (N,) float32), and ``loss:sum``; unless ``forward_only``
        each datum's loss gradient is added to the adapter's gradients."""
        from prefzoo.tinker.losses import LOSSES, check_inputs

        model = self.get(model_id)
        vocab = self.base.get_input_embeddings().num_embeddings
        for i, (tokens, inputs) in enumerate(data):
            if not tokens:
                raise HostError(f"datum {i}: model_input has no tokens.")
            if len(tokens) > self.max_length:
                raise HostError(f"datum {i}: {len(tokens)} tokens; the model takes at most {self.max_length}.")
            check_inputs(loss_fn, i, len(tokens), inputs)
            for what, ids in (("model_input", torch.tensor(tokens)), ("target_tokens", inputs["target_tokens"])):
                if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                    raise HostError(f"datum {i}: {what} has a token id outside [0, {vocab}) (the vocabulary).")
        module = self._activate(model.adapter)
        spec = LOSSES[loss_fn]
        outputs, total = [], 0.0
        for tokens, inputs in data:
            with torch.set_grad_enabled(not forward_only):
                logps = self._datum_logps(module, tokens, inputs["target_tokens"])
                loss = spec.fn(logps, inputs, config).sum()
            if not forward_only:
                loss.backward()
            total += float(loss.detach())
            outputs.append(logps.detach()[0].float())
        if not forward_only:
            model.pending_grads += len(data)
        return outputs, {"loss:sum": total}

    def optim_step(self, model_id: str, learning_rate: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, grad_clip_norm: float) -> dict[str, float]:
        """One AdamW step on the accumulated gradients, then zero them."""
        model = self.get(model_id)
        for name, value, ok in (("learning_rate", learning_rate, learning_rate >= 0), ("eps", eps, eps >= 0),
                                ("beta1", beta1, 0 <= beta1 < 1), ("beta2", beta2, 0 <= beta2 < 1),
                                ("weight_decay", weight_decay, weight_decay >= 0)):
            if not ok or not math.isfinite(value):
                raise HostError(f"AdamParams {name} = {value}: out of range (learning_rate, eps, weight_decay >= 0; "
                                "betas in [0, 1)).")
        params = [p for _, p in model.params]
        metrics = {}
        if grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip_norm)
            metrics["grad_norm:mean"] = float(norm)
        for group in model.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        model.optimizer.step()
        model.optimizer.zero_grad(set_to_none=True)
        model.steps += 1
        model.pending_grads = 0
        return metrics

    # --- weights on disk --------------------------------------------------------------------------------------------

    def adapter_state(self, model_id: str) -> dict[str, torch.Tensor]:
        """The adapter's weights as peft saves them (keys without the adapter name), cloned."""
        from peft import get_peft_model_state_dict

        model = self.get(model_id)
        # only the LoRA weights: a tied output layer in the targets must not pull the whole embedding into the file
        state = get_peft_model_state_dict(self.peft, adapter_name=model.adapter, save_embedding_layers=False)
        return {k: v.detach().clone() for k, v in state.items()}

    def save(self, model_id: str, folder: Path, optimizer: bool) -> None:
        """The adapter (peft's files) and, with ``optimizer``, AdamW's state and the step count, into ``folder``."""
        from safetensors.torch import save_file

        model = self.get(model_id)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(self.adapter_state(model_id), str(folder / "adapter_model.safetensors"))
        config = self.peft.peft_config[model.adapter]
        config.base_model_name_or_path = self.folder
        config.save_pretrained(str(folder))
        meta = {"base_model": self.name, "rank": model.shape.rank, "train_attn": model.shape.train_attn,
                "train_mlp": model.shape.train_mlp, "train_unembed": model.shape.train_unembed, "steps": model.steps}
        if optimizer:
            torch.save(model.optimizer.state_dict(), folder / "optimizer.pt")
        (folder / "tinker.json").write_text(json.dumps(meta, indent=1))

    @staticmethod
    def read_shape(folder: Path) -> LoraShape:
        """The adapter shape a checkpoint folder holds; HostError when it is not one."""
        meta_file = folder / "tinker.json"
        if not meta_file.is_file() or not (folder / "adapter_model.safetensors").is_file():
            raise HostError(f"no checkpoint at {folder} (no adapter_model.safetensors / tinker.json).")
        meta = json.loads(meta_file.read_text())
        return LoraShape(meta["rank"], meta["train_attn"], meta["train_mlp"], meta["train_unembed"])

    def load(self, model_id: str, folder: Path, optimizer: bool) -> None:
        """Load a checkpoint's adapter (and, with ``optimizer``, AdamW's state) into the model; HostError when its shape
        differs or it has no optimizer state."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        model = self.get(model_id)
        shape = self.read_shape(folder)
        if shape != model.shape:
            raise HostError(f"checkpoint {folder.name} is a LoRA of shape {shape}; the model's is {model.shape}.")
        if optimizer and not (folder / "optimizer.pt").is_file():
            raise HostError(f"checkpoint {folder.name} has no optimizer state (saved for the sampler, or without it); "
                            "load it without the optimizer.")
        state = load_file(str(folder / "adapter_model.safetensors"))
        set_peft_model_state_dict(self.peft, state, adapter_name=model.adapter)
        for _, p in model.params:
            p.grad = None
        if optimizer:
            model.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
        else:
            model.optimizer.state.clear()
        model.pending_grads = 0

    # --- sampling ---------------------------------------------------------------------------------------------------

    def _sampler_module(self, shape: LoraShape | None, snapshot: dict[str, torch.Tensor] | None) -> nn.Module:
        """The module to sample from: the base model (no snapshot), or a sampler adapter of ``shape`` holding
        ``snapshot``."""
        from peft import set_peft_model_state_dict

        if snapshot is None:
            return None
        slot = self._sampler_slots.get(shape)
        if slot is None:
            slot = f"s{len(self._sampler_slots)}"
            self._add_adapter(slot, shape, seed=0)
            self._sampler_slots[shape] = slot
            for _, p in self._adapter_params(slot):
                p.requires_grad_(False)
        if self._slot_loaded.get(slot) is not snapshot:
            set_peft_model_state_dict(self.peft, snapshot, adapter_name=slot)
            self._slot_loaded[slot] = snapshot
        return self._activate(slot)

    def check_sample(self, prompt: list[int], num_samples: int, max_tokens: int) -> None:
        """Refuse a sampling request the model cannot take (run when it arrives, before it joins a batch).

        Raises:
            HostError: an empty prompt, a token id outside the vocabulary, prompt + max_tokens longer than the model's
                positions, num_samples or max_tokens < 1.
        """
        if not prompt:
            raise HostError("the prompt has no tokens.")
        vocab = self.base.get_input_embeddings().num_embeddings
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise HostError(f"the prompt has a token id outside [0, {vocab}) (the vocabulary).")
        if len(prompt) + max_tokens > self.max_length:
            raise HostError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) > {self.max_length}, the "
                            "longest sequence the model takes.")
        if num_samples < 1 or max_tokens < 1:
            raise HostError(f"num_samples {num_samples}, max_tokens {max_tokens}: both must be >= 1.")

    def sample_many(self, shape: LoraShape | None, snapshot: dict[str, torch.Tensor] | None,
                    prompts: list[list[int]], num_samples: int, max_tokens: int, temperature: float, top_p: float,
                    top_k: int, stop: list[int] | list[str] | None, seeds: list[int | None],
                    prompt_logprobs: bool) -> list[SampleResult]:
        """Several requests' prompts sampled as ONE batch of the hf engine (left-padded; each distinct prompt is
        prefilled once and its cache repeated for its ``num_samples`` rows): what a client sending one request per
        prompt, as the cookbook does, costs once instead of once per prompt.

        Every prompt has the same settings (the server batches only such requests). ``seeds``: one per prompt, all
        ints or all None. A seeded prompt draws the uniforms :func:`prefzoo.rollout.generate.prompt_uniforms` gives its
        seed, whatever else is in the batch (the same tokens alone or batched, up to the padding's float rounding of
        the logits); unseeded prompts draw from the server's generator stream. Prompts are checked by
        :meth:`check_sample` first.
        """
        from prefzoo.data.preference import pad_rows
        from prefzoo.rollout.generate import prompt_uniforms, sample_completions
        from prefzoo.types import PromptBatch, SamplingParams

        module = self._sampler_module(shape, snapshot)
        stop_strings = [s for s in stop if isinstance(s, str)] if isinstance(stop, list) else []
        eos = self.eos_ids if stop is None or stop_strings else [int(t) for t in stop]
        params = SamplingParams(temperature=max(temperature, 1e-6), top_p=top_p, top_k=max(top_k, 0),
                                max_new_tokens=max_tokens, greedy=temperature <= 0)
        uniforms = None  # a seeded request draws what prefzoo's hf engine draws for a prompt with that rollout seed
        if seeds[0] is not None and not params.greedy:
            uniforms = prompt_uniforms([int(s) for s in seeds], num_samples, max_tokens)
        pad = self.tokenizer.pad_token_id or 0
        ids, mask = pad_rows(prompts, "left", pad)
        batch = PromptBatch(prompt_ids=ids, prompt_mask=mask)
        with torch.no_grad(), self._adapter_context(module) as m:
            seqs, logps = sample_completions(m, batch, num_samples, params, eos_token_ids=eos or [-1],
                                             pad_id=pad, generator=self.generator, uniforms=uniforms,
                                             kv_cache="dynamic")
            prompt_lps = [None] * len(prompts)
            if prompt_logprobs:  # one pass over the prompts, padded on the RIGHT: causal attention, so a prompt's
                # positions see none of its padding and keep their positions 0..n-1 (left padding would shift them)
                right, right_mask = pad_rows(prompts, "right", pad)
                logits = m(input_ids=right, attention_mask=right_mask, use_cache=False).logits
                lps = token_logps(logits[:, :-1], right[:, 1:])
                for i, prompt in enumerate(prompts):
                    prompt_lps[i] = [math.nan] + lps[i, :len(prompt) - 1].tolist()
        out = []
        for i in range(len(prompts)):
            tokens, logprobs, reasons = [], [], []
            for row in range(i * num_samples, (i + 1) * num_samples):
                n = int(seqs.completion_mask[row].sum())
                toks = seqs.completion_ids[row, :n].tolist()
                lps = logps[row, :n].tolist()
                reason = "length" if bool(seqs.truncated[row]) else "stop"
                if stop_strings:
                    cut = self._stop_string_cut(toks, stop_strings)
                    if cut is not None:
                        toks, lps, reason = toks[:cut], lps[:cut], "stop"
                tokens.append(toks)
                logprobs.append(lps)
                reasons.append(reason)
            out.append(SampleResult(tokens, logprobs, reasons, prompt_lps[i]))
        return out

    def _adapter_context(self, module):
        """The base model with every adapter off (``module`` None), or ``module`` as is."""
        import contextlib

        if module is not None:
            return contextlib.nullcontext(module)
        if self.peft is None:
            return contextlib.nullcontext(self.base)

        @contextlib.contextmanager
        def base_only():
            with self.peft.disable_adapter():
                yield self.peft

        return base_only()

    def _stop_string_cut(self, tokens: list[int], stops: list[str]) -> int | None:
        """The number of tokens up to and including the one that completes the first stop string, or None."""
        for i in range(1, len(tokens) + 1):
            text = self.tokenizer.decode(tokens[:i])
            if any(s in text for s in stops):
                return i
        return None
