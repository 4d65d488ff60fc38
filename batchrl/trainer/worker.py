"""One torch.distributed rank of the FSDP2 policy update: `python -m batchrl.trainer.worker SPEC.json`.

Why a separate process per rank (started by `launch.run_update`, later by Ray): FSDP needs one process per
device, and a crashed or NaN update must not take the pipeline driver down with it.

What one update does (PPO-clip or GSPO, as in GRPO):
1. Every rank reads the whole advantages table, sorted by (prompt_id, sample_idx), so all ranks agree on
   validation failures and can compute the same batching plan for every rank (`batching`) without talking.
2. Pre-update log-probs, once, before any step: the old (behaviour) policy's, by a no-grad pass of the
   loaded policy (or taken from the rollout engine), and the frozen reference model's when the KL loss is
   on (the reference is loaded, sharded with FSDP too, used for this one pass and freed before training).
   Ranks compute disjoint samples and share them with one all-reduce of a flat per-token buffer.
3. Each epoch shuffles the prompt groups into mini-batches; one optimizer step per mini-batch, with
   gradient accumulation over token-budget (or fixed-count) micro-batches. Token losses are divided by the
   mini-batch's GLOBAL token/sequence counts, so the per-rank losses sum to the single-process loss; FSDP
   is told to SUM (not average) gradients across ranks, so the gradient equals the single-process gradient
   for any world size. Ranks with fewer micro-batches run empty ones: every FSDP forward/backward is a
   collective.
4. loss = pg_loss (x truncated IS weights) - entropy_coeff * entropy + kl_loss_coef * kl(policy, ref),
   all aggregated with the same mode; the lr follows the schedule of the global optimizer step.
5. A non-finite loss or gradient norm aborts the update (non-zero exit) before the optimizer step and
   before anything is written.
6. The optimizer state (sharded, DCP) and the HF checkpoint are written; rank 0 writes the metrics last.

Resident mode (`python -m batchrl.trainer.worker --serve`, started by `launch.run_update(..., resident=True)`):
the rank stays alive and runs one update per spec path read from stdin, so the imports, the process group and,
when the next update continues from exactly what this one saved, the sharded model, optimizer and tokenizer are
reused (`Resident`). "Exactly" is checked by content, not by path: the pipeline publishes policy_out and
trainer_state_out to the run directory and hands the copies to the next update, so the rank records the
sha256 of every file it saved and reuses its memory only when the next inputs hash the same. The in-memory
model is then the saved float32 policy and the optimizer what DCP saved, so a resident update computes what a
fresh process would, bit for bit (tests/stages/test_trainer_resident.py).

Before anything is loaded from `trainer_state_in` (DCP unpickles it), its files are hashed (the same hashing, shared
by the ranks) and checked against the sha256 its writer recorded, `spec.trainer_state_sha256` (`integrity`).

Departures from verl: dropout is off (eval mode) so that the recomputed old log-probs equal the first
step's log-probs exactly (ratio = 1 at the first step); with gradient checkpointing the decoder layers alone
are put in training mode, which is what transformers checks before checkpointing. Right-padded micro-batches
instead of verl's padding-free packed sequences (see `batching`).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import inspect
import logging
import math
import os
import select
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from batchrl.algorithms.kl import kl_penalty
from batchrl.algorithms.losses import (
    aggregate_token_losses,
    approx_kl,
    entropy_from_logits,
    gspo_token_losses,
    ppo_clip_token_losses,
    token_logprobs,
    truncated_is_weights,
)
from batchrl.trainer.batching import mini_batches, plan_micro_batches, prompt_packs
from batchrl.trainer.checkpoint import (
    load_trainer_state,
    save_policy,
    save_trainer_state,
    write_json_atomic,
    write_logprobs,
)
from batchrl.trainer.data import (
    MicroBatch,
    Samples,
    check_advantages,
    check_token_ids,
    collate_packs,
    first_logit_position,
    read_advantages,
    response_logits,
    samples_from_table,
    scatter_response_values,
)
from batchrl.trainer.integrity import TrainerStateError, check_digests, write_error
from batchrl.trainer.progress_file import ProgressWriter
from batchrl.trainer.schedule import lr_at_step, resolve_warmup_steps
from batchrl.trainer.spec import UpdateSpec, resolve_backend

logger = logging.getLogger(__name__)

# Per-micro-batch sums, all-reduced once per optimizer step.
SUM_NAMES = ("loss", "pg_loss", "kl_loss", "clipped_tokens", "ppo_kl", "entropy", "is_weight", "padded", "real")


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    device: torch.device


# ------------------------------------------------------------------------------------------ setup


def init_distributed(spec: UpdateSpec) -> Dist:
    """Join the process group described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (set by the launcher)."""
    backend = resolve_backend(spec.backend)
    if spec.cpu_offload and backend != "nccl":
        raise ValueError("cpu_offload=True needs GPUs (the nccl backend); on CPU the parameters already live in "
                         "host memory. Set update.cpu_offload=false")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # On GPU, gloo serves the collectives on CPU tensors: DCP's object gathers and, with CPU offload, the
    # gradient-norm reduction over host-resident shards.
    dist.init_process_group(backend="cuda:nccl,cpu:gloo" if backend == "nccl" else backend)
    logger.info("rank %d/%d joined (%s on %s)", dist.get_rank(), dist.get_world_size(), backend, device)
    return Dist(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def load_model(path: str, *, gradient_checkpointing: bool = False) -> torch.nn.Module:
    """Load an HF causal LM in float32 (the master weights) on CPU; FSDP moves the shards."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def shard_model(model: torch.nn.Module, *, ctx: Dist, compute_dtype: str, cpu_offload: bool) -> None:
    """FSDP2: one shard group per decoder layer, then the root (embeddings, final norm, tied lm_head).

    bfloat16 compute: parameters are all-gathered and used in bf16, gradients reduced in fp32, master weights
    fp32. Gradients are SUMMED across ranks (force-sum, divide factor 1): the loss already carries the global
    normalisation, and plain sums work on every backend (gloo has no AVG / pre-multiplied sum).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    mp_policy = MixedPrecisionPolicy()
    if compute_dtype == "bfloat16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no model.layers; the FSDP2 trainer supports decoder-only HF models "
            "laid out like Llama/Qwen2 (model.model.layers[i])"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


def set_dropout_free_mode(model: torch.nn.Module) -> int:
    """eval() everywhere (no dropout), then training mode on the checkpointed decoder layers only.

    transformers checkpoints a layer only when `layer.gradient_checkpointing and layer.training`; the layer's
    submodules (attention, MLP, their dropout) stay in eval mode. Returns the number of checkpointed layers.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.eval()
    checkpointed = 0
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            module.training = True
            checkpointed += 1
    return checkpointed


# ---------------------------------------------------------------------------------------- compute


def micro_batch_budget(spec: UpdateSpec) -> dict[str, int | None]:
    if spec.max_tokens_per_micro_batch is not None:
        return {"max_tokens": spec.max_tokens_per_micro_batch}
    return {"max_samples": spec.micro_batch_size}


def micro_batch_plan(
    samples: Samples, indices: Sequence[int], *, spec: UpdateSpec, world_size: int
) -> list[list[list[list[int]]]]:
    """plan[rank][k] = the packs (sample indices sharing a row, see `data.collate_packs`) of rank's k-th
    micro-batch of the samples `indices`. Without spec.share_prompt every pack is one sample."""
    return pack_plan(samples, indices, share_prompt=spec.share_prompt, world_size=world_size,
                     **micro_batch_budget(spec))


def pack_plan(
    samples: Samples, indices: Sequence[int], *, share_prompt: bool, world_size: int, max_tokens: int | None = None,
    max_samples: int | None = None,
) -> list[list[list[list[int]]]]:
    """`micro_batch_plan` without a spec: packs (with share_prompt, filled up to max_tokens) planned into
    micro-batches by `batching.plan_micro_batches` with the budget given."""
    if share_prompt:
        packs = prompt_packs(indices, prompt_key_N=samples.prompt_key_N, prompt_lengths_N=samples.prompt_lengths_N,
                             response_lengths_N=samples.response_lengths_N, max_tokens=max_tokens)
    else:
        packs = [[int(i)] for i in indices]
    lengths = [int(samples.prompt_lengths_N[pack[0]] + samples.response_lengths_N[pack].sum()) for pack in packs]
    plan = plan_micro_batches(lengths, world_size=world_size, max_tokens=max_tokens, max_samples=max_samples)
    return [[[packs[j] for j in chunk] for chunk in micro_batches] for micro_batches in plan]


def policy_logprobs(
    model: torch.nn.Module, mb: MicroBatch, *, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(response token), entropy), both [samples, response tokens] float32; entropy has grad only if asked.

    The lm_head runs only from the first position a response token needs (`logits_to_keep`, when the model
    takes it): prompt positions before it would be [rows, prompt, vocab] logits computed for nothing.
    """
    attention_mask = mb.attention_mask
    if attention_mask.dim() == 4 and _attention_implementation(model) == "eager":
        # eager attention adds the mask to the scores: True/False would add 1/0, not allow/forbid
        attention_mask = torch.zeros(attention_mask.shape, device=attention_mask.device).masked_fill_(
            ~attention_mask, torch.finfo(torch.float32).min)
    inputs = dict(input_ids=mb.input_ids_BL, attention_mask=attention_mask, use_cache=False)
    if mb.position_ids_BL is not None:
        inputs["position_ids"] = mb.position_ids_BL
    first = first_logit_position(mb) if _takes_logits_to_keep(model) else 0
    if first > 0:
        inputs["logits_to_keep"] = mb.input_ids_BL.shape[1] - first
    logits_SRV = response_logits(model(**inputs).logits, mb, first_position=first)
    logprobs_SR = token_logprobs(logits_SRV, mb.labels_SR)
    entropy_SR = entropy_from_logits(logits_SRV if entropy_grad else logits_SRV.detach())
    return logprobs_SR, entropy_SR


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _attention_implementation(model: torch.nn.Module) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def check_attention(model: torch.nn.Module, spec: UpdateSpec) -> None:
    """Shared-prompt rows need a custom [B, 1, L, L] mask, which flash-attention kernels do not take."""
    implementation = _attention_implementation(model)
    if spec.share_prompt and implementation not in ("sdpa", "eager"):
        raise ValueError(f"update.share_prompt needs the sdpa or eager attention; this model uses {implementation!r}. "
                         "Set update.share_prompt: false")


@torch.no_grad()
def logprob_pass(
    models: dict[str, torch.nn.Module], samples: Samples, *, spec: UpdateSpec, ctx: Dist, pad_token_id: int
) -> dict[str, np.ndarray]:
    """Flat per-token log-probs of every sample under each named model (no grad), identical on every rank.

    Each rank computes its share of the samples into a zero buffer; one SUM all-reduce (x + 0 = x, exact)
    gives every rank every value. A model named twice runs once. FSDP2 keeps the root's parameters unsharded
    after a forward (it expects a backward next); with no backward coming we reshard explicitly.
    """
    names = list(models)
    buffer = torch.zeros((len(names), int(samples.response_offsets_N1[-1])), dtype=torch.float32, device=ctx.device)
    plan = micro_batch_plan(samples, range(samples.num_samples), spec=spec, world_size=ctx.world_size)
    for packs in plan[ctx.rank]:
        mb = collate_packs(samples, packs, pad_token_id=pad_token_id, device=ctx.device)
        by_model: dict[int, torch.Tensor] = {}
        for row, name in enumerate(names):
            model = models[name]
            if id(model) not in by_model:
                by_model[id(model)] = policy_logprobs(model, mb, entropy_grad=False)[0]
            scatter_response_values(by_model[id(model)], mb, samples, out_flat=buffer[row])
    for model in {id(m): m for m in models.values()}.values():
        model.reshard()
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    return {name: buffer[row].cpu().numpy() for row, name in enumerate(names)}


def pre_update_logprobs(
    policy: torch.nn.Module, samples: Samples, *, spec: UpdateSpec, ctx: Dist, pad_token_id: int
) -> dict[str, np.ndarray]:
    """The flat per-token arrays the loss needs: "old" always, "ref" with the KL loss, "rollout" with IS.

    The reference is the policy itself when both name the same checkpoint (iteration 0), else it is loaded,
    sharded like the policy, used for this pass and freed.
    """
    values: dict[str, np.ndarray] = {}
    if spec.old_logprobs == "rollout" or spec.rollout_is_cap is not None:
        values["rollout"] = samples.flat_rollout_logprobs()
    models: dict[str, torch.nn.Module] = {}
    if spec.old_logprobs == "recompute":
        models["old"] = policy
    reference = None
    if spec.kl_loss_coef > 0:
        if same_checkpoint(spec.reference_policy, spec.policy_in):
            models["ref"] = policy
        else:
            reference = load_model(spec.reference_policy).requires_grad_(False)
            shard_model(reference, ctx=ctx, compute_dtype=spec.dtype, cpu_offload=spec.cpu_offload)
            reference.eval()
            models["ref"] = reference
    if models:
        values |= logprob_pass(models, samples, spec=spec, ctx=ctx, pad_token_id=pad_token_id)
    if spec.old_logprobs == "rollout":  # (the spec rejects rollout_is_cap with rollout old log-probs)
        values["old"] = values.pop("rollout")
    if reference is not None:
        del models["ref"], reference
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return values


def same_checkpoint(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    if os.path.exists(a) and os.path.exists(b):
        return os.path.realpath(a) == os.path.realpath(b)
    return a == b


def pg_token_losses(
    logprobs_SR: torch.Tensor, mb: MicroBatch, *, spec: UpdateSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pg_losses_SR, is_clipped_SR) of the configured policy loss, truncated-IS weighted when asked."""
    old_logprobs_SR, mask_SR = mb.token_values_SR["old"], mb.response_mask_SR
    clip = dict(clip_ratio_low=spec.clip_ratio_low, clip_ratio_high=spec.clip_ratio_high)
    if spec.policy_loss == "gspo":
        pg_losses_SR, is_clipped_SR, _ = gspo_token_losses(logprobs_SR, old_logprobs_SR, mb.advantages_SR, mask_SR,
                                                           **clip)
    else:
        pg_losses_SR, is_clipped_SR, _ = ppo_clip_token_losses(
            logprobs_SR, old_logprobs_SR, mb.advantages_SR, dual_clip_ratio=spec.dual_clip_ratio, **clip
        )
    return pg_losses_SR, is_clipped_SR


def micro_batch_backward(
    model: torch.nn.Module, mb: MicroBatch, *, spec: UpdateSpec, num_tokens: int, num_seqs: int
) -> torch.Tensor:
    """Forward + backward of one micro-batch's share of the mini-batch loss; returns its SUM_NAMES sums."""
    agg = dict(mode=spec.loss_agg_mode, num_global_tokens=num_tokens, num_global_seqs=max(num_seqs, 1),
               norm_length=spec.loss_agg_norm_length)
    mask_SR = mb.response_mask_SR
    logprobs_SR, entropy_SR = policy_logprobs(model, mb, entropy_grad=spec.entropy_coeff > 0)
    pg_losses_SR, is_clipped_SR = pg_token_losses(logprobs_SR, mb, spec=spec)
    is_weights_SR = mask_SR.float()
    if spec.rollout_is_cap is not None:
        is_weights_SR = truncated_is_weights(mb.token_values_SR["old"], mb.token_values_SR["rollout"], mask_SR,
                                             cap=spec.rollout_is_cap)
        pg_losses_SR = pg_losses_SR * is_weights_SR
    pg_loss = aggregate_token_losses(pg_losses_SR, mask_SR, **agg)
    loss = pg_loss
    if spec.entropy_coeff > 0:
        loss = loss - spec.entropy_coeff * aggregate_token_losses(entropy_SR, mask_SR, **agg)
    kl_loss = torch.zeros((), device=pg_loss.device)
    if spec.kl_loss_coef > 0:
        kl_SR = kl_penalty(logprobs_SR, mb.token_values_SR["ref"], estimator=spec.kl_estimator)
        kl_loss = aggregate_token_losses(kl_SR, mask_SR, **agg)
        loss = loss + spec.kl_loss_coef * kl_loss
    loss.backward()
    ppo_kl_sum = approx_kl(logprobs_SR.detach(), mb.token_values_SR["old"], mask_SR) * mask_SR.sum()
    return torch.stack([
        loss.detach().double(),
        pg_loss.detach().double(),
        kl_loss.detach().double(),
        (is_clipped_SR & mask_SR).sum().double(),
        ppo_kl_sum.double(),
        entropy_SR.detach().masked_fill(~mask_SR, 0).sum().double(),
        is_weights_SR.masked_fill(~mask_SR, 0).sum().double(),
        torch.tensor(float(mb.padded_tokens), dtype=torch.float64, device=pg_loss.device),
        torch.tensor(float(mb.real_tokens if mb.indices else 0), dtype=torch.float64, device=pg_loss.device),
    ])


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Samples,
    indices: np.ndarray,
    token_values: dict[str, np.ndarray],
    *,
    spec: UpdateSpec,
    ctx: Dist,
    pad_token_id: int,
    lr: float,
) -> dict[str, float] | None:
    """One optimizer step on the mini-batch `indices` (gradient accumulation); None if it has no loss tokens."""
    loss_tokens = samples.loss_tokens_N[indices]
    num_tokens, num_seqs = int(loss_tokens.sum()), int((loss_tokens > 0).sum())
    if num_tokens == 0:
        logger.warning("a mini-batch of %d samples has no response tokens; no optimizer step for it", len(indices))
        return None
    plan = micro_batch_plan(samples, indices, spec=spec, world_size=ctx.world_size)
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(len(SUM_NAMES), dtype=torch.float64, device=ctx.device)
    for k, packs in enumerate(plan[ctx.rank]):
        if ctx.world_size == 1 and not spec.cpu_offload:  # one rank: sharded = unsharded, skip per-micro-batch copies
            model.set_requires_gradient_sync(k == len(plan[ctx.rank]) - 1)
        mb = collate_packs(samples, packs, pad_token_id=pad_token_id, device=ctx.device, token_values=token_values)
        sums += micro_batch_backward(model, mb, spec=spec, num_tokens=num_tokens, num_seqs=num_seqs)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    total = dict(zip(SUM_NAMES, sums.tolist()))
    if not math.isfinite(total["loss"]):
        raise FloatingPointError(
            f"policy loss is {total['loss']} (NaN/inf; pg_loss={total['pg_loss']}, kl_loss={total['kl_loss']}); "
            "aborting before the optimizer step. Check the advantages table and, with old_logprobs='rollout' or "
            "rollout_is_cap, the engine logprobs for NaN/inf values"
        )
    grad_norm = clip_gradients(model, max_grad_norm=spec.max_grad_norm)
    if not math.isfinite(grad_norm):
        raise FloatingPointError(
            f"gradient norm is {grad_norm} (NaN/inf); aborting before the optimizer step. Lower lr or check "
            "the inputs for extreme values"
        )
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    metrics = {
        "actor/pg_loss": total["pg_loss"],
        "actor/pg_clipfrac": total["clipped_tokens"] / num_tokens,
        "actor/ppo_kl": total["ppo_kl"] / num_tokens,
        "actor/entropy": total["entropy"] / num_tokens,
        "actor/grad_norm": grad_norm,
        "perf/padded_tokens": total["padded"],
        "perf/real_tokens": total["real"],
    }
    if spec.kl_loss_coef > 0:
        metrics["actor/kl_loss"] = total["kl_loss"]
    if spec.rollout_is_cap is not None:
        metrics["actor/rollout_is_weight_mean"] = total["is_weight"] / num_tokens
    return metrics


def clip_gradients(model: torch.nn.Module, *, max_grad_norm: float) -> float:
    """Clip to max_grad_norm (no clipping when <= 0) and return the FULL pre-clip norm over all shards."""
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(total_norm, "full_tensor"):  # DTensor with a partial placement: reduce across ranks
        total_norm = total_norm.full_tensor()
    return float(total_norm)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Samples,
    token_values: dict[str, np.ndarray],
    *,
    spec: UpdateSpec,
    ctx: Dist,
    pad_token_id: int,
    start_step: int,
    progress: ProgressWriter | None = None,
) -> tuple[list[dict[str, float]], int]:
    """All epochs x mini-batches; returns each step's metrics and the global step after the last one.

    `progress` gets one record per mini-batch (done / planned steps and the step's pg_loss, grad_norm, lr).
    """
    progress = progress or ProgressWriter(None)
    batches = dict(groups_per_mini_batch=spec.ppo_mini_batch_size, seed=spec.seed)
    steps_per_update = spec.ppo_epochs * len(mini_batches(samples.group_N, epoch=0, **batches))
    total_steps = spec.lr_total_steps or spec.num_iterations * steps_per_update
    schedule = dict(lr=spec.lr, schedule=spec.lr_schedule, total_steps=total_steps, min_lr_ratio=spec.min_lr_ratio,
                    warmup_steps=resolve_warmup_steps(warmup_steps=spec.lr_warmup_steps,
                                                      warmup_ratio=spec.lr_warmup_ratio, total_steps=total_steps))
    step, step_metrics, done = start_step, [], 0
    progress.write({"phase": "train", "done": 0, "total": steps_per_update})
    for epoch in range(spec.ppo_epochs):
        for indices in mini_batches(samples.group_N, epoch=epoch, **batches):
            lr, started = lr_at_step(step, **schedule), time.perf_counter()
            metrics = optimizer_step(model, optimizer, samples, indices, token_values, spec=spec, ctx=ctx,
                                     pad_token_id=pad_token_id, lr=lr)
            done += 1
            if metrics is None:
                progress.write({"phase": "train", "done": done, "total": steps_per_update})
                continue
            progress.write({"phase": "train", "done": done, "total": steps_per_update, "global_step": step + 1,
                            "pg_loss": metrics["actor/pg_loss"], "grad_norm": metrics["actor/grad_norm"], "lr": lr})
            step_metrics.append(metrics | {"actor/lr": lr, "perf/step_time_s": time.perf_counter() - started})
            step += 1
            logger.info("epoch %d, step %d: %s", epoch, step, metrics)
    if not step_metrics:
        raise ValueError("the advantages table has no response tokens to train on; every response is empty")
    return step_metrics, step


# -------------------------------------------------------------------------------------------- main


def summarize(step_metrics: list[dict[str, float]], *, spec: UpdateSpec, global_step: int) -> dict[str, float]:
    """Means over optimizer steps of the per-step metrics; the last lr; the fastest step; token totals."""
    summed = {"perf/padded_tokens", "perf/real_tokens"}
    metrics = {name: sum(m[name] for m in step_metrics) / len(step_metrics)
               for name in step_metrics[0] if name not in summed | {"actor/lr"}}
    metrics |= {name: sum(m[name] for m in step_metrics) for name in summed}
    metrics["actor/lr"] = step_metrics[-1]["actor/lr"]
    metrics["perf/step_time_min_s"] = min(m["perf/step_time_s"] for m in step_metrics)
    metrics["perf/padding_ratio"] = metrics["perf/padded_tokens"] / max(metrics["perf/real_tokens"], 1.0)
    metrics["actor/num_optimizer_steps"] = float(len(step_metrics))
    metrics["actor/global_step"] = float(global_step)
    if spec.kl_loss_coef > 0:
        metrics["actor/kl_coef"] = spec.kl_loss_coef
    return metrics


# Spec fields that may change from one update to the next while a resident rank keeps its model and optimizer:
# where to read and write, which data, the seed. Any other difference (lr, weight decay, dtype, reference, ...)
# rebuilds them from disk, as a fresh process would.
PER_UPDATE_FIELDS = frozenset({"policy_in", "policy_out", "advantages_files", "metrics_path", "seed",
                               "trainer_state_in", "trainer_state_sha256", "trainer_state_out", "logprobs_out",
                               "progress_path"})


@dataclass
class Resident:
    """What a resident rank keeps after an update, and what it is an exact copy of.

    `policy_files` / `state_files`: sha256 per relative path of the policy and trainer state it saved (None:
    no trainer state saved). The next update may reuse the memory only if its inputs hash the same.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: object
    global_step: int
    settings: dict
    policy_files: dict[str, str]
    state_files: dict[str, str] | None


def spec_settings(spec: UpdateSpec) -> dict:
    """The spec minus PER_UPDATE_FIELDS: what must be equal for a resident rank to reuse its model/optimizer."""
    return {k: v for k, v in dataclasses.asdict(spec).items() if k not in PER_UPDATE_FIELDS}


def checkpoint_files(root: str) -> list[str] | None:
    """Relative paths of the files under `root`, sorted; entries whose top-level name starts with "_" or "." are
    not part of a checkpoint (the run's manifest, _trainer_state, _logprobs, a cache's .complete marker).
    None when `root` is not a local directory (a hub id)."""
    base = Path(root)
    if not base.is_dir():
        return None
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*")
                  if p.is_file() and not p.relative_to(base).parts[0].startswith(("_", ".")))


def file_digests(root: str, *, ctx: Dist) -> dict[str, str] | None:
    """{relative path: sha256} of the checkpoint under `root`, computed by all ranks (each hashes every
    world_size-th file) and identical on every rank. A collective: every rank must call it."""
    names = checkpoint_files(root)
    if names is None:
        return None
    mine = {}
    for name in names[ctx.rank::ctx.world_size]:
        with open(Path(root) / name, "rb") as f:
            mine[name] = hashlib.file_digest(f, "sha256").hexdigest()
    gathered: list[dict[str, str] | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    return {name: digest for part in gathered for name, digest in part.items()}


def verified_trainer_state(spec: UpdateSpec, *, ctx: Dist) -> dict[str, str] | None:
    """The digests of spec.trainer_state_in's files (None without one), checked against spec.trainer_state_sha256
    (when given) before anything is loaded from them: DCP unpickles them. A collective; a mismatch raises
    TrainerStateError on every rank (they compare the same gathered digests), and rank 0 reports it to the
    local launcher."""
    if spec.trainer_state_in is None:
        return None
    digests = file_digests(spec.trainer_state_in, ctx=ctx) or {}
    if spec.trainer_state_sha256 is not None:
        try:
            check_digests(spec.trainer_state_sha256, digests)
        except TrainerStateError as error:
            if ctx.rank == 0:
                write_error(spec.metrics_path, error)
            raise
    return digests


def can_reuse(kept: Resident | None, spec: UpdateSpec, *, ctx: Dist, state_files: dict[str, str] | None) -> bool:
    """True when `spec` continues from exactly what `kept` holds: same settings, its policy_in has the bytes of the
    policy `kept` saved, and its trainer state (`state_files`: the digests of trainer_state_in's files, if any)
    those of the trainer state `kept` saved.

    Every branch depends on values that are equal on all ranks, so all ranks take the same collectives."""
    if kept is None or spec_settings(spec) != kept.settings:
        return False
    if spec.trainer_state_in is not None and kept.state_files is None:
        return False
    if file_digests(spec.policy_in, ctx=ctx) != kept.policy_files:
        return False
    return spec.trainer_state_in is None or state_files == kept.state_files


def new_optimizer(model: torch.nn.Module, spec: UpdateSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)


def build_trainer(spec: UpdateSpec, *, ctx: Dist) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, int]:
    """(model, optimizer, tokenizer, global step) from spec.policy_in and spec.trainer_state_in, on disk."""
    from transformers import AutoTokenizer

    model = load_model(spec.policy_in, gradient_checkpointing=spec.gradient_checkpointing)
    tokenizer = AutoTokenizer.from_pretrained(spec.policy_in)
    shard_model(model, ctx=ctx, compute_dtype=spec.dtype, cpu_offload=spec.cpu_offload)
    set_dropout_free_mode(model)
    # Built before any forward: only then does model.parameters() yield the sharded DTensors for every module.
    optimizer = new_optimizer(model, spec)
    start_step = 0
    if spec.trainer_state_in is not None:
        start_step = load_trainer_state(model, optimizer, in_dir=spec.trainer_state_in)
    return model, optimizer, tokenizer, start_step


def reuse_trainer(kept: Resident, spec: UpdateSpec) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, int]:
    """What `kept` holds, as build_trainer would load it: without a trainer_state_in a fresh process starts Adam
    from zero moments at step 0, so the optimizer is replaced by a new one."""
    if spec.trainer_state_in is not None:
        return kept.model, kept.optimizer, kept.tokenizer, kept.global_step
    kept.model.reshard()  # the new optimizer must hold the sharded parameters, as in build_trainer
    return kept.model, new_optimizer(kept.model, spec), kept.tokenizer, 0


def run(spec: UpdateSpec) -> dict[str, float] | None:
    """The whole update on this rank, in a fresh process; returns the metrics on rank 0, None elsewhere."""
    return update(spec, ctx=init_distributed(spec))[0]


def update(
    spec: UpdateSpec, *, ctx: Dist, kept: Resident | None = None, keep: bool = False
) -> tuple[dict[str, float] | None, Resident | None]:
    """One update on this rank: (the metrics on rank 0 / None elsewhere, what to keep for the next update).

    `kept`: what the previous update of this process left (reused if `can_reuse`, else freed and rebuilt).
    `keep`: return a Resident (costs hashing the saved files); else None.
    """
    torch.manual_seed(spec.seed)
    start = time.perf_counter()
    table = read_advantages(spec.advantages_files)
    check_advantages(table, needs_rollout_logprobs=spec.old_logprobs == "rollout" or spec.rollout_is_cap is not None)
    samples = samples_from_table(table)
    state_files = verified_trainer_state(spec, ctx=ctx)
    reused = can_reuse(kept, spec, ctx=ctx, state_files=state_files)
    if reused:
        model, optimizer, tokenizer, start_step = reuse_trainer(kept, spec)
    else:
        kept = None  # free the previous model and optimizer before loading the next
        gc.collect()
        model, optimizer, tokenizer, start_step = build_trainer(spec, ctx=ctx)
    kept = None
    check_token_ids(table, vocab_size=model.get_input_embeddings().num_embeddings)
    check_attention(model, spec)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    load_time = time.perf_counter() - start

    progress = ProgressWriter(spec.progress_path if ctx.rank == 0 else None)
    progress.write({"phase": "logprobs"})
    logprob_start = time.perf_counter()
    token_values = pre_update_logprobs(model, samples, spec=spec, ctx=ctx, pad_token_id=pad_token_id)
    if ctx.rank == 0 and spec.logprobs_out is not None:
        write_logprobs(samples, old_flat=token_values["old"], ref_flat=token_values.get("ref"),
                       loss_tokens_N=samples.loss_tokens_N, path=spec.logprobs_out)
    train_start = time.perf_counter()
    step_metrics, global_step = train(model, optimizer, samples, token_values, spec=spec, ctx=ctx,
                                      pad_token_id=pad_token_id, start_step=start_step, progress=progress)
    train_time = time.perf_counter() - train_start
    progress.write({"phase": "save"})
    progress.close()

    save_start = time.perf_counter()
    if spec.trainer_state_out is not None:
        save_trainer_state(model, optimizer, out_dir=spec.trainer_state_out, global_step=global_step, rank=ctx.rank)
    save_policy(model, tokenizer, policy_out=spec.policy_out, rank=ctx.rank)
    save_time = time.perf_counter() - save_start
    if keep:
        optimizer.zero_grad(set_to_none=True)  # the next step zeroes them anyway; free the memory meanwhile
        kept = Resident(model=model, optimizer=optimizer, tokenizer=tokenizer, global_step=global_step,
                        settings=spec_settings(spec), policy_files=file_digests(spec.policy_out, ctx=ctx),
                        state_files=None if spec.trainer_state_out is None
                        else file_digests(spec.trainer_state_out, ctx=ctx))
    metrics = summarize(step_metrics, spec=spec, global_step=global_step)
    metrics |= {
        "actor/optimizer_state_restored": float(spec.trainer_state_in is not None),
        "actor/trainer_reused": float(reused),
        "perf/num_tokens": float(samples.loss_tokens_N.sum()),
        "perf/num_samples": float(samples.num_samples),
        "perf/update_time_s": save_start - logprob_start,
        "perf/logprob_time_s": train_start - logprob_start,
        "perf/train_time_s": train_time,
        "perf/train_tokens_per_s": metrics["perf/real_tokens"] / max(train_time, 1e-9),
        "perf/load_time_s": load_time,
        "perf/save_time_s": save_time,
    }
    return (metrics if ctx.rank == 0 else None), kept


def serve() -> None:
    """Resident mode: for each spec path read from stdin, one update, then an empty `<spec path>.rank<R>.done`
    file (rank 0 writes the metrics before it). An error exits the process, as in one-shot mode: the launcher
    then kills the other ranks (stuck in a collective) and reports this rank's stderr."""
    rank = os.environ.get("RANK", "0")
    ctx, kept = None, []  # kept: at most one Resident, popped into update() so that a rebuild can free it first
    for spec_path in _commands():
        spec = UpdateSpec.from_json(spec_path)
        ctx = ctx or init_distributed(spec)
        metrics, resident = update(spec, ctx=ctx, kept=kept.pop() if kept else None, keep=True)
        kept.append(resident)
        if metrics is not None:
            write_json_atomic(spec.metrics_path, metrics)
        Path(f"{spec_path}.rank{rank}.done").touch()
        sys.stdout.flush()
        sys.stderr.flush()


def _commands():
    """Spec paths, one per stdin line, until stdin closes or the launching process dies (this rank would be
    orphaned; a forked child of the launcher could keep stdin open, so the parent is checked too). Reads the raw
    file descriptor: a buffered reader could hold a line that select() no longer reports."""
    parent, fd, buffer = os.getppid(), sys.stdin.fileno(), b""
    while os.getppid() == parent:
        if b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line.decode().strip()
            continue
        readable, _, _ = select.select([fd], [], [], 1.0)
        if not readable:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return
        buffer += chunk


def main() -> None:
    """Entry point of one rank. Logging is configured here because this is a process's main, like cli.py."""
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m batchrl.trainer.worker SPEC.json | --serve")
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    if sys.argv[1] == "--serve":
        serve()
    else:
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
