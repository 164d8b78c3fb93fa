"""Tests for prefzoo.objective.reduce: the one loss reduction, exact under accumulation.

Tolerances (tests/bounds.py). The hand values are exact in float32 but for one division (kind 1). The accumulation
tests are float64 (kind 1): the whole batch and its micro-batches sum the same <= 30 values of |v| <= 2.3
(sum |v| = 28.8 over all 30, 16.6 over the 17 masked-in) in other orders, at most 2 gamma_29 sum |v| / N = 3.7e-14
apart (tests.bounds.sum_bound with u64, N >= 5 the normaliser); 1e-12 leaves 27x over that worst case (measured
1.1e-16). A gradient element is 1/N or 1/(n_b N), computed alike in both: measured equal.
"""

import pytest
import torch

from prefzoo.objective import AGGREGATIONS, ObjectiveError, aggregate_loss, loss_normaliser
from tests.bounds import U32

MAX_LENGTH = 4


def test_hand_values_each_aggregation():
    """values [[1, 2, 3], [4, 5, 6]], mask [[T, T, F], [T, F, F]], max_length 4:
    sequence_mean: row means (1+2)/2 = 1.5 and 4, sum 5.5, / 2 rows     = 2.75
    token_mean:    (1 + 2 + 4) / 3 tokens                              = 7/3
    constant:      7 / (2 rows * 4)                                    = 0.875
    example_mean:  per-example [3, 5] / 2                              = 4
    Sums of small integers and divisions by 2 and 8 are exact in float32; 7/3 is rounded: within 2 u32 |7/3| (a
    division, or a product with a rounded reciprocal; measured 7.9e-8, bound 2.8e-7; was a round 1e-6)."""
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    expected = {"sequence_mean": 2.75, "token_mean": 7 / 3, "constant": 0.875}
    for agg, value in expected.items():
        n = loss_normaliser(mask, agg, max_length=MAX_LENGTH)
        assert abs(float(aggregate_loss(values, mask, agg, n)) - value) <= 2 * U32 * value, agg
    per_example = torch.tensor([3.0, 5.0])
    n = loss_normaliser(2, "example_mean")
    assert float(aggregate_loss(per_example, None, "example_mean", n)) == 4.0
    assert loss_normaliser(mask, "sequence_mean") == 2.0
    assert loss_normaliser(mask, "token_mean") == 3.0
    assert loss_normaliser(mask, "constant", max_length=MAX_LENGTH) == 8.0


def test_rows_without_tokens_contribute_zero_to_sequence_mean():
    values = torch.tensor([[1.0, 3.0], [float("nan"), 7.0]])
    mask = torch.tensor([[True, True], [False, False]])
    out = aggregate_loss(values, mask, "sequence_mean", loss_normaliser(mask, "sequence_mean"))
    assert float(out) == 1.0  # (2 + 0) / 2


def _batch():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(5, 6, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 5, 2])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    return values, mask


def _loss_and_grad(values, pieces, agg, use_global):
    """Sum of aggregate_loss over micro-batches (row slices); returns (loss, d loss / d values)."""
    values = values.clone().requires_grad_(True)
    _, mask = _batch()
    if agg == "example_mean":
        norms = [loss_normaliser(stop - start, agg) for start, stop in pieces]
    else:
        norms = [loss_normaliser(mask[start:stop], agg, max_length=6) for start, stop in pieces]
    total = sum(norms)
    loss = 0.0
    for (start, stop), own in zip(pieces, norms):
        if agg == "example_mean":
            per_example = values[start:stop].sum(-1)
            part = aggregate_loss(per_example, None, agg, total if use_global else own)
        else:
            part = aggregate_loss(values[start:stop], mask[start:stop], agg,
                                  total if use_global else own)
        loss = loss + (part if use_global else part / len(pieces))
    (grad,) = torch.autograd.grad(loss, values)
    return float(loss.detach()), grad


@pytest.mark.numerics
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_micro_batches_with_global_normaliser_equal_the_whole_batch(agg):
    """Split 5 rows as [0:2] (7 tokens) + [2:5] (10 tokens): summing aggregate_loss over the
    micro-batches with the GLOBAL normaliser equals the whole batch, in value and gradient.
    Averaging the per-micro-batch means (the naive recipe) does not (it moves the loss and the gradient by > 1e-3).
    Bounds: module docstring."""
    values, _ = _batch()
    whole_loss, whole_grad = _loss_and_grad(values, [(0, 5)], agg, use_global=True)
    split_loss, split_grad = _loss_and_grad(values, [(0, 2), (2, 5)], agg, use_global=True)
    assert abs(split_loss - whole_loss) < 1e-12
    torch.testing.assert_close(split_grad, whole_grad, atol=1e-12, rtol=0)
    naive_loss, naive_grad = _loss_and_grad(values, [(0, 2), (2, 5)], agg, use_global=False)
    assert abs(naive_loss - whole_loss) > 1e-3
    assert float((naive_grad - whole_grad).abs().max()) > 1e-3


@pytest.mark.numerics
def test_three_uneven_pieces_token_mean():
    """Rows [0:1] + [1:2] + [2:5] with the global normaliser equal the whole batch (bounds: module docstring)."""
    values, _ = _batch()
    whole, g_whole = _loss_and_grad(values, [(0, 5)], "token_mean", use_global=True)
    split, g_split = _loss_and_grad(values, [(0, 1), (1, 2), (2, 5)], "token_mean", use_global=True)
    assert abs(split - whole) < 1e-12
    torch.testing.assert_close(g_split, g_whole, atol=1e-12, rtol=0)


def test_reduce_errors():
    values, mask = _batch()
    with pytest.raises(ObjectiveError, match="'sequence_mean', 'token_mean'"):
        loss_normaliser(mask, "median")
    with pytest.raises(ObjectiveError, match="needs the"):
        loss_normaliser(5, "token_mean")
    with pytest.raises(ObjectiveError, match="max_length"):
        loss_normaliser(mask, "constant")
    with pytest.raises(ObjectiveError, match="normaliser"):
        aggregate_loss(values, mask, "token_mean", 0.0)
    with pytest.raises(ObjectiveError, match="mask=None"):
        aggregate_loss(values[:, 0], mask[:, 0], "example_mean", 5.0)
    with pytest.raises(ObjectiveError, match=r"\(B, T\)"):
        aggregate_loss(values[:, 0], None, "token_mean", 5.0)
    with pytest.raises(ObjectiveError, match="bool"):
        aggregate_loss(values, mask.float(), "token_mean", 5.0)
