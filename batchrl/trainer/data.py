"""Rows of the advantages table in memory, and micro-batch tensors.

Why columns plus flat per-token arrays: the update needs, per sample, values for every response token
(engine log-probs, recomputed old log-probs, reference log-probs). Those live in flat float32 arrays indexed
by `response_offsets_N1` (sample i's response tokens are flat[offsets[i]:offsets[i+1]]), so one pass can
fill them for any subset of samples and one all-reduce can share a mini-batch's between ranks.

Micro-batch layout (`MicroBatch`): the model input is right-padded rows, one per sample, or one per "pack" of
samples that share a prompt (prompt once, then their responses: see `collate_packs`); everything the loss
needs is gathered into [samples, response tokens] tensors, so the loss code is the same for both. A response
token with no predictor (the first one after an empty prompt) is outside the loss mask and its values are 0.
So is a tool token of a multi-turn sample (``response_masks``, 0 where a tool wrote the token, as verl's
``response_mask``): it stays in the row, so the policy's later tokens see it as context, but no loss, KL, entropy,
clip fraction or token count includes it. Masking rather than dropping keeps the input ids the engine's exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pyarrow as pa
import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Samples:
    """Rows of the advantages table in memory, in (prompt_id, sample_idx) order: one rank's share of a mini-batch
    (`rows.RowReader`: token lists as numpy arrays), or a shard's samples (`samples_from_table`, for the advantage
    stage's reference scorer: Python lists). N = samples."""

    prompt_ids: list[str]
    sample_idx: list[int]
    prompt_token_ids: Sequence[Sequence[int]]
    response_token_ids: Sequence[Sequence[int]]
    rollout_logprobs: Sequence[Sequence[float]]
    advantages_N: np.ndarray  # float64
    group_N: np.ndarray  # int64, the prompt group number of each sample (0..num_groups-1)
    response_offsets_N1: np.ndarray  # int64 [N + 1], offsets of each response in flat per-token arrays
    # per-token list columns read besides the tokens (GAE's token_advantages, values, returns), by column name
    token_lists: dict[str, Sequence[Sequence[float]]] = field(default_factory=dict)
    # per sample, 1 on policy tokens and 0 on tool tokens (the table's response_mask); empty: all the policy's
    response_masks: Sequence[Sequence[int]] = ()

    @property
    def num_samples(self) -> int:
        return len(self.prompt_ids)

    @cached_property
    def lengths_N(self) -> np.ndarray:
        """Prompt + response tokens per sample (the padded length it needs)."""
        return np.array([len(p) + len(r) for p, r in zip(self.prompt_token_ids, self.response_token_ids)])

    @cached_property
    def prompt_lengths_N(self) -> np.ndarray:
        return np.array([len(p) for p in self.prompt_token_ids], dtype=np.int64)

    @cached_property
    def response_lengths_N(self) -> np.ndarray:
        return np.array([len(r) for r in self.response_token_ids], dtype=np.int64)

    @cached_property
    def prompt_key_N(self) -> np.ndarray:
        """Equal numbers for samples whose prompt token ids are equal (what may share a row)."""
        keys: dict[tuple[int, ...], int] = {}
        return np.array([keys.setdefault(tuple(p), len(keys)) for p in self.prompt_token_ids], dtype=np.int64)

    @cached_property
    def loss_tokens_N(self) -> np.ndarray:
        """Response tokens per sample that are in the loss: the policy's (`policy_mask`), but a first token with
        no prompt before it."""
        if self.response_masks:
            return np.array([int(self.loss_mask(i).sum()) for i in range(self.num_samples)], dtype=np.int64)
        return np.array(
            [len(r) - (len(p) == 0 and len(r) > 0) for p, r in zip(self.prompt_token_ids, self.response_token_ids)],
            dtype=np.int64,
        )

    def policy_mask(self, i: int) -> np.ndarray:
        """Sample i's response tokens the policy wrote (bool, one per token): all of them without a mask."""
        mask, num_response = (self.response_masks[i] if self.response_masks else ()), len(self.response_token_ids[i])
        if mask is None or not len(mask):
            return np.ones(num_response, dtype=bool)
        if len(mask) != num_response:
            raise ValueError(
                f"sample ({self.prompt_ids[i]!r}, {self.sample_idx[i]}) has {len(mask)} response_mask entries for "
                f"{num_response} response tokens; the mask must have one entry per response token"
            )
        return np.asarray(mask) != 0

    def loss_mask(self, i: int) -> np.ndarray:
        """Sample i's response tokens in the loss: the policy's, but a first token with no prompt before it."""
        mask = self.policy_mask(i)
        if not len(self.prompt_token_ids[i]):
            mask[:1] = False
        return mask

    def flat_policy_mask(self) -> np.ndarray:
        """`policy_mask` of every sample, flat like the responses (`response_offsets_N1`)."""
        return np.concatenate([self.policy_mask(i) for i in range(self.num_samples)] + [np.zeros(0, bool)])

    def flat_token_list(self, name: str) -> np.ndarray:
        """A per-token list column (``token_lists``: GAE's token_advantages, values, returns) as one flat float32
        array, checked against the response lengths (the advantage stage writes one value per response token)."""
        lengths = np.diff(self.response_offsets_N1)
        for i, values in enumerate(self.token_lists[name]):
            if len(values) != lengths[i]:
                raise ValueError(
                    f"sample ({self.prompt_ids[i]!r}, {self.sample_idx[i]}) has {len(values)} {name} for "
                    f"{lengths[i]} response tokens; the advantages table was not written by advantage.estimator=gae"
                )
        return np.concatenate(
            [np.asarray(v, dtype=np.float32) for v in self.token_lists[name]] + [np.zeros(0, np.float32)]
        )

    def flat_rollout_logprobs(self, fill: np.ndarray | None = None) -> np.ndarray:
        """The engine's per-token log-probs as one flat array (lengths checked by check_advantages). A sample with
        none (a logged response logged without them) takes its values from ``fill`` (flat like the responses: the
        recomputed old log-probs), or raises without it."""
        offsets = self.response_offsets_N1
        pieces = []
        for i, lp in enumerate(self.rollout_logprobs):
            if not len(lp) and offsets[i + 1] > offsets[i]:
                if fill is None:
                    raise ValueError("a sample has no rollout log-probs and none were recomputed to fill them")
                pieces.append(np.asarray(fill[offsets[i] : offsets[i + 1]], dtype=np.float32))
            else:
                pieces.append(np.asarray(lp, dtype=np.float32))
        return np.concatenate(pieces + [np.zeros(0, dtype=np.float32)])


def samples_from_groups(table: pa.Table) -> Samples:
    """The samples of a table of prompt groups (rollouts, scores: one row per group, list columns of its samples),
    row-major (groups in order, samples in their group), as Python lists; advantages zero. What a stage scores with
    a model before advantages exist (the reference log-probs of KL in the reward, the critic's values), without
    exploding every column of the table into one row per sample."""
    prompts = table.column("prompt_token_ids").to_pylist()
    groups = table.column("response_token_ids").to_pylist()
    ids = table.column("prompt_id").to_pylist()
    responses = [response for group in groups for response in group]
    if "response_logprobs" in table.column_names:
        logprobs = [lp or [] for group in table.column("response_logprobs").to_pylist() for lp in group]
    else:
        logprobs = [[] for _ in responses]
    offsets = np.zeros(len(responses) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in responses], out=offsets[1:])
    return Samples(
        prompt_ids=[pid for pid, group in zip(ids, groups) for _ in group],
        sample_idx=[k for group in groups for k in range(len(group))],
        prompt_token_ids=[prompt for prompt, group in zip(prompts, groups) for _ in group],
        response_token_ids=responses,
        rollout_logprobs=logprobs,
        advantages_N=np.zeros(len(responses)),
        group_N=np.repeat(np.arange(len(groups)), [len(g) for g in groups]).astype(np.int64),
        response_offsets_N1=offsets,
        response_masks=_group_masks(table, groups),
    )


def _group_masks(table: pa.Table, groups: list[list]) -> list:
    """The samples' policy masks of a group table (``response_masks``), flat; () where no group has one."""
    if "response_masks" not in table.column_names or table.column("response_masks").null_count == table.num_rows:
        return ()
    masks = table.column("response_masks").to_pylist()
    return [m for group_masks, group in zip(masks, groups) for m in (group_masks or [None] * len(group))]


def sample_sums(flat: np.ndarray, offsets_N1: np.ndarray) -> np.ndarray:
    """Per-sample sums of a flat per-token array laid out by ``offsets_N1`` (an empty response sums to 0)."""
    return np.diff(np.concatenate([[0.0], np.cumsum(flat)])[offsets_N1])


def samples_from_table(table: pa.Table) -> Samples:
    """The rows of a table with the advantages-table columns, in its order, as Python lists."""
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
        response_masks=columns["response_mask"] if any(columns.get("response_mask") or ()) else (),
    )


@dataclass(frozen=True)
class MicroBatch:
    """Tensors of one forward/backward.

    The model input has B rows of length L. A row holds one sample (prompt + response, right-padded), or, with
    shared prompts (`collate_packs`), one prompt followed by several of its responses (a "pack"), each response
    attending to the prompt and to itself only (a [B, 1, L, L] mask) at the positions it would have alone.
    Per-sample tensors are [S, R]: S = samples in `indices` order, R = the longest response; column j is the
    sample's response token j, predicted by the logits at (logit_rows_S[s], logit_positions_SR[s, j]).
    """

    indices: tuple[int, ...]  # sample indices, in [S, R] row order; empty for a padding micro-batch
    input_ids_BL: torch.Tensor  # [B, L] token ids, right-padded
    attention_mask: torch.Tensor  # [B, L] 1 on real tokens, or [B, 1, L, L] True where a query may attend a key
    position_ids_BL: torch.Tensor | None  # [B, L] for packed rows; None: 0..L-1 (the model's default)
    real_tokens: int  # non-padding tokens in input_ids_BL
    logit_rows_S: torch.Tensor  # [S] the input row of each sample
    logit_positions_SR: torch.Tensor  # [S, R] the position whose logits predict response token j (0 if masked)
    labels_SR: torch.Tensor  # [S, R] the response tokens (the pad id where masked)
    response_mask_SR: torch.Tensor  # [S, R] True on the loss's tokens: the policy's response tokens with a predictor
    scored_SR: torch.Tensor  # [S, R] True on response tokens that have a predictor (tool tokens too: their log-prob)
    advantages_SR: torch.Tensor  # [S, R] the sample's advantage on its response tokens
    token_values_SR: dict[str, torch.Tensor]  # per-token arrays (old/ref/rollout log-probs) in the same layout

    @property
    def padded_tokens(self) -> int:
        return self.input_ids_BL.numel() if self.indices else 0


def collate(
    samples: Samples,
    indices: Sequence[int],
    *,
    pad_token_id: int,
    device: torch.device,
    token_values: dict[str, np.ndarray] | None = None,
) -> MicroBatch:
    """One row per sample: prompt + response, right-padded; `token_values` (flat per-token arrays) are laid out
    like the labels. An empty index list gives a one-row, fully masked batch (a padding micro-batch: FSDP still
    needs the forward/backward collectives)."""
    return collate_packs(
        samples, [[i] for i in indices], pad_token_id=pad_token_id, device=device, token_values=token_values
    )


def collate_packs(
    samples: Samples,
    packs: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    device: torch.device,
    token_values: dict[str, np.ndarray] | None = None,
) -> MicroBatch:
    """One row per pack: the prompt of its samples (which must share it, see `batching.prompt_packs`), then each
    sample's response. A micro-batch of one-sample packs gets the plain [B, L] padding mask (the model's causal
    kernels); any larger pack makes it a [B, 1, L, L] mask in which response k sees the prompt and itself.

    Response token j of a sample whose response starts at column o is predicted by position o + j - 1, except
    token 0 of a packed response: its predictor is the prompt's last token, shared by the pack. The positions
    (RoPE) of a packed response continue from the prompt as if it were alone, so its log-probs are the unpacked
    ones up to float rounding. A sample with an empty prompt has no predictor for its first token: masked.
    """
    token_values = token_values or {}
    indices = [i for pack in packs for i in pack]
    rows = max(1, len(packs))
    lengths = [
        len(samples.prompt_token_ids[pack[0]]) + sum(len(samples.response_token_ids[i]) for i in pack) for pack in packs
    ]
    seq_len = max([2] + lengths)
    num_samples, max_response = max(1, len(indices)), max([1] + [len(samples.response_token_ids[i]) for i in indices])
    packed = any(len(pack) > 1 for pack in packs)
    input_ids_BL = torch.full((rows, seq_len), pad_token_id, dtype=torch.long)
    segment_BL = torch.full((rows, seq_len), -1, dtype=torch.long)  # -1 padding, 0 prompt, k + 1 response k
    position_ids_BL = torch.zeros((rows, seq_len), dtype=torch.long)
    logit_rows_S = torch.zeros(num_samples, dtype=torch.long)
    logit_positions_SR = torch.zeros((num_samples, max_response), dtype=torch.long)
    labels_SR = torch.full((num_samples, max_response), pad_token_id, dtype=torch.long)
    response_mask_SR = torch.zeros((num_samples, max_response), dtype=torch.bool)
    scored_SR = torch.zeros((num_samples, max_response), dtype=torch.bool)
    advantages_SR = torch.zeros((num_samples, max_response), dtype=torch.float32)
    values_SR = {name: torch.zeros((num_samples, max_response), dtype=torch.float32) for name in token_values}
    s = 0
    for row, pack in enumerate(packs):
        prompt = samples.prompt_token_ids[pack[0]]
        num_prompt = len(prompt)
        input_ids_BL[row, :num_prompt] = torch.tensor(prompt, dtype=torch.long)
        segment_BL[row, :num_prompt] = 0
        position_ids_BL[row, :num_prompt] = torch.arange(num_prompt)
        start = num_prompt
        for k, i in enumerate(pack):
            response = samples.response_token_ids[i]
            num_response = len(response)
            end = start + num_response
            input_ids_BL[row, start:end] = torch.tensor(response, dtype=torch.long)
            segment_BL[row, start:end] = k + 1
            position_ids_BL[row, start:end] = torch.arange(num_prompt, num_prompt + num_response)
            logit_rows_S[s] = row
            predictors = torch.arange(start - 1, end - 1)
            if num_response:
                predictors[0] = num_prompt - 1
            logit_positions_SR[s, :num_response] = predictors.clamp(min=0)
            labels_SR[s, :num_response] = torch.tensor(response, dtype=torch.long)
            scored_SR[s, :num_response] = predictors >= 0
            response_mask_SR[s, :num_response] = scored_SR[s, :num_response]
            if samples.response_masks:  # tool tokens stay in the row as context, outside the loss
                response_mask_SR[s, :num_response] &= torch.from_numpy(samples.policy_mask(i))
            advantages_SR[s, :num_response] = float(samples.advantages_N[i])
            offset = int(samples.response_offsets_N1[i])
            for name, flat in token_values.items():
                values_SR[name][s, :num_response] = torch.from_numpy(flat[offset : offset + num_response])
            start, s = end, s + 1
    if "advantages" in values_SR:  # per-token advantages (GAE) in place of the sample's one
        advantages_SR = values_SR.pop("advantages")
    advantages_SR.masked_fill_(~response_mask_SR, 0.0)
    for values in values_SR.values():
        values.masked_fill_(~response_mask_SR, 0.0)
    real_BL = segment_BL >= 0
    if packed:
        # query q may attend key k <= q of the prompt or of its own segment; padding queries see the prompt and
        # the padding before them, so no row of the mask is empty (an empty row would be NaN in softmax)
        seg_q, seg_k = segment_BL[:, :, None], segment_BL[:, None, :]
        causal_LL = torch.ones((seq_len, seq_len), dtype=torch.bool).tril()
        attention_mask = (causal_LL & ((seg_k == 0) | (seg_k == seg_q)))[:, None]
        position_ids = position_ids_BL.to(device)
    else:
        attention_mask, position_ids = real_BL.long(), None
    return MicroBatch(
        indices=tuple(indices),
        input_ids_BL=input_ids_BL.to(device),
        attention_mask=attention_mask.to(device),
        position_ids_BL=position_ids,
        real_tokens=int(real_BL.sum()),
        logit_rows_S=logit_rows_S.to(device),
        logit_positions_SR=logit_positions_SR.to(device),
        labels_SR=labels_SR.to(device),
        response_mask_SR=response_mask_SR.to(device),
        scored_SR=scored_SR.to(device),
        advantages_SR=advantages_SR.to(device),
        token_values_SR={name: values.to(device) for name, values in values_SR.items()},
    )


def response_logits(logits_BLV: torch.Tensor, mb: MicroBatch, *, first_position: int = 0) -> torch.Tensor:
    """[S, R, V] the logits predicting each response token; `logits_BLV` may start at `first_position` (the
    model was asked for the logits from there on only, see `first_logit_position`)."""
    rows, length, vocab = logits_BLV.shape
    positions_SR = (mb.logit_positions_SR - first_position).clamp(min=0)  # masked tokens: any valid position
    flat_SR = mb.logit_rows_S[:, None] * length + positions_SR
    # index_select: its backward is one index_add_, cheaper than advanced indexing's accumulate on CPU
    return logits_BLV.reshape(rows * length, vocab).index_select(0, flat_SR.flatten()).view(*flat_SR.shape, vocab)


def first_logit_position(mb: MicroBatch) -> int:
    """The first input position whose logits any response token needs: positions before it need no lm_head."""
    return int(mb.logit_positions_SR[mb.scored_SR].min()) if bool(mb.scored_SR.any()) else 0


def scatter_response_values(
    values_SR: torch.Tensor, mb: MicroBatch, samples: Samples, *, out_flat: torch.Tensor
) -> None:
    """Write each sample's per-response-token values from [S, R] into the flat array (inverse of collate)."""
    for s, i in enumerate(mb.indices):
        offset, num_response = int(samples.response_offsets_N1[i]), len(samples.response_token_ids[i])
        out_flat[offset : offset + num_response] = values_SR[s, :num_response]
