"""The advantage stage's table shaping: a scores shard's groups as dense [P, n] arrays, and back to one row per sample.

The group is the row (one prompt, its n samples), so no groupby is needed: the rewards of a shard form a dense
[num_prompts, n] array for the group estimators (batchrl.algorithms.estimators). Groups of several sizes in one
shard (logged data, rows dropped upstream) are handled one size at a time and put back in shard order. The output
explodes to one row per sample, keyed by (prompt_id, sample_idx), which the update stage consumes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrl.algorithms.advantages import dynamic_sampling_mask
from batchrl.errors import DataError


@dataclasses.dataclass(frozen=True)
class ShardGroups:
    """The groups of one shard that take part in the update, as dense [P, n] arrays."""

    table: pa.Table  # kept rows (groups) of the scores shard
    rewards_PG: np.ndarray
    lengths_PG: np.ndarray  # the policy's response tokens of each sample (a multi-turn sample's tool tokens left out)
    num_filtered: int


def shard_groups(table: pa.Table, *, filter_groups: bool) -> ShardGroups:
    """The groups of a table whose groups all have the same size (see by_group_size)."""
    scores = table.column("scores").to_pylist()
    if len({len(g) for g in scores}) > 1:
        raise ValueError(f"shard_groups takes groups of one size, got {sorted({len(g) for g in scores})}")
    empty = [row for row, group in enumerate(scores) if not group]
    if empty:
        ids = table.column("prompt_id") if "prompt_id" in table.column_names else None
        which = f"prompt {ids[empty[0]].as_py()!r}" if ids is not None else f"the group in row {empty[0]}"
        raise DataError(f"{which} has no samples: every group needs at least one")
    rewards_PG = np.asarray(scores, dtype=np.float64).reshape(table.num_rows, -1)
    lengths_PG = policy_token_counts(table).reshape(rewards_PG.shape)
    keep_P = dynamic_sampling_mask(rewards_PG) if filter_groups and table.num_rows else np.ones(table.num_rows, bool)
    return ShardGroups(
        table=table.filter(pa.array(keep_P)),
        rewards_PG=rewards_PG[keep_P],
        lengths_PG=lengths_PG[keep_P],
        num_filtered=int((~keep_P).sum()),
    )


ROW_KEY = "_group_row"  # a group's row in its shard, carried through by_group_size's pieces


def by_group_size(table: pa.Table) -> list[pa.Table]:
    """The shard's groups split by group size, each piece with the ``ROW_KEY`` column (its rows' places in the
    shard); the table itself, without that column, when its groups are all one size (generated rollouts).

    Why: the estimators work on dense [P, n] arrays, one row reduction per group; groups of several sizes (logged
    data, rows dropped upstream) are processed one size at a time, and their samples put back in shard order
    (``in_shard_order``). A group of one sample gets verl's treatment (GRPO: r / (1 + eps), RLOO: r)."""
    sizes_P = pc.list_value_length(table.column("scores")).to_numpy(zero_copy_only=False)
    if len(np.unique(sizes_P)) <= 1:
        return [table]
    table = table.append_column(ROW_KEY, pa.array(np.arange(table.num_rows, dtype=np.int64)))
    return [table.filter(pa.array(sizes_P == size)) for size in np.unique(sizes_P)]


def in_shard_order(pieces: list[tuple[pa.Table, np.ndarray]]) -> pa.Table:
    """The exploded samples of each piece (with the shard rows of its kept groups), concatenated in shard order:
    groups as in the shard, samples as in their group."""
    if len(pieces) == 1:
        return pieces[0][0]
    rows_S = np.concatenate([np.repeat(rows_P, _samples_per_group(out, rows_P)) for out, rows_P in pieces])
    return pa.concat_tables([out for out, _ in pieces]).take(pa.array(np.argsort(rows_S, kind="stable")))


def _samples_per_group(out: pa.Table, rows_P: np.ndarray) -> int:
    return out.num_rows // len(rows_P) if len(rows_P) else 0


def shard_rows(groups: ShardGroups) -> np.ndarray:
    """The shard rows of the kept groups of a by_group_size piece (0..P-1 for a whole shard)."""
    if ROW_KEY in groups.table.column_names:
        return groups.table.column(ROW_KEY).to_numpy()
    return np.arange(groups.table.num_rows, dtype=np.int64)


def explode_groups(table: pa.Table, advantages_PG: np.ndarray, *, reward_kl_PG: np.ndarray | None = None) -> pa.Table:
    """One row per sample: scalar columns repeat per sample, list-of-sample columns are flattened, and the
    prompt's and response's token counts are columns of their own."""
    num_samples_P = np.asarray([len(g) for g in table.column("scores").to_pylist()], dtype=np.int64)
    take_S = np.repeat(np.arange(table.num_rows), num_samples_P)
    sample_idx_S = np.concatenate([np.arange(n) for n in num_samples_P]) if len(num_samples_P) else np.zeros(0)
    repeated = table.select(["prompt_id", "data_source", "prompt_token_ids", "policy_version"]).take(take_S)
    flattened = {
        "response_token_ids": "response_token_ids",
        "response_logprobs": "response_logprobs",
        "response_text": "response_texts",
        "finish_reason": "finish_reasons",
        "score": "scores",
        "score_error": "score_errors",
    }
    columns = {name: repeated.column(name) for name in repeated.column_names}
    columns["sample_idx"] = pa.array(sample_idx_S, pa.int32())
    for out_name, list_name in flattened.items():
        columns[out_name] = (
            pa.concat_arrays([c.flatten() for c in table.column(list_name).chunks])
            if table.num_rows
            else pa.array([], table.schema.field(list_name).type.value_type)
        )
    # The lengths let the update plan mini- and micro-batches from two small columns (batchrl.trainer.index)
    columns["prompt_length"] = pc.list_value_length(columns["prompt_token_ids"]).cast(pa.int32())
    columns["response_length"] = pc.list_value_length(columns["response_token_ids"]).cast(pa.int32())
    columns["response_mask"] = sample_masks(table)
    columns["advantage"] = pa.array(advantages_PG.reshape(-1), pa.float32())
    columns["reward_kl"] = (
        pa.array(reward_kl_PG.reshape(-1), pa.float32())
        if reward_kl_PG is not None
        else pa.nulls(int(num_samples_P.sum()), pa.float32())
    )
    return pa.table(columns)


MASK_TYPE = pa.list_(pa.int32())


def has_masks(table: pa.Table) -> bool:
    """Whether some group of the table has policy masks (multi-turn rollouts)."""
    return "response_masks" in table.column_names and table.column("response_masks").null_count < table.num_rows


def policy_token_counts(table: pa.Table) -> np.ndarray:
    """Flat float64 [samples]: each sample's tokens the policy wrote, its response length where it has no mask. What
    token-weighted statistics (whitening's moments, per-token KL means) count: a tool's tokens are not the policy's."""
    lengths = table.column("response_lengths").to_pylist()
    if not has_masks(table):
        return np.asarray([n for group in lengths for n in group], dtype=np.float64)
    groups = zip(table.column("response_masks").to_pylist(), lengths)
    return np.asarray(
        [
            sum(1 for x in m if x) if m is not None else n
            for masks, group in groups
            for m, n in zip(masks or [None] * len(group), group)
        ],
        dtype=np.float64,
    )


def sample_masks(table: pa.Table) -> pa.Array:
    """Each sample's policy-token mask (the rollouts' ``response_masks``), flat in the samples' order: null for a
    sample whose group has none (single-turn or logged: every token is the policy's), so a table without masks
    keeps an all-null column, as before the column existed."""
    num_samples = sum(len(g) for g in table.column("scores").to_pylist())
    if not has_masks(table):
        return pa.nulls(num_samples, MASK_TYPE)
    groups = zip(table.column("response_masks").to_pylist(), table.column("scores").to_pylist())
    return pa.array(
        [m for masks, scores in groups for m in (masks if masks is not None else [None] * len(scores))], MASK_TYPE
    )
