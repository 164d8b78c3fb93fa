"""A fused LoRA linear layer: the same function as peft's, in fewer and better-shaped operations.

peft computes a LoRA linear layer (Hu et al. 2021, eq. 3) as

    y = base(x) + lora_B(lora_A(dropout(x))) * scaling

which is five operations on the (n, out) output in the forward (the base matmul, two skinny matmuls, a
multiply, an add: three (n, out) temporaries) and, in the backward, a multiply, a skinny matmul in a layout
that runs 10-25x slower than its transpose on this CPU (``grad @ B`` with B (out, r) row-major), a second
(n, in) gradient and its sum. :func:`lora_linear` computes the same

    y = x W^T + b + s (x A^T) B^T

with one base matmul and the low-rank term added in place (``addmm_``), and a hand-written backward

    dx = dy W + s (dy B) A        dA = s (dy B)^T x        dB = s dy^T (x A^T)

that reuses ``dy B`` and ``x A^T`` (saved: n x r) and adds the low-rank part of ``dx`` in place. It saves the
same tensors for the backward as peft's path (x, shared with the caller, and the n x r product).

:func:`enable_fast_lora` switches a peft model's LoRA linear layers to it by changing their class to a
subclass whose ``forward`` takes the fused path when it computes the same thing as peft's forward — adapter
on and not merged, exactly one active vanilla adapter (no DoRA or other variant), no dropout (p = 0 or eval
mode), a plain ``nn.Linear`` base, no ``adapter_names`` — and otherwise calls peft's own forward. A bf16 base with
float32 LoRA matrices (``model.dtype=bfloat16``, :mod:`prefzoo.models.precision`) is fused too: the low-rank term
runs in bf16 on copies of A and B, where peft casts x to float32 and adds the term in float32 before rounding the
sum to bf16; the two differ by bf16 roundings (``tests/perf/test_fast_lora.py``). Changing the
class (rather than the instance's ``forward``) keeps ``copy.deepcopy`` (the frozen reference copy) correct.
Tested equal to peft's forward and backward in ``tests/perf/test_fast_lora.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["lora_linear", "enable_fast_lora", "disable_fast_lora"]


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):
        ctx.adapter_dtype = lora_a.dtype
        lora_a, lora_b = lora_a.to(x.dtype), lora_b.to(x.dtype)  # bf16 base, float32 adapter: compute copies
        x2 = x.reshape(-1, x.shape[-1])
        y = F.linear(x2, weight, bias)
        xa = F.linear(x2, lora_a)  # (n, r)
        y.addmm_(xa, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x, weight, lora_a, lora_b, xa)
        ctx.scaling = scaling
        ctx.has_bias = bias is not None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, lora_a, lora_b, xa = ctx.saved_tensors
        s = ctx.scaling
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        gy = grad_y.reshape(-1, grad_y.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        gyb = None
        if need_x or need_a:
            gyb = F.linear(gy, lora_b.t().contiguous())  # dy B, (n, r): the fast layout of this skinny product
        if need_x:
            grad_x = gy @ weight
            grad_x.addmm_(gyb, lora_a, alpha=s)
            grad_x = grad_x.view(x.shape)
        if need_a:
            grad_a = (gyb.t() @ x2).mul_(s).to(ctx.adapter_dtype)
        if need_b:
            grad_b = (gy.t() @ xa).mul_(s).to(ctx.adapter_dtype)
        if need_w:
            grad_w = gy.t() @ x2
        if need_bias and ctx.has_bias:
            grad_bias = gy.sum(0)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, scaling: float
                ) -> Tensor:
    """``x W^T + b + scaling * (x A^T) B^T`` with a fused forward and backward.

    Shape: x (..., in); weight (out, in); bias (out,) or None; lora_a (r, in); lora_b (out, r) -> (..., out).
    x, weight and bias in one dtype; lora_a and lora_b in it too, or float32 master weights beside a bf16/fp16
    base (``model.dtype=bfloat16``): then the low-rank term runs on copies of them in x's dtype (as autocast
    would) and their gradients come back in float32. Gradients flow to every input that requires grad.

    Source: LoRA, Hu et al. 2021, eq. 3 (h = W0 x + B A x, scaled by alpha / r).
    """
    return _LoraLinear.apply(x, weight, bias, lora_a, lora_b, float(scaling))


def _lora_linear_class():
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    return PeftLoraLinear


_FAST_CLASSES: dict[type, type] = {}


def _fast_class(base: type) -> type:
    if base not in _FAST_CLASSES:
        def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
            fast = None if args or kwargs else _fused_arguments(self, x)
            if fast is None:
                return base.forward(self, x, *args, **kwargs)
            return lora_linear(x, *fast)

        _FAST_CLASSES[base] = type("Fast" + base.__name__, (base,), {"forward": forward, "__module__": __name__})
    return _FAST_CLASSES[base]


def _fused_arguments(layer, x: Tensor):
    """(weight, bias, A, B, scaling) when the fused path computes exactly what peft's forward would, else None."""
    if layer.disable_adapters or layer.merged:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1 or active[0] in getattr(layer, "lora_variant", {}):
        return None
    name = active[0]
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, nn.Identity) and not (isinstance(dropout, nn.Dropout) and
                                                     (dropout.p == 0 or not dropout.training)):
        return None
    base = layer.base_layer
    if type(base) is not nn.Linear or torch.is_autocast_enabled(x.device.type):
        return None
    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
    if not (x.dtype == base.weight.dtype and a.dtype == b.dtype and (a.dtype == x.dtype or a.dtype == torch.float32)):
        return None
    return base.weight, base.bias, a, b, layer.scaling[name]


def enable_fast_lora(model: nn.Module) -> int:
    """Switch every peft LoRA ``Linear`` layer of ``model`` to the fused path; returns how many were switched."""
    peft_linear = _lora_linear_class()
    count = 0
    for module in model.modules():
        if type(module) is peft_linear:
            module.__class__ = _fast_class(peft_linear)
            count += 1
    return count


def disable_fast_lora(model: nn.Module) -> int:
    """Undo :func:`enable_fast_lora`; returns how many layers were switched back."""
    count = 0
    for module in model.modules():
        for base, fast in _FAST_CLASSES.items():
            if type(module) is fast:
                module.__class__ = base
                count += 1
    return count
