"""The advantages table as the trainer sees it: validated columns, and right-padded micro-batch tensors.

Why columns plus flat per-token arrays: the update needs, per sample, values for every response token
(engine log-probs, recomputed old log-probs, reference log-probs). Those live in flat float32 arrays indexed
by `response_offsets_N1` (sample i's response tokens are flat[offsets[i]:offsets[i+1]]), so one pass can
fill them for any subset of samples and one all-reduce can share them between ranks.

Alignment: position t of the shifted [B, T = L - 1] tensors predicts token t + 1. A response token at
position 0 (an empty prompt) has no predictor: it is outside the loss mask and its per-token values are 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

logger = logging.getLogger(__name__)

ADVANTAGE_COLUMNS = (
    "prompt_id",
    "sample_idx",
    "prompt_token_ids",
    "response_token_ids",
    "response_logprobs",
    "advantage",
)


@dataclass(frozen=True)
class Samples:
    """The advantages table sorted by (prompt_id, sample_idx). N = samples."""

    prompt_ids: list[str]
    sample_idx: list[int]
    prompt_token_ids: list[list[int]]
    response_token_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    advantages_N: np.ndarray  # float64
    group_N: np.ndarray  # int64, the prompt group number of each sample (0..num_groups-1)
    response_offsets_N1: np.ndarray  # int64 [N + 1], offsets of each response in flat per-token arrays

    @property
    def num_samples(self) -> int:
        return len(self.prompt_ids)

    @cached_property
    def lengths_N(self) -> np.ndarray:
        """Prompt + response tokens per sample (the padded length it needs)."""
        return np.array([len(p) + len(r) for p, r in zip(self.prompt_token_ids, self.response_token_ids)])

    @cached_property
    def loss_tokens_N(self) -> np.ndarray:
        """Response tokens per sample that are in the loss (all but a first token with no prompt before it)."""
        return np.array([len(r) - (len(p) == 0 and len(r) > 0)
                         for p, r in zip(self.prompt_token_ids, self.response_token_ids)], dtype=np.int64)

    def flat_rollout_logprobs(self) -> np.ndarray:
        """The engine's per-token log-probs as one flat array (lengths checked by check_advantages)."""
        return np.concatenate([np.asarray(lp, dtype=np.float32) for lp in self.rollout_logprobs] + [np.zeros(0, dtype=np.float32)])


def read_advantages(paths: list[str]) -> pa.Table:
    """All advantages parts as one table sorted by (prompt_id, sample_idx), so every rank sees one order."""
    tables = []
    for path in paths:
        schema_names = pq.read_schema(path).names
        missing = [c for c in ADVANTAGE_COLUMNS if c not in schema_names]
        if missing:
            raise ValueError(f"{path} lacks advantages-table columns {missing}; pass the advantage stage's output")
        tables.append(pq.read_table(path, columns=list(ADVANTAGE_COLUMNS)))
    table = pa.concat_tables(tables, promote_options="permissive")
    return table.sort_by([("prompt_id", "ascending"), ("sample_idx", "ascending")])


def check_advantages(table: pa.Table, *, needs_rollout_logprobs: bool) -> None:
    """User-data errors caught before any compute: non-finite advantages, mismatched logprob lists."""
    advantages_N = table.column("advantage").to_numpy(zero_copy_only=False).astype(np.float64)  # nulls -> NaN
    bad = np.flatnonzero(~np.isfinite(advantages_N))
    if bad.size:
        first = table.slice(int(bad[0]), 1).to_pylist()[0]
        raise ValueError(
            f"{bad.size} of {table.num_rows} advantages are NaN/inf (first: prompt_id={first['prompt_id']!r}, "
            f"sample_idx={first['sample_idx']}); fix the advantage stage output (e.g. a std of 0 in a group)"
        )
    if needs_rollout_logprobs:
        num_tokens = pc.list_value_length(table.column("response_token_ids")).fill_null(0)
        num_logprobs = pc.list_value_length(table.column("response_logprobs")).fill_null(0)
        if not pc.all(pc.equal(num_tokens, num_logprobs)).as_py():
            raise ValueError(
                "response_logprobs and response_token_ids differ in length for some rows; old_logprobs='rollout' "
                "and rollout_is_cap need one engine logprob per response token (use old_logprobs='recompute' "
                "and rollout_is_cap=None, or regenerate the rollouts with logprobs)"
            )


def check_token_ids(table: pa.Table, *, vocab_size: int) -> None:
    """Ids outside the embedding table mean the rollouts came from another tokenizer/model."""
    for column in ("prompt_token_ids", "response_token_ids"):
        ids = pc.list_flatten(table.column(column))
        if len(ids) == 0:
            continue
        low, high = pc.min_max(ids).values()
        if low.as_py() < 0 or high.as_py() >= vocab_size:
            raise ValueError(
                f"{column} holds ids in [{low.as_py()}, {high.as_py()}] but the policy's vocabulary has "
                f"{vocab_size} entries; the rollouts must come from this policy's tokenizer"
            )


def samples_from_table(table: pa.Table) -> Samples:
    columns = table.to_pydict()
    prompt_ids = columns["prompt_id"]
    _, group_N = np.unique(np.array(prompt_ids, dtype=object), return_inverse=True)
    response_token_ids = columns["response_token_ids"]
    response_offsets_N1 = np.zeros(len(prompt_ids) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in response_token_ids], out=response_offsets_N1[1:])
    return Samples(
        prompt_ids=prompt_ids,
        sample_idx=columns["sample_idx"],
        prompt_token_ids=columns["prompt_token_ids"],
        response_token_ids=response_token_ids,
        rollout_logprobs=[lp or [] for lp in columns["response_logprobs"]],
        advantages_N=np.asarray(columns["advantage"], dtype=np.float64),
        group_N=group_N.astype(np.int64),
        response_offsets_N1=response_offsets_N1,
    )


@dataclass(frozen=True)
class MicroBatch:
    """Tensors of one forward/backward. L = padded sequence length, T = L - 1 (next-token positions)."""

    indices: tuple[int, ...]  # sample indices, in row order; empty for a padding micro-batch
    input_ids_BL: torch.Tensor  # [batch, seq_len] prompt + response, right-padded
    attention_mask_BL: torch.Tensor  # [batch, seq_len] 1 on real tokens
    labels_BT: torch.Tensor  # [batch, seq_len - 1] the token each position predicts
    response_mask_BT: torch.Tensor  # [batch, seq_len - 1] True where the predicted token is a response token
    advantages_BT: torch.Tensor  # [batch, seq_len - 1] the sample's advantage on its response tokens
    token_values_BT: dict[str, torch.Tensor]  # per-token arrays (old/ref/rollout log-probs) in the same layout


def collate(
    samples: Samples,
    indices: list[int],
    *,
    pad_token_id: int,
    device: torch.device,
    token_values: dict[str, np.ndarray] | None = None,
) -> MicroBatch:
    """Right-pad samples[indices]; `token_values` (flat per-token arrays) are laid out like the labels.

    An empty index list gives a one-row, fully masked batch (a padding micro-batch: FSDP still needs the
    forward/backward collectives).
    """
    token_values = token_values or {}
    lengths = [len(samples.prompt_token_ids[i]) + len(samples.response_token_ids[i]) for i in indices]
    rows, seq_len = max(1, len(indices)), max([2] + lengths)
    input_ids_BL = torch.full((rows, seq_len), pad_token_id, dtype=torch.long)
    attention_mask_BL = torch.zeros((rows, seq_len), dtype=torch.long)
    is_response_BL = torch.zeros((rows, seq_len), dtype=torch.bool)
    advantages_BL = torch.zeros((rows, seq_len), dtype=torch.float32)
    values_BL = {name: torch.zeros((rows, seq_len), dtype=torch.float32) for name in token_values}
    for row, i in enumerate(indices):
        prompt, response = samples.prompt_token_ids[i], samples.response_token_ids[i]
        start, end = len(prompt), len(prompt) + len(response)
        input_ids_BL[row, :end] = torch.tensor(prompt + response, dtype=torch.long)
        attention_mask_BL[row, :end] = 1
        is_response_BL[row, start:end] = True
        advantages_BL[row, start:end] = float(samples.advantages_N[i])
        offset = int(samples.response_offsets_N1[i])
        for name, flat in token_values.items():
            values_BL[name][row, start:end] = torch.from_numpy(flat[offset : offset + len(response)])
    return MicroBatch(
        indices=tuple(indices),
        input_ids_BL=input_ids_BL.to(device),
        attention_mask_BL=attention_mask_BL.to(device),
        labels_BT=input_ids_BL[:, 1:].to(device),
        response_mask_BT=is_response_BL[:, 1:].to(device),
        advantages_BT=advantages_BL[:, 1:].to(device),
        token_values_BT={name: values[:, 1:].to(device) for name, values in values_BL.items()},
    )


def scatter_response_values(
    values_BT: torch.Tensor, mb: MicroBatch, samples: Samples, *, out_flat: torch.Tensor
) -> None:
    """Write each sample's per-response-token values from [B, T] into the flat array (inverse of collate)."""
    values_BL = torch.nn.functional.pad(values_BT, (1, 0))  # position t of BT is token t + 1 of BL
    for row, i in enumerate(mb.indices):
        start = len(samples.prompt_token_ids[i])
        num_response = len(samples.response_token_ids[i])
        offset = int(samples.response_offsets_N1[i])
        out_flat[offset : offset + num_response] = values_BL[row, start : start + num_response]
