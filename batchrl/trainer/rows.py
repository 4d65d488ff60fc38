"""The rows one rank trains on, read from the advantages parts when it needs them: a mini-batch at a time.

Why: the token lists are the table's weight (~121 KB per sample of 150 + 1024 tokens as Python lists), and a rank
needs, at any moment, only the samples of its micro-batches of one mini-batch. `RowReader.read` finds them through
the index (part, row), reads from each part only the row groups that hold them and only the list columns, one column
at a time, in place from a local path or any fsspec URI (s3://...: range requests, no download), and keeps just the
rows asked for. A rank's memory for rows is then one mini-batch's share plus one row group's column chunk.

The token lists come back as numpy views into one flat array per column (4 bytes a token, not a Python int each).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from batchrl.trainer.data import Samples
from batchrl.trainer.fsdp import Dist
from batchrl.trainer.index import MASK_COLUMN, SampleIndex, open_parquet

LIST_COLUMNS = ("prompt_token_ids", "response_token_ids")


class RowReader:
    """Reads chosen samples' token lists (and engine log-probs, `with_rollout_logprobs`) from the advantages parts."""

    def __init__(self, index: SampleIndex, *, with_rollout_logprobs: bool, token_columns: Sequence[str] = ()):
        self.index = index
        self.token_columns = tuple(token_columns)  # per-token float lists (GAE), in Samples.token_lists
        self.columns = LIST_COLUMNS + (("response_logprobs",) if with_rollout_logprobs else ()) + self.token_columns
        if index.has_masks:  # multi-turn rows: which response tokens the policy wrote (the loss skips the others)
            self.columns += (MASK_COLUMN,)
        self._group_starts = index.row_group_starts  # first row of each row group, per part
        # what it decoded so far: the rows of the row groups it read (all the columns of one count once), and the
        # bytes of the column chunks in memory: the I/O of a rank, whatever the planning (`read_over_share`)
        self.rows_decoded, self.bytes_decoded = 0, 0

    def read(self, indices: Sequence[int]) -> Samples:
        """The samples `indices` (positions in the index) as Samples, in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        part_S = self.index.part_N[indices]
        lists: dict[str, list[np.ndarray]] = {column: [None] * len(indices) for column in self.columns}
        for part in np.unique(part_S):
            chosen = np.flatnonzero(part_S == part)
            for column, values in self._read_part(int(part), self.index.row_N[indices[chosen]]).items():
                for s, value in zip(chosen, values):
                    lists[column][s] = value
        index = self.index
        response_offsets_N1 = np.concatenate([[0], np.cumsum(index.response_lengths_N[indices])]).astype(np.int64)
        empty = np.zeros(0, np.float32)
        return Samples(
            prompt_ids=index.prompt_ids.take(pa.array(indices)).to_pylist(),
            sample_idx=index.sample_idx_N[indices].tolist(),
            prompt_token_ids=lists["prompt_token_ids"],
            response_token_ids=lists["response_token_ids"],
            rollout_logprobs=lists.get("response_logprobs", [empty] * len(indices)),
            advantages_N=index.advantages_N[indices],
            group_N=index.group_N[indices],
            response_offsets_N1=response_offsets_N1,
            token_lists={column: lists[column] for column in self.token_columns},
            response_masks=lists.get(MASK_COLUMN, ()),
        )

    def _read_part(self, part: int, rows_R: np.ndarray) -> dict[str, list[np.ndarray]]:
        """{column: the lists of rows `rows_R` of part `part`, in that order}: only the row groups holding them."""
        starts = self._group_starts[part]
        group_R = np.searchsorted(starts, rows_R, side="right") - 1
        out: dict[str, list[np.ndarray]] = {column: [None] * len(rows_R) for column in self.columns}
        with open_parquet(self.index.files[part], metadata=self.index.footers[part]) as parquet:
            for group in np.unique(group_R):
                self.rows_decoded += int(starts[group + 1] - starts[group])
                chosen = np.flatnonzero(group_R == group)
                take = pa.array(rows_R[chosen] - starts[group])
                for column in self.columns:  # one column chunk in memory at a time
                    values = parquet.read_row_group(int(group), columns=[column]).column(0)
                    self.bytes_decoded += values.nbytes
                    values = values.take(take)
                    for r, value in zip(chosen, split_lists(values)):
                        out[column][r] = value
        return out


def read_over_share(reader: RowReader, *, ctx: Dist) -> float:
    """The most rows any rank decoded (`RowReader.rows_decoded`) over a rank's share of the table (its rows /
    world): how many times the busiest rank read its share. Every pass over the table (the pre-update log-probs,
    each epoch, the critic's epochs) reads it at least once; update.mini_batch_grain sample reads about world x
    mini-batches per pass, row_group about 1. A collective."""
    decoded = torch.tensor([float(reader.rows_decoded)], dtype=torch.float64, device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(decoded, op=dist.ReduceOp.MAX)
    return float(decoded.item()) * ctx.world_size / max(reader.index.num_samples, 1)


def split_lists(values: pa.ChunkedArray) -> list[np.ndarray]:
    """A list column as one numpy view per row into a single flat array (a null list is empty)."""
    values = values.combine_chunks()
    offsets = values.offsets.to_numpy()
    flat = values.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    offsets = offsets - offsets[0]
    lists = [flat[offsets[k] : offsets[k + 1]] for k in range(len(values))]
    if values.null_count:
        valid = values.is_valid().to_numpy(zero_copy_only=False)
        lists = [value if ok else flat[:0] for value, ok in zip(lists, valid)]
    return lists
