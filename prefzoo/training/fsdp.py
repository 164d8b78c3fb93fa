"""Fully sharded data parallel training (FSDP2: torch's ``fully_shard``) for the training loop.

Under data parallelism (:mod:`prefzoo.training.distributed`) every process holds the whole model. With
``trainer.fsdp=true`` (or an accelerate config with ``distributed_type: FSDP`` and ``fsdp_version: 2``,
``accelerate/fsdp2.yaml``) each process keeps 1/N of every parameter, of its gradient and of its AdamW state
(torch's DTensor shards); a module's full parameters exist only while it computes (an all-gather before its
forward, a reduce-scatter of the gradients after its backward). What this module does for the loop:

* :func:`shard`: ``fully_shard`` on every decoder layer (the classes the Hugging Face model lists in
  ``_no_split_modules``) of each module that holds weights: the policy (LoRA adapter and frozen base alike: the base
  weights are sharded and stay frozen), a value model with a backbone of its own, a reference copy (full
  fine-tuning). What lies outside the layers (embeddings, final norm, output layer, a value head) stays whole on
  every process, its gradients averaged as under DDP (:func:`all_reduce_replicated_grads`; why: :func:`shard`).
* :func:`gathered`: a context in which every sharded module is whole on every process (one all-gather each, at the
  cost of one full copy of the weights per process) and stays whole through any number of forward passes. The loop
  samples rollouts, scores them (policy, reference, value passes without gradients) and evaluates inside it: those
  passes differ in number from process to process (a process's rows finish decoding at their own time), which the
  per-forward all-gathers of a sharded pass could not allow. Gradient-carrying passes run sharded, the same number
  on every process (:func:`prefzoo.training.step.accumulate_gradients` pads with zero-weight passes).
* :func:`full_model_state` and :func:`full_optimizer_state` / :func:`load_optimizer_state`: checkpoints are
  GATHERED (torch.distributed.checkpoint's ``full_state_dict``, offloaded to the CPU): the adapter in the standard
  peft folder, the optimizer state in the layout of ``torch.optim.Optimizer.state_dict`` of one process. A checkpoint
  therefore loads on any number of processes, sharded or not (and an unsharded run's checkpoint loads here).

Source: Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel" (the algorithm);
torch.distributed.fsdp.fully_shard (FSDP2, per-parameter DTensor sharding). Departures: no parameter offload, no
mixed-precision policy (``model.dtype`` chooses the precision), no FSDP activation checkpointing (use
``model.gradient_checkpointing``), and the rollout does not run on the shards (see :func:`gathered`): the layout of
verl's and NeMo-RL's FSDP trainers, which gather the weights for their rollout engine.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def _fsdp():
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return FSDPModule, fully_shard


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The submodules of ``module`` whose class a Hugging Face model inside it names in ``_no_split_modules`` (the
    decoder layers: ``LlamaDecoderLayer`` for SmolLM2), in module order; [] when there is none."""
    names: set[str] = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in module.modules() if type(m).__name__ in names]


def shard(modules: list[nn.Module], reshard_after_forward: bool = True) -> None:
    """``fully_shard`` every decoder layer of each module, in place, over the default process group: each process
    keeps its shard of every layer parameter (they become DTensors, so optimizers must be built afterwards). Each
    layer is its own FSDP unit; everything outside the layers (embeddings, final norm, output layer, a value head)
    stays whole on every process and trains as under DDP (:func:`all_reduce_replicated_grads`).

    Why not one more unit around the whole model, as FSDP trainers usually do: prefzoo's log-prob and value passes
    call the model's body and read the output layer's weight directly (``model.fast.fused_logps``, the value model on
    the policy's backbone), which the forward hooks of an outer unit would not see; and the output layer is tied to
    the embeddings (SmolLM2), which FSDP requires in one unit. For SmolLM2-135M the layers hold 106M of the 135M
    weights (the embeddings 28M); for a 7B model with an untied head about 93%.

    Ends with one :func:`gathered` block, outside any inference mode, on every process: FSDP2 allocates each unit's
    unsharded parameters at its first all-gather, and this makes sure that is not under ``torch.inference_mode`` (the
    reference pass), whose tensors cannot take part in a backward (a precaution)."""
    FSDPModule, fully_shard = _fsdp()
    for module in modules:
        for layer in decoder_layers(module):
            if not isinstance(layer, FSDPModule):
                fully_shard(layer, reshard_after_forward=reshard_after_forward)
    with torch.no_grad(), gathered(modules, reshard_after_forward):
        pass


def sharded_modules(roots: list[nn.Module]) -> list[nn.Module]:
    """Every FSDP module in ``roots`` (each once, in module order)."""
    FSDPModule, _ = _fsdp()
    seen, out = set(), []
    for root in roots:
        for m in root.modules():
            if isinstance(m, FSDPModule) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


@contextlib.contextmanager
def gathered(roots: list[nn.Module], reshard_after_forward: bool = True):
    """Within the block every FSDP unit of ``roots`` (the modules :func:`shard` was given) holds its whole
    parameters (all-gathered once, on entry, by every process: call it on all of them) and keeps them through its
    forward passes, which then communicate nothing: each process may run a different number of them. On exit the
    parameters are sharded again and the units reshard after their forwards again if ``reshard_after_forward``.
    Only for passes without gradients, with no backward in flight: a backward inside would reduce-scatter, which
    the other processes do not join.

    Measured on 2 processes (tiny model): rollouts whose forwards differ in number between the processes (three
    extra forwards on one of them) train to the same adapter; but an evaluation run by ONE process inside the block
    left the next backward's collectives out of step (a hang, FSDP2's per-unit state, torch 2.13), so the loop
    evaluates on every process (:meth:`prefzoo.training.loop.Trainer.evaluate_everywhere`)."""
    modules = sharded_modules(roots)
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.set_reshard_after_forward(reshard_after_forward, recurse=False)
            m.reshard()


def is_sharded(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def all_reduce_replicated_grads(params: list[nn.Parameter], world_size: int) -> None:
    """Average the gradients of the parameters FSDP does not shard (outside the decoder layers: a value head, the
    embeddings under full fine-tuning) over the processes, as DDP does (the losses are scaled by the number of
    processes, so the mean over them is the global batch's gradient; FSDP2 averages its own shards alike). One
    flattened all-reduce; a parameter without a gradient on this process counts as zeros. Every process calls it."""
    import torch.distributed as dist

    plain = [p for p in params if not is_sharded(p)]
    if not plain:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in plain])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for p in plain:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
        offset += n


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` over sharded (DTensor) and replicated gradients together: the global L2
    norm (the shards' squared norms summed over processes, plus the replicated ones once), every gradient scaled by
    min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping, the same on every process."""
    import torch.distributed as dist

    sharded = torch.zeros((), dtype=torch.float64)
    plain = torch.zeros((), dtype=torch.float64)
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        if is_sharded(g):
            sharded += g.to_local().double().pow(2).sum()
        else:
            plain += g.double().pow(2).sum()
    dist.all_reduce(sharded)
    norm = float((sharded + plain).sqrt())
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return norm


def full_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's whole state dict (every parameter and buffer, gathered, on the CPU) on process 0; {} on the
    others. Every process must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(root: nn.Module, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> dict:
    """``optimizer``'s state gathered, in the layout of one process's ``optimizer.state_dict()`` (state keyed by the
    position of each parameter in ``params``, the order the optimizer was built with), on process 0 ({} on the
    others). ``root``: a module holding every parameter in ``params``. Every process must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(root, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not full:
        return {}
    names = parameter_names(root, params)
    index = {name: i for i, name in enumerate(names)}
    groups = []
    for group in full["param_groups"]:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [index[name] for name in group["params"]]})
    return {"state": {index[name]: value for name, value in full["state"].items()}, "param_groups": groups}


def load_optimizer_state(root: nn.Module, optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                         state: dict) -> None:
    """Load a state saved as one process's ``optimizer.state_dict()`` (by :func:`full_optimizer_state` or by an
    unsharded run) into the sharded ``optimizer``: every process loads the whole state and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = parameter_names(root, params)
    full = {"state": {names[int(i)]: value for i, value in state["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[int(i)] for i in g["params"]]}
                             for g in state["param_groups"]]}
    set_optimizer_state_dict(root, optimizer, full, options=StateDictOptions(full_state_dict=True))


def parameter_names(root: nn.Module, params: list[nn.Parameter]) -> list[str]:
    """The name under ``root`` of each parameter in ``params`` (the names torch.distributed.checkpoint uses)."""
    by_id = {id(p): name for name, p in root.named_parameters()}
    return [by_id[id(p)] for p in params]
