"""Pre-update log-probs: the old (behaviour) policy's and the frozen reference's, once, before any step.

Why once and up front: PPO's ratio compares the policy being trained with the policy that was loaded, and the KL
loss compares it with the reference; both are fixed for the whole update, so a no-grad pass over every sample
before the first optimizer step gives every later micro-batch its values (and the log-probs table the stage
publishes). The old log-probs come from the loaded policy (or the rollout engine, `update.old_logprobs`); the
reference is loaded, sharded with FSDP too, used for this one pass and freed before training. Ranks compute
disjoint samples and share them with one all-reduce of a flat per-token buffer.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import torch
import torch.distributed as dist

from batchrl.trainer.data import Samples, collate_packs, scatter_response_values
from batchrl.trainer.forward import micro_batch_plan, policy_logprobs
from batchrl.trainer.fsdp import Dist, load_model, shard_model
from batchrl.trainer.spec import UpdateSpec


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
    update = spec.update
    values: dict[str, np.ndarray] = {}
    if update.old_logprobs == "rollout" or update.rollout_is_cap is not None:
        values["rollout"] = samples.flat_rollout_logprobs()
    models: dict[str, torch.nn.Module] = {}
    if update.old_logprobs == "recompute":
        models["old"] = policy
    reference = None
    if update.kl_loss_coef > 0:
        if same_checkpoint(spec.reference_policy, spec.policy_in):
            models["ref"] = policy
        else:
            reference = load_model(spec.reference_policy).requires_grad_(False)
            shard_model(reference, ctx=ctx, compute_dtype=spec.dtype, cpu_offload=update.cpu_offload)
            reference.eval()
            models["ref"] = reference
    if models:
        values |= logprob_pass(models, samples, spec=spec, ctx=ctx, pad_token_id=pad_token_id)
    if update.old_logprobs == "rollout":  # (UpdateConfig rejects rollout_is_cap with rollout old log-probs)
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
