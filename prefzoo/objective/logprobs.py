"""Per-token log-probabilities and masked statistics.

Everything an algorithm needs to turn model logits into ``logps`` (B, T) and to reduce masked
per-token quantities: gathering the log-probability of the sampled/label token without building
the full (B, T, V) log-softmax, the entropy of the next-token distribution, masked sums, means,
variances, and the advantage whitening of PPO practice (with an optional data-parallel hook).

Conventions (DESIGN.md): B = number of sequences in the batch, T = number of token positions
(completion positions, already shifted so that ``logits[:, t]`` predicts ``labels[:, t]``),
V = vocabulary size. Masks are bool, True = "this token counts". Log-probabilities are returned
in float32 whatever the dtype of the logits (bf16 logits are upcast chunk by chunk).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import (
    ObjectiveError,
    check_floating,
    check_mask,
    check_ndim,
    check_number,
)

__all__ = [
    "token_logps",
    "support_mask",
    "support_log_mass",
    "masked_logps",
    "sequence_logps",
    "mean_logps",
    "token_entropy",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "last_token_index",
]


def _check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ObjectiveError(
            f"chunk_size must be a positive int or None (no chunking), got {chunk_size!r}"
        )


def _chunks(length: int, chunk_size: int | None) -> list[tuple[int, int]]:
    step = length if chunk_size is None else chunk_size
    return [(s, min(s + step, length)) for s in range(0, max(length, 1), max(step, 1))]


def token_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probability of each label token under the softmax of the logits.

    ``logps[b, t] = log softmax(logits[b, t].float() / temperature)[labels[b, t]]``, computed as
    the gathered logit minus ``logsumexp`` over the vocabulary, so the full (B, T, V)
    log-softmax is never materialised. With ``chunk_size`` the T axis is processed in chunks of
    that many positions (only one float32 (B, chunk, V) copy lives at a time); the result is the
    same as without chunking. Gradients flow back to ``logits``; note that under autograd each
    chunk's float32 copy is kept for the backward pass, so chunking bounds peak memory mainly
    in no-grad use (reference/old log-probs) unless the caller adds checkpointing.

    Labels outside ``[0, V)`` (pad ids beyond the vocabulary, ``-100``) are replaced by 0 before
    the gather, so any value is allowed at positions the caller will mask out; the value returned
    there is meaningless and must be masked (see :func:`masked_logps`).

    Shape: logits (B, T, V), labels (B, T) integer -> (B, T) float32; B = sequences,
    T = token positions, V = vocabulary size.
    Units: nats (natural-log probabilities, <= 0).

    Raises:
        ObjectiveError: logits not 3-D or not floating point; labels not (B, T) integer;
            temperature <= 0; chunk_size not a positive int.

    Source: definition of the autoregressive policy pi(y_t | x, y_<t) = softmax(logits / tau);
    sampling temperature tau as in Ouyang et al. 2022 (the log-probs must be taken at the
    temperature used for sampling).
    """
    check_ndim("logits", logits, 3, "(B, T, V)")
    check_floating("logits", logits)
    check_ndim("labels", labels, 2, "(B, T)")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ObjectiveError(f"labels must be an integer tensor (token ids), got {labels.dtype}")
    if labels.shape != logits.shape[:2]:
        raise ObjectiveError(
            f"labels has shape {tuple(labels.shape)} but logits has shape {tuple(logits.shape)}; "
            "labels must be (B, T) matching the first two axes of logits (B, T, V)"
        )
    temperature = check_number("temperature", temperature, low=0.0, strict_low=True)
    _check_chunk_size(chunk_size)

    vocab = logits.shape[-1]
    valid = (labels >= 0) & (labels < vocab)
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels)).long()

    pieces = []
    for start, stop in _chunks(logits.shape[1], chunk_size):
        x = logits[:, start:stop].float()
        if temperature != 1.0:
            x = x / temperature
        picked = x.gather(-1, safe_labels[:, start:stop, None]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(x, dim=-1))
    return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]


def support_mask(logits: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The tokens a top-k / top-p (nucleus) sampler keeps: True = may be drawn.

    Top-k first (the ``top_k`` largest logits; 0 = all), then top-p over the distribution renormalised on what is left:
    sorted by probability, a token is kept while the mass of the tokens BEFORE it is below ``top_p``, so the kept set
    is the smallest whose mass reaches ``top_p`` and the most likely token is always kept. Ties are broken by the
    sort's order. This is the sampler's rule (:func:`prefzoo.rollout.generate.filter_support` draws from it) and the
    rule the trainer uses to renormalise over the sampler's support (:func:`support_log_mass`): one definition.

    Shape: logits (..., V) float, already divided by the temperature -> (..., V) bool. Units: none.

    Raises:
        ObjectiveError: top_p not in (0, 1]; top_k < 0.

    Source: Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration" (nucleus sampling, sec. 3.1);
    Fan et al. 2018 (top-k sampling); the order top-k then top-p is vLLM's and transformers' default.
    """
    top_p = check_number("top_p", top_p, low=0.0, high=1.0, strict_low=True)
    if not isinstance(top_k, int) or top_k < 0:
        raise ObjectiveError(f"top_k={top_k!r}: a number of tokens >= 0 (0 = no top-k)")
    x = logits.float()
    keep = torch.ones(x.shape, dtype=torch.bool, device=x.device)
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        keep = x >= kth
        x = x.masked_fill(~keep, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        keep_sorted = mass_before < top_p
        keep = keep & torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return keep


def support_log_mass(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                     top_k: int = 0, chunk_size: int | None = None) -> torch.Tensor:
    """log of the probability mass a top-k / top-p sampler kept at each position, the chosen token included.

        log Z_t = log sum_{v in S_t} softmax(logits_t / tau)_v,     S_t = support_mask(logits_t / tau) + {labels_t}

    A sampler that draws from the distribution renormalised on S_t and reports its log-probs after the
    renormalisation (vLLM's ``processed_logprobs``, prefzoo's hf engine) gives log pi_sampler(y) = log pi(y) - log Z;
    a trainer that compares its plain log pi(y) with it sees a ratio of Z_t < 1 on every token even with identical
    weights: TRL measured a mean ratio of 0.896 at top_p = 0.8. Subtracting log Z_t from the trainer's log-prob
    renormalises it over the same support, and a matched sampler then gives a ratio of exactly 1. The chosen
    token is put in S_t so that a token the trainer would not have kept (the sampler's weights differ) keeps a
    finite ratio. 0 when top_p = 1 and top_k = 0. DETACHED.

    Shape: logits (B, T, V), labels (B, T) integer -> (B, T) float32 (<= 0); meaningless where the caller masks.
    Units: nats.

    Raises:
        ObjectiveError: as :func:`token_logps` and :func:`support_mask`.

    Source: Holtzman et al. 2020 (nucleus sampling); the bias and its fix: TRL 1.17's release notes ("unbiased
    importance sampling under top-k, top-p and min-p") and vLLM's logprobs modes (``processed_logprobs``).
    """
    check_ndim("logits", logits, 3, "(B, T, V)")
    check_ndim("labels", labels, 2, "(B, T)")
    temperature = check_number("temperature", temperature, low=0.0, strict_low=True)
    _check_chunk_size(chunk_size)
    if top_p >= 1.0 and not top_k:
        support_mask(logits[:, :0], top_p, top_k)  # (the checks)
        return torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    vocab = logits.shape[-1]
    safe = torch.where((labels >= 0) & (labels < vocab), labels, torch.zeros_like(labels)).long()
    pieces = []
    with torch.no_grad():
        for start, stop in _chunks(logits.shape[1], chunk_size):
            x = logits[:, start:stop].float() / temperature
            keep = support_mask(x, top_p, top_k).scatter(-1, safe[:, start:stop, None], True)
            pieces.append(torch.logsumexp(x.masked_fill(~keep, float("-inf")), -1) - torch.logsumexp(x, -1))
    return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]


def masked_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token log-probabilities, exactly 0.0 where the mask is False.

    Same as :func:`token_logps`, then ``torch.where(mask, logps, 0.0)``: masked positions are
    zero (not multiplied, so a NaN/inf at a padded position never leaks) and get no gradient.

    Shape: logits (B, T, V), labels (B, T), mask (B, T) bool -> (B, T) float32;
    B = sequences, T = token positions, V = vocabulary size.
    Units: nats.

    Raises:
        ObjectiveError: as :func:`token_logps`; mask not bool or not the shape of labels.

    Source: as :func:`token_logps` (masking convention of DESIGN.md).
    """
    check_ndim("labels", labels, 2, "(B, T)")
    check_mask(mask, labels, "labels")
    logps = token_logps(logits, labels, temperature=temperature)
    return torch.where(mask, logps, torch.zeros_like(logps))


def sequence_logps(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probability of each whole sequence: the sum of its counted token log-probs.

    ``seq_logps[b] = sum_t mask[b, t] * logps[b, t]`` = log pi(y_b | x_b) by the chain rule.
    A row with no counted token gives 0.

    Shape: logps (B, T), mask (B, T) bool -> (B,); B = sequences, T = token positions.
    Units: nats.

    Raises:
        ObjectiveError: logps not 2-D; mask not bool or not the shape of logps.

    Source: chain rule of probability; the sequence log-likelihood of DPO (Rafailov et al. 2023,
    eq. 7 uses log pi(y|x)).
    """
    check_ndim("logps", logps, 2, "(B, T)")
    check_mask(mask, logps, "logps")
    return torch.where(mask, logps, torch.zeros_like(logps)).sum(dim=-1)


def mean_logps(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised sequence log-probability: sum of counted log-probs / number counted.

    A row with no counted token gives 0 (not NaN).

    Shape: logps (B, T), mask (B, T) bool -> (B,); B = sequences, T = token positions.
    Units: nats per token.

    Raises:
        ObjectiveError: logps not 2-D; mask not bool or not the shape of logps.

    Source: the length-normalised log-likelihood (1/|y|) log pi(y|x) in the reward of SimPO
    (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward").
    """
    total = sequence_logps(logps, mask)
    count = mask.sum(dim=-1).clamp(min=1).to(total.dtype)
    return total / count


def token_entropy(
    logits: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Entropy of the next-token distribution softmax(logits / temperature) at each position.

    ``H = logsumexp(x) - sum_v softmax(x)_v * x_v`` with ``x = logits.float() / temperature``;
    entries of x equal to -inf (banned tokens) contribute 0, in value and in gradient (dH/dx_j = -p_j (x_j - E_p[x])
    is 0 there, finite everywhere). Chunked over T as in
    :func:`token_logps` (one float32 (B, chunk, V) probability tensor at a time).

    Shape: logits (B, T, V) -> (B, T) float32; B = sequences, T = positions, V = vocabulary.
    Units: nats (0 <= H <= log V).

    Raises:
        ObjectiveError: logits not 3-D or not floating point; temperature <= 0; bad chunk_size.

    Source: Shannon entropy H(p) = -sum_v p_v log p_v (Cover & Thomas 2006, eq. 2.1), in nats.
    """
    check_ndim("logits", logits, 3, "(B, T, V)")
    check_floating("logits", logits)
    temperature = check_number("temperature", temperature, low=0.0, strict_low=True)
    _check_chunk_size(chunk_size)
    pieces = []
    for start, stop in _chunks(logits.shape[1], chunk_size):
        x = logits[:, start:stop].float()
        if temperature != 1.0:
            x = x / temperature
        probs = torch.softmax(x, dim=-1)
        # p * x is 0 * (-inf) = NaN for banned tokens, in value and (through the multiplication) in gradient; their
        # true contribution is 0, so the product is taken on a finite copy of x (0 where p is 0).
        p_x = probs * torch.where(probs > 0, x, torch.zeros_like(x))
        pieces.append(torch.logsumexp(x, dim=-1) - p_x.sum(dim=-1))
    return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None
) -> torch.Tensor:
    """Sum of ``values`` over the positions where ``mask`` is True.

    Shape: values (...), mask (...) bool of the same shape -> scalar if ``dim`` is None, else
    the shape with ``dim`` removed. Typically (B, T) with B = sequences, T = token positions.
    Units: those of ``values``.

    Raises:
        ObjectiveError: mask not bool or not the shape of values.

    Source: definition (masked reduction).
    """
    check_mask(mask, values)
    kept = torch.where(mask, values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None
) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is True.

    Where no position is True the result is 0 (the empty sum), not NaN.

    Shape: values (...), mask (...) bool -> scalar if ``dim`` is None, else the shape with
    ``dim`` removed. Typically (B, T): B = sequences, T = token positions.
    Units: those of ``values``.

    Raises:
        ObjectiveError: mask not bool or not the shape of values.

    Source: definition (masked reduction).
    """
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(
    values: torch.Tensor, mask: torch.Tensor, unbiased: bool = False
) -> torch.Tensor:
    """Variance of ``values`` over all positions where ``mask`` is True (a scalar).

    Two-pass: mean first, then the mean squared deviation. ``unbiased=True`` applies Bessel's
    correction n / (n - 1).

    Shape: values (...), mask (...) bool -> scalar (0-dim). Typically (B, T): B = sequences,
    T = token positions.
    Units: squared units of ``values``.

    Raises:
        ObjectiveError: mask not bool or not the shape of values; no True position (or only one
            when ``unbiased``): the variance is undefined. (Reads the count, a host sync.)

    Source: definition of the (sample) variance.
    """
    check_mask(mask, values)
    count = int(mask.sum())
    needed = 2 if unbiased else 1
    if count < needed:
        raise ObjectiveError(
            f"masked_var needs at least {needed} position(s) where mask is True, got {count}; "
            "check the mask (an empty batch has no variance)"
        )
    mean = masked_mean(values, mask)
    centred = torch.where(mask, values - mean, torch.zeros_like(values))
    var = (centred * centred).sum() / count
    if unbiased:
        var = var * (count / (count - 1))
    return var


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Normalise ``values`` to mean 0 and variance 1 over the True positions.

    ``out = (values - mean) / sqrt(var + eps)`` where mean and (population, i.e. biased)
    variance are taken over the True positions only; out is exactly 0 at False positions, and
    the values there have no influence. With ``shift_mean=False`` the mean is added back
    (only the scale changes), as PPO implementations do when whitening rewards.

    Data parallelism: ``all_reduce`` is a callable that returns the element-wise SUM of its
    tensor argument over all data-parallel processes (e.g. a wrapper of
    ``torch.distributed.all_reduce`` with ``ReduceOp.SUM`` that returns the tensor). It is
    called exactly twice, by every process, in this order: on a float64 tensor
    ``[sum of values, number of True positions]`` (shape (2,)), then on a float64 tensor
    ``[sum of squared deviations from the global mean]`` (shape (1,)). The statistics are then
    those of the whole global batch. Default: no reduction (single process).

    Shape: values (...), mask (...) bool of the same shape -> same shape and dtype as values.
    Typically (B, T) advantages: B = sequences, T = token positions.
    Units: dimensionless (standard deviations) when ``shift_mean``; else values' units rescaled.

    Raises:
        ObjectiveError: mask not bool or shape mismatch; eps < 0; no True position in the
            (global) batch. (Reads the global count, a host sync.)

    Source: advantage normalisation of PPO practice (Huang et al. 2022, "The 37 Implementation
    Details of Proximal Policy Optimization", ICLR 2022 Blog Track, detail "Normalization of
    Advantages"), restricted to the tokens of the completion mask.
    """
    check_mask(mask, values)
    eps = check_number("eps", eps, low=0.0)
    reduce = all_reduce if all_reduce is not None else (lambda t: t)

    v64 = values.double()  # statistics in float64: exact enough for any batch size
    kept = torch.where(mask, v64, torch.zeros_like(v64))
    first = torch.stack([kept.sum(), mask.sum().to(torch.float64)])
    first = reduce(first)
    count = float(first[1])
    if count < 1:
        raise ObjectiveError(
            "masked_whiten got no position where mask is True in the whole (global) batch; "
            "there is nothing to whiten — check the completion mask"
        )
    mean = first[0] / count
    centred = torch.where(mask, v64 - mean, torch.zeros_like(v64))
    second = reduce((centred * centred).sum().reshape(1))
    var = second[0] / count
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = torch.where(mask, out + mean, torch.zeros_like(out))
    return out.to(values.dtype)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """The position of each row's LAST counted token (the rightmost True of ``mask``), whatever the padding side.

    ``index[b] = max{t : mask[b, t]}``, or -1 for a row with no counted token. Right padding (completions)
    gives ``mask[b].sum() - 1``; left padding (prompts) gives T - 1; holes are allowed.

    Shape: mask (B, T) bool -> (B,) long; B = rows, T = token positions.
    Units: token positions.

    Raises:
        ObjectiveError: mask not a (B, T) bool tensor.

    Source: definition (where a sequence-level reward lands: Ziegler et al. 2019, sec. 2.2; where a reward
    model reads its scalar head: Ouyang et al. 2022, sec. 3.5).
    """
    check_ndim("mask", mask, 2, "(B, T)")
    if mask.dtype != torch.bool:
        raise ObjectiveError(f"mask must be bool (True = counts), got dtype {mask.dtype}; convert it with mask.bool()")
    positions = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=-1)
