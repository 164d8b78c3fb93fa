"""A merged-weights copy of a LoRA policy for sampling: every adapted linear layer is one plain matmul again.

During a rollout each decode step runs every linear layer on a handful of rows. With peft's unmerged LoRA that
is three matmuls, a multiply, an add and the Python of the wrapper per layer (210 layers on SmolLM2-135M, for
a few microseconds of useful work each); with the adapter merged, ``W' = W + s B A``, it is one matmul.

Merging in place (``merge_adapter`` / ``unmerge_adapter``) would make the base weights drift by rounding
(``(W + D) - D != W`` in floating point), and the base weights ARE the reference policy when pi_ref is the
adapter-disabled model. So the merge goes into a separate copy: :class:`MergedCopy` builds, once, a module tree
that shares every tensor of the policy (embeddings, norms, output layer: no extra memory) except the adapted
linear layers, which become plain ``nn.Linear`` with their own merged weight (``W + s B A``, computed from the
untouched ``W`` each time, so nothing accumulates). It is refreshed lazily: only when an adapter weight changed
(an optimizer step, a checkpoint load) since the last merge, which :meth:`MergedCopy.module` checks by the
tensors' version counters. Extra memory: one copy of the adapted weights (about 425 MB for SmolLM2-135M fp32).

A copy in another dtype (``dtype``, ``rollout.dtype``): the sampler in bfloat16 while the trainer computes in float32, as a
vLLM engine in bf16 beside a float32 trainer. Then nothing is shared: every floating parameter of the copy is converted
once (the embedding and its tied output layer, the norms; the rotary frequencies, buffers, stay as they are), the merged
weights are computed in the source's precision and rounded once (``round(W + s B A)``), and a trainable tensor outside
the adapter (``modules_to_save``) is copied again whenever it changed. Extra memory: the whole model in ``dtype`` (about
270 MB for SmolLM2-135M in bf16). The sampler is then not the trainer: its log-probs differ by the rounding, which
``rollout.log_mismatch`` measures and ``rollout.correction.*`` corrects (docs/off-policy.md).

Tested in ``tests/perf/test_merged.py``: the copy's logits equal the LoRA model's (float tolerance), the base
weights are bit-identical before and after, and the copy follows an optimizer step; in bf16, the copy's weights are the
float32 merge rounded once, and it follows an optimizer step too.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["MergedCopy", "can_merge"]


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    return [(n, m) for n, m in model.named_modules() if isinstance(m, PeftLoraLinear)]


def can_merge(model: nn.Module) -> bool:
    """True for a peft LoRA model whose adapted layers are plain float linear layers with vanilla adapters."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return False
    layers = _lora_layers(model)
    for _, m in layers:
        if type(m.base_layer) is not nn.Linear or getattr(m, "lora_variant", {}) or m.merged:
            return False
        if not m.base_layer.weight.is_floating_point():
            return False
    return bool(layers)


class MergedCopy:
    """A plain causal LM with the policy's active LoRA adapter merged in, sharing all other tensors.

    Args:
        model: the peft LoRA model (``can_merge(model)`` must hold).
        dtype: the copy's floating dtype (e.g. ``torch.bfloat16``); None: the source's own, sharing every tensor
            outside the adapted layers.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None):
        self.source = model
        self.dtype = dtype
        self._copy: nn.Module | None = None
        self._targets: list[tuple[nn.Module, nn.Linear]] = []  # (peft layer, its merged nn.Linear in the copy)
        self._converted: list[tuple[torch.Tensor, torch.Tensor]] = []  # (trainable source tensor, its copy in dtype)
        self._stamp: tuple | None = None
        self.merges = 0  # how many times the weights were (re)merged (for tests and benchmarks)

    def _build(self) -> None:
        hf = self.source.get_base_model()
        originals = dict(_lora_layers(hf))
        tensors = list(hf.parameters()) + list(hf.buffers())
        memo = {id(t): t for t in tensors}  # deepcopy re-uses these: the copy shares every tensor
        if self.dtype is not None:  # ... except the floating parameters, converted (the adapted layers' are replaced)
            replaced = {id(t) for layer in originals.values() for t in layer.parameters()}
            for p in hf.parameters():
                if id(p) not in replaced and p.is_floating_point() and p.dtype != self.dtype:
                    memo[id(p)] = nn.Parameter(p.detach().to(self.dtype), requires_grad=False)
                    if p.requires_grad:
                        self._converted.append((p, memo[id(p)]))
        clone = copy.deepcopy(hf, memo)
        targets = []
        for name, _ in _lora_layers(clone):
            parent_name, _, child = name.rpartition(".")
            parent = clone.get_submodule(parent_name) if parent_name else clone
            base = originals[name].base_layer
            linear = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
            linear.weight = nn.Parameter(torch.empty_like(base.weight, dtype=self.dtype or base.weight.dtype),
                                         requires_grad=False)
            if base.bias is not None:
                linear.bias = (base.bias if self.dtype in (None, base.bias.dtype)
                               else nn.Parameter(base.bias.detach().to(self.dtype), requires_grad=False))
            setattr(parent, child, linear)
            targets.append((originals[name], linear))
        for p in clone.parameters():
            p.requires_grad_(False)
        clone.eval()
        self._copy, self._targets = clone, targets

    def _current_stamp(self) -> tuple:
        stamp = []
        for layer, _ in self._targets:
            for name in layer.active_adapters:
                if name in layer.lora_A:
                    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
                    stamp.append((name, id(a), a._version, id(b), b._version, layer.scaling[name]))
            stamp.append(id(layer.base_layer.weight))
            stamp.append(layer.base_layer.weight._version)
        stamp.extend((id(p), p._version) for p, _ in self._converted)
        return tuple(stamp)

    @torch.no_grad()
    def _merge(self) -> None:
        for layer, linear in self._targets:
            base = layer.base_layer.weight
            # in the source's precision, then rounded once into the copy's dtype (a no-op copy when they agree)
            w = linear.weight if linear.weight.dtype == base.dtype else base.clone()
            if w is linear.weight:
                w.copy_(base)
            for name in layer.active_adapters:
                if name in layer.lora_A:
                    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
                    w.addmm_(b.to(w.dtype), a.to(w.dtype), alpha=layer.scaling[name])
            if w is not linear.weight:
                linear.weight.copy_(w)
        for p, q in self._converted:
            q.copy_(p)
        self.merges += 1

    def module(self) -> nn.Module:
        """The merged causal LM, re-merged first if an adapter weight changed since the last call."""
        if self._copy is None:
            self._build()
        stamp = self._current_stamp()
        if stamp != self._stamp:
            self._merge()
            self._stamp = stamp
        return self._copy


def merged_copy(model: nn.Module, dtype: torch.dtype | None = None) -> MergedCopy | None:
    """A :class:`MergedCopy` of ``model`` (in ``dtype``; None: its own) when it can be merged (:func:`can_merge`), else
    None: the factory the hf rollout engine takes (:class:`prefzoo.rollout.engine.HFEngine`)."""
    return MergedCopy(model, dtype) if can_merge(model) else None
