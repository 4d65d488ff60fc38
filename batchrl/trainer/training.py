"""The optimizer steps of one update (PPO-clip or GSPO, as in GRPO): losses, gradient accumulation, AdamW.

Why a module of its own: this is the algorithm, the part a reader compares with the paper and with verl, so it
is kept apart from how ranks start, load and save (`worker`, `fsdp`) and from the pre-update pass (`logprobs`).

- Each epoch shuffles the prompt groups into mini-batches; one optimizer step per mini-batch, with gradient
  accumulation over token-budget (or fixed-count) micro-batches. A rank reads the rows of its micro-batches when
  their mini-batch trains (`logprobs.UpdateInputs`). Token losses are divided by the mini-batch's
  GLOBAL token/sequence counts, so the per-rank losses sum to the single-process loss; FSDP is told to SUM (not
  average) gradients across ranks, so the gradient equals the single-process gradient for any world size. Ranks
  with fewer micro-batches run empty ones: every FSDP forward/backward is a collective.
- loss = pg_loss (x truncated IS weights) - entropy_coeff * entropy + kl_loss_coef * kl(policy, ref), all
  aggregated with the same mode; the lr follows the schedule of the global optimizer step (`schedule`).
- A non-finite loss or gradient norm aborts the update (an exception, so a non-zero exit) before the optimizer
  step and before anything is written.
As in verl, GSPO has no dual clip: `update.dual_clip_ratio` (3.0 by default) applies to ppo_clip only.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch
import torch.distributed as dist

from batchrl.algorithms.kl import kl_penalty
from batchrl.algorithms.losses import (
    aggregate_token_losses,
    approx_kl,
    gspo_token_losses,
    ppo_clip_token_losses,
    truncated_is_weights,
)
from batchrl.trainer.data import MicroBatch, collate_packs
from batchrl.trainer.forward import policy_logprobs
from batchrl.trainer.fsdp import Dist
from batchrl.trainer.logprobs import UpdateInputs, epoch_mini_batches
from batchrl.trainer.progress_file import ProgressWriter
from batchrl.trainer.schedule import lr_at_step, resolve_warmup_steps
from batchrl.trainer.spec import UpdateSpec

logger = logging.getLogger(__name__)

# Per-micro-batch sums, all-reduced once per optimizer step.
SUM_NAMES = ("loss", "pg_loss", "kl_loss", "clipped_tokens", "ppo_kl", "entropy", "is_weight", "padded", "real")


def new_optimizer(model: torch.nn.Module, spec: UpdateSpec) -> torch.optim.Optimizer:
    # With update.lora the base is frozen: only the adapter's parameters are optimized (and saved in its state).
    trainable = [param for param in model.parameters() if param.requires_grad]
    return torch.optim.AdamW(trainable, lr=spec.update.lr, weight_decay=spec.update.weight_decay)


def pg_token_losses(
    logprobs_SR: torch.Tensor, mb: MicroBatch, *, spec: UpdateSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pg_losses_SR, is_clipped_SR) of the configured policy loss, truncated-IS weighted when asked."""
    update = spec.update
    old_logprobs_SR, mask_SR = mb.token_values_SR["old"], mb.response_mask_SR
    clip = dict(clip_ratio_low=update.clip_ratio_low, clip_ratio_high=update.clip_ratio_high)
    if update.policy_loss == "gspo":
        pg_losses_SR, is_clipped_SR, _ = gspo_token_losses(
            logprobs_SR, old_logprobs_SR, mb.advantages_SR, mask_SR, **clip
        )
    else:
        pg_losses_SR, is_clipped_SR, _ = ppo_clip_token_losses(
            logprobs_SR, old_logprobs_SR, mb.advantages_SR, dual_clip_ratio=update.dual_clip_ratio, **clip
        )
    return pg_losses_SR, is_clipped_SR


def micro_batch_backward(
    model: torch.nn.Module, mb: MicroBatch, *, spec: UpdateSpec, num_tokens: int, num_seqs: int
) -> torch.Tensor:
    """Forward + backward of one micro-batch's share of the mini-batch loss; returns its SUM_NAMES sums."""
    update = spec.update
    agg = dict(
        mode=update.loss_agg_mode,
        num_global_tokens=num_tokens,
        num_global_seqs=max(num_seqs, 1),
        norm_length=update.loss_agg_norm_length,
    )
    mask_SR = mb.response_mask_SR
    logprobs_SR, entropy_SR = policy_logprobs(model, mb, entropy_grad=update.entropy_coeff > 0)
    pg_losses_SR, is_clipped_SR = pg_token_losses(logprobs_SR, mb, spec=spec)
    is_weights_SR = mask_SR.float()
    if update.rollout_is_cap is not None:
        is_weights_SR = truncated_is_weights(
            mb.token_values_SR["old"], mb.token_values_SR["rollout"], mask_SR, cap=update.rollout_is_cap
        )
        pg_losses_SR = pg_losses_SR * is_weights_SR
    pg_loss = aggregate_token_losses(pg_losses_SR, mask_SR, **agg)
    loss = pg_loss
    if update.entropy_coeff > 0:
        loss = loss - update.entropy_coeff * aggregate_token_losses(entropy_SR, mask_SR, **agg)
    kl_loss = torch.zeros((), device=pg_loss.device)
    if update.kl_loss_coef > 0:
        kl_SR = kl_penalty(logprobs_SR, mb.token_values_SR["ref"], estimator=update.kl_estimator)
        kl_loss = aggregate_token_losses(kl_SR, mask_SR, **agg)
        loss = loss + update.kl_loss_coef * kl_loss
    loss.backward()
    ppo_kl_sum = approx_kl(logprobs_SR.detach(), mb.token_values_SR["old"], mask_SR) * mask_SR.sum()
    return torch.stack(
        [
            loss.detach().double(),
            pg_loss.detach().double(),
            kl_loss.detach().double(),
            (is_clipped_SR & mask_SR).sum().double(),
            ppo_kl_sum.double(),
            entropy_SR.detach().masked_fill(~mask_SR, 0).sum().double(),
            is_weights_SR.masked_fill(~mask_SR, 0).sum().double(),
            torch.tensor(float(mb.padded_tokens), dtype=torch.float64, device=pg_loss.device),
            torch.tensor(float(mb.real_tokens if mb.indices else 0), dtype=torch.float64, device=pg_loss.device),
        ]
    )


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: UpdateInputs,
    indices: np.ndarray,
    *,
    spec: UpdateSpec,
    ctx: Dist,
    pad_token_id: int,
    lr: float,
) -> dict[str, float] | None:
    """One optimizer step on the mini-batch `indices` (gradient accumulation); None if it has no loss tokens."""
    loss_tokens = inputs.index.loss_tokens_N[indices]
    num_tokens, num_seqs = int(loss_tokens.sum()), int((loss_tokens > 0).sum())
    if num_tokens == 0:
        logger.warning("a mini-batch of %d samples has no response tokens; no optimizer step for it", len(indices))
        return None
    share = inputs.share(indices, ctx=ctx)  # this rank's micro-batches, rows and old/ref values
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(len(SUM_NAMES), dtype=torch.float64, device=ctx.device)
    for k, packs in enumerate(share.packs_plan):
        if ctx.world_size == 1 and not spec.update.cpu_offload:  # one rank: sharded = unsharded, skip copies
            model.set_requires_gradient_sync(k == len(share.packs_plan) - 1)
        mb = collate_packs(
            share.rows, packs, pad_token_id=pad_token_id, device=ctx.device, token_values=share.token_values
        )
        sums += micro_batch_backward(model, mb, spec=spec, num_tokens=num_tokens, num_seqs=num_seqs)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    total = dict(zip(SUM_NAMES, sums.tolist()))
    if not math.isfinite(total["loss"]):
        raise FloatingPointError(
            f"policy loss is {total['loss']} (NaN/inf; pg_loss={total['pg_loss']}, kl_loss={total['kl_loss']}); "
            "aborting before the optimizer step. Check the advantages table and, with old_logprobs='rollout' or "
            "rollout_is_cap, the engine logprobs for NaN/inf values"
        )
    grad_norm = clipped_step(model, optimizer, max_grad_norm=spec.update.max_grad_norm, lr=lr)
    return metrics_of_step(total, spec=spec, num_tokens=num_tokens, grad_norm=grad_norm)


def clipped_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float, lr: float, what: str = ""
) -> float:
    """Clip the accumulated gradients, refuse a non-finite norm before anything changes, step at ``lr``; returns the
    pre-clip norm. The actor's steps and the critic's (``what``: "critic ") end the same way."""
    grad_norm = clip_gradients(model, max_grad_norm=max_grad_norm)
    if not math.isfinite(grad_norm):
        raise FloatingPointError(
            f"{what}gradient norm is {grad_norm} (NaN/inf); aborting before the optimizer step. Lower lr or check "
            "the inputs for extreme values"
        )
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return grad_norm


def metrics_of_step(
    total: dict[str, float], *, spec: UpdateSpec, num_tokens: int, grad_norm: float
) -> dict[str, float]:
    """One optimizer step's metrics from the all-reduced SUM_NAMES sums."""
    metrics = {
        "actor/pg_loss": total["pg_loss"],
        "actor/pg_clipfrac": total["clipped_tokens"] / num_tokens,
        "actor/ppo_kl": total["ppo_kl"] / num_tokens,
        "actor/entropy": total["entropy"] / num_tokens,
        "actor/grad_norm": grad_norm,
        "perf/padded_tokens": total["padded"],
        "perf/real_tokens": total["real"],
    }
    if spec.update.kl_loss_coef > 0:
        metrics["actor/kl_loss"] = total["kl_loss"]
    if spec.update.rollout_is_cap is not None:
        metrics["actor/rollout_is_weight_mean"] = total["is_weight"] / num_tokens
    return metrics


def clip_gradients(model: torch.nn.Module, *, max_grad_norm: float) -> float:
    """Clip to max_grad_norm (no clipping when <= 0) and return the FULL pre-clip norm over all shards."""
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(total_norm, "full_tensor"):  # DTensor with a partial placement: reduce across ranks
        total_norm = total_norm.full_tensor()
    return float(total_norm)


def lr_schedule_for(spec: UpdateSpec, *, steps_per_update: int) -> dict:
    """lr_at_step's keyword arguments: the schedule spans update.lr_total_steps, else num_iterations updates."""
    update = spec.update
    total_steps = update.lr_total_steps or spec.num_iterations * steps_per_update
    warmup_steps = resolve_warmup_steps(
        warmup_steps=update.lr_warmup_steps, warmup_ratio=update.lr_warmup_ratio, total_steps=total_steps
    )
    return dict(
        lr=update.lr,
        schedule=update.lr_schedule,
        total_steps=total_steps,
        min_lr_ratio=update.min_lr_ratio,
        warmup_steps=warmup_steps,
    )


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: UpdateInputs,
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
    steps_per_update = spec.update.ppo_epochs * len(epoch_mini_batches(inputs.index, spec, epoch=0))
    schedule = lr_schedule_for(spec, steps_per_update=steps_per_update)
    step, step_metrics, done = start_step, [], 0
    progress.write({"phase": "train", "done": 0, "total": steps_per_update})
    for epoch in range(spec.update.ppo_epochs):
        for indices in epoch_mini_batches(inputs.index, spec, epoch=epoch):
            lr, started = lr_at_step(step, **schedule), time.perf_counter()
            metrics = optimizer_step(
                model, optimizer, inputs, indices, spec=spec, ctx=ctx, pad_token_id=pad_token_id, lr=lr
            )
            done += 1
            if metrics is None:
                progress.write({"phase": "train", "done": done, "total": steps_per_update})
                continue
            progress.write(
                {
                    "phase": "train",
                    "done": done,
                    "total": steps_per_update,
                    "global_step": step + 1,
                    "pg_loss": metrics["actor/pg_loss"],
                    "grad_norm": metrics["actor/grad_norm"],
                    "lr": lr,
                }
            )
            # staleness: optimizer steps this update took before this one, i.e. since the rollout's policy
            staleness = float(step - start_step)
            step_metrics.append(
                metrics
                | {"actor/lr": lr, "perf/step_time_s": time.perf_counter() - started, "update/staleness": staleness}
            )
            step += 1
            logger.info("epoch %d, step %d: %s", epoch, step, metrics)
    if not step_metrics:
        raise ValueError("the advantages table has no response tokens to train on; every response is empty")
    return step_metrics, step


def summarize(step_metrics: list[dict[str, float]], *, spec: UpdateSpec, global_step: int) -> dict[str, float]:
    """Means over optimizer steps of the per-step metrics; the last lr; the fastest step; token totals; the mean
    and largest staleness (optimizer steps taken since the rollout's policy: step k of the update has k)."""
    summed = {"perf/padded_tokens", "perf/real_tokens"}
    metrics = {
        name: sum(m[name] for m in step_metrics) / len(step_metrics)
        for name in step_metrics[0]
        if name not in summed | {"actor/lr", "update/staleness"}
    }
    staleness = [m["update/staleness"] for m in step_metrics]
    metrics["update/staleness_mean"] = sum(staleness) / len(staleness)
    metrics["update/staleness_max"] = max(staleness)
    metrics |= {name: sum(m[name] for m in step_metrics) for name in summed}
    metrics["actor/lr"] = step_metrics[-1]["actor/lr"]
    metrics["perf/step_time_min_s"] = min(m["perf/step_time_s"] for m in step_metrics)
    metrics["perf/padding_ratio"] = metrics["perf/padded_tokens"] / max(metrics["perf/real_tokens"], 1.0)
    metrics["actor/num_optimizer_steps"] = float(len(step_metrics))
    metrics["actor/global_step"] = float(global_step)
    if spec.update.kl_loss_coef > 0:
        metrics["actor/kl_coef"] = spec.update.kl_loss_coef
    return metrics
