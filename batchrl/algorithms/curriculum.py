"""Difficulty-aware batches (``data.curriculum``): a source's batch that passes over the prompts the run has solved
k iterations in a row, read from the prompt_stats table of the iteration before (issue 37, item 3).

A pure function of the seed, the iteration, the prompts table's parts (and their prompt ids) and that stats table:

- The batch starts where the uniform batch starts (`batches.iteration_batch`: epoch i div E, position
  (i mod E) x B of that epoch's stream) and walks the same stream forward, taking each prompt that is not skipped,
  until it has B. Past the epoch's last position it goes on into the next epoch's order (the same orders a uniform
  run uses), a prompt taken once per batch. So a skipped prompt's place goes to the next one in the stream: the
  batch is always full, and the prompts it takes from further along are ones a later batch would have taken.
- A prompt is skipped when its solved streak (prompt_stats.solved_streak: iterations in a row, up to its last,
  whose group passed in every sample) is >= ``skip_solved_streak``. A prompt never sampled has no row, hence no
  streak, and is never skipped: new prompts (a file appended tonight) always come.
- The exploration floor: a skipped prompt is taken anyway with probability ``revisit``, by a keyed hash of (seed,
  iteration, prompt id), so that a solved prompt is checked again now and then (forgetting shows as a streak
  reset to 0) and a run that has solved most of its set does not stop looking at it.
- When one whole pass over the source (N distinct prompts) finds fewer than B to take, the batch is filled with the
  skipped ones in stream order: a batch is never short, whatever the table says.

Departure from prime-rl's pools (prompts binned by pass rate, each bin with a weight): skipping by streak needs one
number per prompt and leaves the uniform stream's order (hence its per-source counts and epochs) as it is; pools can
be added as another rule over the same table.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

from batchrl.algorithms.batches import Batch, Slice, batches_per_epoch, part_order, row_order


@dataclass(frozen=True)
class CurriculumRule:
    skip_solved_streak: int  # skip a prompt solved in this many iterations in a row (>= 1)
    revisit: float = 0.0  # the chance a skipped prompt is taken anyway, in [0, 1)


def revisited(prompt_id: str, *, seed: int, iteration: int, revisit: float) -> bool:
    """Whether a skipped prompt is taken anyway at ``iteration``: a keyed hash of (seed, iteration, prompt id) as a
    number in [0, 1), below ``revisit``."""
    if revisit <= 0:
        return False
    digest = hashlib.blake2b(f"{int(seed)}/{int(iteration)}/{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < revisit


def stream(parts: list[tuple[str, int]], *, seed: int, epoch: int, key: str) -> Iterator[tuple[str, int]]:
    """(part, row) in the order of epoch ``epoch``'s stream, then the next epochs', without end."""
    while True:
        for position in part_order(len(parts), seed=seed, epoch=epoch, stream=key):
            name, rows = parts[position]
            for row in row_order(rows, seed=seed, epoch=epoch, part=name):
                yield name, row
        epoch += 1


def curriculum_batch(
    parts: list[tuple[str, int]],
    prompt_ids: dict[str, list[str]],
    streaks: dict[str, int],
    *,
    rule: CurriculumRule,
    seed: int,
    iteration: int,
    batch_size: int,
    key: str = "",
) -> Batch:
    """Iteration ``iteration``'s ``batch_size`` prompts of ``parts`` ((name, rows) in table order; ``prompt_ids``:
    each part's ids by row; ``streaks``: solved_streak by prompt id, from the previous iteration's prompt_stats), by
    the rule of the module docstring. ``key`` keys the parts' order as `iteration_batch`'s ``stream`` does."""
    num_rows = sum(rows for _, rows in parts)
    per_epoch = batches_per_epoch(num_rows, batch_size)
    epoch, index = divmod(iteration, per_epoch)
    rows_stream = stream(parts, seed=seed, epoch=epoch, key=key)
    for _ in range(index * batch_size):  # the uniform batch's first position
        next(rows_stream)
    taken: list[tuple[str, int]] = []
    passed: list[tuple[str, int]] = []
    seen: set[tuple[str, int]] = set()
    while len(taken) < batch_size and len(seen) < num_rows:
        place = next(rows_stream)
        if place in seen:
            continue  # the next epoch's order, past a prompt this batch has met already
        seen.add(place)
        prompt_id = prompt_ids[place[0]][place[1]]
        solved = streaks.get(prompt_id, 0) >= rule.skip_solved_streak
        if solved and not revisited(prompt_id, seed=seed, iteration=iteration, revisit=rule.revisit):
            passed.append(place)
        else:
            taken.append(place)
    filled = passed[: batch_size - len(taken)]  # a pass over the whole source was not enough: the batch stays full
    skipped = len(passed) - len(filled)  # Batch.skipped: prompts passed over (solved) before the batch was full
    return Batch(iteration, epoch, index, per_epoch, slices_of(taken + filled), whole_parts=False, skipped=skipped)


def slices_of(places: list[tuple[str, int]]) -> tuple[Slice, ...]:
    """One slice per part, in the order the parts were first met, each with its rows ascending."""
    rows: dict[str, list[int]] = {}
    for name, row in places:
        rows.setdefault(name, []).append(row)
    return tuple(Slice(name, 0, len(taken), tuple(sorted(taken))) for name, taken in rows.items())
