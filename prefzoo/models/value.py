"""The value model of PPO (and the reward model of ``algo=rm``): a scalar head on the backbone's hidden states.

What it computes. For a row ``[prompt | completion]`` with P prompt and C completion columns,

    values[b, t] = w . h[b, P - 1 + t] + c          t = 0 .. C-1

where ``h`` is the backbone's final (normed) hidden state, i.e. the hidden state at the position that
PREDICTS completion token t: the value of the state before token t, the same alignment as
:meth:`CausalLMPolicy.logps`. ``values[b, 0]`` is the value of the prompt alone; the value of the state
after the last token (the terminal state) is not part of the (B, C) output, and GAE does not need it
(it is 0 by definition, the episode has ended). The head is float32 whatever the backbone's dtype, and
values are exactly 0 where ``completion_mask`` is False.

Design: a separate LoRA adapter on the shared, frozen base weights (the default). With LoRA the base
weights are frozen anyway, so a second peft adapter (``"value"``) next to the policy's (``"default"``)
gives the value function parameters that are completely separate from the policy's -- as in Stiennon
et al. 2020, sec. 3.4 ("a Transformer with completely separate parameters from the policy ... prevents
updates to the value function from partially destroying the pretrained policy early in training"; also
Ouyang et al. 2022, who initialise the value function from the reward model) -- at the memory cost of
one adapter instead of a second copy of the model. The price is one more forward/backward pass of the
backbone per mini-batch (the policy's and the value's cannot share a pass, their adapters differ). The
value is computed with the value adapter switched on and the policy's off, so it never touches the
reference (which is the adapter-disabled base, or a frozen copy) and the reference never sees it.

Alternatives, selected with ``algo.value_adapter``:

* ``separate`` (default): as above. Without LoRA (full fine-tuning) "separate" means a trainable deep copy
  of the starting model, so the value still shares no parameter with the policy.
* ``shared``: the head sits on the policy's own adapter (or, without LoRA, the policy model itself): the
  value loss then also trains the policy's weights (the shared-trunk design of many PPO codebases). Cheap in
  memory, but the two losses interfere. It is what ``algo=rm`` uses: there the "policy" adapter IS the reward
  model's adapter and nothing samples from it.

Gradient checkpointing recomputes the forward during backward with whatever adapter is active THEN, so it
cannot be combined with the ``separate`` adapter (which is switched on only during its own forward):
:func:`build_value_model` refuses the combination.

The value head is initialised to zero (every value starts at 0; its gradient is not zero, so it learns at once);
``algo=rm`` draws its head from N(0, 1/(hidden + 1)) instead (``algo.head_init``).

Saving: :meth:`ValueModel.state_dict` holds only what the value model trains (the head and, in
``separate`` mode, its adapter), so the training loop's checkpoint stays small;
:meth:`ValueModel.save_pretrained` writes a self-contained folder (adapter in peft format, head, and how
to rebuild the base model) that :func:`load_value_model` reads back, e.g. as a reward model.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from prefzoo.types import SequenceBatch, ValueHeadSpec, position_ids_from_mask
from prefzoo.errors import ConfigError, ModelError
from prefzoo.models.packing import packed_states

VALUE_ADAPTER = "value"
VALUE_ADAPTERS = ("separate", "shared")
HEAD_INITS = ("zeros", "normal")
HEAD_FILE = "value_head.safetensors"
META_FILE = "value_model.json"


def _is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _decoder(model: nn.Module) -> nn.Module:
    """The transformer body (no LM head) of a causal LM, a peft-wrapped one included."""
    hf = model.get_base_model() if _is_peft(model) else model
    body = getattr(hf, "base_model", hf)
    if body is hf:
        raise ModelError(f"cannot find the transformer body of {type(hf).__name__} (no base_model): the value "
                         "head needs the final hidden states.")
    return body


@contextlib.contextmanager
def use_adapter(model: nn.Module, name: str | None, trainable=()):
    """Make peft adapter ``name`` the active one inside the block (None: leave the model as it is).

    peft switches ``requires_grad`` along with the active adapter (``set_adapter``, and also on leaving its
    ``disable_adapter`` context, which the reference uses: only the active adapter is left trainable). So the
    flags of every parameter are restored after each switch, and the parameters in ``trainable`` (the value
    adapter's own, unless frozen for inference) are made to require grad inside and after the block.
    """
    if name is None:
        yield
        return
    previous = model.active_adapter
    flags = [(p, p.requires_grad) for p in model.parameters()]

    def restore():
        for p, flag in flags:
            if p.requires_grad != flag:
                p.requires_grad_(flag)
        for p in trainable:
            p.requires_grad_(True)

    model.set_adapter(name)
    restore()
    try:
        yield
    finally:
        model.set_adapter(previous)
        restore()


class ValueModel(nn.Module):
    """Per-token values V(prompt, completion[:t]) from a scalar head on a causal LM's hidden states.

    Args:
        backbone: the causal LM whose hidden states feed the head (a peft model in LoRA modes).
        hidden_size: width of the final hidden state.
        adapter: the peft adapter to activate for the forward pass (``"value"`` in separate-adapter mode),
            or None to use the backbone as it is (shared mode, or a separate full copy).
        owns_backbone: True when the backbone is a private copy whose weights all belong to the value
            model (separate mode without LoRA); then they are registered (trained, checkpointed).
        meta: how to rebuild the base model (written by :meth:`save_pretrained`).
        head_init: ``zeros`` (every value starts at 0) or ``normal`` (weights ~ N(0, 1/(hidden_size + 1)), the
            reward-head initialisation of OpenAI's lm-human-preferences, per Huang et al. 2024, "The N+
            implementation details of RLHF with PPO"; a reward model then ranks pairs at chance, not all tied).
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, adapter: str | None = None, owns_backbone: bool = False,
                 meta: dict | None = None, head_init: str = "zeros"):
        super().__init__()
        self.head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        if head_init not in HEAD_INITS:
            raise ConfigError(f"head_init={head_init!r}; choose one of {', '.join(HEAD_INITS)}.")
        if head_init == "normal":
            nn.init.normal_(self.head.weight, std=1.0 / math.sqrt(hidden_size + 1))
        else:
            nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.adapter = adapter
        self.owns_backbone = owns_backbone
        self.meta = dict(meta or {})
        if owns_backbone:
            self.backbone = backbone
        else:  # not a submodule: its weights belong to the policy (or are frozen)
            self.__dict__["_backbone"] = backbone
        # the adapter's weights are registered here so that parameters() and state_dict() include them
        self.adapter_params = nn.ParameterList(
            [p for n, p in backbone.named_parameters() if adapter is not None and f".{adapter}." in n])
        self.trainable = True  # False after load_value_model: nothing is made to require grad
        self.padding_free = False  # the training setup sets it (model.fast.padding_free): one packed pass per batch
        self.share_prompts = True  # (packed passes) rows with one prompt share it
        self.head.to(next(backbone.parameters()).device)

    @property
    def model(self) -> nn.Module:
        return self.backbone if self.owns_backbone else self.__dict__["_backbone"]

    def forward(self, batch: SequenceBatch) -> Tensor:
        """Values of the states before each completion token.

        Args:
            batch: prompts (B, P) left-padded, completions (B, C) right-padded, with masks.
        Returns:
            Shape (B, C) float32, reward units, with grad; exactly 0 where ``completion_mask`` is False.
        """
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        mask = batch.attention_mask()
        p, c = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
        if p == 0:
            raise ModelError("the value model needs at least one prompt token per row (the state before the "
                             "first completion token).")
        with use_adapter(self.model, self.adapter, self.adapter_params if self.trainable else ()):
            body = _decoder(self.model)
            states = packed_states(body, batch, self.share_prompts) if self.padding_free else None
            if states is not None:  # one packed pass (prefzoo.models.packing): the counted positions only
                values = self.head(states.float()).squeeze(-1)
                full = torch.zeros(batch.completion_mask.shape, dtype=values.dtype, device=values.device)
                return full.masked_scatter(batch.completion_mask, values)
            out = body(input_ids=input_ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask),
                       use_cache=False)
        hidden = out.last_hidden_state[:, p - 1:p + c - 1]
        values = self.head(hidden.float()).squeeze(-1)
        return values.masked_fill(~batch.completion_mask, 0.0)

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, folder: str | Path, extra: dict | None = None) -> Path:
        """Write a self-contained copy: ``adapter/`` (peft format) or ``model/`` (full weights), the head and
        ``value_model.json`` (base model, dtype, adapter name, ``extra``). Returns ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}, str(folder / HEAD_FILE))
        model = self.model
        meta = dict(self.meta, hidden_size=self.head.in_features, **(extra or {}))
        if _is_peft(model):
            name = self.adapter or model.active_adapter
            model.save_pretrained(folder / "adapter", selected_adapters=[name])
            # peft writes the "default" adapter into the folder itself and any other into a sub-folder
            adapter_dir = Path("adapter") if name == "default" else Path("adapter") / name
            if not (folder / adapter_dir / "adapter_config.json").is_file():
                raise ModelError(f"peft did not write adapter {name!r} where expected ({folder / adapter_dir}).")
            meta.update(weights="adapter", adapter_dir=str(adapter_dir))
        else:
            model.save_pretrained(folder / "model")
            meta.update(weights="model", adapter_dir=None)
        (folder / META_FILE).write_text(json.dumps(meta, indent=2))
        return folder


def _plain(node) -> dict:
    """A config node (dataclass or DictConfig) as plain JSON-able data."""
    import dataclasses

    from omegaconf import OmegaConf

    if dataclasses.is_dataclass(node):
        return dataclasses.asdict(node)
    return OmegaConf.to_container(node, resolve=True)


def check_value_adapter(mode: str, gradient_checkpointing: bool) -> None:
    """The value head's adapter (``algo.value_adapter``) against the model settings; the pre-flight asks it before any
    model loads, :func:`build_value_model` again.

    Raises:
        ConfigError: ``mode`` not one of :data:`VALUE_ADAPTERS`; ``separate`` with gradient checkpointing (the
            recomputed forward would run through the policy's adapter, not the value's).
    """
    if mode not in VALUE_ADAPTERS:
        raise ConfigError(f"algo.value_adapter={mode!r}; choose one of {', '.join(VALUE_ADAPTERS)}.")
    if mode == "separate" and gradient_checkpointing:
        raise ConfigError("algo.value_adapter=separate cannot be combined with model.gradient_checkpointing=true "
                          "(the recomputed forward would use the policy's adapter); set algo.value_adapter=shared "
                          "or turn gradient checkpointing off.")


def build_value_model(cfg, spec: ValueHeadSpec, model: nn.Module, device: torch.device) -> ValueModel:
    """The value model for a run (see the module docstring for the design).

    Args:
        cfg: the run's config: ``cfg.model.lora`` (the value adapter uses the policy's LoRA settings, without modules_to_save),
            ``cfg.model.gradient_checkpointing``.
        model: the freshly wrapped trainable policy model (a ``PeftModel`` under LoRA), before any step.
        device: where the head goes (the backbone is already there).
        spec: what the plugin declared: ``adapter`` (``separate`` | ``shared``) and ``init`` (``zeros`` | ``normal``).

    Raises:
        ConfigError: unknown ``value_adapter`` or ``head_init``; ``separate`` with gradient checkpointing.
    """
    mode, head_init = spec.adapter, spec.init
    check_value_adapter(mode, cfg.model.gradient_checkpointing)
    m = cfg.model
    from prefzoo.models.precision import resolve_model_dtype

    meta = {"model": m.name, "dtype": resolve_model_dtype(m, device)[0], "quantization": m.quantization,
            "seed": cfg.trainer.seed,
            "tiny_hidden_size": m.tiny_hidden_size, "tiny_layers": m.tiny_layers, "value_adapter": mode,
            "data": _plain(cfg.data)}
    if meta["data"].get("path") and Path(meta["data"]["path"]).exists():  # usable from any working directory
        meta["data"]["path"] = str(Path(meta["data"]["path"]).resolve())
    hidden_size = model.config.hidden_size
    if mode == "shared":
        return ValueModel(model, hidden_size, adapter=None, meta=meta, head_init=head_init).to(device)
    if _is_peft(model):
        from prefzoo.models.lora import peft_lora_config

        lora_cfg = peft_lora_config(m.lora)
        lora_cfg.modules_to_save = None
        model.add_adapter(VALUE_ADAPTER, lora_cfg)
        for n, p in model.named_parameters():
            if f".{VALUE_ADAPTER}." in n:
                p.requires_grad_(True)
        return ValueModel(model, hidden_size, adapter=VALUE_ADAPTER, meta=meta, head_init=head_init).to(device)
    backbone = copy.deepcopy(model)
    for p in backbone.parameters():
        p.requires_grad_(True)
    return ValueModel(backbone, hidden_size, adapter=None, owns_backbone=True, meta=meta, head_init=head_init).to(device)


def load_value_model(folder: str | Path, device: torch.device | str = "cpu", fast: bool = False
                     ) -> tuple[ValueModel, object]:
    """Rebuild a value (or reward) model written by :meth:`ValueModel.save_pretrained`, for inference.

    ``fast``: for scoring many rows (a reward model scoring rollouts and evaluation samples): the LoRA adapter is
    merged into the base weights (W + s B A once, float32, instead of the adapter's two extra products in every
    layer) and rows are scored in one packed pass with the prompt of rows that share one run once
    (:mod:`prefzoo.models.packing`, where the model's attention can run packs). The values equal the plain
    pass's up to float32 rounding (measured on the issue-32 proxy: 2.1e-5 of rewards in [-8.3, 1.7]; tested in
    tests/algos/test_rm.py); 4-bit weights are not merged.

    Returns:
        (value_model in eval mode with every parameter frozen, its tokenizer).
    Raises:
        ModelError: the folder is not a saved value/reward model.
    """
    from prefzoo.models.loading import load_causal_lm, load_tokenizer

    folder = Path(folder)
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        raise ModelError(f"{folder} holds no {META_FILE}: not a value/reward model saved by prefzoo (train one with "
                         "algo=rm and pass its run folder's reward_model/ directory).")
    meta = json.loads(meta_path.read_text())
    tokenizer = load_tokenizer(meta["model"])
    device = torch.device(device)
    if meta["weights"] == "adapter":
        from peft import PeftModel

        quant = None
        if meta.get("quantization") == "4bit":
            from prefzoo.models.lora import bnb_4bit_config

            quant = bnb_4bit_config(getattr(torch, meta["dtype"]))
        base = load_causal_lm(meta["model"], dtype=meta["dtype"], seed=meta["seed"], tokenizer=tokenizer,
                              quantization_config=quant,
                              tiny_kwargs={"hidden_size": meta["tiny_hidden_size"], "num_layers": meta["tiny_layers"]},
                              device_map={"": device.index or 0} if quant is not None and device.type == "cuda" else None)
        if quant is None:
            base = base.to(device)
        model = PeftModel.from_pretrained(base, str(folder / meta["adapter_dir"]), is_trainable=False)
        if fast and quant is None:
            model = model.merge_and_unload()
    else:
        model = load_causal_lm(str(folder / "model"), dtype=meta["dtype"]).to(device)
    value = ValueModel(model, meta["hidden_size"], adapter=None, meta=meta)
    value.head.load_state_dict(load_file(str(folder / HEAD_FILE)))
    value.trainable = False
    value.to(device).eval()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    for p in value.parameters():
        p.requires_grad_(False)
    if fast:
        from prefzoo.models.packing import packing_mode, use_packed_attention

        use_packed_attention(value.model)
        value.padding_free = packing_mode(value.model) is not None
    return value, tokenizer
