"""The advantages table as the update plans it: an index of small columns, and streaming checks of the lists.

Why an index: the plan (mini-batches, packs, micro-batches, ranks: `batching`) needs per sample only its key
(prompt_id, sample_idx), its prompt and response lengths and which samples share a prompt, and the loss needs its
advantage: ~40 bytes, against ~121 KB of Python lists for a sample of 150 + 1024 tokens. So every rank reads those
small columns of every part (the lengths are columns of their own, written by the advantage stage) and computes
the same plan for every rank without talking, as before; the token lists are read later, a mini-batch at a time,
only for the rows a rank trains on (`rows`). Where each sample lives (part, row) is in the index too.

Order: samples are sorted by (prompt_id, sample_idx) with Arrow's stable sort over the parts in the order given,
exactly as the whole table was sorted when every rank read it, so the plan is the plan of the whole table.
Tables written before the lengths were columns are read as well: their lengths are computed from the lists
(`pyarrow.compute.list_value_length`), one column and one row group at a time.

Checks that used to run on the whole table in memory run as column passes before any optimizer step: non-finite
advantages on the index; the list columns (token id ranges, engine log-probs per response token, list lengths
against the length columns) streamed part by part, the parts shared out among the ranks and the results gathered,
so every rank raises the same error (`check_lists`, `check_token_ids`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchrl.storage import open_parquet as storage_open_parquet

logger = logging.getLogger(__name__)

ADVANTAGE_COLUMNS = (
    "prompt_id",
    "sample_idx",
    "prompt_token_ids",
    "response_token_ids",
    "response_logprobs",
    "advantage",
)
# length column -> the list column it counts
LENGTH_COLUMNS = {"prompt_length": "prompt_token_ids", "response_length": "response_token_ids"}
MASK_COLUMN = "response_mask"  # 1 policy token, 0 tool token; null: all the policy's (single-turn)
SCAN_BATCH_ROWS = 4096  # rows per streamed batch of a list column: bounds a column pass's memory


@contextlib.contextmanager
def open_parquet(uri: str, *, metadata: pq.FileMetaData | None = None) -> Iterator[pq.ParquetFile]:
    """An advantages part, read in place (`storage.open_parquet`), with errors that say which input is wrong."""
    try:
        with storage_open_parquet(uri, metadata=metadata) as parquet:
            yield parquet
    except FileNotFoundError:
        raise ValueError(f"advantages part {uri} does not exist; pass the advantage stage's parts") from None
    except pa.ArrowInvalid as err:
        raise ValueError(f"{uri} is not a readable Parquet file: {err}") from None


@dataclass(frozen=True)
class SampleIndex:
    """The small columns of the advantages table, sorted by (prompt_id, sample_idx). N = samples."""

    files: list[str]  # the advantages parts (local paths or URIs)
    footers: list[pq.FileMetaData] = field(repr=False)  # each part's footer, read once
    prompt_ids: pa.Array  # string [N]
    sample_idx_N: np.ndarray  # int64
    part_N: np.ndarray  # int64, the part (index into `files`) that holds the sample
    row_N: np.ndarray  # int64, its row in that part
    prompt_lengths_N: np.ndarray  # int64
    response_lengths_N: np.ndarray  # int64
    advantages_N: np.ndarray  # float64 (a null is NaN)
    group_N: np.ndarray  # int64, the prompt group number of each sample (0..num_groups-1, in prompt_id order)
    # int64, tool tokens (response_mask 0) per sample that would otherwise be loss tokens; None: no sample has any
    tool_tokens_N: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_key_N(self) -> np.ndarray:
        """Equal numbers for samples that may share a row (`batching.prompt_packs`): samples of one prompt_id.

        Why the prompt_id and not the prompt's tokens (what the whole-table reader compared): the samples of a
        prompt_id are one rollout group, exploded from one row, so they have the same prompt; keys from the tokens
        would need the prompt lists of every sample on every rank. The two differ only where two prompt ids hold
        the same tokens (a duplicated question): their samples are no longer packed into one row, which costs
        that prompt's forward once more and changes no value.
        """
        return self.group_N

    @property
    def lengths_N(self) -> np.ndarray:
        return self.prompt_lengths_N + self.response_lengths_N

    @property
    def loss_tokens_N(self) -> np.ndarray:
        """Response tokens per sample that are in the loss: all but a first token with no prompt before it, and but
        the tool tokens of a multi-turn sample (`tool_tokens_N`). Token-mean losses and token budgets' counts."""
        loss_tokens_N = self.response_lengths_N - ((self.prompt_lengths_N == 0) & (self.response_lengths_N > 0))
        return loss_tokens_N if self.tool_tokens_N is None else loss_tokens_N - self.tool_tokens_N

    @property
    def has_masks(self) -> bool:
        """Whether some sample has a response_mask (multi-turn): the rows must then be read with their masks."""
        return self.tool_tokens_N is not None

    @cached_property
    def row_group_starts(self) -> list[np.ndarray]:
        """Per part, the first row of each of its row groups and then its row count (from the footers)."""
        return [
            np.cumsum([0] + [footer.row_group(g).num_rows for g in range(footer.num_row_groups)], dtype=np.int64)
            for footer in self.footers
        ]

    @cached_property
    def storage_row_N(self) -> np.ndarray:
        """Each sample's row in the parts laid end to end, in the order of `files` (storage order)."""
        part_offsets = np.cumsum([0] + [int(starts[-1]) for starts in self.row_group_starts], dtype=np.int64)
        return part_offsets[self.part_N] + self.row_N

    @cached_property
    def row_group_N(self) -> np.ndarray:
        """The row group holding each sample, numbered over all parts in storage order: what a read decodes."""
        first_group = np.cumsum([0] + [len(starts) - 1 for starts in self.row_group_starts], dtype=np.int64)
        row_group_N = np.zeros(self.num_samples, dtype=np.int64)
        for part, starts in enumerate(self.row_group_starts):
            here = self.part_N == part
            row_group_N[here] = first_group[part] + np.searchsorted(starts, self.row_N[here], side="right") - 1
        return row_group_N

    def rows_of_part(self, part: int) -> np.ndarray:
        """Positions in the index of part `part`'s samples, in the part's row order."""
        order, starts = self._by_part
        return order[starts[part] : starts[part + 1]]

    @cached_property
    def _by_part(self) -> tuple[np.ndarray, np.ndarray]:
        order = np.lexsort((self.row_N, self.part_N))
        return order, np.searchsorted(self.part_N[order], np.arange(len(self.files) + 1))


def read_index(files: list[str]) -> SampleIndex:
    """The index of the advantages parts `files`: their small columns, sorted as one table would be."""
    tables, footers = [], []
    for part, uri in enumerate(files):
        table, footer = _part_index(uri, part)
        tables.append(table)
        footers.append(footer)
    table = pa.concat_tables(tables, promote_options="permissive")
    table = table.sort_by([("prompt_id", "ascending"), ("sample_idx", "ascending")])
    prompt_ids = table.column("prompt_id").combine_chunks()
    new_group = pc.not_equal(prompt_ids[1:], prompt_ids[:-1]).to_numpy(zero_copy_only=False)
    group_N = np.concatenate([np.zeros(min(1, len(prompt_ids)), np.int64), np.cumsum(new_group, dtype=np.int64)])

    def column(name: str, dtype) -> np.ndarray:
        return table.column(name).to_numpy().astype(dtype)

    return SampleIndex(
        files=list(files),
        footers=footers,
        prompt_ids=prompt_ids,
        sample_idx_N=column("sample_idx", np.int64),
        part_N=column("part", np.int64),
        row_N=column("row", np.int64),
        prompt_lengths_N=column("prompt_length", np.int64),
        response_lengths_N=column("response_length", np.int64),
        advantages_N=table.column("advantage").to_numpy().astype(np.float64),
        group_N=group_N,
        tool_tokens_N=(
            table.column("tool_tokens").fill_null(0).to_numpy().astype(np.int64)
            if "tool_tokens" in table.column_names
            else None
        ),
    )


def _part_index(uri: str, part: int) -> tuple[pa.Table, pq.FileMetaData]:
    """One part's small columns plus its (part, row) position, and its footer."""
    with open_parquet(uri) as parquet:
        names = parquet.schema_arrow.names
        missing = [c for c in ADVANTAGE_COLUMNS if c not in names]
        if missing:
            raise ValueError(f"{uri} lacks advantages-table columns {missing}; pass the advantage stage's output")
        table = parquet.read(columns=["prompt_id", "sample_idx", "advantage"])
        for length_column, list_column in LENGTH_COLUMNS.items():
            if length_column in names:
                lengths = parquet.read(columns=[length_column]).column(0)
            else:  # a table written before the lengths were columns
                lengths = pa.chunked_array(
                    [_list_lengths(batch.column(0)) for batch in _batches(parquet, list_column)], pa.int32()
                )
            table = table.append_column(length_column, lengths.cast(pa.int64()))
        if MASK_COLUMN in names:
            lengths = {name: table.column(name).to_numpy() for name in ("response_length", "prompt_length")}
            tool_tokens = _tool_tokens(parquet, lengths["response_length"], lengths["prompt_length"])
            if tool_tokens is not None:
                table = table.append_column("tool_tokens", pa.array(tool_tokens))
        num_rows = table.num_rows
        table = table.append_column("part", pa.array(np.full(num_rows, part, np.int64)))
        table = table.append_column("row", pa.array(np.arange(num_rows, dtype=np.int64)))
        return table, parquet.metadata


def _tool_tokens(parquet: pq.ParquetFile, expected_R: np.ndarray, prompt_lengths_R: np.ndarray) -> np.ndarray | None:
    """Per row, the 0s of its response_mask (tool tokens), but one at position 0 after an empty prompt (that token
    has no predictor: out of the loss already); None where every mask is null (single-turn). A mask of another
    length than its response is the user's data error."""
    counts, start, any_mask = [], 0, False
    for batch in _batches(parquet, MASK_COLUMN):
        values = batch.column(0)
        rows = slice(start, start + len(values))
        any_mask |= values.null_count < len(values)
        lengths = _list_lengths(values).to_numpy().astype(np.int64)
        wrong = values.is_valid().to_numpy(zero_copy_only=False) & (lengths != expected_R[rows])
        if wrong.any():
            raise ValueError(
                f"{int(wrong.sum())} row(s) have another number of response_mask entries than response tokens; the "
                "mask must have one entry per response token (1 policy, 0 tool)"
            )
        is_zero = pc.list_flatten(values).to_numpy(zero_copy_only=False) == 0
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        zeros_before = np.concatenate([[0], np.cumsum(is_zero)])
        first_zero = np.zeros(len(lengths), bool)
        first_zero[lengths > 0] = is_zero[offsets[:-1][lengths > 0]]
        counts.append(
            zeros_before[offsets[1:]] - zeros_before[offsets[:-1]] - (first_zero & (prompt_lengths_R[rows] == 0))
        )
        start += len(values)
    return np.concatenate(counts).astype(np.int64) if any_mask else None


def _batches(parquet: pq.ParquetFile, column: str) -> Iterator[pa.RecordBatch]:
    return parquet.iter_batches(batch_size=SCAN_BATCH_ROWS, columns=[column], use_threads=False)


def _list_lengths(values: pa.Array) -> pa.Array:
    return pc.list_value_length(values).fill_null(0).cast(pa.int32())


def check_advantages(index: SampleIndex) -> None:
    """Non-finite advantages are a user-data error caught before any compute."""
    bad = np.flatnonzero(~np.isfinite(index.advantages_N))
    if bad.size:
        first = int(bad[0])
        raise ValueError(
            f"{bad.size} of {index.num_samples} advantages are NaN/inf (first: "
            f"prompt_id={index.prompt_ids[first].as_py()!r}, sample_idx={int(index.sample_idx_N[first])}); fix the "
            "advantage stage output (e.g. a std of 0 in a group)"
        )


@dataclass(frozen=True)
class ListScan:
    """What one part's list columns hold, from one streamed pass over them."""

    part: int  # the part's position in the index's files
    file: str
    token_ranges: dict[str, tuple[int, int]]  # list column -> (min, max) id; absent when it holds no id
    length_mismatches: dict[str, int]  # list column -> rows whose list length is not the index's length
    logprob_mismatches: int  # rows with another number of engine log-probs than response tokens (when checked)
    missing_logprobs: int = 0  # rows with no engine log-probs at all (logged data without them; recomputed)


def scan_part(index: SampleIndex, part: int, *, check_rollout_logprobs: bool) -> ListScan:
    """Stream part `part`'s list columns one at a time (a batch of rows at a time): id ranges and list lengths."""
    positions = index.rows_of_part(part)
    expected = {
        "prompt_token_ids": index.prompt_lengths_N[positions],
        "response_token_ids": index.response_lengths_N[positions],
    }
    if check_rollout_logprobs:
        expected["response_logprobs"] = index.response_lengths_N[positions]
    ranges, mismatches, missing = {}, {}, 0
    with open_parquet(index.files[part], metadata=index.footers[part]) as parquet:
        for column, lengths_R in expected.items():
            start, mismatches[column] = 0, 0
            for batch in _batches(parquet, column):
                values = batch.column(0)
                lengths = _list_lengths(values).to_numpy()
                wrong = lengths != lengths_R[start : start + len(lengths)]
                if column == "response_logprobs":  # none at all: a logged response without them (recomputed)
                    absent = wrong & (lengths == 0)
                    missing += int(absent.sum())
                    wrong &= ~absent
                mismatches[column] += int(wrong.sum())
                start += len(lengths)
                flat = pc.list_flatten(values)
                if column.endswith("token_ids") and len(flat):
                    low, high = (v.as_py() for v in pc.min_max(flat).values())
                    old_low, old_high = ranges.get(column, (low, high))
                    ranges[column] = (min(low, old_low), max(high, old_high))
    logprob_mismatches = mismatches.pop("response_logprobs", 0)
    return ListScan(
        part=part,
        file=index.files[part],
        token_ranges=ranges,
        length_mismatches={c: n for c, n in mismatches.items() if n},
        logprob_mismatches=logprob_mismatches,
        missing_logprobs=missing,
    )


def check_lists(scans: list[ListScan]) -> None:
    """The errors a scan finds without the model: list lengths, engine log-probs per response token."""
    for scan in scans:
        for column, count in scan.length_mismatches.items():
            length_column = next(k for k, v in LENGTH_COLUMNS.items() if v == column)
            raise ValueError(
                f"{scan.file}: {count} row(s) have another number of {column} than their {length_column} says; "
                f"the length columns must count the lists (redo the advantage stage that wrote it)"
            )
    if any(scan.logprob_mismatches for scan in scans):
        raise ValueError(
            "response_logprobs and response_token_ids differ in length for some rows; old_logprobs='rollout' "
            "and rollout_is_cap need one engine logprob per response token (use old_logprobs='recompute' "
            "and rollout_is_cap=None, or regenerate the rollouts with logprobs)"
        )


def check_token_ids(scans: list[ListScan], *, vocab_size: int) -> None:
    """Ids outside the embedding table mean the rollouts came from another tokenizer/model."""
    for column in ("prompt_token_ids", "response_token_ids"):
        ranges = [scan.token_ranges[column] for scan in scans if column in scan.token_ranges]
        if not ranges:
            continue
        low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"{column} holds ids in [{low}, {high}] but the policy's vocabulary has {vocab_size} entries; the "
                "rollouts must come from this policy's tokenizer"
            )
