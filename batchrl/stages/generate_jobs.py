"""The generate stage's jobs: an iteration's prompt slices, cut so that every engine has work.

A batch's slices follow the prompts table's parts (one slice per part a batch touches): a 1024-prompt batch over
256-row parts is 4-5 slices, so 8 engines had 4-5 jobs, and 3-4 sat idle (issue 35). With ``generate.num_actors``
engines, slices larger than ``rows // num_actors`` are cut into row ranges of at most that many prompts, so there
are at least num_actors jobs of about equal size whenever the batch has that many prompts.

What stays the same: every sample's seed derives from (run seed, iteration, prompt_id, sample_idx), never from its
shard, so a cut batch rolls out the same prompts with the same seeds; only the partition of the rollouts table into
parts differs (names part-00000... by position, as a batch's always were). With one engine (the default) nothing is
cut and the table is exactly what it was. An engine batches the requests of one shard: with several engines the
rows may differ in the last float bits where an engine's numerics depend on its batch (vLLM on GPUs), as they
already did between runs with different part sizes. The cut is a function of the config (generate.num_actors), so
the output parts of a step, which the resume keeps, are known before it runs.
"""

from __future__ import annotations

from batchrl.algorithms.batches import Batch, Slice
from batchrl.storage.layout import part_name


def engine_slices(slices: tuple[Slice, ...], num_engines: int) -> tuple[Slice, ...]:
    """``slices`` with each one larger than ``rows // num_engines`` cut into consecutive pieces of its rows (ascending,
    at most that many each): at least ``num_engines`` pieces when the slices hold that many rows. Unchanged with one
    engine, or when no slice is larger."""
    total = sum(piece.rows for piece in slices)
    size = max(1, total // num_engines)
    if num_engines <= 1 or all(piece.rows <= size for piece in slices):
        return slices
    cut: list[Slice] = []
    for piece in slices:
        if piece.rows <= size:
            cut.append(piece)
            continue
        rows = piece.row_indices()
        count = -(-len(rows) // size)  # ceil: pieces of this slice, at most `size` rows each, near-equal
        bounds = [len(rows) * k // count for k in range(count + 1)]
        cut += [Slice(piece.part, 0, b - a, tuple(rows[a:b])) for a, b in zip(bounds, bounds[1:])]
    return tuple(cut)


def batch_parts(batch: Batch, *, num_engines: int = 1) -> list[tuple[str, Slice]]:
    """(output part name, the prompts slice it is generated from), the slices cut for ``num_engines`` engines
    (`engine_slices`): a whole-table iteration that is not cut keeps the prompts' part names (as before batches
    existed); otherwise parts are named by position, part-00000 for the first slice."""
    slices = engine_slices(batch.slices, num_engines)
    if batch.whole_parts and slices == batch.slices:
        return [(piece.part, piece) for piece in slices]
    return [(part_name(index), piece) for index, piece in enumerate(slices)]


def part_pieces(parts: list[tuple[str, int]], num_engines: int) -> dict[str, list[tuple[str, Slice]]]:
    """Each part ((name, rows)) of a table generated whole (evaluate's held-out prompts) as the pieces it is generated
    in, in row order (`engine_slices`): the part itself under its own name, or, cut, row ranges named
    ``<part>-r<k>.parquet``. A held-out set is often one part, which kept one of the engines busy."""
    cut: dict[str, list[Slice]] = {name: [] for name, _ in parts}
    for piece in engine_slices(tuple(Slice(name, 0, rows) for name, rows in parts), num_engines):
        cut[piece.part].append(piece)
    return {
        name: [(name, pieces[0])]
        if len(pieces) == 1 and pieces[0].row_ids is None
        else [(f"{name.removesuffix('.parquet')}-r{k:04d}.parquet", piece) for k, piece in enumerate(pieces)]
        for name, pieces in cut.items()
    }
