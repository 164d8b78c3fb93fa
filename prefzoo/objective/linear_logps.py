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

Precision: the logits are computed in float32 whatever the dtype of ``hidden``/``weight`` (bf16 inputs are
upcast chunk by chunk; the weight once per call; float64 stays float64) and with autocast switched off inside,
so log-probs are returned in float32 (DESIGN.md: log-probs and log-ratios in float32 even when the model runs in bf16).

Shapes: N = positions (flattened rows x tokens that count), d = hidden size, V = vocabulary size.
"""

from __future__ import annotations

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


class _LinearLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, with_entropy):
        # When only the hidden states need a gradient (a frozen output layer, as under LoRA), d logp_i / d h_i =
        # (W[y_i] - p_i W) / tau does not depend on the upstream gradient: it is computed here, from the chunk's
        # softmax, and kept as an (N, d) tensor, so the backward needs no second pass over the logits (two
        # output-layer matmuls per chunk instead of three).
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        early = need_h and not need_w and not need_b
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
        ctx.early, ctx.hidden_dtype = early, hidden.dtype
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
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
            return grad_h, None, None, None, None, None, None
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
        return grad_h, grad_w, grad_b, None, None, None, None


def linear_token_logps(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None,
                       temperature: float = 1.0, chunk_size: int = 256, with_entropy: bool = False
                       ) -> tuple[Tensor, Tensor | None]:
    """Log-probability of each label under ``softmax((hidden @ weight.T + bias) / temperature)``, chunked.

    Equal (up to float rounding) to ``token_logps(hidden @ weight.T + bias, labels, temperature)``, with
    gradients w.r.t. ``hidden``, ``weight`` and ``bias`` (each only where it requires grad), but the (N, V)
    logits are never stored: see the module docstring.

    Shape: hidden (N, d) float; weight (V, d); bias (V,) or None; labels (N,) integer in [0, V)
    -> (logps (N,) float32, entropy (N,) float32 or None). N = positions, d = hidden size, V = vocabulary.
    Units: nats (logps <= 0; 0 <= entropy <= log V).

    Raises:
        ObjectiveError: wrong ranks or shapes, labels not integer or outside [0, V), temperature <= 0,
            chunk_size not a positive int.

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
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= weight.shape[0]):
        raise ObjectiveError(f"labels must lie in [0, {weight.shape[0]}) (the vocabulary); select the positions "
                             "that count before calling (pad ids outside the vocabulary are not allowed here)")
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + 0.0 * hidden.sum()
        return empty, (empty.detach() if with_entropy else None)
    return _LinearLogps.apply(hidden, weight, bias, labels.long(), temperature, chunk_size, with_entropy)
