"""Per-token log-probs straight from hidden states: the output layer, log-softmax and gather fused, chunk by chunk.

``linear_token_logps(hidden, weight, labels)`` equals ``token_logps(hidden @ weight.T, labels)`` but never holds
the (N, V) logits of all N positions at once, neither in the forward nor for the backward: it walks the
positions in chunks of ``chunk_size`` rows, and for each chunk computes the logits (float32), their
``logsumexp`` and the label's logit. With

    d logp_i / d z_iv = 1[v = y_i] - softmax(z_i)_v          z_i = h_i W^T / tau (the logits over temperature)

the gradient w.r.t. the hidden states is ``g_i (W[y_i] - p_i W) / tau`` (g = the upstream gradient, p the
softmax) and w.r.t. the weight (only if it requires grad) ``((onehot - p) * g / tau)^T @ h``. When only the
hidden states need a gradient (the output layer is frozen, as under LoRA), ``(W[y_i] - p_i W) / tau`` is
computed in the forward from the chunk's softmax and kept ((N, d): small), and the backward scales it by g:
two output-layer matmuls per chunk in all. Otherwise the forward keeps only the per-row ``logsumexp`` and the
backward recomputes each chunk's logits (activation checkpointing at the granularity of one chunk): three. With V = 49,152 and N = 1,000 positions the plain path holds
about 200 MB of float32 logits for the backward, plus as much again for the softmax of the log-sum-exp
backward; here one chunk (``chunk_size`` x V floats) lives at a time.

The entropy of each position's distribution, ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` (nats), comes from
the same chunk pass when asked (no gradient; one more elementwise pass over the chunk).

Precision: by default the logits are computed in float32 whatever the dtype of ``hidden``/``weight`` (bf16 inputs
are upcast chunk by chunk; the weight once per call; float64 stays float64) and with autocast switched off inside,
so log-probs are returned in float32 (DESIGN.md: log-probs and log-ratios in float32 even when the model runs in bf16).

``matmul_dtype=torch.bfloat16`` (or float16; what a bf16 model's policy passes, :mod:`prefzoo.models.precision`)
runs the output layer's two matmuls in that dtype instead -- on a bf16 model they are about half the step's matmul
time on hardware with bf16 units if left in float32 (``bench/profile_bf16.py``: 15% of the FLOPs, 54% of the
estimated time at a 6.5x bf16/float32 peak ratio) -- while keeping the log-probs nearly as exact as float32 logits:

* **logits relative to the label's.** A bf16 matmul accumulates in float32 but rounds its output to bf16
  (relative u = 2^-8): plain bf16 logits z_v are off by up to u |z_v|, 0.1-0.3 nat on logits of 20-70, and every
  log-prob with them. Here each position's label logit z_y = h . W_y is computed first in float32 (N x d
  products: cheap), rounded to bf16 as an offset c, and appended as one more input column (-c against a column
  of ones in W, padded to a multiple of 16), so the matmul returns z_v - c, the subtraction done inside its float32
  accumulation, and only then rounded: each logit is off by u |z_v - c|, small exactly where the probability mass
  is (near the label and the mode); the far tail (z_v - c of -20 or less) carries exp(-20) of the mass. Then
  log p_y = (z_y - c) / tau - logsumexp((z - c) / tau) in float32, and by the convexity of logsumexp its error is at
  most exp(2 max_v e_v) sum_v p_v e_v, e_v = u |z_v - c| / tau + the float32 accumulation (``tests/perf/
  test_linear_logps.py`` derives the bound term by term and checks it against float64).
* **the gradient as (onehot - p) W.** d logp_y / d h = (W_y - p W) / tau is formed as (onehot(y) - p) in float32,
  rounded to bf16 entry by entry (relative u each: no cancellation between W_y and p W), times W in bf16 with
  float32 accumulation, the result rounded once (u).

It applies when the output layer is frozen and has no bias (LoRA: the case it is for); when the weight or bias
trains, or a bias is given, or the weight is a tensor subclass (a sharded DTensor under FSDP2), the float32
computation runs (a trained weight wants float32 gradients). The weight
with its offset column is kept between calls (one V x d' copy per weight, d' = d + 1 rounded up to 16: 58 MB for
SmolLM2 in bf16; rebuilt if the weight changes in place or another dtype is asked). The analysis assumes what the
bf16/fp16 matmuls of oneDNN (CPU) and cuBLAS (CUDA) do: exact products, float32 accumulation, one rounding of the
output (float16: u = 2^-11). This departs from TRL under ``bf16=True``, which takes plain bf16
logits and upcasts them: on the tests' logits (|z| up to ~70, labels drawn from the softmax) the log-probs are
6.0e-3 from the exact ones here against 0.18 with plain bf16 logits (30x closer).

Shapes: N = positions (flattened rows x tokens that count), d = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from .errors import ObjectiveError, check_ndim, check_number

__all__ = ["linear_token_logps"]


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """float32, or float64 when an input already is (never rounded down)."""
    return torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)


def _cast(x: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return x if x is None or x.dtype == dtype else x.to(dtype)


def _chunk_logits(h: Tensor, w: Tensor, b: Tensor | None, temperature: float) -> Tensor:
    z = torch.nn.functional.linear(_cast(h, w.dtype), w, b)
    if temperature != 1.0:
        z.div_(temperature)
    return z


LOW_PRECISION = (torch.bfloat16, torch.float16)

#: id(weight) -> (a weak reference to it, its version, the dtype, the weight in that dtype with the offset column):
#: see the module docstring; an entry goes when its weight is freed
_WITH_OFFSET: dict[int, tuple[weakref.ref, int, torch.dtype, Tensor]] = {}


def _offset_width(d: int) -> int:
    """The hidden size plus the offset column, padded to a multiple of 16 (aligned rows for the matmul)."""
    return (d + 1 + 15) // 16 * 16


def _weight_with_offset(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """(V, d') = [W, 1, 0...] in ``dtype``, d' = :func:`_offset_width` (d): kept per weight until it changes."""
    key = id(weight)
    kept = _WITH_OFFSET.get(key)
    if kept is not None and kept[0]() is weight and kept[1:3] == (weight._version, dtype):
        return kept[3]
    v, d = weight.shape
    with torch.inference_mode(False), torch.no_grad():
        out = torch.zeros((v, _offset_width(d)), dtype=dtype, device=weight.device)
        out[:, :d] = weight.detach()
        out[:, d] = 1
    _WITH_OFFSET[key] = (weakref.ref(weight, lambda _, k=key: _WITH_OFFSET.pop(k, None)), weight._version, dtype, out)
    return out


def _low_precision_forward(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, chunk_size: int,
                           with_entropy: bool, need_h: bool, dtype: torch.dtype):
    """The ``matmul_dtype`` route (module docstring): (logps, entropy or None, d logp / d h or None), float32."""
    n, d = hidden.shape
    w_off = _weight_with_offset(weight, dtype)
    w_low = w_off[:, :d]
    logps = torch.empty(n, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty_like(logps) if with_entropy else None
    dlogp_dh = torch.empty((n, d), dtype=torch.float32, device=hidden.device) if need_h else None
    h_off = torch.zeros((min(chunk_size, n), w_off.shape[1]), dtype=dtype, device=hidden.device)
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        h, y = hidden[s:e].to(dtype), labels[s:e]  # (float32 states under autocast: rounded once, as autocast does)
        z_y = (h.float() * weight[y].to(dtype).float()).sum(-1)  # the label's logit of these numbers, float32
        c = z_y.to(dtype)
        rows = h_off[: e - s]
        rows[:, :d] = h
        rows[:, d] = -c
        z = torch.mm(rows, w_off.t()).float()  # z_v - c, rounded once to ``dtype`` after float32 accumulation
        label = z_y - c.float()
        if temperature != 1.0:
            z.div_(temperature)
            label.div_(temperature)
        lse = torch.logsumexp(z, dim=-1)
        logps[s:e] = label - lse
        if with_entropy or need_h:
            log_p = z.sub_(lse[:, None])
            p = log_p.exp()
            if with_entropy:
                entropy[s:e] = -(p * log_p).sum(-1)
            if need_h:  # (onehot(y) - p) W / tau
                p.neg_().scatter_add_(-1, y[:, None], torch.ones_like(p[:, :1]))
                g = torch.mm(p.to(dtype), w_low).float()
                dlogp_dh[s:e] = g.div_(temperature) if temperature != 1.0 else g
    return logps, entropy, dlogp_dh


class _LinearLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, with_entropy, matmul_dtype=None):
        # When only the hidden states need a gradient (a frozen output layer, as under LoRA), d logp_i / d h_i =
        # (W[y_i] - p_i W) / tau does not depend on the upstream gradient: it is computed here, from the chunk's
        # softmax, and kept as an (N, d) tensor, so the backward needs no second pass over the logits (two
        # output-layer matmuls per chunk instead of three).
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        early = need_h and not need_w and not need_b
        ctx.temperature, ctx.chunk_size, ctx.hidden_dtype = temperature, chunk_size, hidden.dtype
        plain = isinstance(weight, torch.Tensor) and type(weight) in (torch.Tensor, torch.nn.Parameter)
        if matmul_dtype is not None and bias is None and not need_w and plain:  # (not a sharded DTensor weight)
            with torch.autocast(hidden.device.type, enabled=False):
                logps, entropy, dlogp_dh = _low_precision_forward(hidden, weight, labels, temperature, chunk_size,
                                                                  with_entropy, need_h, matmul_dtype)
            ctx.early = need_h
            if need_h:
                ctx.save_for_backward(dlogp_dh)
            if entropy is not None:
                ctx.mark_non_differentiable(entropy)
            return logps, entropy
        with torch.autocast(hidden.device.type, enabled=False):
            dtype = _compute_dtype(hidden, weight)
            w, b = _cast(weight, dtype), _cast(bias, dtype)
            n = hidden.shape[0]
            logps = torch.empty(n, dtype=dtype, device=hidden.device)
            lse = torch.empty_like(logps)
            entropy = torch.empty_like(logps) if with_entropy else None
            dlogp_dh = torch.empty((n, hidden.shape[1]), dtype=dtype, device=hidden.device) if early else None
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                y = labels[s:e]
                z = _chunk_logits(hidden[s:e], w, b, temperature)
                lse[s:e] = torch.logsumexp(z, dim=-1)
                logps[s:e] = z.gather(-1, y[:, None])[:, 0] - lse[s:e]
                if with_entropy or early:
                    log_p = z.sub_(lse[s:e, None])  # in place: the chunk's log-softmax
                    p = log_p.exp()
                    if with_entropy:  # H = -sum_v p_v log p_v
                        entropy[s:e] = -(p * log_p).sum(-1)
                    if early:
                        torch.sub(w[y], p @ w, out=dlogp_dh[s:e])
                        if temperature != 1.0:
                            dlogp_dh[s:e].div_(temperature)
        if early:
            ctx.save_for_backward(dlogp_dh)
        else:
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.early = early
        logps = logps.float()
        if entropy is not None:
            entropy = entropy.float()
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        if ctx.early:
            (dlogp_dh,) = ctx.saved_tensors
            grad_h = (grad_logps.to(dlogp_dh.dtype)[:, None] * dlogp_dh).to(ctx.hidden_dtype)
            return grad_h, None, None, None, None, None, None, None
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = lse.dtype  # float32 (float64 for a float64 model)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        g = grad_logps.to(lse.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _cast(weight, acc), _cast(bias, acc)
            for s in range(0, hidden.shape[0], chunk):
                e = min(s + chunk, hidden.shape[0])
                z = _chunk_logits(hidden[s:e], w, b, t)
                # dz = (onehot(y) - softmax(z)) * g / t, built in place in the chunk's logits buffer
                dz = z.sub_(lse[s:e, None]).exp_().mul_(-g[s:e, None])
                dz.scatter_add_(-1, labels[s:e, None], g[s:e, None])
                if t != 1.0:
                    dz.div_(t)
                if need_h:
                    if grad_h.dtype == dz.dtype:
                        torch.mm(dz, w, out=grad_h[s:e])
                    else:
                        grad_h[s:e] = (dz @ w).to(hidden.dtype)
                if need_w:
                    grad_w.addmm_(dz.t(), _cast(hidden[s:e], acc))
                if need_b:
                    grad_b += dz.sum(0)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        if need_b:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def linear_token_logps(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None,
                       temperature: float = 1.0, chunk_size: int = 256, with_entropy: bool = False,
                       matmul_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
    """Log-probability of each label under ``softmax((hidden @ weight.T + bias) / temperature)``, chunked.

    Equal (up to float rounding) to ``token_logps(hidden @ weight.T + bias, labels, temperature)``, with
    gradients w.r.t. ``hidden``, ``weight`` and ``bias`` (each only where it requires grad), but the (N, V)
    logits are never stored: see the module docstring.

    Shape: hidden (N, d) float; weight (V, d); bias (V,) or None; labels (N,) integer in [0, V)
    -> (logps (N,) float32, entropy (N,) float32 or None). N = positions, d = hidden size, V = vocabulary.
    Units: nats (logps <= 0; 0 <= entropy <= log V).

    ``matmul_dtype``: None (float32 logits) or torch.bfloat16 / torch.float16: the output layer's matmuls in that
    dtype with the logits taken relative to the label's (module docstring: the error bound, and when it applies).

    Raises:
        ObjectiveError: wrong ranks or shapes, labels not integer or outside [0, V), temperature <= 0,
            chunk_size not a positive int, matmul_dtype not None, torch.bfloat16 or torch.float16.

    Source: log softmax(z)_y = z_y - logsumexp(z) and its gradient onehot(y) - softmax(z) (the policy of
    Ouyang et al. 2022 at sampling temperature tau); entropy as in :func:`token_entropy`.
    """
    check_ndim("hidden", hidden, 2, "(N, d)")
    check_ndim("weight", weight, 2, "(V, d)")
    check_ndim("labels", labels, 1, "(N,)")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ObjectiveError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if hidden.shape[1] != weight.shape[1]:
        raise ObjectiveError(f"hidden is {tuple(hidden.shape)} but weight is {tuple(weight.shape)}: the hidden size "
                             "(last axis of both) must agree; weight is the output layer's (V, d) matrix")
    if labels.shape[0] != hidden.shape[0]:
        raise ObjectiveError(f"labels has {labels.shape[0]} entries but hidden has {hidden.shape[0]} rows; one label "
                             "per position")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ObjectiveError(f"labels must be an integer tensor (token ids), got {labels.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ObjectiveError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ObjectiveError(f"chunk_size must be a positive int, got {chunk_size!r}")
    temperature = check_number("temperature", temperature, low=0.0, strict_low=True)
    if matmul_dtype is not None and matmul_dtype not in LOW_PRECISION:
        raise ObjectiveError(f"matmul_dtype must be None (float32 logits), torch.bfloat16 or torch.float16, got "
                             f"{matmul_dtype!r}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= weight.shape[0]):
        raise ObjectiveError(f"labels must lie in [0, {weight.shape[0]}) (the vocabulary); select the positions "
                             "that count before calling (pad ids outside the vocabulary are not allowed here)")
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + 0.0 * hidden.sum()
        return empty, (empty.detach() if with_entropy else None)
    return _LinearLogps.apply(hidden, weight, bias, labels.long(), temperature, chunk_size, with_entropy, matmul_dtype)
