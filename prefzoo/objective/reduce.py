"""The one loss reduction used by every algorithm, exact under gradient accumulation and DP.

A per-token (B, T) or per-example (B,) loss becomes a scalar as ``sum / normaliser``. The
numerator is computed per micro-batch; the normaliser is the GLOBAL one of the optimizer step:

    normaliser = sum over all micro-batches (and all data-parallel ranks) of
                 loss_normaliser(micro_batch_mask, aggregation, max_length)

Then ``sum over micro-batches of aggregate_loss(micro_batch, normaliser)`` is exactly the
loss (and gradient) of the whole step's batch, however the batch was split and whatever the
number of completion tokens in each piece. (Averaging per-micro-batch means instead weights
tokens of short micro-batches more: a silent bias.) Under DDP, which AVERAGES gradients over W
ranks, use the global normaliser and multiply the loss by W (or sum gradients instead).

Aggregations:

    sequence_mean  sum_b (1/n_b) sum_t v[b,t] / number of sequences   GRPO (Shao 2024, eq. 3)
    token_mean     sum_{b,t} v[b,t]           / number of tokens      DAPO (Yu 2025, eq. 8)
    constant       sum_{b,t} v[b,t]           / (B * max_length)      Dr. GRPO (Liu 2025)
    sequence_sum   sum_{b,t} v[b,t]           / number of sequences   LUSPO (Liu et al. 2026): each sequence's
                                                                      per-token loss summed, i.e. weighted by |y_b|
    example_mean   sum_b v[b]                 / number of examples    DPO, SimPO (per pair)

(sums over counted tokens only; n_b = counted tokens of row b.)
"""

from __future__ import annotations

import torch

from .errors import ObjectiveError, check_choice, check_mask, check_ndim, check_number
from .logprobs import masked_sum

__all__ = ["AGGREGATIONS", "loss_normaliser", "aggregate_loss"]

AGGREGATIONS = ("sequence_mean", "token_mean", "constant", "example_mean", "sequence_sum")


def loss_normaliser(mask_or_batch_size: torch.Tensor | int, aggregation: str,
                    max_length: int | None = None) -> float:
    """What one (micro-)batch contributes to the global normaliser of :func:`aggregate_loss`.

        sequence_mean -> B (rows, including rows with no counted token)
        token_mean    -> number of True entries of the mask
        constant      -> B * max_length (a fixed generation budget, not the padded length)
        example_mean  -> B
        sequence_sum  -> B

    Sum the result over every micro-batch of the optimizer step and over data-parallel ranks
    (all-reduce SUM) before calling :func:`aggregate_loss`.

    Shape: mask_or_batch_size is a (B, T) bool completion mask or the int B; B = sequences,
    T = completion token positions.
    Units: sequences, tokens, or token slots (constant).

    Raises:
        ObjectiveError: unknown aggregation (lists AGGREGATIONS); "token_mean" given an int
            (it needs the mask); "constant" without a positive max_length; mask not a (B, T)
            bool tensor; negative batch size.

    Source: GRPO, Shao et al. 2024, eq. 3 (1/G sum_i 1/|o_i| sum_t); DAPO, Yu et al. 2025,
    eq. 8 (1 / sum_i |o_i|); Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training"
    (constant normaliser).
    """
    check_choice("aggregation", aggregation, AGGREGATIONS)
    if isinstance(mask_or_batch_size, torch.Tensor):
        mask = mask_or_batch_size
        check_ndim("mask", mask, 2, "(B, T)")
        check_mask(mask, mask, "mask")
        batch = mask.shape[0]
    elif isinstance(mask_or_batch_size, int) and not isinstance(mask_or_batch_size, bool):
        mask, batch = None, mask_or_batch_size
        if batch < 0:
            raise ObjectiveError(f"batch size must be >= 0, got {batch}")
    else:
        raise ObjectiveError(
            "mask_or_batch_size must be a (B, T) bool mask or an int batch size, got "
            f"{type(mask_or_batch_size).__name__}"
        )
    if aggregation == "token_mean":
        if mask is None:
            raise ObjectiveError(
                "token_mean counts tokens, so loss_normaliser needs the (B, T) completion mask, "
                "not a batch size"
            )
        return float(mask.sum())
    if aggregation == "constant":
        if max_length is None:
            raise ObjectiveError(
                "the 'constant' aggregation needs max_length (the generation budget in "
                "tokens, the same for every micro-batch), e.g. max_length=cfg.max_new_tokens"
            )
        max_length = int(check_number("max_length", max_length, low=0.0, strict_low=True))
        return float(batch * max_length)
    return float(batch)


def aggregate_loss(values: torch.Tensor, mask: torch.Tensor | None, aggregation: str,
                   normaliser: float | torch.Tensor) -> torch.Tensor:
    """Reduce per-token (or per-example) losses to the scalar to backpropagate.

        sequence_mean: sum_b (sum_t v[b,t] m[b,t] / n_b) / normaliser   (n_b = sum_t m[b,t];
                       rows with no counted token contribute 0)
        token_mean:    sum_{b,t} v[b,t] m[b,t] / normaliser
        constant:      sum_{b,t} v[b,t] m[b,t] / normaliser
        sequence_sum:  sum_{b,t} v[b,t] m[b,t] / normaliser                (normaliser: the number of sequences)
        example_mean:  sum_b v[b] / normaliser                          (mask must be None)

    ``normaliser`` is the GLOBAL one: the sum of :func:`loss_normaliser` over all micro-batches
    (and ranks) of the optimizer step. With the micro-batch's own normaliser, this is the plain
    mean of that micro-batch.

    Shape: values (B, T) with mask (B, T) bool, or values (B,) with mask None for
    example_mean -> scalar (0-dim); B = sequences (or pairs), T = completion token positions.
    Units: those of values (per token or per example).

    Raises:
        ObjectiveError: unknown aggregation; normaliser not > 0 (e.g. no token in the whole
            step); token aggregations without a (B, T) bool mask matching values;
            example_mean with a mask or with values that are not (B,).

    Source: GRPO, Shao et al. 2024, eq. 3; DAPO, Yu et al. 2025, eq. 8; Dr. GRPO, Liu et al.
    2025; LUSPO, Liu et al. 2026 (arXiv 2602.05261: GSPO's sequence loss scaled by the sequence's length, TRL 1.16's
    ``loss_type="luspo"``: ``(per_token_loss * mask).sum(-1).mean()``); DESIGN.md "Conventions" (one tested
    reduction, global normaliser).
    """
    check_choice("aggregation", aggregation, AGGREGATIONS)
    normaliser = check_number(
        "normaliser", normaliser, low=0.0, strict_low=True,
        hint="it is the sum of loss_normaliser(...) over the whole step; 0 means the step has "
             "no sequence/token to learn from — skip it",
    )
    if aggregation == "example_mean":
        if mask is not None:
            raise ObjectiveError(
                "example_mean reduces per-example losses (B,); pass mask=None (reduce per-token "
                "losses to per-example ones first, e.g. with sequence_logps)"
            )
        check_ndim("values", values, 1, "(B,) — one loss per example")
        return values.sum() / normaliser
    check_ndim("values", values, 2, "(B, T) — one loss per token")
    if mask is None:
        raise ObjectiveError(f"aggregation {aggregation!r} needs the (B, T) bool completion mask")
    check_mask(mask, values)
    if aggregation == "sequence_mean":
        per_row = masked_sum(values, mask, dim=-1)
        counts = mask.sum(dim=-1).clamp(min=1).to(per_row.dtype)
        return (per_row / counts).sum() / normaliser
    return masked_sum(values, mask) / normaliser
