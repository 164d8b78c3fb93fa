"""On-policy distillation: the per-token generalised Jensen-Shannon divergence to a teacher, and the teacher's
log-ratio as a reward.

**The generalised JSD** (Agarwal et al. 2024, GKD, arXiv:2306.13649, eq. 1-2 and sec. 3), per token position t of a
completion the student sampled, between the student's next-token distribution S = pi_theta(. | x, y_<t) and the
teacher's T = pi_T(. | x, y_<t), both over the whole vocabulary and both at temperature tau (softmax(z / tau)):

    M      = beta T + (1 - beta) S
    JSD_b  = beta KL(T || M) + (1 - beta) KL(S || M)              0 < beta < 1
    JSD_0  = KL(T || S)     (forward KL: the student covers the teacher's mass; supervised KD's direction)
    JSD_1  = KL(S || T)     (reverse KL: mode seeking; TRL's default and Thinking Machines')

The convention is TRL 1.16's ``DistillationTrainer`` (its ``beta``; prefzoo's ``algo.jsd_beta``): the ends are the two
KLs. The GKD paper's JSD(beta) is the same expression in between, but taken literally it is 0 at both ends (M = S at
beta = 0, M = T at beta = 1); its text says the divergence *behaves like* forward KL as beta -> 0 and reverse KL as
beta -> 1 (JSD_b / beta -> KL(T || S)-like gradients), which is why the implementations special-case the ends. So
prefzoo's (and TRL's) value jumps at beta = 0 and 1: JSD_0.001 is about 0.001 x KL-scale, JSD_0 the full KL. Units:
nats per token. Its gradient flows through S only (the teacher is frozen; T and its logits have no gradient).

**Memory.** The divergence needs both models' logits over the vocabulary at every counted position. With
:class:`TokenLogits` in its linear form (final hidden states (N, d) and the output layer (V, d)), the positions go
through in chunks of ``chunk_size`` rows, and each chunk's forward runs under activation checkpointing: its (chunk, V)
logits, softmaxes and mixture are freed after the forward and recomputed in the backward (the teacher's chunk too,
from its hidden states), so one chunk's vocabulary-sized tensors live at a time instead of the (N, V) of all positions
(TRL does the same with its chunked kernel). Logits are computed in float32 (float64 kept), autocast off.

**The teacher's log-ratio as a reward.** On prefzoo's objective J(pi) = E[r] - beta KL(pi || pi_ref), the reward
r(x, y) = beta log pi_T(y | x) / pi_ref(y | x) gives J = -beta KL(pi || pi_T) + const: its maximiser
pi* = pi_ref exp(r / beta) / Z is the teacher itself (Z = 1), for every beta > 0. With the KL penalty in the reward
(k1 per token), pi_ref cancels from the per-token reward:

    r_t = beta (log pi_T(y_t) - log pi_ref(y_t)) - beta (log pi_old(y_t) - log pi_ref(y_t)) = beta (log pi_T - log pi_old)_t

the negative per-token reverse-KL sample of the on-policy distillation write-ups (Thinking Machines' "On-Policy
Distillation", 2025; Tinker's cookbook), so no reference model is needed. :func:`teacher_log_ratio_rewards` returns it
with beta = 1 (beta only scales the gradient here: the fixed point is pi_T whatever it is).

Shapes: N = counted positions (the True entries of a completion mask, in row-major order), V = vocabulary, d = hidden
size; (B, T) for per-token tensors of a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .errors import ObjectiveError, check_mask, check_number, check_same_shape

__all__ = ["TokenLogits", "generalized_jsd", "chunked_generalized_jsd", "teacher_log_ratio_rewards"]


@dataclass
class TokenLogits:
    """The logits of N counted positions, given either in full or as the output layer's inputs.

    Linear form: ``states`` Shape (N, d) (the final hidden states, after the last norm), ``weight`` Shape (V, d) (the
    output layer), ``bias`` Shape (V,) or None: logits = states @ weight.T + bias. Full form: ``logits`` Shape (N, V)
    (e.g. from a data-parallel forward that returns logits). Exactly one of the two forms is given. Units: logits (nats
    before the softmax), at temperature 1.

    Raises:
        ObjectiveError: neither or both forms, or shapes that do not fit.

    Source: project convention (the fused output layer of :mod:`prefzoo.objective.linear_logps`; TRL 1.16 passes its
    chunked divergence the same pair of hidden states and output weights).
    """

    states: Tensor | None = None
    weight: Tensor | None = None
    bias: Tensor | None = None
    logits: Tensor | None = None

    def __post_init__(self) -> None:
        linear = self.states is not None or self.weight is not None
        if linear == (self.logits is not None):
            raise ObjectiveError("TokenLogits: give either states and weight (the output layer's inputs) or logits, "
                                 "not both and not neither")
        if linear:
            if self.states is None or self.weight is None or self.states.ndim != 2 or self.weight.ndim != 2 \
                    or self.states.shape[1] != self.weight.shape[1]:
                raise ObjectiveError(f"TokenLogits: states must be (N, d) and weight (V, d); got "
                                     f"{None if self.states is None else tuple(self.states.shape)} and "
                                     f"{None if self.weight is None else tuple(self.weight.shape)}")
        elif self.logits.ndim != 2:
            raise ObjectiveError(f"TokenLogits: logits must be (N, V), got {tuple(self.logits.shape)}")

    @property
    def num_positions(self) -> int:
        return (self.states if self.logits is None else self.logits).shape[0]

    @property
    def vocab_size(self) -> int:
        return (self.weight if self.logits is None else self.logits).shape[0 if self.logits is None else 1]


def _compute_dtype(*xs: Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for x in xs:
        if x is not None:
            dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _xlogy_difference(log_p: Tensor, log_q: Tensor) -> Tensor:
    """sum_v p_v (log p_v - log q_v) over the last dimension, 0 where p_v = 0 (log p = -inf)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros((), dtype=p.dtype, device=p.device)).sum(-1)


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, beta: float, temperature: float = 1.0) -> Tensor:
    """The generalised JSD between softmax(student_logits / tau) and softmax(teacher_logits / tau), per position.

    ``beta`` = 0: KL(teacher || student); 1: KL(student || teacher); in between: beta KL(T || M) + (1 - beta) KL(S || M),
    M = beta T + (1 - beta) S (module docstring; TRL 1.16's convention). Computed in float32 (float64 kept).

    Shape: (..., V) and (..., V) -> (...). Units: nats. The gradient flows into ``student_logits`` (and into
    ``teacher_logits`` if it requires one: the caller detaches a frozen teacher).

    Raises:
        ObjectiveError: shapes differ, beta outside [0, 1], temperature <= 0.

    Source: Agarwal et al. 2024 (GKD), eq. 1-2 and sec. 3; the ends as TRL 1.16's ``DistillationTrainer`` (``beta``).
    """
    check_same_shape("student_logits", student_logits, "teacher_logits", teacher_logits)
    check_number("beta", beta, low=0.0, high=1.0)
    check_number("temperature", temperature, low=0.0, strict_low=True)
    dtype = _compute_dtype(student_logits, teacher_logits)
    with torch.autocast(student_logits.device.type, enabled=False):
        log_s = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
        log_t = torch.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
        if beta == 0.0:
            return _xlogy_difference(log_t, log_s)
        if beta == 1.0:
            return _xlogy_difference(log_s, log_t)
        log_m = torch.logaddexp(log_s + math.log(1.0 - beta), log_t + math.log(beta))
        return beta * _xlogy_difference(log_t, log_m) + (1.0 - beta) * _xlogy_difference(log_s, log_m)


def _chunk(side: TokenLogits, states: Tensor | None, weight: Tensor | None, bias: Tensor | None, start: int, end: int,
           dtype: torch.dtype) -> Tensor:
    if side.logits is not None:
        return side.logits[start:end].to(dtype)
    return torch.nn.functional.linear(states.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def _divergence_and_gradient(log_s: Tensor, log_t: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """The per-row JSD_beta of two log-softmaxes (chunk, V) and its gradient in the student's (tempered) logits:

        beta = 0:  S - T
        beta = 1:  S (log S - log T - KL(S || T))
        else:      (1 - beta) S (log S - log M - KL(S || M))      (d JSD / d S_v = (1 - beta) log(S_v / M_v), then softmax)
    """
    s = log_s.exp()
    if beta == 0.0:
        return _xlogy_difference(log_t, log_s), s - log_t.exp()
    if beta == 1.0:
        kl = _xlogy_difference(log_s, log_t)
        return kl, s * (log_s - log_t - kl[:, None])
    log_m = torch.logaddexp(log_s + math.log(1.0 - beta), log_t + math.log(beta))
    kl_s = _xlogy_difference(log_s, log_m)
    div = beta * _xlogy_difference(log_t, log_m) + (1.0 - beta) * kl_s
    return div, (1.0 - beta) * s * (log_s - log_m - kl_s[:, None])


class _FrozenHeadJSD(torch.autograd.Function):
    """The chunked JSD when only the student's hidden states need a gradient (a frozen output layer, as under LoRA):
    d JSD_i / d h_i = G_i W / tau (G_i the gradient in the tempered logits, :func:`_divergence_and_gradient`) does not
    depend on the upstream gradient, so it is computed in the forward chunk by chunk and kept ((N, d): small); the
    backward only scales it. Two output-layer matmuls per chunk for the student (the logits, then G W) and one for the
    teacher, against five with checkpointing's recomputation."""

    @staticmethod
    def forward(ctx, s_states, teacher, s_weight, s_bias, beta, temperature, chunk_size, dtype):
        with torch.autocast(s_states.device.type, enabled=False):
            n = s_states.shape[0]
            w = s_weight.to(dtype)
            out = torch.empty(n, dtype=dtype, device=s_states.device)
            dh = torch.empty((n, s_states.shape[1]), dtype=dtype, device=s_states.device)
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                t_states = None if teacher.states is None else teacher.states[start:end]
                z_t = _chunk(teacher, t_states, teacher.weight, teacher.bias, start, end, dtype)
                z_s = _chunk(TokenLogits(s_states, s_weight, s_bias), s_states[start:end], w, s_bias, start, end, dtype)
                log_s = torch.log_softmax(z_s / temperature, dim=-1)
                log_t = torch.log_softmax(z_t / temperature, dim=-1)
                out[start:end], grad = _divergence_and_gradient(log_s, log_t, beta)
                dh[start:end] = (grad @ w) / temperature
        ctx.save_for_backward(dh)
        ctx.input_dtype = s_states.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (dh,) = ctx.saved_tensors
        return (grad_out[:, None].to(dh.dtype) * dh).to(ctx.input_dtype), None, None, None, None, None, None, None


def chunked_generalized_jsd(student: TokenLogits, teacher: TokenLogits, beta: float, temperature: float = 1.0,
                            chunk_size: int = 256) -> Tensor:
    """:func:`generalized_jsd` of N positions, ``chunk_size`` at a time, each chunk's forward checkpointed (its
    vocabulary-sized tensors recomputed in the backward, the teacher's under no_grad; module docstring). When only the
    student's hidden states need a gradient (a frozen output layer: LoRA), the gradient is computed in the forward
    instead (:class:`_FrozenHeadJSD`) and nothing vocabulary-sized is recomputed.

    Equal to ``generalized_jsd(student logits, teacher logits, beta, temperature)`` on the full (N, V) logits up to
    float rounding, and so is its gradient (``tests/objective/test_distillation.py``). The teacher side never carries a
    gradient.

    Shape: two :class:`TokenLogits` of N positions and one vocabulary V -> (N,) float32 (float64 when an input is).
    Units: nats.

    Raises:
        ObjectiveError: the two sides differ in N or V; beta outside [0, 1]; temperature or chunk_size <= 0.

    Source: :func:`generalized_jsd`'s; the chunking and the early gradient are prefzoo's (module docstring).
    """
    if student.num_positions != teacher.num_positions or student.vocab_size != teacher.vocab_size:
        raise ObjectiveError(f"student and teacher logits must cover the same positions and vocabulary: student "
                             f"(N={student.num_positions}, V={student.vocab_size}), teacher "
                             f"(N={teacher.num_positions}, V={teacher.vocab_size}); a teacher must share the "
                             "student's tokenizer")
    check_number("beta", beta, low=0.0, high=1.0)
    check_number("temperature", temperature, low=0.0, strict_low=True)
    if chunk_size < 1:
        raise ObjectiveError(f"chunk_size must be >= 1, got {chunk_size}")
    dtype = _compute_dtype(student.states, student.weight, student.logits, teacher.states, teacher.weight,
                           teacher.logits)
    n = student.num_positions
    device = (student.states if student.logits is None else student.logits).device
    if n == 0:
        return torch.zeros(0, dtype=dtype, device=device)

    def piece(start: int, end: int, s_states, s_weight, s_bias) -> Tensor:
        with torch.autocast(device.type, enabled=False):
            with torch.no_grad():
                t_states = None if teacher.states is None else teacher.states[start:end]
                t = _chunk(teacher, t_states, teacher.weight, teacher.bias, start, end, dtype)
            s = _chunk(student, s_states, s_weight, s_bias, start, end, dtype)
            return generalized_jsd(s, t, beta, temperature)

    frozen_head = (student.logits is None and not student.weight.requires_grad
                   and (student.bias is None or not student.bias.requires_grad))
    if frozen_head and torch.is_grad_enabled() and student.states.requires_grad:
        return _FrozenHeadJSD.apply(student.states, teacher, student.weight, student.bias, beta, temperature,
                                    chunk_size, dtype)
    out = []
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        s_states = None if student.states is None else student.states[start:end]
        args = (s_states, student.weight, student.bias)
        if torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in (*args, student.logits)):
            out.append(checkpoint(piece, start, end, *args, use_reentrant=False))
        else:
            out.append(piece(start, end, *args))
    return torch.cat(out)


def teacher_log_ratio_rewards(teacher_logps: Tensor, logps: Tensor, mask: Tensor) -> Tensor:
    """The per-token reward of distillation as RL: r_t = log pi_T(y_t) - log pi_old(y_t) (module docstring: the
    objective's reward beta log pi_T / pi_ref with the k1 penalty in the reward, over beta; pi_ref cancels). Its sum
    over a completion is -log pi_old(y|x)/pi_T(y|x), whose expectation under pi_old is -KL(pi_old || pi_T).

    Shape: (B, T), (B, T), bool (B, T) -> (B, T) float32, 0 where masked. Units: nats. No gradient (detached inputs
    expected: the sampling policy's and the teacher's log-probs).

    Raises:
        ObjectiveError: shapes differ or the mask is not a bool tensor of their shape.

    Source: Thinking Machines, "On-Policy Distillation" (2025): the per-token reverse KL as the advantage; derived here
    from the objective (module docstring).
    """
    check_same_shape("teacher_logps", teacher_logps, "logps", logps)
    check_mask(mask, logps, "logps")
    return (teacher_logps.float() - logps.float()).masked_fill(~mask, 0.0)
