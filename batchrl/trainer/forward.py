"""The policy's forward pass over micro-batches: per-token log-probs and entropies of the response tokens.

Why a module of its own: the update ranks (old and reference log-probs, then the loss) and the advantage stage's
reference scorer (`reference`, one process, no torch.distributed) must give a token the same value, so they share
the packing of samples into rows and the forward that reads the log-probs off the logits. Nothing here joins a
process group or knows about optimizers.
Right-padded micro-batches instead of verl's padding-free packed sequences (see `batching`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from batchrl.algorithms.losses import entropy_from_logits, token_logprobs
from batchrl.trainer.batching import plan_micro_batches, prompt_packs
from batchrl.trainer.data import (
    MicroBatch,
    collate_packs,
    first_logit_position,
    response_logits,
    scatter_response_values,
)

if TYPE_CHECKING:
    from batchrl.trainer.spec import UpdateSpec


class SampleLengths(Protocol):
    """What planning reads of the samples: `data.Samples` (rows in memory) and `index.SampleIndex` (small columns)
    both have it."""

    @property
    def prompt_key_N(self) -> np.ndarray: ...  # equal for samples that may share a row
    @property
    def prompt_lengths_N(self) -> np.ndarray: ...
    @property
    def response_lengths_N(self) -> np.ndarray: ...


def micro_batch_plan(
    samples: SampleLengths, indices: Sequence[int], *, spec: UpdateSpec, world_size: int
) -> list[list[list[list[int]]]]:
    """plan[rank][k] = the packs (sample indices sharing a row, see `data.collate_packs`) of rank's k-th
    micro-batch of the samples `indices`. Without update.share_prompt every pack is one sample."""
    update = spec.update
    if update.max_tokens_per_micro_batch is not None:
        budget = {"max_tokens": update.max_tokens_per_micro_batch}
    else:
        budget = {"max_samples": update.micro_batch_size}
    return pack_plan(samples, indices, share_prompt=update.share_prompt, world_size=world_size, **budget)


def pack_plan(
    samples: SampleLengths,
    indices: Sequence[int],
    *,
    share_prompt: bool,
    world_size: int,
    max_tokens: int | None = None,
    max_samples: int | None = None,
) -> list[list[list[list[int]]]]:
    """`micro_batch_plan` without a spec: packs (with share_prompt, filled up to max_tokens) planned into
    micro-batches by `batching.plan_micro_batches` with the budget given."""
    if share_prompt:
        packs = prompt_packs(
            indices,
            prompt_key_N=samples.prompt_key_N,
            prompt_lengths_N=samples.prompt_lengths_N,
            response_lengths_N=samples.response_lengths_N,
            max_tokens=max_tokens,
        )
    else:
        packs = [[int(i)] for i in indices]
    lengths = [int(samples.prompt_lengths_N[pack[0]] + samples.response_lengths_N[pack].sum()) for pack in packs]
    plan = plan_micro_batches(lengths, world_size=world_size, max_tokens=max_tokens, max_samples=max_samples)
    return [[[packs[j] for j in chunk] for chunk in micro_batches] for micro_batches in plan]


def flat_response_values(
    samples,
    forward: Callable[[MicroBatch], torch.Tensor],
    *,
    pad_token_id: int,
    max_tokens: int,
    share_prompt: bool,
    device: torch.device,
) -> np.ndarray:
    """Flat float32 array (samples.response_offsets_N1 layout) of `forward`'s [S, R] value of every response token,
    over micro-batches of up to `max_tokens` padded tokens (a longer sample goes alone), in one process: the
    reference log-probs of KL in the reward, the critic's values. `share_prompt`: packs of a prompt's samples."""
    out_flat = torch.zeros(int(samples.response_offsets_N1[-1]), dtype=torch.float32)
    if samples.num_samples == 0:
        return out_flat.numpy()
    budget = max(max_tokens, int(samples.lengths_N.max()))
    plan = pack_plan(samples, range(samples.num_samples), share_prompt=share_prompt, world_size=1, max_tokens=budget)
    for packs in plan[0]:
        if packs:
            mb = collate_packs(samples, packs, pad_token_id=pad_token_id, device=device)
            scatter_response_values(forward(mb).cpu(), mb, samples, out_flat=out_flat)
    return out_flat.numpy()


def policy_logprobs(model: torch.nn.Module, mb: MicroBatch, *, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(response token), entropy), both [samples, response tokens] float32; entropy has grad only if asked.

    The lm_head runs only from the first position a response token needs (`logits_to_keep`, when the model
    takes it): prompt positions before it would be [rows, prompt, vocab] logits computed for nothing.
    """
    inputs = model_inputs(model, mb)
    first = first_logit_position(mb) if _takes_logits_to_keep(model) else 0
    if first > 0:
        inputs["logits_to_keep"] = mb.input_ids_BL.shape[1] - first
    logits_SRV = response_logits(model(**inputs).logits, mb, first_position=first)
    logprobs_SR = token_logprobs(logits_SRV, mb.labels_SR)
    entropy_SR = entropy_from_logits(logits_SRV if entropy_grad else logits_SRV.detach())
    return logprobs_SR, entropy_SR


def model_inputs(model: torch.nn.Module, mb: MicroBatch) -> dict:
    """The keyword arguments of a forward over `mb`'s rows (policy or critic): ids, mask, packed positions."""
    attention_mask = mb.attention_mask
    if attention_mask.dim() == 4 and attention_implementation(model) == "eager":
        # eager attention adds the mask to the scores: True/False would add 1/0, not allow/forbid
        attention_mask = torch.zeros(attention_mask.shape, device=attention_mask.device).masked_fill_(
            ~attention_mask, torch.finfo(torch.float32).min
        )
    inputs = dict(input_ids=mb.input_ids_BL, attention_mask=attention_mask, use_cache=False)
    if mb.position_ids_BL is not None:
        inputs["position_ids"] = mb.position_ids_BL
    return inputs


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT passes it on (update.lora)
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def attention_implementation(model: torch.nn.Module) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def check_attention(model: torch.nn.Module, *, share_prompt: bool) -> None:
    """Shared-prompt rows need a custom [B, 1, L, L] mask, which flash-attention kernels do not take."""
    implementation = attention_implementation(model)
    if share_prompt and implementation not in ("sdpa", "eager"):
        raise ValueError(
            f"update.share_prompt needs the sdpa or eager attention; this model uses {implementation!r}. "
            "Set update.share_prompt: false"
        )
