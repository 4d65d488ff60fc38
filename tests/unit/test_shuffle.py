"""Seeded shuffles (batchrl.algorithms.shuffle): a permutation keyed by (seed, epoch) alone, the same under any numpy
or Python version. The pinned orders were computed once by `keyed_order`; a change to them moves prompts between
iterations and samples between mini-batches of every existing run, so it must be deliberate."""

from __future__ import annotations

import hashlib

import pytest

from batchrl.algorithms.shuffle import keyed_order


@pytest.mark.parametrize(
    ("seed", "epoch", "num_items", "expected"),
    [
        (0, 0, 10, [0, 4, 2, 3, 8, 7, 6, 9, 5, 1]),
        (0, 1, 10, [3, 2, 7, 0, 8, 4, 6, 5, 9, 1]),
        (7, 1, 10, [2, 0, 8, 4, 9, 5, 1, 3, 6, 7]),
        (42, 3, 16, [10, 5, 15, 4, 12, 8, 7, 3, 2, 0, 11, 9, 13, 14, 1, 6]),
    ],
)
def test_known_orders_stay_what_they_were_when_pinned(seed, epoch, num_items, expected):
    assert keyed_order(num_items, seed=seed, epoch=epoch) == expected


def test_the_order_is_that_of_each_items_blake2b_digest_of_seed_epoch_and_index():
    def digest(index: int) -> bytes:
        return hashlib.blake2b(f"5/2/{index}".encode(), digest_size=8).digest()

    assert keyed_order(200, seed=5, epoch=2) == sorted(range(200), key=digest)


@pytest.mark.parametrize("num_items", [0, 1, 2, 3, 100, 1000])
def test_every_order_is_a_permutation_of_the_indices(num_items):
    assert sorted(keyed_order(num_items, seed=3, epoch=4)) == list(range(num_items))


def test_another_epoch_or_seed_gives_another_order_and_the_same_ones_the_same():
    orders = {tuple(keyed_order(50, seed=seed, epoch=epoch)) for seed in range(4) for epoch in range(5)}
    assert len(orders) == 20
    assert keyed_order(50, seed=1, epoch=2) == keyed_order(50, seed=1, epoch=2)


def test_the_items_of_a_shorter_list_keep_their_relative_order_in_a_longer_one():
    """Each item's key depends on its own index alone (no draw of a stream shared by all items)."""
    short, long = keyed_order(20, seed=0, epoch=0), keyed_order(40, seed=0, epoch=0)
    assert [i for i in long if i < 20] == short
