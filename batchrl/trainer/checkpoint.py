"""What an update leaves behind: the HF policy, the trainer state for exact resume, the log-probs table.

Why three outputs:
- The HF checkpoint (float32 safetensors + tokenizer) is what the next iteration's vLLM/transformers
  engine loads, and what nightly runs start from; rank 0 gathers the full state dict and writes it.
- The trainer state makes consecutive iterations one training run: AdamW's moments and step counts
  (a sharded torch.distributed.checkpoint, DCP, each rank writing its own shards) plus
  `trainer_state.json` with the global optimizer step that the lr schedule continues from. DCP reshards
  on load, so the next update may use a different number of processes. Without it every iteration would
  restart Adam from zero moments, i.e. take bias-corrected sign-like first steps.
- The log-probs table records, per sample, the old-policy and reference log-probs the loss used (one part per
  rank, `LogprobsWriter`).

RNG: nothing stateful is carried. Dropout is off, and the only randomness (mini-batch shuffles) derives
from (seed, iteration, epoch), so a resumed run draws the same shuffles without saved generator state.
Departure from verl: its checkpoints are per-rank FSDP shards of model + optimizer + extra state; here the
model is always a full HF checkpoint and only the optimizer is sharded.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from batchrl.trainer.data import Samples

logger = logging.getLogger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"
OPTIMIZER_DIR = "optimizer"
LOGPROBS_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("sample_idx", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("old_logprob_sum", pa.float64()),
        ("ref_logprob_sum", pa.float64()),
        ("old_logprobs", pa.list_(pa.float32())),
        ("ref_logprobs", pa.list_(pa.float32())),
    ]
)


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


def save_trainer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, out_dir: str, global_step: int, rank: int
) -> None:
    """Every rank writes its optimizer shards (DCP); rank 0 then writes trainer_state.json, last."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = Path(out_dir)
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        (out / OPTIMIZER_DIR).mkdir(parents=True)
    dist.barrier()
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(out / OPTIMIZER_DIR))
    dist.barrier()
    if rank == 0:
        state = {"global_step": global_step, "world_size": dist.get_world_size(), "format_version": 1}
        write_json_atomic(str(out / TRAINER_STATE_FILE), state)
        logger.info("saved trainer state (global step %d) to %s", global_step, out)
    dist.barrier()


def load_trainer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, in_dir: str) -> int:
    """Restore the optimizer moments into the (sharded) optimizer; return the global step to continue from.

    Must run before the first forward (the optimizer holds the sharded parameters). get_optimizer_state_dict
    first materialises empty Adam state with a zero-gradient, lr-0 step, which DCP then overwrites.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state_file = Path(in_dir) / TRAINER_STATE_FILE
    if not state_file.is_file():
        raise ValueError(f"{in_dir} has no {TRAINER_STATE_FILE}; pass a directory written by trainer_state_out")
    with open(state_file, encoding="utf-8") as f:
        global_step = int(json.load(f)["global_step"])
    hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    state_dict = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state_dict, checkpoint_id=str(Path(in_dir) / OPTIMIZER_DIR))
    set_optimizer_state_dict(model, optimizer, state_dict["optimizer"])
    for group, saved in zip(optimizer.param_groups, hyperparameters):
        group.update(saved)  # this update's lr / weight decay, not the previous update's
    logger.info("restored optimizer state from %s (global step %d)", in_dir, global_step)
    return global_step


def logprobs_table(rows: Samples, *, old_flat: np.ndarray, ref_flat: np.ndarray | None) -> pa.Table:
    """One row per sample of `rows` with the per-token old/reference log-probs the loss used, and their sums.

    Sums run over loss tokens only (a first response token with no prompt before it is excluded, and the tool
    tokens of a multi-turn sample); the lists hold every response token's.
    """
    offsets = rows.response_offsets_N1
    loss_tokens_N = rows.loss_tokens_N
    old_lists, ref_lists, old_sums, ref_sums = [], [], [], []
    for i in range(rows.num_samples):
        start, end = int(offsets[i]), int(offsets[i + 1])
        skip_first = int(end - start > loss_tokens_N[i])
        keep = rows.loss_mask(i) if rows.response_masks else None
        old_lists.append(old_flat[start:end])
        old_sums.append(_loss_sum(old_flat[start:end], skip_first, keep))
        if ref_flat is not None:
            ref_lists.append(ref_flat[start:end])
            ref_sums.append(_loss_sum(ref_flat[start:end], skip_first, keep))
    return pa.table(
        {
            "prompt_id": rows.prompt_ids,
            "sample_idx": rows.sample_idx,
            "num_loss_tokens": loss_tokens_N.astype(np.int32),
            "old_logprob_sum": old_sums,
            "ref_logprob_sum": ref_sums if ref_flat is not None else [None] * rows.num_samples,
            "old_logprobs": old_lists,
            "ref_logprobs": ref_lists if ref_flat is not None else [None] * rows.num_samples,
        },
        schema=LOGPROBS_SCHEMA,
    )


def _loss_sum(values: np.ndarray, skip_first: int, keep: np.ndarray | None) -> float:
    """Sum of a sample's values over its loss tokens: past ``skip_first`` or, with a policy mask, where ``keep``."""
    return float((values[skip_first:] if keep is None else values[keep]).astype(np.float64).sum())


class LogprobsWriter:
    """This rank's rows of the log-probs table, streamed as they are computed: one row group per `write` into
    ``<out_dir>/part-<rank>.parquet``, under a temporary name until `close` renames it into place (`abort`, after a
    failure, removes it). Each rank writes the samples it computed, so the parts together hold every sample once;
    rows are in (prompt_id, sample_idx) order within a row group, not across them."""

    def __init__(self, out_dir: str, *, rank: int):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(out_dir) / f"part-{rank:05d}.parquet"
        self._tmp = Path(out_dir) / f".{self.path.name}.tmp-{os.getpid()}"
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(self._tmp, LOGPROBS_SCHEMA, compression="zstd")

    def write(self, rows: Samples, *, old_flat: np.ndarray, ref_flat: np.ndarray | None) -> None:
        if rows.num_samples:
            self._writer.write_table(logprobs_table(rows, old_flat=old_flat, ref_flat=ref_flat))

    def close(self) -> None:
        self._writer.close()
        self._writer = None
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Remove the unfinished file (nothing to do after `close`)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._tmp.unlink(missing_ok=True)


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
