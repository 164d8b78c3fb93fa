"""Tests for prefzoo.training.sampler.IndexSampler: seeded epochs, exact mid-epoch resume."""

import pytest

from prefzoo.training.sampler import IndexSampler


def test_each_epoch_is_a_permutation_and_epochs_differ():
    s = IndexSampler(10, 5, seed=3)
    e1 = s.next() + s.next()
    e2 = s.next() + s.next()
    assert sorted(e1) == sorted(e2) == list(range(10))
    assert e1 != e2


def test_batches_wrap_across_epochs():
    s = IndexSampler(5, 3, seed=0)
    batches = [s.next() for _ in range(5)]  # 15 indices = 3 epochs exactly
    flat = sum(batches, [])
    for epoch in range(3):
        assert sorted(flat[5 * epoch: 5 * epoch + 5]) == list(range(5))
    assert s.epoch == 2 and s.position == 5


def test_same_seed_same_order_other_seed_other_order():
    assert [IndexSampler(20, 4, 1).next() for _ in range(1)] == [IndexSampler(20, 4, 1).next()]
    assert IndexSampler(20, 4, 1).next() != IndexSampler(20, 4, 2).next()


@pytest.mark.parametrize("consumed", [1, 2, 3, 7])
def test_resume_mid_epoch_continues_exactly(consumed):
    straight = IndexSampler(7, 3, seed=4)
    ahead = [straight.next() for _ in range(consumed)]
    state = straight.state_dict()
    rest = [straight.next() for _ in range(6)]
    fresh = IndexSampler(7, 3, seed=4)
    fresh.load_state_dict(state)
    assert [fresh.next() for _ in range(6)] == rest
    assert ahead  # (the resumed sampler did not replay the consumed batches)


def test_no_shuffle_and_empty():
    s = IndexSampler(4, 3, seed=0, shuffle=False)
    assert s.next() == [0, 1, 2] and s.next() == [3, 0, 1]
    with pytest.raises(ValueError, match="empty"):
        IndexSampler(0, 1, 0)
