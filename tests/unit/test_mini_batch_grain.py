"""update.mini_batch_grain row_group: mini-batches of whole row groups and ranks on contiguous runs of the table, so
that an update rank decodes about its share of the advantages table per pass (issue 35, item 2).

The table is simulated in the grpo_math.yaml shape: 1,024 prompts x 5 samples in 4 parts of 256 prompts (one per
scores shard), row groups of whole prompt groups (60 rows: `advantage.group_aligned_rows`), mini-batches of 256
prompts, 8 ranks. Prompt ids are random, so the index's order (by prompt_id) is not the storage order.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from batchrl.stages.advantage import ROW_GROUP_ROWS, group_aligned_rows
from batchrl.trainer.batching import RANK_SLACK, block_mini_batches, mini_batches, plan_micro_batches, storage_ranks

PROMPTS, SAMPLES, PARTS, MINI_BATCH, WORLD = 1024, 5, 4, 256, 8


def simulated_table(*, row_group_rows: int = 60, seed: int = 0) -> dict[str, np.ndarray]:
    """Per sample, in the index's order (by prompt_id, then sample_idx): its group, storage row, row group and
    tokens (prompt + response)."""
    rng = np.random.default_rng(seed)
    rows = PROMPTS * SAMPLES
    rows_per_part = rows // PARTS
    storage_row = np.arange(rows)
    prompt_rank = rng.permutation(PROMPTS)[storage_row // SAMPLES]  # where each storage group sorts by prompt_id
    order = np.argsort(prompt_rank * SAMPLES + storage_row % SAMPLES)  # index position -> storage row
    storage_row_N = storage_row[order]
    groups_per_part = -(-rows_per_part // row_group_rows)
    part_N = storage_row_N // rows_per_part
    return {
        "group_N": prompt_rank[order],
        "storage_row_N": storage_row_N,
        "row_group_N": part_N * groups_per_part + (storage_row_N % rows_per_part) // row_group_rows,
        "tokens_N": rng.integers(100, 1300, rows),
        "row_group_rows": np.int64(row_group_rows),
    }


def rows_decoded(table: dict[str, np.ndarray], samples: np.ndarray) -> int:
    """The rows a reader decodes to read `samples`: every row group they touch, whole."""
    return len(np.unique(table["row_group_N"][samples])) * int(table["row_group_rows"])


def epoch_reads_over_share(table, *, grain: str, epoch: int = 0) -> np.ndarray:
    """Per rank, rows decoded over one epoch / its share of the table (rows / world)."""
    group_N, rows = table["group_N"], len(table["group_N"])
    decoded = np.zeros(WORLD)
    if grain == "row_group":
        batches = block_mini_batches(
            group_N, table["row_group_N"], groups_per_mini_batch=MINI_BATCH, seed=3, epoch=epoch
        )
    else:
        batches = mini_batches(group_N, groups_per_mini_batch=MINI_BATCH, seed=3, epoch=epoch)
    for batch in batches:
        if grain == "row_group":
            ranks = storage_ranks(
                batch,
                **{k: table[k] for k in ("storage_row_N", "row_group_N", "group_N", "tokens_N")},
                world_size=WORLD,
            )
        else:  # today's planning: length-sorted micro-batches dealt over all ranks
            plan = plan_micro_batches(table["tokens_N"][batch], world_size=WORLD, max_tokens=16384)
            ranks = [batch[[i for chunk in micro_batches for i in chunk]] for micro_batches in plan]
        decoded += [rows_decoded(table, samples) for samples in ranks]
    return decoded / (rows / WORLD)


def test_a_rank_decodes_about_its_share_per_epoch_where_random_mini_batches_read_the_table_world_x_steps_times():
    table = simulated_table()
    for epoch in range(3):
        assert epoch_reads_over_share(table, grain="row_group", epoch=epoch).max() <= 1.5
    # the default's: each (mini-batch, rank) touches most row groups of the table (~70% of them at 60 rows, ~100% at
    # the 128 rows parts had before they were aligned to groups)
    assert epoch_reads_over_share(table, grain="sample").mean() > 0.5 * WORLD * PROMPTS / MINI_BATCH


def test_every_sample_is_in_exactly_one_mini_batch_per_epoch_and_groups_stay_whole():
    table = simulated_table()
    group_N = table["group_N"]
    batches = block_mini_batches(group_N, table["row_group_N"], groups_per_mini_batch=MINI_BATCH, seed=3, epoch=1)
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(len(group_N)))
    owner = np.zeros(len(group_N), dtype=np.int64)
    for k, batch in enumerate(batches):
        owner[batch] = k
        assert np.all(np.diff(batch) > 0)  # in the index's order, as mini_batches gives them
    for group in np.unique(group_N):
        assert len(np.unique(owner[group_N == group])) == 1
    # the same steps as random mini-batches: their number and prompts per step
    assert [len(np.unique(group_N[b])) for b in batches] == [MINI_BATCH] * (PROMPTS // MINI_BATCH)


def test_a_mini_batch_is_a_few_whole_row_groups_drawn_anew_each_epoch_and_seed_but_fixed_by_them():
    table = simulated_table()
    args = (table["group_N"], table["row_group_N"])

    def draw(seed, epoch):
        return block_mini_batches(*args, groups_per_mini_batch=MINI_BATCH, seed=seed, epoch=epoch)

    first = draw(3, 0)
    assert all(np.array_equal(a, b) for a, b in zip(first, draw(3, 0)))
    assert not np.array_equal(first[0], draw(3, 1)[0])
    assert not np.array_equal(first[0], draw(4, 0)[0])
    row_groups = len(np.unique(table["row_group_N"]))
    touched = [len(np.unique(table["row_group_N"][b])) for b in first]
    assert max(touched) <= row_groups * MINI_BATCH / PROMPTS + 2  # its own blocks and pieces of the two at its ends


def test_no_mini_batch_size_gives_one_mini_batch_in_table_order():
    table = simulated_table()
    (only,) = block_mini_batches(table["group_N"], table["row_group_N"], groups_per_mini_batch=None, seed=0, epoch=0)
    assert np.array_equal(only, np.arange(len(table["group_N"])))
    with pytest.raises(ValueError, match="groups_per_mini_batch=0"):
        block_mini_batches(table["group_N"], table["row_group_N"], groups_per_mini_batch=0, seed=0, epoch=0)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ranks_get_contiguous_runs_of_whole_groups_with_their_share_of_tokens_within_the_stated_factor(world):
    table = simulated_table()
    columns = {k: table[k] for k in ("storage_row_N", "row_group_N", "group_N", "tokens_N")}
    batch = block_mini_batches(
        table["group_N"], table["row_group_N"], groups_per_mini_batch=MINI_BATCH, seed=3, epoch=0
    )[0]
    ranks = storage_ranks(batch, **columns, world_size=world)
    assert np.array_equal(np.sort(np.concatenate(ranks)), batch)
    tokens = np.array([table["tokens_N"][r].sum() for r in ranks])
    largest_group = max(table["tokens_N"][table["group_N"] == g].sum() for g in np.unique(table["group_N"][batch]))
    assert tokens.max() <= (1 + 2 * RANK_SLACK) * tokens.mean() + largest_group
    for r, samples in enumerate(ranks):
        rows = np.sort(table["storage_row_N"][samples])
        later = np.concatenate(ranks[r + 1 :]) if r + 1 < world else np.zeros(0, np.int64)
        assert not len(later) or rows[-1] < table["storage_row_N"][later].min()  # runs in storage order
        for group in np.unique(table["group_N"][samples]):  # whole groups
            assert set(np.flatnonzero(table["group_N"] == group)) <= set(samples.tolist())


def test_advantages_parts_hold_whole_prompt_groups_per_row_group_when_every_prompt_has_as_many_samples():
    def table(sizes):
        return pa.table({"prompt_id": [f"p{k}" for k, size in enumerate(sizes) for _ in range(size)]})

    assert group_aligned_rows(table([5] * 300)) == 60
    assert group_aligned_rows(table([16] * 40)) == 64
    assert group_aligned_rows(table([5, 4, 5])) == ROW_GROUP_ROWS  # uneven groups: the plain cap
    assert group_aligned_rows(table([100] * 3)) == ROW_GROUP_ROWS  # a group larger than the cap
