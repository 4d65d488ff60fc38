"""Which samples go into which optimizer step, rank and micro-batch: pure functions of sample lengths.

Why plan everything from lengths alone: every rank reads the lengths of every sample (two small columns of
the advantages table, see `index`), so every rank can compute the same plan for all ranks without
communicating. That gives, for free, what the collectives
need to agree on: the number of micro-batches (ranks with fewer get empty ones, because every FSDP
forward/backward is a collective) and the global token and sequence counts that normalise the loss.

- Mini-batches (`mini_batches`): like verl's `ppo_mini_batch_size`, counted in PROMPTS (groups). Each
  epoch shuffles the groups by a keyed hash of (seed, epoch, group) (`batchrl.algorithms.shuffle`: the same
  order under any numpy version, as the prompt batches), then cuts them into consecutive
  mini-batches of `groups_per_mini_batch`; the last one may be smaller. One optimizer step per mini-batch.
- Row-group mini-batches (`block_mini_batches`, update.mini_batch_grain: row_group): the same cut, but the
  shuffle moves whole row groups of the advantages table (a group goes with the row group of its first sample),
  and each rank trains on a contiguous run of the mini-batch in storage order (`storage_ranks`), then plans its
  own micro-batches. Why: ranks read rows a row group at a time, and a random mini-batch has samples in nearly
  every row group, so with the default every rank decodes about the whole table for every mini-batch (world x
  mini-batches decodes of the table per pass; over s3:// each crosses the network). Here a rank decodes about
  its share (tests/unit/test_mini_batch_grain.py: at most 1.5x over an epoch in the grpo_math shape). The cost is
  statistical: a mini-batch holds runs of ~12 neighbouring prompts of one scores shard (row groups of 60-64
  rows) instead of independent draws, so prompts that sit together in the input (a source file sorted by topic)
  share steps more often; every prompt is still in exactly one mini-batch per epoch, with the same number and
  sizes of mini-batches and the same global token counts. Micro-batches are length-sorted within a rank's run
  only (more padded micro-batches when a run is short), and ranks hold within (1 + 2 x RANK_SLACK) of their
  share of tokens, plus one group. It changes which samples share a step, hence the weights: an option.
- Packs (`prompt_packs`, with update.share_prompt): samples of one prompt that share one row, the prompt
  computed once; the micro-batch planner then places packs as it would place samples.
- Micro-batches (`plan_micro_batches`): the samples of one mini-batch are sorted by length (longest first),
  cut into runs of similar length (minimising padded tokens plus a small cost per micro-batch), and the
  micro-batches are dealt to ranks longest-processing-time first (each to the rank with the least padded
  tokens so far). Sorting keeps similar lengths together, so right-padding wastes little; dealing by cost
  keeps the ranks' work balanced.
  Two limits: a TOKEN BUDGET (`max_tokens`: rows x padded length <= budget, verl's dynamic batch size), or a
  fixed COUNT of samples per micro-batch (`max_samples`).

Departures from verl's dynamic batch size: verl removes padding (packed, "rmpad" sequences) and its budget
counts real tokens; here micro-batches are right-padded [rows, length] tensors and the budget counts
PADDED tokens (rows x longest row), which is what bounds activation memory. A sample longer than the budget
gets a micro-batch of its own instead of an error (with a warning), so one long sample cannot abort a run.
In fixed-count mode micro-batches hold `max_samples` samples (per rank, as before) and are dealt the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from batchrl.algorithms.shuffle import keyed_order

logger = logging.getLogger(__name__)

# The fixed cost of one more micro-batch (kernel launches, FSDP all-gathers), as a fraction of a full budget.
MICRO_BATCH_OVERHEAD = 1 / 32
# How far (a fraction of a rank's share of tokens) `storage_ranks` moves a cut to land on a row-group boundary.
RANK_SLACK = 0.25


def mini_batches(
    group_of_sample_N: Sequence[int], *, groups_per_mini_batch: int | None, seed: int, epoch: int
) -> list[np.ndarray]:
    """Sample indices of each mini-batch of one epoch, groups shuffled by a hash keyed by (seed, epoch) (`keyed_order`).

    `group_of_sample_N[i]` is the group (prompt) number of sample i. None = one mini-batch with every sample.
    Samples keep their table order inside a mini-batch; a group is never split.
    """
    group_of_sample_N = np.asarray(group_of_sample_N, dtype=np.int64)
    if groups_per_mini_batch is not None and groups_per_mini_batch < 1:
        raise ValueError(f"groups_per_mini_batch={groups_per_mini_batch} must be >= 1 (or None for one mini-batch)")
    groups = np.unique(group_of_sample_N)
    if groups_per_mini_batch is None or groups_per_mini_batch >= len(groups):
        return [np.arange(len(group_of_sample_N))]
    shuffled = groups[keyed_order(len(groups), seed=seed, epoch=epoch)]
    batches = []
    for start in range(0, len(shuffled), groups_per_mini_batch):
        chosen = np.isin(group_of_sample_N, shuffled[start : start + groups_per_mini_batch])
        batches.append(np.flatnonzero(chosen))
    return batches


def block_mini_batches(
    group_N: Sequence[int],
    row_group_N: Sequence[int],
    *,
    groups_per_mini_batch: int | None,
    seed: int,
    epoch: int,
) -> list[np.ndarray]:
    """`mini_batches` shuffled at ROW-GROUP grain (update.mini_batch_grain: row_group): sample indices of each
    mini-batch of one epoch, a group never split, every group in exactly one mini-batch.

    `group_N` is sorted (the index's order: a group's samples are consecutive) and `row_group_N[i]` is the
    storage row group holding sample i (numbered in storage order). A group belongs to the row group of its first
    sample (its block); the blocks are ordered by `keyed_order` of (seed, epoch), a block's groups stay in storage
    order, and the sequence is cut every `groups_per_mini_batch` groups: the same number and sizes of mini-batches
    as `mini_batches`, each made of a few whole blocks (and pieces of the two at its ends) instead of groups drawn
    from every row group, so a mini-batch's rows lie in about groups_per_mini_batch / (groups per row group) row
    groups and not in all of them.
    """
    group_N, row_group_N = np.asarray(group_N, dtype=np.int64), np.asarray(row_group_N, dtype=np.int64)
    if groups_per_mini_batch is not None and groups_per_mini_batch < 1:
        raise ValueError(f"groups_per_mini_batch={groups_per_mini_batch} must be >= 1 (or None for one mini-batch)")
    starts = np.flatnonzero(np.diff(group_N, prepend=-1))  # first sample of each group
    if groups_per_mini_batch is None or groups_per_mini_batch >= len(starts):
        return [np.arange(len(group_N))]
    block_G = row_group_N[starts]
    blocks, block_of_G = np.unique(block_G, return_inverse=True)
    place_B = np.empty(len(blocks), dtype=np.int64)
    place_B[keyed_order(len(blocks), seed=seed, epoch=epoch)] = np.arange(len(blocks))
    # a block's groups in storage order: by the row group of their first sample, then by that sample's index
    order_G = np.lexsort((starts, place_B[block_of_G]))
    ends = np.append(starts[1:], len(group_N))
    batches = []
    for first in range(0, len(order_G), groups_per_mini_batch):
        chosen = np.sort(order_G[first : first + groups_per_mini_batch])
        batches.append(np.concatenate([np.arange(starts[g], ends[g]) for g in chosen]))
    return batches


def storage_ranks(
    indices: Sequence[int],
    *,
    storage_row_N: Sequence[int],
    row_group_N: Sequence[int],
    group_N: Sequence[int],
    tokens_N: Sequence[int],
    world_size: int,
    slack: float = RANK_SLACK,
) -> list[np.ndarray]:
    """`indices` shared out among `world_size` ranks in contiguous runs of storage rows (whole groups), each rank's
    run holding about 1/world of the tokens: ranks[r] = rank r's samples, sorted.

    Why contiguous: a rank decodes every row group its samples touch, so a run of the mini-batch in storage order
    costs it its share plus at most the row groups at the run's two ends. A cut goes to the group boundary nearest
    the balanced one, or to a ROW-GROUP boundary instead when one lies within `slack` x a rank's share of tokens
    of it (then no row group is decoded by two ranks): a rank holds at most (1 + 2 x slack) x its share of tokens,
    plus one group.
    """
    indices = np.asarray(indices, dtype=np.int64)
    order = indices[np.argsort(np.asarray(storage_row_N)[indices], kind="stable")]
    tokens = np.asarray(tokens_N, dtype=np.int64)[order]
    group, row_group = np.asarray(group_N)[order], np.asarray(row_group_N)[order]
    cuts = np.flatnonzero(np.diff(group, prepend=-1))  # where a group starts: the allowed cuts
    before = np.concatenate([[0], np.cumsum(tokens)])[cuts]  # tokens before each allowed cut
    new_row_group = np.diff(row_group, prepend=-1)[cuts] != 0
    share = before[-1] / world_size if len(cuts) else 0.0
    bounds = [0]
    for rank in range(1, world_size):
        distance = np.abs(before - rank * share)
        snapped = np.flatnonzero(new_row_group & (distance <= slack * share))
        pick = snapped[np.argmin(distance[snapped])] if snapped.size else int(np.argmin(distance)) if len(cuts) else 0
        bounds.append(max(bounds[-1], int(cuts[pick]) if len(cuts) else 0))
    bounds.append(len(order))
    return [np.sort(order[bounds[r] : bounds[r + 1]]) for r in range(world_size)]


def prompt_packs(
    indices: Sequence[int],
    *,
    prompt_key_N: Sequence[int],
    prompt_lengths_N: Sequence[int],
    response_lengths_N: Sequence[int],
    max_tokens: int,
) -> list[list[int]]:
    """`indices` cut into packs of samples with the same prompt (equal `prompt_key_N`) whose prompt, counted
    once, plus their responses fit in `max_tokens`; in index order, greedily. A sample with an empty prompt
    stays alone (a packed response's first token is predicted by the prompt's last token).

    Why: the n samples of a GRPO group share their prompt, so one row [prompt, response 1, ..., response k]
    computes the prompt once instead of k times (see `data.collate_packs`). That saves (k - 1) x prompt tokens
    of forward and backward per pack, and costs attention over the longer row: it pays when prompts are long
    relative to responses.
    """
    packs: list[list[int]] = []
    open_pack: dict[int, tuple[list[int], int]] = {}  # prompt key -> (the pack being filled, its length)
    for i in indices:
        i = int(i)
        prompt, response = int(prompt_lengths_N[i]), int(response_lengths_N[i])
        if prompt == 0:
            packs.append([i])
            continue
        key = int(prompt_key_N[i])
        pack, length = open_pack.get(key, (None, 0))
        if pack is None or length + response > max_tokens:
            pack, length = [], prompt
            packs.append(pack)
        pack.append(i)
        open_pack[key] = (pack, length + response)
    return packs


def plan_micro_batches(
    lengths_N: Sequence[int],
    *,
    world_size: int,
    max_tokens: int | None = None,
    max_samples: int | None = None,
) -> list[list[list[int]]]:
    """plan[rank][k] = the sample indices (into lengths_N) of rank's k-th micro-batch.

    Exactly one of `max_tokens` (padded-token budget per micro-batch) and `max_samples` (samples per
    micro-batch) is given. Every rank gets the same number of micro-batches (at least one); the extra
    ones are empty lists. Deterministic: ties are broken by sample index and by rank.
    """
    if (max_tokens is None) == (max_samples is None):
        raise ValueError("pass exactly one of max_tokens (token budget) and max_samples (fixed count)")
    if world_size < 1 or (max_tokens is not None and max_tokens < 1) or (max_samples is not None and max_samples < 1):
        raise ValueError(f"world_size={world_size}, max_tokens={max_tokens}, max_samples={max_samples} must be >= 1")
    lengths_N = np.asarray(lengths_N, dtype=np.int64)
    order = sorted(range(len(lengths_N)), key=lambda i: (-int(lengths_N[i]), i))  # longest first
    if max_tokens is not None:
        chunks = _cut_by_token_budget(order, lengths_N, max_tokens=max_tokens)
    else:
        chunks = [order[start : start + max_samples] for start in range(0, len(order), max_samples)]
    _split_until_every_rank_has_work(chunks, lengths_N, world_size=world_size)
    plan: list[list[list[int]]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for chunk in sorted(chunks, key=lambda c: (-padded_tokens(c, lengths_N), c[0])):
        rank = min(range(world_size), key=lambda r: (load[r], len(plan[r]), r))
        plan[rank].append(chunk)
        load[rank] += padded_tokens(chunk, lengths_N)
    num_micro_batches = max(1, max(len(micro_batches) for micro_batches in plan))
    return [micro_batches + [[] for _ in range(num_micro_batches - len(micro_batches))] for micro_batches in plan]


def _split_until_every_rank_has_work(chunks: list[list[int]], lengths_N: np.ndarray, *, world_size: int) -> None:
    """Halve the costliest micro-batch (in place) while there are fewer micro-batches than ranks: a mini-batch
    that fits one budget would otherwise leave all ranks but one idle (e.g. shared-prompt packs, or a small
    mini-batch under a large budget), and an idle rank still waits for the busy one at every collective."""
    while len(chunks) < world_size:
        k = max(range(len(chunks)), key=lambda j: (padded_tokens(chunks[j], lengths_N), -j), default=None)
        if k is None or len(chunks[k]) < 2:
            return
        half = (len(chunks[k]) + 1) // 2
        chunks[k : k + 1] = [chunks[k][:half], chunks[k][half:]]


def _cut_by_token_budget(order: list[int], lengths_N: np.ndarray, *, max_tokens: int) -> list[list[int]]:
    """Split `order` (longest first) into consecutive runs with rows x first length <= max_tokens.

    Among all such splits, the one minimising padded tokens + MICRO_BATCH_OVERHEAD x micro-batches (dynamic
    programming over the sorted lengths). Greedy filling would minimise the count alone, but at a long tail
    it puts one long sample with many much shorter ones and pads them all to its length.
    """
    sorted_lengths = np.maximum(lengths_N[order], 1)
    num = len(order)
    overhead = MICRO_BATCH_OVERHEAD * max_tokens
    best = np.full(num + 1, np.inf)  # best[j]: cost of splitting the first j samples
    best[0], start_of = 0.0, np.zeros(num + 1, dtype=np.int64)
    for end in range(1, num + 1):
        # A run [start, end) pads to sorted_lengths[start] >= sorted_lengths[end - 1]: at most this many rows fit.
        first = max(0, end - max(1, max_tokens // int(sorted_lengths[end - 1])))
        rows = end - np.arange(first, end)
        costs = best[first:end] + rows * sorted_lengths[first:end] + overhead
        costs[(rows * sorted_lengths[first:end] > max_tokens) & (rows > 1)] = np.inf  # a lone long sample is allowed
        start_of[end] = first + int(np.argmin(costs))
        best[end] = costs[start_of[end] - first]
    chunks, end = [], num
    while end > 0:
        chunks.append(order[start_of[end] : end])
        end = start_of[end]
    too_long = int((lengths_N[order] > max_tokens).sum())
    if too_long:
        logger.warning(
            "%d sample(s) are longer than max_tokens_per_micro_batch=%d (longest %d tokens); each gets a micro-batch "
            "of its own. Raise the budget if that runs out of memory",
            too_long,
            max_tokens,
            int(lengths_N.max()),
        )
    return chunks[::-1]


def padded_tokens(indices: Sequence[int], lengths_N: np.ndarray) -> int:
    """Tokens of the right-padded [rows, longest row] tensor of these samples."""
    return len(indices) * max((int(lengths_N[i]) for i in indices), default=0)


def padding_ratio(plan: list[list[list[int]]], lengths_N: Sequence[int]) -> float:
    """Padded tokens / real tokens over all non-empty micro-batches of a plan (1.0 = no padding)."""
    lengths_N = np.asarray(lengths_N, dtype=np.int64)
    chunks = [chunk for micro_batches in plan for chunk in micro_batches if chunk]
    real = sum(int(lengths_N[i]) for chunk in chunks for i in chunk)
    return sum(padded_tokens(chunk, lengths_N) for chunk in chunks) / max(real, 1)
