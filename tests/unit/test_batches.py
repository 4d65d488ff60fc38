"""Per-iteration prompt batches (batchrl.algorithms.batches): exact sizes, epochs, determinism, rows shuffled inside
the parts a batch reads."""

from __future__ import annotations

import pytest

from batchrl.algorithms.batches import Slice, batches_per_epoch, iteration_batch, part_order, row_order

PARTS = [("p0", 3), ("p1", 2), ("p2", 4), ("p3", 5)]  # 14 rows


def rows_of(batch) -> list[tuple[str, int]]:
    return [(s.part, row) for s in batch.slices for row in s.row_indices()]


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


def test_a_batch_is_a_window_of_the_epochs_permuted_stream_of_parts_each_in_its_row_order():
    """By hand: the epoch's part order from part_order, each part's rows in row_order, then positions [4, 8) of the
    concatenated parts; a slice lists its rows ascending."""
    order = part_order(len(PARTS), seed=11, epoch=0)
    stream = [(PARTS[i][0], row) for i in order for row in row_order(PARTS[i][1], seed=11, epoch=0, part=PARTS[i][0])]
    batch = iteration_batch(PARTS, seed=11, iteration=1, batch_size=4)
    assert sorted(rows_of(batch)) == sorted(stream[4:8])
    assert [s.part for s in batch.slices] == list(dict.fromkeys(part for part, _ in stream[4:8]))
    assert (batch.epoch, batch.index_in_epoch, batch.batches_per_epoch, batch.rows) == (0, 1, 3, 4)


def test_the_batches_of_a_known_seed_stay_what_they_were_when_pinned():
    """Computed once (`shuffle.keyed_order`): a change moves prompts between the iterations of every existing run."""
    assert part_order(len(PARTS), seed=11, epoch=0) == [3, 2, 0, 1]
    assert [iteration_batch(PARTS, seed=11, iteration=i, batch_size=4).slices for i in range(4)] == [
        (Slice("p3", 0, 4, (0, 2, 3, 4)),),
        (Slice("p3", 4, 5, (1,)), Slice("p2", 0, 3, (0, 1, 2))),
        (Slice("p2", 3, 4, (3,)), Slice("p0", 0, 3, (0, 1, 2))),
        (Slice("p1", 0, 2, (0, 1)), Slice("p3", 0, 2, (2, 4))),  # epoch 1: another order
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


def test_a_part_split_between_batches_is_split_at_the_boundary_of_its_row_order():
    parts = [("a", 10)]
    first = iteration_batch(parts, seed=0, iteration=0, batch_size=4)
    second = iteration_batch(parts, seed=0, iteration=1, batch_size=4)
    order = row_order(10, seed=0, epoch=0, part="a")
    assert first.slices == (Slice("a", 0, 4, tuple(sorted(order[:4]))),)
    assert second.slices == (Slice("a", 4, 8, tuple(sorted(order[4:8]))),)
    assert iteration_batch(parts, seed=0, iteration=2, batch_size=4).epoch == 1  # 2 rows left out of epoch 0


def test_a_table_of_one_part_gives_each_epoch_other_batches_not_the_same_rows_in_the_same_order():
    """The quickstart's case (one part of 128 rows, 32 per iteration): epochs used to repeat rows 0-31, 32-63, ..."""
    parts = [("part-00000", 128)]
    epochs = [
        [
            frozenset(rows_of(iteration_batch(parts, seed=5, iteration=epoch * 4 + index, batch_size=32)))
            for index in range(4)
        ]
        for epoch in range(3)
    ]
    for batches in epochs:
        assert len(frozenset().union(*batches)) == 128  # an epoch still covers every row once
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert not set(epochs[0]) & set(epochs[1])  # no batch of epoch 0 comes back in epoch 1
    assert epochs[0][0] != frozenset(("part-00000", row) for row in range(32))


def test_a_batch_reads_only_the_parts_of_its_window_of_the_part_stream():
    """Rows are shuffled inside parts, never across them: the parts a batch reads are the same as without it."""
    parts = [(f"p{i}", 10) for i in range(20)]
    for iteration in range(40):
        batch = iteration_batch(parts, seed=2, iteration=iteration, batch_size=25)
        order = part_order(len(parts), seed=2, epoch=batch.epoch)
        stream = [parts[i][0] for i in order for _ in range(10)]
        first = batch.index_in_epoch * 25
        assert [s.part for s in batch.slices] == list(dict.fromkeys(stream[first : first + 25]))
        assert len(batch.slices) <= 4  # 25 rows from parts of 10: at most 4 parts
