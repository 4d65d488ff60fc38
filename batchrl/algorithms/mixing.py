"""Batches that mix several prompt sources in fixed proportions (``data.sources``): pure functions of the seed, the
iteration and the prompts table's parts, as `batches` is for one source.

- Weights become integer counts per iteration by the largest remainder (Hamilton's method): each source gets the
  floor of its exact share of B, and the prompts left over go to the largest fractional parts (ties to the source
  listed first), so the counts sum to B exactly and no source is more than one prompt off its share. Sources given
  an exact ``count`` take it first; the weighted ones share what is left.
- Each source is its own stream, with its own epochs: batch i takes count_s prompts from source s's stream exactly
  as `batches.iteration_batch` takes B from a single table (parts by a keyed hash, rows inside each part by one too),
  keyed by the source's name as well, so two sources of one size are not shuffled alike. A source whose rows run
  out starts its next epoch (a new order) while the others go on: with counts 24 and 8 per iteration and 96 and 96
  prompts, the first source repeats every 4 iterations and the second every 12. So a small source is repeated more
  often, which is what a weight above its share of the rows asks for.
- A part belongs to the source its name starts with (``<source>/part-00003.parquet``: ingest writes each source's
  rows into parts of their own, under a directory named after it), so the manifest alone says which rows are which
  source's and the batch needs nothing else.

Departure from ROLL's and NeMo-RL's samplers (a per-draw random choice of the source with the weights as
probabilities): those give every batch a random mix, exact only on average; here every batch holds the proportions
exactly, so a source's share of the update is the same every step and per-source metrics compare across steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchrl.algorithms.batches import Batch, iteration_batch

# (the source's parts, its count, its stream key) -> its slice of the batch: `iteration_batch` unless data.curriculum
Choose = Callable[[list[tuple[str, int]], int, str], Batch]


@dataclass(frozen=True)
class SourceShare:
    """One source's share of a mixed batch: how many prompts, and where its own stream is."""

    name: str
    count: int
    epoch: int
    index_in_epoch: int
    batches_per_epoch: int


def largest_remainder(weights: dict[str, float], total: int) -> dict[str, int]:
    """``total`` split in proportion to ``weights`` (positive), in integers summing to ``total``: each key gets the
    floor of its exact share, and the rest go one each to the largest fractional parts (ties: the key listed first)."""
    weight_sum = sum(weights.values())
    exact = {name: total * weight / weight_sum for name, weight in weights.items()}
    counts = {name: int(share) for name, share in exact.items()}
    left = total - sum(counts.values())
    by_remainder = sorted(exact, key=lambda name: -(exact[name] - counts[name]))  # stable: ties keep config order
    for name in by_remainder[:left]:
        counts[name] += 1
    return counts


def source_counts(
    *, counts: dict[str, int | None], weights: dict[str, float | None], total: int | None
) -> dict[str, int]:
    """Prompts per iteration of each source, in the sources' order: its exact count, or its share (largest remainder)
    of what ``total`` leaves after the exact counts. ``total`` None: the exact counts' sum (every source has one)."""
    fixed = {name: count for name, count in counts.items() if count is not None}
    weighted = {name: weight for name, weight in weights.items() if weight is not None}
    rest = (total if total is not None else sum(fixed.values())) - sum(fixed.values())
    shares = largest_remainder(weighted, rest) if weighted else {}
    return {name: fixed[name] if name in fixed else shares[name] for name in counts}


def source_of_part(part: str) -> str | None:
    """The source a prompts part belongs to (the directory its name starts with), None for an unprefixed part."""
    head, slash, _ = part.partition("/")
    return head if slash and not head.startswith("_") else None


def mixed_batch(
    parts: list[tuple[str, int]], *, counts: dict[str, int], seed: int, iteration: int, choose: Choose | None = None
) -> Batch:
    """Iteration ``iteration``'s prompts: ``counts[s]`` from each source s's own stream over its parts of ``parts``
    ((name, rows) in table order), the sources' slices in ``counts``' order; ``choose``: how a source's slice is
    drawn (data.curriculum), else its uniform stream. ValueError naming the source when it has fewer prompts than its
    count (a prompt would be twice in one batch, and its group would not be whole)."""
    by_source: dict[str, list[tuple[str, int]]] = {name: [] for name in counts}
    for name, rows in parts:
        source = source_of_part(name)
        if source in by_source:
            by_source[source].append((name, rows))
    slices, shares, skipped = [], [], 0
    for source, count in counts.items():
        available = sum(rows for _, rows in by_source[source])
        if count > available:
            raise ValueError(f"source {source!r} has {available} prompt(s), fewer than its {count} per iteration")
        if count == 0:
            continue
        if choose is None:
            batch = iteration_batch(by_source[source], seed=seed, iteration=iteration, batch_size=count, stream=source)
        else:
            batch = choose(by_source[source], count, source)
        slices += batch.slices
        skipped += batch.skipped
        shares.append(SourceShare(source, count, batch.epoch, batch.index_in_epoch, batch.batches_per_epoch))
    # the batch's epoch is its most advanced source's: how many times some source has started over
    lead = max(shares, key=lambda share: (share.epoch, -share.batches_per_epoch))
    return Batch(
        iteration,
        lead.epoch,
        lead.index_in_epoch,
        lead.batches_per_epoch,
        tuple(slices),
        whole_parts=False,
        sources=tuple(shares),
        skipped=skipped,
    )
