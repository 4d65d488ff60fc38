"""generate's jobs (issue 35, item 3): an iteration's prompt slices are cut so that generate.num_actors engines all
have work, and with one engine they are what they always were."""

from __future__ import annotations

from collections import defaultdict

from batchrl.algorithms.batches import iteration_batch
from batchrl.stages.generate_jobs import batch_parts, engine_slices, part_pieces
from batchrl.storage.layout import part_name

PARTS = [(part_name(k), 256) for k in range(40)]  # a 10,240-prompt table of 256-row parts


def rows_by_part(pieces) -> dict[str, list[int]]:
    rows = defaultdict(list)
    for _, piece in pieces:
        rows[piece.part] += piece.row_indices()
    return {part: sorted(ids) for part, ids in rows.items()}


def test_a_1024_prompt_batch_over_256_row_parts_gives_eight_engines_eight_jobs_or_more():
    batch = iteration_batch(PARTS, seed=3, iteration=2, batch_size=1024)
    assert len(batch.slices) <= 5  # what the engines got before: one job per part the batch touches
    pieces = batch_parts(batch, num_engines=8)
    assert len(pieces) >= 8
    assert max(len(piece.row_indices()) for _, piece in pieces) <= 1024 // 8
    assert rows_by_part(pieces) == rows_by_part(batch_parts(batch))  # the same prompts, none twice
    assert [name for name, _ in pieces] == [part_name(k) for k in range(len(pieces))]


def test_with_one_engine_the_jobs_are_the_batchs_slices_under_their_old_names():
    batch = iteration_batch(PARTS, seed=3, iteration=2, batch_size=1024)
    assert [piece for _, piece in batch_parts(batch)] == list(batch.slices)
    whole = iteration_batch(PARTS[:3], seed=3, iteration=0, batch_size=None)
    assert batch_parts(whole) == [(name, piece) for name, piece in zip([p for p, _ in PARTS[:3]], whole.slices)]


def test_a_whole_table_of_few_parts_is_cut_into_row_ranges_named_by_position():
    whole = iteration_batch(PARTS[:2], seed=3, iteration=0, batch_size=None)
    pieces = batch_parts(whole, num_engines=4)
    assert [len(piece.row_indices()) for _, piece in pieces] == [128] * 4
    assert [name for name, _ in pieces] == [part_name(k) for k in range(4)]
    assert rows_by_part(pieces) == {PARTS[0][0]: list(range(256)), PARTS[1][0]: list(range(256))}


def test_fewer_prompts_than_engines_give_one_job_a_prompt():
    batch = iteration_batch(PARTS, seed=0, iteration=0, batch_size=3)
    assert sum(len(piece.row_indices()) for piece in engine_slices(batch.slices, 8)) == 3
    assert len(engine_slices(batch.slices, 8)) == 3


def test_slices_already_small_enough_are_kept_as_they_are():
    batch = iteration_batch(PARTS, seed=0, iteration=0, batch_size=None)  # 40 parts of 256 rows for 8 engines
    assert engine_slices(batch.slices, 8) == batch.slices


def test_held_out_parts_are_cut_into_row_ranges_named_after_their_part_for_several_engines():
    parts = [("part-00000.parquet", 5), ("part-00001.parquet", 1)]
    one_engine = part_pieces(parts, 1)
    assert {part: [(name, piece.row_ids) for name, piece in pieces] for part, pieces in one_engine.items()} == {
        name: [(name, None)] for name, _ in parts
    }  # each part whole, under its own name, as before
    cut = part_pieces(parts, 3)  # 6 prompts, 3 engines: pieces of at most 2 prompts
    assert [name for name, _ in cut["part-00000.parquet"]] == [f"part-00000-r{k:04d}.parquet" for k in range(3)]
    assert [row for _, piece in cut["part-00000.parquet"] for row in piece.row_indices()] == [0, 1, 2, 3, 4]
    assert [(name, piece.row_ids) for name, piece in cut["part-00001.parquet"]] == [("part-00001.parquet", None)]
