"""Per-iteration prompt batches: which prompts iteration i rolls out (verl's ``data.train_batch_size`` loop).

A pure function of (seed, iteration, the prompts table's parts and their row counts): a resumed run, a re-planned
run and ``--from-stage`` all see the same batch, and no state is carried between iterations.

- Epoch e orders the table's parts by a keyed hash of (seed, e, part index), and the rows inside each part by a
  keyed hash of (seed, e, part name, row) (`shuffle.keyed_order`: the same order under any numpy or Python
  version). The epoch's stream is those parts concatenated, each in its row order, and batch b of the epoch is
  positions [b*B, (b+1)*B) of it: a slice of a part is a set of its rows (`Slice.row_ids`, ascending).
- An epoch has floor(N / B) batches (at least 1); the rows after the last whole batch are left out of that epoch,
  as verl's sampler does with drop_last. Another permutation leaves out other rows in the next epoch. So every
  iteration has exactly B prompts, and a prompt is never twice in one batch (its GRPO group stays whole).
- Iteration i is batch i mod floor(N / B) of epoch i div floor(N / B).
- B unset (or B >= N): every iteration is the whole table, parts in table order (one epoch per iteration).

Why whole parts are shuffled between batches, not rows: a row-level permutation of the whole table sends every
batch to ~B different parts (B object-store reads of a whole part each, per iteration), while a part-level one
reads about B / shard_size parts, each read whole as before. Why rows are
shuffled inside each part too: without it, a table of one part (any set smaller than two shards) gave every epoch
the same batches in the same order (rows 0-31, 32-63, ...), and a part split between batches was split at the same
rows every epoch. Shuffling inside a part costs no read: a batch reads the same parts, and a shard worker reads a
whole part anyway, then takes its rows. What remains coarse: rows of one part (neighbours in the input files) stay
in the same or adjacent batches of an epoch. Shuffle the input rows once, before ingest, if neighbouring rows are
alike (sorted by source or difficulty).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchrl.algorithms.shuffle import keyed_order


@dataclass(frozen=True)
class Slice:
    """Positions [start, stop) of one part of the prompts table: its rows [start, stop) in table order, or, with
    ``row_ids``, the rows at those positions of the part's order in the epoch (listed ascending)."""

    part: str
    start: int
    stop: int
    row_ids: tuple[int, ...] | None = None

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def row_indices(self) -> list[int]:
        """The part's rows the slice takes, ascending."""
        return list(range(self.start, self.stop)) if self.row_ids is None else list(self.row_ids)


@dataclass(frozen=True)
class Batch:
    iteration: int
    epoch: int
    index_in_epoch: int
    batches_per_epoch: int
    slices: tuple[Slice, ...]
    whole_parts: bool  # every slice is a whole part, in table order (prompts_per_iteration unset or >= the table)
    sources: tuple = ()  # a mixed batch (data.sources): each source's `mixing.SourceShare`, in the sources' order
    skipped: int = 0  # data.curriculum: prompts passed over as solved (`curriculum.curriculum_batch`)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.slices)


def batches_per_epoch(num_rows: int, batch_size: int | None) -> int:
    """floor(num_rows / batch_size), at least 1 (a batch larger than the table is the whole table)."""
    if batch_size is None or batch_size >= num_rows:
        return 1
    return num_rows // batch_size


def part_order(num_parts: int, *, seed: int, epoch: int, stream: str = "") -> list[int]:
    """The indices of the parts in epoch ``epoch``'s order: a permutation keyed by (seed, epoch) alone, or with
    ``stream`` (a source of a mixed batch) by (seed, epoch, stream)."""
    return keyed_order(num_parts, seed=seed, epoch=epoch, stream=stream)


def row_order(num_rows: int, *, seed: int, epoch: int, part: str) -> list[int]:
    """The rows of part ``part`` in epoch ``epoch``'s order: a permutation keyed by (seed, epoch, part name), so two
    parts of one size are not shuffled alike."""
    return keyed_order(num_rows, seed=seed, epoch=epoch, stream=part)


def iteration_batch(
    parts: list[tuple[str, int]], *, seed: int, iteration: int, batch_size: int | None, stream: str = ""
) -> Batch:
    """The prompts of ``iteration``, as slices of ``parts`` ((name, rows) in table order). ``stream`` keys the order
    of the parts as well (one source of a mixed batch, `mixing`); rows are keyed by their part's name already."""
    num_rows = sum(rows for _, rows in parts)
    per_epoch = batches_per_epoch(num_rows, batch_size)
    epoch, index = divmod(iteration, per_epoch)
    if batch_size is None or batch_size >= num_rows:
        slices = tuple(Slice(name, 0, rows) for name, rows in parts if rows)
        return Batch(iteration, epoch, index, per_epoch, slices, whole_parts=True)
    first, last = index * batch_size, (index + 1) * batch_size
    slices, offset = [], 0
    for position in part_order(len(parts), seed=seed, epoch=epoch, stream=stream):
        name, rows = parts[position]
        start, stop = max(first, offset), min(last, offset + rows)
        if start < stop:
            taken = row_order(rows, seed=seed, epoch=epoch, part=name)[start - offset : stop - offset]
            slices.append(Slice(name, start - offset, stop - offset, tuple(sorted(taken))))
        offset += rows
        if offset >= last:
            break
    return Batch(iteration, epoch, index, per_epoch, tuple(slices), whole_parts=False)


def described(batch: Batch, *, max_rows: int = 8) -> str:
    """Where a batch's prompts come from, for `batchrl plan`: each part and its rows, the first ``max_rows`` of a
    part listed ("part-00003: 32 rows 0 2 5 9 11 12 17 20 ...")."""
    pieces = []
    for piece in batch.slices:
        rows = piece.row_indices()
        shown = " ".join(map(str, rows[:max_rows])) + (" ..." if len(rows) > max_rows else "")
        pieces.append(f"{piece.part}: {len(rows)} rows {shown}" if piece.row_ids is not None else f"{piece.part}: all")
    return "; ".join(pieces)
