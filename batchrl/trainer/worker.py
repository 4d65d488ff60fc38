"""One torch.distributed rank of the FSDP2 policy update: `python -m batchrl.trainer.worker SPEC.json`.

Why a separate process per rank (started by `launch.run_update`, later by Ray): FSDP needs one process per
device, and a crashed or NaN update must not take the pipeline driver down with it.

What one update does (PPO-clip, as in GRPO):
1. Every rank reads the whole advantages table (so all ranks agree on global counts and on validation
   failures), sorts it by (prompt_id, sample_idx) and keeps rows[rank::world_size].
2. Rows become right-padded micro-batches of prompt+response ids. Position t of the shifted arrays predicts
   token t+1; only response tokens are in the loss mask. Ranks pad their micro-batch list with empty
   micro-batches to the same length, because every FSDP forward/backward is a collective.
3. Old log-probs are recomputed by a no-grad pass of the pre-update policy (once, before the first epoch)
   or taken from the rollout engine.
4. Each epoch is ONE optimizer step over the whole table (one mini-batch), with gradient accumulation over
   micro-batches. Token losses are divided by the GLOBAL token/sequence counts, so the per-rank losses sum
   to the single-process loss; FSDP is told to SUM (not average) gradients across ranks, so the gradient
   equals the single-process gradient for any world size and no world-size factor appears in the loss.
5. A non-finite loss or gradient norm aborts the update (non-zero exit) before the optimizer step and
   before anything is written.
6. Rank 0 writes the full float32 state dict as an HF checkpoint into a temporary sibling directory and
   renames it onto `policy_out`, then writes the metrics JSON.

Departures from verl: no dynamic (token-budget) batching yet; dropout is off (eval mode) so that the
recomputed old log-probs equal the first epoch's log-probs exactly (ratio = 1 at the first step).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from batchrl.algorithms.losses import (
    aggregate_token_losses,
    approx_kl,
    entropy_from_logits,
    ppo_clip_token_losses,
    token_logprobs,
)
from batchrl.trainer.spec import UpdateSpec

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
class MicroBatch:
    """Tensors of one forward/backward. L = padded sequence length, T = L - 1 (next-token positions)."""

    input_ids_BL: torch.Tensor  # [batch, seq_len] prompt + response, right-padded
    attention_mask_BL: torch.Tensor  # [batch, seq_len] 1 on real tokens
    labels_BT: torch.Tensor  # [batch, seq_len - 1] the token each position predicts
    response_mask_BT: torch.Tensor  # [batch, seq_len - 1] True where the predicted token is a response token
    advantages_BT: torch.Tensor  # [batch, seq_len - 1] the sample's advantage on its response tokens
    rollout_logprobs_BT: torch.Tensor  # [batch, seq_len - 1] engine log-probs on response tokens


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    device: torch.device


# ------------------------------------------------------------------------------------------ setup


def init_distributed(spec: UpdateSpec) -> Dist:
    """Join the process group described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (set by the launcher)."""
    backend = spec.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=backend)
    logger.info("rank %d/%d joined (%s on %s)", dist.get_rank(), dist.get_world_size(), backend, device)
    return Dist(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def load_policy(spec: UpdateSpec):
    """Load the policy in float32 (the master weights) and its tokenizer, on CPU; FSDP moves the shards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(spec.policy_in, dtype=torch.float32)
    model.config.use_cache = False
    tokenizer = AutoTokenizer.from_pretrained(spec.policy_in)
    return model, tokenizer


def shard_policy(model: torch.nn.Module, *, ctx: Dist, compute_dtype: str) -> None:
    """FSDP2: one shard group per decoder layer, then the root (embeddings, final norm, tied lm_head).

    Gradients are SUMMED across ranks (force-sum, divide factor 1): the loss already carries the global
    normalisation, and plain sums work on every backend (gloo has no AVG / pre-multiplied sum).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    mp_policy = MixedPrecisionPolicy()
    if compute_dtype == "bfloat16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no model.layers; the FSDP2 trainer supports decoder-only HF models "
            "laid out like Llama/Qwen2 (model.model.layers[i])"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


# ------------------------------------------------------------------------------------------- data


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


def check_advantages(table: pa.Table, *, old_logprobs: str) -> None:
    """User-data errors caught before any compute: non-finite advantages, mismatched logprob lists."""
    advantages_N = table.column("advantage").to_numpy(zero_copy_only=False).astype(np.float64)  # nulls -> NaN
    bad = np.flatnonzero(~np.isfinite(advantages_N))
    if bad.size:
        first = table.slice(int(bad[0]), 1).to_pylist()[0]
        raise ValueError(
            f"{bad.size} of {table.num_rows} advantages are NaN/inf (first: prompt_id={first['prompt_id']!r}, "
            f"sample_idx={first['sample_idx']}); fix the advantage stage output (e.g. a std of 0 in a group)"
        )
    if old_logprobs == "rollout":
        num_tokens = pc.list_value_length(table.column("response_token_ids"))
        num_logprobs = pc.list_value_length(table.column("response_logprobs"))
        if not pc.all(pc.equal(num_tokens, num_logprobs)).as_py():
            raise ValueError(
                "response_logprobs and response_token_ids differ in length for some rows; old_logprobs='rollout' "
                "needs one engine logprob per response token (or use old_logprobs='recompute')"
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


def _collate(rows: list[dict], *, pad_token_id: int) -> MicroBatch:
    """Right-pad prompt+response; an empty row list gives a one-row, fully masked batch."""
    rows = rows or [{"prompt_token_ids": [], "response_token_ids": [], "response_logprobs": [], "advantage": 0.0}]
    seq_len = max(2, max(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in rows))
    input_ids_BL = torch.full((len(rows), seq_len), pad_token_id, dtype=torch.long)
    attention_mask_BL = torch.zeros((len(rows), seq_len), dtype=torch.long)
    is_response_BL = torch.zeros((len(rows), seq_len), dtype=torch.bool)
    advantages_BL = torch.zeros((len(rows), seq_len), dtype=torch.float32)
    rollout_logprobs_BL = torch.zeros((len(rows), seq_len), dtype=torch.float32)
    for i, row in enumerate(rows):
        prompt, response = row["prompt_token_ids"], row["response_token_ids"]
        start, end = len(prompt), len(prompt) + len(response)
        input_ids_BL[i, :end] = torch.tensor(prompt + response, dtype=torch.long)
        attention_mask_BL[i, :end] = 1
        is_response_BL[i, start:end] = True
        advantages_BL[i, start:end] = float(row["advantage"])
        logprobs = row["response_logprobs"] or []
        rollout_logprobs_BL[i, start : start + len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32)
    # Position t predicts token t + 1; a response token at position 0 (empty prompt) has no predictor.
    return MicroBatch(
        input_ids_BL=input_ids_BL,
        attention_mask_BL=attention_mask_BL,
        labels_BT=input_ids_BL[:, 1:],
        response_mask_BT=is_response_BL[:, 1:],
        advantages_BT=advantages_BL[:, 1:],
        rollout_logprobs_BT=rollout_logprobs_BL[:, 1:],
    )


def build_micro_batches(
    rows: list[dict], *, micro_batch_size: int, num_micro_batches: int, pad_token_id: int, device: torch.device
) -> list[MicroBatch]:
    """`num_micro_batches` micro-batches (the max over ranks); the ones past this rank's rows are empty."""
    micro_batches = []
    for index in range(num_micro_batches):
        chunk = rows[index * micro_batch_size : (index + 1) * micro_batch_size]
        micro_batch = _collate(chunk, pad_token_id=pad_token_id)
        micro_batches.append(MicroBatch(**{k: v.to(device) for k, v in vars(micro_batch).items()}))
    return micro_batches


def global_counts(micro_batches: list[MicroBatch], *, device: torch.device) -> tuple[int, int]:
    """(response tokens, sequences with at least one response token) over all ranks."""
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for mb in micro_batches:
        tokens_per_seq_B = mb.response_mask_BT.sum(-1)
        counts[0] += tokens_per_seq_B.sum()
        counts[1] += (tokens_per_seq_B > 0).sum()
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    num_tokens, num_seqs = (int(c) for c in counts.tolist())
    if num_tokens == 0:
        raise ValueError("the advantages table has no response tokens to train on; every response is empty")
    return num_tokens, num_seqs


# ---------------------------------------------------------------------------------------- compute


def policy_logprobs(
    model: torch.nn.Module, mb: MicroBatch, *, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy), both [batch, seq_len - 1] float32; entropy carries grad only if asked."""
    logits_BLV = model(input_ids=mb.input_ids_BL, attention_mask=mb.attention_mask_BL, use_cache=False).logits
    logits_BTV = logits_BLV[:, :-1]
    logprobs_BT = token_logprobs(logits_BTV, mb.labels_BT)
    entropy_BT = entropy_from_logits(logits_BTV if entropy_grad else logits_BTV.detach())
    return logprobs_BT, entropy_BT


@torch.no_grad()
def recompute_old_logprobs(model: torch.nn.Module, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
    """Log-probs of the pre-update policy (the behaviour policy of PPO's ratio), one tensor per micro-batch.

    FSDP2 keeps the root's parameters unsharded after a forward (it expects a backward next); with no
    backward coming we reshard explicitly, so the module again exposes the sharded parameters that the
    optimizer updates.
    """
    old_logprobs = [policy_logprobs(model, mb, entropy_grad=False)[0].detach() for mb in micro_batches]
    model.reshard()
    return old_logprobs


def micro_batch_backward(
    model: torch.nn.Module,
    mb: MicroBatch,
    old_logprobs_BT: torch.Tensor,
    *,
    spec: UpdateSpec,
    num_tokens: int,
    num_seqs: int,
) -> torch.Tensor:
    """Forward + backward of one micro-batch's share of the global loss; returns this share's metric sums
    [pg_loss, clipped tokens, kl sum, entropy sum] (float64) for the all-reduce."""
    agg = dict(mode=spec.loss_agg_mode, num_global_tokens=num_tokens, num_global_seqs=max(num_seqs, 1))
    logprobs_BT, entropy_BT = policy_logprobs(model, mb, entropy_grad=spec.entropy_coeff > 0)
    pg_losses_BT, is_clipped_BT, _ = ppo_clip_token_losses(
        logprobs_BT,
        old_logprobs_BT,
        mb.advantages_BT,
        clip_ratio_low=spec.clip_ratio_low,
        clip_ratio_high=spec.clip_ratio_high,
    )
    mask_BT = mb.response_mask_BT
    pg_loss = aggregate_token_losses(pg_losses_BT, mask_BT, **agg)
    loss = pg_loss
    if spec.entropy_coeff > 0:
        loss = loss - spec.entropy_coeff * aggregate_token_losses(entropy_BT, mask_BT, **agg)
    loss.backward()
    kl_sum = approx_kl(logprobs_BT.detach(), old_logprobs_BT, mask_BT) * mask_BT.sum()
    return torch.stack(
        [
            pg_loss.detach().double(),
            (is_clipped_BT & mask_BT).sum().double(),
            kl_sum.double(),
            entropy_BT.detach().masked_fill(~mask_BT, 0).sum().double(),
        ]
    )


def ppo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    old_logprobs: list[torch.Tensor],
    *,
    spec: UpdateSpec,
    num_tokens: int,
    num_seqs: int,
) -> dict[str, float]:
    """One optimizer step over all micro-batches (gradient accumulation); returns global metrics."""
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(4, dtype=torch.float64, device=micro_batches[0].input_ids_BL.device)
    for mb, old_logprobs_BT in zip(micro_batches, old_logprobs):
        sums += micro_batch_backward(
            model, mb, old_logprobs_BT, spec=spec, num_tokens=num_tokens, num_seqs=num_seqs
        )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    pg_loss_value = float(sums[0])
    if not math.isfinite(pg_loss_value):
        raise FloatingPointError(
            f"policy loss is {pg_loss_value} (NaN/inf); aborting before the optimizer step. Check the advantages "
            "table and, with old_logprobs='rollout', the engine logprobs for NaN/inf values"
        )
    grad_norm = clip_gradients(model, max_grad_norm=spec.max_grad_norm)
    if not math.isfinite(grad_norm):
        raise FloatingPointError(
            f"gradient norm is {grad_norm} (NaN/inf); aborting before the optimizer step. Lower lr or check "
            "the inputs for extreme values"
        )
    optimizer.step()
    return {
        "actor/pg_loss": pg_loss_value,
        "actor/pg_clipfrac": float(sums[1]) / num_tokens,
        "actor/ppo_kl": float(sums[2]) / num_tokens,
        "actor/entropy": float(sums[3]) / num_tokens,
        "actor/grad_norm": grad_norm,
    }


def clip_gradients(model: torch.nn.Module, *, max_grad_norm: float) -> float:
    """Clip to max_grad_norm (no clipping when <= 0) and return the FULL pre-clip norm over all shards."""
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(total_norm, "full_tensor"):  # DTensor with a partial placement: reduce across ranks
        total_norm = total_norm.full_tensor()
    return float(total_norm)


# ------------------------------------------------------------------------------------------ output


def save_policy(model: torch.nn.Module, tokenizer, *, policy_out: str, rank: int) -> None:
    """Gather the full state dict (a collective) and let rank 0 write it, then rename it into place."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Tied weights (lm_head = embed_tokens) come out as separate copies; keep only the first name, as HF does.
    unique_names = {name for name, _ in model.named_parameters()}
    for alias in {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique_names:
        state_dict.pop(alias, None)
    if rank == 0:
        out_dir = Path(policy_out)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        model.save_pretrained(str(tmp_dir), state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(str(tmp_dir))
        replace_dir(tmp_dir, out_dir)
        logger.info("saved policy to %s", out_dir)
    dist.barrier()


def replace_dir(src: Path, dst: Path) -> None:
    """Move src onto dst by rename; an existing dst is renamed away first and deleted after."""
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def write_json_atomic(path: str, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp_path = f"{path}.tmp-{os.getpid()}"
    with open(tmp_path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
    os.replace(tmp_path, path)


# -------------------------------------------------------------------------------------------- main


def run(spec: UpdateSpec) -> dict[str, float] | None:
    """The whole update on this rank; returns the metrics on rank 0, None elsewhere."""
    ctx = init_distributed(spec)
    torch.manual_seed(spec.seed)
    start = time.perf_counter()
    table = read_advantages(spec.advantages_files)
    check_advantages(table, old_logprobs=spec.old_logprobs)
    model, tokenizer = load_policy(spec)
    check_token_ids(table, vocab_size=model.get_input_embeddings().num_embeddings)
    shard_policy(model, ctx=ctx, compute_dtype=spec.dtype)
    model.eval()  # no dropout: recomputed old log-probs equal the first epoch's log-probs
    # Built before any forward: only then does model.parameters() yield the sharded DTensors for every module.
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    load_time = time.perf_counter() - start

    rows = table.take(np.arange(ctx.rank, table.num_rows, ctx.world_size, dtype=np.int64)).to_pylist()
    num_micro_batches = torch.tensor(-(-len(rows) // spec.micro_batch_size), device=ctx.device)
    dist.all_reduce(num_micro_batches, op=dist.ReduceOp.MAX)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    micro_batches = build_micro_batches(
        rows,
        micro_batch_size=spec.micro_batch_size,
        num_micro_batches=max(1, int(num_micro_batches)),
        pad_token_id=pad_token_id,
        device=ctx.device,
    )
    num_tokens, num_seqs = global_counts(micro_batches, device=ctx.device)

    update_start = time.perf_counter()
    if spec.old_logprobs == "recompute":
        old_logprobs = recompute_old_logprobs(model, micro_batches)
    else:
        old_logprobs = [mb.rollout_logprobs_BT for mb in micro_batches]
    epoch_metrics = []
    for epoch in range(spec.ppo_epochs):
        step_metrics = ppo_step(
            model, optimizer, micro_batches, old_logprobs, spec=spec, num_tokens=num_tokens, num_seqs=num_seqs
        )
        logger.info("epoch %d: %s", epoch, step_metrics)
        epoch_metrics.append(step_metrics)
    update_time = time.perf_counter() - update_start

    save_start = time.perf_counter()
    save_policy(model, tokenizer, policy_out=spec.policy_out, rank=ctx.rank)
    metrics = {name: sum(m[name] for m in epoch_metrics) / len(epoch_metrics) for name in epoch_metrics[0]}
    metrics |= {
        "actor/lr": spec.lr,
        "perf/num_tokens": float(num_tokens),
        "perf/num_samples": float(table.num_rows),
        "perf/update_time_s": update_time,
        "perf/load_time_s": load_time,
        "perf/save_time_s": time.perf_counter() - save_start,
    }
    return metrics if ctx.rank == 0 else None


def main() -> None:
    """Entry point of one rank. Logging is configured here because this is a process's main, like cli.py."""
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m batchrl.trainer.worker SPEC.json")
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    spec = UpdateSpec.from_json(sys.argv[1])
    metrics = run(spec)
    if metrics is not None:
        write_json_atomic(spec.metrics_path, metrics)
    dist.destroy_process_group()
    # Skip interpreter finalisation: gloo's worker threads can still hold tensors whose destruction during
    # teardown aborts the process (SIGABRT, "terminate called without an active exception"; seen in CI).
    # Everything this rank owed is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
