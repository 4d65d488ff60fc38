"""Pre-update log-probs (the old policy's and the frozen reference's), a mini-batch at a time, and what a rank
trains on in each optimizer step: its micro-batches, their rows and their per-token values.

Why before any step: PPO's ratio compares the policy being trained with the policy that was loaded, and the KL loss
compares it with the reference; both are fixed for the whole update, so they cannot be computed lazily once steps
have changed the weights. The pass (`pre_update_pass`) therefore runs first, over epoch 0's mini-batches with the
plan training will use (`micro_batch_plan`): a rank reads one mini-batch's share of rows at a time (`rows`), and
writes what it computes to files in a rank-local scratch directory (`SpilledValues`: the page cache holds them,
not the rank's memory) and to its part of the log-probs table (`checkpoint.LogprobsWriter`).

Epochs reshuffle the mini-batches, so a rank may train on samples another rank computed. When a mini-batch trains,
each rank fills a mini-batch-sized buffer with the values it holds and one SUM all-reduce (x + 0 = x, exact) gives
every rank the whole mini-batch's (`SpilledValues.for_mini_batch`). Memory: one mini-batch of values per rank,
where one buffer over every response token of the table used to be all-reduced once. The engine's own log-probs
("rollout", with `update.old_logprobs: rollout` or truncated IS) come with the rows.

The reference is loaded, sharded like the policy, used for this pass and freed before training; it is the policy
itself when both name the same checkpoint (iteration 0). With update.lora the reference is the base: the policy
itself with its adapter disabled (`lora.AdapterDisabled`), never a second copy of the base weights.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from batchrl.trainer.batching import block_mini_batches, mini_batches, storage_ranks
from batchrl.trainer.checkpoint import LogprobsWriter
from batchrl.trainer.data import Samples, collate_packs, scatter_response_values
from batchrl.trainer.forward import micro_batch_plan, policy_logprobs
from batchrl.trainer.fsdp import Dist, load_model, shard_model
from batchrl.trainer.index import SampleIndex
from batchrl.trainer.lora import AdapterDisabled
from batchrl.trainer.rows import RowReader
from batchrl.trainer.spec import UpdateSpec


def uses_rollout_logprobs(spec: UpdateSpec) -> bool:
    """Whether the loss reads the engine's per-token log-probs (as the old policy, or for truncated IS)."""
    return spec.update.old_logprobs == "rollout" or spec.update.rollout_is_cap is not None


def recomputes_old(spec: UpdateSpec, *, missing_rollout_logprobs: int) -> bool:
    """Whether the pre-update pass recomputes the old log-probs: with old_logprobs=recompute, and also when the
    loss reads rollout log-probs that some samples lack (logged data): theirs are filled with the recomputed ones
    (as the old policy they then start at ratio 1; for truncated IS their weight is 1)."""
    return spec.update.old_logprobs == "recompute" or (uses_rollout_logprobs(spec) and missing_rollout_logprobs > 0)


def old_logprobs_used(rows: Samples, values: dict[str, np.ndarray], spec: UpdateSpec) -> np.ndarray:
    """The old log-probs the loss uses for ``rows``, flat: the rollout ones with old_logprobs=rollout (those a
    sample lacks filled with the recomputed ones), else the recomputed ones."""
    if spec.update.old_logprobs == "rollout":
        return rows.flat_rollout_logprobs(fill=values.get("old"))
    return values["old"]


def mini_batch_options(spec: UpdateSpec) -> dict:
    """`batching.mini_batches`' options for this update (the shuffles derive from the spec's seed)."""
    return dict(groups_per_mini_batch=spec.update.ppo_mini_batch_size, seed=spec.seed)


def epoch_mini_batches(index: SampleIndex, spec: UpdateSpec, *, epoch: int) -> list[np.ndarray]:
    """Epoch `epoch`'s mini-batches (sample indices) drawn as update.mini_batch_grain says (see `batching`)."""
    if spec.update.mini_batch_grain == "row_group":
        return block_mini_batches(index.group_N, index.row_group_N, epoch=epoch, **mini_batch_options(spec))
    return mini_batches(index.group_N, epoch=epoch, **mini_batch_options(spec))


def rank_plan(
    index: SampleIndex, indices: np.ndarray, planner: Callable, *, spec: UpdateSpec, world_size: int
) -> list[list[list[list[int]]]]:
    """plan[rank][k] = the packs of rank's k-th micro-batch of the mini-batch `indices`; `planner(indices,
    world_size)` plans micro-batches (`forward.pack_plan` with a budget). With mini_batch_grain sample it plans the
    whole mini-batch over the ranks (samples of similar length together, whatever rank they land on); with
    row_group each rank first takes a contiguous run of the table (`batching.storage_ranks`: it then decodes
    about its share of row groups) and plans its own micro-batches, padded with empty ones to the longest plan."""
    if spec.update.mini_batch_grain != "row_group" or world_size == 1:
        return planner(indices, world_size)
    ranks = storage_ranks(
        indices,
        storage_row_N=index.storage_row_N,
        row_group_N=index.row_group_N,
        group_N=index.group_N,
        tokens_N=index.lengths_N,
        world_size=world_size,
    )
    plans = [planner(samples, 1)[0] if len(samples) else [] for samples in ranks]
    count = max(1, max(len(plan) for plan in plans))
    return [plan + [[] for _ in range(count - len(plan))] for plan in plans]


def own_share(rank_plan: list[list[list[int]]]) -> tuple[np.ndarray, list[list[list[int]]]]:
    """(this rank's samples, sorted; its micro-batches with each sample replaced by its position among them)."""
    mine = np.array(sorted({i for packs in rank_plan for pack in packs for i in pack}), dtype=np.int64)
    position = {int(i): k for k, i in enumerate(mine)}
    return mine, [[[position[i] for i in pack] for pack in packs] for packs in rank_plan]


def token_positions(offsets_N1: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """Positions in a flat per-token array (laid out by `offsets_N1`) of the tokens of samples `picks`, in order."""
    starts, lengths = offsets_N1[picks], offsets_N1[picks + 1] - offsets_N1[picks]
    before = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - before, lengths)


class SpilledValues:
    """The pre-update values ("old", "ref") of the samples this rank computed, in files under `scratch_dir`.

    One float32 file per name, appended a mini-batch at a time; `offset_N` says where a sample this rank holds
    starts (-1: another rank computed it). Reads are `pread`s of just the samples asked for.
    """

    def __init__(self, names: list[str], index: SampleIndex, scratch_dir: str):
        self.names, self.index = names, index
        self.offset_N = np.full(index.num_samples, -1, dtype=np.int64)
        self._files = {name: open(Path(scratch_dir) / f"{name}.float32", "w+b") for name in names}
        self._tokens = 0

    def append(self, indices: np.ndarray, values: dict[str, np.ndarray]) -> None:
        """Record the flat values (`indices`' responses, concatenated in order) this rank computed."""
        lengths = self.index.response_lengths_N[indices]
        self.offset_N[indices] = self._tokens + np.cumsum(lengths) - lengths
        for name, f in self._files.items():
            f.write(np.ascontiguousarray(values[name], dtype=np.float32).tobytes())
            f.flush()
        self._tokens += int(lengths.sum())

    def for_mini_batch(self, indices: np.ndarray, *, ctx: Dist) -> dict[str, np.ndarray]:
        """{name: flat values of `indices`' responses, in order}, the same on every rank. A collective when there
        is more than one rank and anything to share: every rank must call it with the same `indices`."""
        if not self.names:
            return {}
        offsets = np.concatenate([[0], np.cumsum(self.index.response_lengths_N[indices])]).astype(np.int64)
        buffer = np.zeros((len(self.names), int(offsets[-1])), dtype=np.float32)
        for j in np.flatnonzero(self.offset_N[indices] >= 0):
            count, start = int(offsets[j + 1] - offsets[j]), int(self.offset_N[indices[j]])
            for row, f in enumerate(self._files.values()):
                data = os.pread(f.fileno(), 4 * count, 4 * start)
                buffer[row, offsets[j] : offsets[j + 1]] = np.frombuffer(data, dtype=np.float32)
        if ctx.world_size > 1:
            shared = torch.from_numpy(buffer).to(ctx.device)
            dist.all_reduce(shared, op=dist.ReduceOp.SUM)
            buffer = shared.cpu().numpy()
        return {name: buffer[row] for row, name in enumerate(self.names)}

    def close(self) -> None:
        for f in self._files.values():
            f.close()


@torch.no_grad()
def logprob_pass(
    models: dict[str, torch.nn.Module],
    rows: Samples,
    packs_plan: list[list[list[int]]],
    *,
    ctx: Dist,
    pad_token_id: int,
) -> dict[str, np.ndarray]:
    """Flat per-token log-probs of `rows` under each named model (no grad), over this rank's micro-batches
    `packs_plan` (positions in `rows`; as many as every other rank's, empty ones included: each forward is an FSDP
    collective). A model named twice runs once."""
    if not models:
        return {}
    buffer = torch.zeros((len(models), int(rows.response_offsets_N1[-1])), dtype=torch.float32)
    for packs in packs_plan:
        mb = collate_packs(rows, packs, pad_token_id=pad_token_id, device=ctx.device)
        by_model: dict[int, torch.Tensor] = {}
        for row, model in enumerate(models.values()):
            if id(model) not in by_model:
                by_model[id(model)] = policy_logprobs(model, mb, entropy_grad=False)[0].cpu()
            scatter_response_values(by_model[id(model)], mb, rows, out_flat=buffer[row])
    return {name: buffer[row].numpy() for row, name in enumerate(models)}


def pre_update_pass(
    policy: torch.nn.Module,
    index: SampleIndex,
    reader: RowReader,
    *,
    spec: UpdateSpec,
    ctx: Dist,
    pad_token_id: int,
    scratch_dir: str,
    recompute_old: bool | None = None,
) -> SpilledValues:
    """Compute this rank's share of the old/reference log-probs, epoch 0's mini-batch by mini-batch, before any
    step; write its part of the log-probs table (`spec.logprobs_dir`). Returns where the values went.
    ``recompute_old``: `recomputes_old` (default: with old_logprobs=recompute)."""
    if recompute_old is None:
        recompute_old = recomputes_old(spec, missing_rollout_logprobs=0)
    models, reference = _pass_models(policy, spec=spec, ctx=ctx, recompute_old=recompute_old)
    spilled = SpilledValues(list(models), index, scratch_dir)
    writer = LogprobsWriter(spec.logprobs_dir, rank=ctx.rank) if spec.logprobs_dir is not None else None
    try:
        if models or writer is not None:
            for chunk in epoch_mini_batches(index, spec, epoch=0):
                mine, packs_plan = own_share(update_plan(index, chunk, spec=spec, world_size=ctx.world_size)[ctx.rank])
                rows = reader.read(mine)
                values = logprob_pass(models, rows, packs_plan, ctx=ctx, pad_token_id=pad_token_id)
                spilled.append(mine, values)
                if writer is not None:
                    writer.write(rows, old_flat=old_logprobs_used(rows, values, spec), ref_flat=values.get("ref"))
        for model in {id(m): m for m in models.values()}.values():
            model.reshard()  # FSDP2 keeps the root unsharded after a forward (it expects a backward)
        if writer is not None:
            writer.close()
    finally:
        if writer is not None:
            writer.abort()
        del models, reference
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return spilled


def _pass_models(
    policy: torch.nn.Module, *, spec: UpdateSpec, ctx: Dist, recompute_old: bool
) -> tuple[dict, list[torch.nn.Module] | None]:
    """({"old": the behaviour policy with recomputed old log-probs, "ref": the reference with the KL loss}, the
    models loaded for this pass (the reference, an older behaviour policy), else None). ``recompute_old``: see
    `recomputes_old`. A checkpoint that is policy_in's is the policy itself; one named twice is loaded once."""
    models: dict[str, torch.nn.Module] = {}
    loaded: dict[str, torch.nn.Module] = {}  # checkpoints loaded for this pass, by path

    def frozen(path: str | None) -> torch.nn.Module:
        if path is None or same_checkpoint(path, spec.policy_in):
            return policy
        for other, model in loaded.items():
            if same_checkpoint(path, other):
                return model
        model = load_model(path).requires_grad_(False)
        shard_model(model, ctx=ctx, compute_dtype=spec.dtype, cpu_offload=spec.update.cpu_offload)
        loaded[path] = model.eval()
        return model

    if recompute_old:  # the behaviour policy's (run.max_staleness > 0: an older checkpoint than policy_in)
        models["old"] = frozen(spec.behaviour_policy)
    if spec.update.kl_loss_coef > 0:  # with update.lora the reference is the base: the policy, adapter disabled
        models["ref"] = AdapterDisabled(policy) if spec.update.lora is not None else frozen(spec.reference_policy)
    return models, list(loaded.values()) or None


@dataclass(frozen=True)
class RankShare:
    """This rank's part of one mini-batch: its rows, its micro-batches (packs of positions in `rows`) and the
    per-token values the loss needs (flat over `rows`: "old" always, "ref" with the KL loss, "rollout" with IS)."""

    rows: Samples
    packs_plan: list[list[list[int]]]
    token_values: dict[str, np.ndarray]


@dataclass(frozen=True)
class UpdateInputs:
    """What the optimizer steps read: the index (the plan), the rows (read per mini-batch), the pre-update values."""

    index: SampleIndex
    reader: RowReader
    spilled: SpilledValues
    spec: UpdateSpec

    def share(self, indices: np.ndarray, *, ctx: Dist) -> RankShare:
        """This rank's share of the mini-batch `indices` (sorted). A collective (`SpilledValues.for_mini_batch`)."""
        plan = update_plan(self.index, indices, spec=self.spec, world_size=ctx.world_size)
        mine, packs_plan = own_share(plan[ctx.rank])
        shared = self.spilled.for_mini_batch(indices, ctx=ctx)
        offsets = np.concatenate([[0], np.cumsum(self.index.response_lengths_N[indices])]).astype(np.int64)
        picks = token_positions(offsets, np.searchsorted(indices, mine))
        token_values = {name: values[picks] for name, values in shared.items()}
        rows = self.reader.read(mine)
        if "token_advantages" in rows.token_lists:  # GAE: an advantage per token
            token_values["advantages"] = rows.flat_token_list("token_advantages")
        if uses_rollout_logprobs(self.spec):  # a sample without them (logged data) has the recomputed ones
            token_values["rollout"] = rows.flat_rollout_logprobs(fill=token_values.get("old"))
        if self.spec.update.old_logprobs == "rollout":  # (UpdateConfig rejects rollout_is_cap with rollout old)
            token_values["old"] = token_values.pop("rollout")
        return RankShare(rows=rows, packs_plan=packs_plan, token_values=token_values)


def update_plan(index: SampleIndex, indices: np.ndarray, *, spec: UpdateSpec, world_size: int):
    """The policy's micro-batch plan of a mini-batch (`rank_plan` with update's budget): the pre-update pass and
    the optimizer step plan alike, so a rank computes the old log-probs of the samples it trains on in epoch 0."""

    def planner(samples: np.ndarray, ranks: int):
        return micro_batch_plan(index, samples, spec=spec, world_size=ranks)

    return rank_plan(index, indices, planner, spec=spec, world_size=world_size)


def same_checkpoint(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    if os.path.exists(a) and os.path.exists(b):
        return os.path.realpath(a) == os.path.realpath(b)
    return a == b
