"""PPO's critic: a value model's per-token values of the rollouts, and its update in the actor's ranks.

The critic is an HF token-classification model with one label (`AutoModelForTokenClassification`,
`num_labels=1`): the policy's architecture with a scalar head in place of the lm_head, so a checkpoint it
writes loads with transformers as any other. It starts from `critic.model_path` (default: the initial policy):
a critic checkpoint is continued; a causal LM gets a fresh head, drawn from a generator seeded by run.seed, so
the values stage and the update build the same initial critic without writing it anywhere.

V(s_t) for response token t is read at the position that predicts token t (the state before it), as the
policy's log-prob of t is: verl's `values[:, -response_length - 1 : -1]`.

Why the actor's ranks (not ranks of its own): one set of processes, one process group, and the critic's FSDP2
shards sit beside the actor's; the memory cost is a second model with its AdamW moments (4 x 4 bytes a
parameter, sharded over the ranks), which the actor alone does not pay. The critic trains after the actor, on
the same mini-batch plan (update.ppo_mini_batch_size, the same shuffles), with its own epochs, micro-batches,
lr and clip range. It is rebuilt from its saved files every update (resident ranks keep only the actor): the
values it is trained from come from the table, so this costs a load, not a difference.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from batchrl.algorithms.gae import clipped_value_losses
from batchrl.algorithms.losses import aggregate_token_losses
from batchrl.trainer.data import MicroBatch, Samples, collate_packs, response_logits
from batchrl.trainer.forward import flat_response_values, model_inputs, pack_plan
from batchrl.trainer.fsdp import Dist

logger = logging.getLogger(__name__)

CRITIC_DIR = "critic"  # the critic's HF checkpoint, inside the policy directory an update writes
CRITIC_STATE_DIR = "critic"  # its optimizer state, inside the update's trainer state directory
VALUE_COLUMNS = ("values", "returns")  # the advantages table's per-token lists the critic trains from
TOKEN_COLUMNS = ("token_advantages", *VALUE_COLUMNS)  # what the update reads of a GAE advantages table
SUM_NAMES = ("vf_loss", "clipped", "vpred", "tokens")


def critic_source(policy_dir: str, model_path: str | None) -> str:
    """The checkpoint a critic is built from: the critic saved inside `policy_dir` (the update that wrote it, or
    run.init_from's policy), else `model_path` (critic.model_path), else the policy itself (a fresh head)."""
    saved = Path(policy_dir) / CRITIC_DIR
    if (saved / "config.json").is_file():
        return str(saved)
    return model_path or policy_dir


def is_critic_checkpoint(path: str) -> bool:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return any(name.endswith("ForTokenClassification") for name in config.architectures or [])


def load_critic(path: str, *, seed: int, gradient_checkpointing: bool = False) -> torch.nn.Module:
    """The critic in float32 on CPU: `path` continued when it is a critic, else its body with a fresh value head
    drawn from N(0, initializer_range) with a generator seeded by `seed` (bias 0)."""
    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    fresh = not is_critic_checkpoint(path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights were newly initialized": the head, by design
    try:
        model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.use_cache = False
    if fresh:
        head = value_head(model)
        generator = torch.Generator().manual_seed(seed)
        std = float(getattr(model.config, "initializer_range", 0.02))
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
            if head.bias is not None:
                head.bias.zero_()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def value_head(model: torch.nn.Module) -> torch.nn.Linear:
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear value head (score or classifier)")
    return head


def critic_values(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """[S, R] float32: V at the position predicting each response token (0 where masked)."""
    inputs = model_inputs(model, mb)
    inputs.pop("use_cache")  # token-classification heads take no cache argument
    values_SR = response_logits(model(**inputs).logits.float(), mb)[..., 0]
    return values_SR.masked_fill(~mb.response_mask_SR, 0.0)


@torch.no_grad()
def response_values(
    model: torch.nn.Module, samples: Samples, *, pad_token_id: int, max_tokens: int, share_prompt: bool = False
) -> np.ndarray:
    """Flat float32 array (samples.response_offsets_N1 layout): the critic's V(s_t) of every response token, in
    one process (the values stage). `share_prompt`: a prompt once per row for several of its samples (as
    update.share_prompt; the same values up to float rounding)."""
    return flat_response_values(
        samples,
        lambda mb: critic_values(model, mb),
        pad_token_id=pad_token_id,
        max_tokens=max_tokens,
        share_prompt=share_prompt,
        device=next(model.parameters()).device,
    )


def train_critic(model, optimizer, index, reader, *, spec, ctx: Dist, pad_token_id: int, start_step: int):
    """Every critic epoch x mini-batch: one optimizer step of the clipped value loss, gradients accumulated over
    token-budget micro-batches and normalised by the mini-batch's global token / sequence counts (as the actor's);
    returns (each step's metrics, the critic's global step after the last)."""
    critic = spec.critic
    step, step_metrics = start_step, []
    from batchrl.trainer.logprobs import epoch_mini_batches

    for epoch in range(critic.ppo_epochs):
        for indices in epoch_mini_batches(index, spec, epoch=epoch):
            metrics = _critic_step(
                model, optimizer, index, reader, indices, spec=spec, ctx=ctx, pad_token_id=pad_token_id
            )
            if metrics is not None:
                step_metrics.append(metrics)
                step += 1
    return step_metrics, step


def _critic_step(model, optimizer, index, reader, indices, *, spec, ctx: Dist, pad_token_id: int):
    from batchrl.trainer.logprobs import own_share, rank_plan
    from batchrl.trainer.training import clipped_step

    critic = spec.critic
    loss_tokens = index.loss_tokens_N[indices]
    num_tokens, num_seqs = int(loss_tokens.sum()), int((loss_tokens > 0).sum())
    if num_tokens == 0:
        return None
    max_tokens = critic.max_tokens_per_micro_batch
    share_prompt = spec.update.share_prompt and max_tokens is not None
    budget = {"max_tokens": max_tokens} if max_tokens is not None else {"max_samples": critic.micro_batch_size}

    def planner(samples, ranks):
        return pack_plan(index, samples, share_prompt=share_prompt, world_size=ranks, **budget)

    plan = rank_plan(index, indices, planner, spec=spec, world_size=ctx.world_size)
    mine, packs_plan = own_share(plan[ctx.rank])
    rows = reader.read(mine)
    token_values = {name: rows.flat_token_list(name) for name in VALUE_COLUMNS}
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(len(SUM_NAMES), dtype=torch.float64, device=ctx.device)
    for k, packs in enumerate(packs_plan):
        if ctx.world_size == 1 and not spec.update.cpu_offload:
            model.set_requires_gradient_sync(k == len(packs_plan) - 1)
        mb = collate_packs(rows, packs, pad_token_id=pad_token_id, device=ctx.device, token_values=token_values)
        mask_SR = mb.response_mask_SR
        vpreds_SR = critic_values(model, mb)
        losses_SR, clip_fraction = clipped_value_losses(
            vpreds_SR,
            mb.token_values_SR["returns"],
            mb.token_values_SR["values"],
            mask_SR,
            clip_range=critic.cliprange_value,
        )
        loss = aggregate_token_losses(
            losses_SR, mask_SR, mode=critic.loss_agg_mode, num_global_tokens=num_tokens, num_global_seqs=num_seqs
        )
        loss.backward()
        tokens = mask_SR.sum()
        sums += torch.stack(
            [
                loss.detach().double(),
                (clip_fraction.detach() * tokens).double(),  # the tokens whose clipped loss was the larger
                vpreds_SR.detach().masked_fill(~mask_SR, 0).sum().double(),
                tokens.double(),
            ]
        )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    total = dict(zip(SUM_NAMES, sums.tolist()))
    if not math.isfinite(total["vf_loss"]):
        raise FloatingPointError(
            f"critic value loss is {total['vf_loss']} (NaN/inf); aborting before the optimizer step. Check the "
            "advantages table's values and returns"
        )
    grad_norm = clipped_step(model, optimizer, max_grad_norm=critic.max_grad_norm, lr=critic.lr, what="critic ")
    return {
        "critic/vf_loss": total["vf_loss"],
        "critic/vf_clipfrac": total["clipped"] / max(total["tokens"], 1.0),
        "critic/vpred_mean": total["vpred"] / max(total["tokens"], 1.0),
        "critic/grad_norm": grad_norm,
    }


def summarize_critic(step_metrics: list[dict[str, float]], *, lr: float, global_step: int) -> dict[str, float]:
    """Means over the critic's optimizer steps, its lr and step counts."""
    metrics = {name: sum(m[name] for m in step_metrics) / len(step_metrics) for name in step_metrics[0]}
    return metrics | {
        "critic/lr": lr,
        "critic/num_optimizer_steps": float(len(step_metrics)),
        "critic/global_step": float(global_step),
    }


def update_critic(spec, *, ctx: Dist, index, reader, tokenizer, pad_token_id: int) -> dict[str, float]:
    """The critic's part of an update on this rank: build it (`critic_source`: the input policy's critic/, else
    critic.model_path, else the policy with a fresh head) with its optimizer state from the trainer state's critic/
    when there is one, train it, save its HF checkpoint to policy_out/critic/ and its optimizer state to
    trainer_state_out/critic/, free it. Returns its metrics (the same on every rank)."""
    import gc

    from batchrl.storage import local_copy
    from batchrl.trainer.checkpoint import TRAINER_STATE_FILE, load_trainer_state, save_policy, save_trainer_state
    from batchrl.trainer.fsdp import set_dropout_free_mode, shard_model

    critic = spec.critic
    source = critic_source(spec.policy_in, None if critic.model_path is None else local_copy(critic.model_path))
    model = load_critic(source, seed=spec.critic_head_seed, gradient_checkpointing=spec.update.gradient_checkpointing)
    shard_model(model, ctx=ctx, compute_dtype=spec.dtype, cpu_offload=spec.update.cpu_offload)
    set_dropout_free_mode(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=critic.lr, weight_decay=critic.weight_decay)
    start_step, restored = 0, False
    state_in = None if spec.trainer_state_in is None else Path(spec.trainer_state_in) / CRITIC_STATE_DIR
    if state_in is not None and (state_in / TRAINER_STATE_FILE).is_file():
        start_step, restored = load_trainer_state(model, optimizer, in_dir=str(state_in)), True
    step_metrics, global_step = train_critic(
        model, optimizer, index, reader, spec=spec, ctx=ctx, pad_token_id=pad_token_id, start_step=start_step
    )
    if spec.trainer_state_out is not None:
        out = str(Path(spec.trainer_state_out) / CRITIC_STATE_DIR)
        save_trainer_state(model, optimizer, out_dir=out, global_step=global_step, rank=ctx.rank)
    save_policy(model, tokenizer, policy_out=str(Path(spec.policy_out) / CRITIC_DIR), rank=ctx.rank)
    del model, optimizer
    gc.collect()
    metrics = summarize_critic(step_metrics, lr=critic.lr, global_step=global_step) if step_metrics else {}
    return metrics | {"critic/optimizer_state_restored": float(restored)}
