"""Per-iteration prompt batches (batchrl.algorithms.batches): exact sizes, epochs, determinism."""

from __future__ import annotations

import pytest

from batchrl.algorithms.batches import Slice, batches_per_epoch, iteration_batch, part_order

PARTS = [("p0", 3), ("p1", 2), ("p2", 4), ("p3", 5)]  # 14 rows


def rows_of(batch) -> list[tuple[str, int]]:
    return [(s.part, row) for s in batch.slices for row in range(s.start, s.stop)]


def test_batches_per_epoch_drops_the_rows_after_the_last_whole_batch():
    assert batches_per_epoch(14, 4) == 3
    assert batches_per_epoch(14, 7) == 2
    assert batches_per_epoch(14, 14) == 1
    assert batches_per_epoch(14, 100) == 1
    assert batches_per_epoch(14, None) == 1


def test_unset_batch_size_is_the_whole_table_in_table_order_every_iteration():
    for iteration in (0, 1, 7):
        batch = iteration_batch(PARTS, seed=3, iteration=iteration, batch_size=None)
        assert batch.whole_parts and batch.epoch == iteration and batch.index_in_epoch == 0
        assert batch.slices == tuple(Slice(name, 0, rows) for name, rows in PARTS)
    assert iteration_batch(PARTS, seed=3, iteration=0, batch_size=99).slices == batch.slices


def test_a_batch_is_a_window_of_the_epochs_permuted_stream_of_parts():
    """By hand: the epoch's part order from part_order, then rows [4, 8) of the concatenated parts."""
    order = part_order(len(PARTS), seed=11, epoch=0)
    stream = [(PARTS[i][0], row) for i in order for row in range(PARTS[i][1])]
    batch = iteration_batch(PARTS, seed=11, iteration=1, batch_size=4)
    assert rows_of(batch) == stream[4:8]
    assert (batch.epoch, batch.index_in_epoch, batch.batches_per_epoch, batch.rows) == (0, 1, 3, 4)


def test_the_batches_of_a_known_seed_stay_what_they_were_when_pinned():
    """Computed once (`shuffle.keyed_order`): a change moves prompts between the iterations of every existing run."""
    assert part_order(len(PARTS), seed=11, epoch=0) == [3, 2, 0, 1]
    assert [iteration_batch(PARTS, seed=11, iteration=i, batch_size=4).slices for i in range(4)] == [
        (Slice("p3", 0, 4),),
        (Slice("p3", 4, 5), Slice("p2", 0, 3)),
        (Slice("p2", 3, 4), Slice("p0", 0, 3)),
        (Slice("p1", 0, 2), Slice("p3", 0, 2)),  # epoch 1: another order
    ]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_each_epoch_covers_distinct_prompts_in_batches_of_exactly_the_size(seed):
    everything = {(name, row) for name, rows in PARTS for row in range(rows)}
    epochs = []
    for epoch in range(3):
        seen: list[tuple[str, int]] = []
        for index in range(3):  # 14 // 4 batches per epoch
            batch = iteration_batch(PARTS, seed=seed, iteration=epoch * 3 + index, batch_size=4)
            assert batch.rows == 4 and batch.epoch == epoch and batch.index_in_epoch == index
            seen += rows_of(batch)
        assert len(seen) == len(set(seen)) == 12 and set(seen) <= everything  # 2 rows left out this epoch
        epochs.append(seen)
    assert iteration_batch(PARTS, seed=seed, iteration=2, batch_size=4) == iteration_batch(
        PARTS, seed=seed, iteration=2, batch_size=4
    )


def test_epochs_are_permuted_differently_and_the_seed_matters():
    orders = {tuple(part_order(50, seed=0, epoch=e)) for e in range(5)}
    assert len(orders) == 5
    assert part_order(50, seed=0, epoch=0) != part_order(50, seed=1, epoch=0)
    assert sorted(part_order(50, seed=0, epoch=3)) == list(range(50))


def test_a_part_split_between_batches_is_sliced_at_the_boundary():
    parts = [("a", 10)]
    first = iteration_batch(parts, seed=0, iteration=0, batch_size=4)
    second = iteration_batch(parts, seed=0, iteration=1, batch_size=4)
    assert first.slices == (Slice("a", 0, 4),) and second.slices == (Slice("a", 4, 8),)
    assert iteration_batch(parts, seed=0, iteration=2, batch_size=4).epoch == 1  # rows 8, 9 left out of epoch 0
