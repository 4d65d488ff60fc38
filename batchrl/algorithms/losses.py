"""Token log-probabilities, entropy and the PPO-clip policy loss, as pure torch functions.

Why these pieces: GRPO and PPO share one policy update. The trainer computes the current policy's
log-probability of every response token (`token_logprobs`), compares it with the log-probability under
the policy that generated the data (`old_logprobs`), and applies the clipped surrogate of PPO
(https://arxiv.org/abs/1707.06347) per token (`ppo_clip_token_losses`). The per-token losses are then
reduced to one scalar by `aggregate_token_losses`, whose mode decides how long and short responses are
weighted (token-mean is DAPO's recommendation, seq-mean-token-mean is the GRPO paper's).

Memory: logits are [batch, tokens, vocab] and vocabularies run to 150k+, so a float32 log-softmax copy
of bf16 logits can be the largest tensor of the step. `token_logprobs` and `entropy_from_logits` work
on chunks of rows in float32 and keep only per-token statistics for backward, recomputing softmax
chunk by chunk there. Peak extra memory is a few float32 chunks (`max_chunk_elements` each) plus the
gradient of the logits, which autograd needs anyway.

Semantics follow verl (core_algos.compute_policy_loss_vanilla, agg_loss):
- the log ratio is clamped to [-20, 20] before exp, so one stale token cannot produce inf/NaN;
- `is_clipped` is where the clipped branch is strictly larger (verl's `actor/pg_clipfrac`);
- `approx_kl` is the mean of old - new log-probs (verl's `actor/ppo_kl`);
- fully masked sequences do not count as sequences in the seq-mean modes.
Departures: dual-clip PPO (https://arxiv.org/abs/1912.09729) is off unless `dual_clip_ratio` is given,
whereas verl always applies it with 3.0; `aggregate_token_losses` returns the rank's share of the
global loss rather than verl's share multiplied by dp_size (see its docstring). Log-probabilities are
at least float32 whatever the logits dtype (verl returns bf16 log-probs for bf16 logits).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

LOG_RATIO_CLAMP = 20.0
AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
DEFAULT_MAX_CHUNK_ELEMENTS = 1 << 25  # 128 MiB of float32 per chunk


def _row_chunks(shape_BTV: torch.Size, max_chunk_elements: int) -> Iterator[tuple[slice, slice]]:
    """Yield (batch, token) slices covering [B, T] so each chunk holds at most max_chunk_elements logits.

    Chunks are views of the input (never a flatten, which would copy a sliced `logits[:, :-1]`).
    """
    batch_size, num_tokens, vocab_size = shape_BTV
    rows_per_chunk = max(1, max_chunk_elements // max(vocab_size, 1))
    if num_tokens == 0:
        return
    if num_tokens <= rows_per_chunk:
        seqs_per_chunk = rows_per_chunk // num_tokens
        for start in range(0, batch_size, seqs_per_chunk):
            yield slice(start, start + seqs_per_chunk), slice(None)
        return
    for seq in range(batch_size):
        for start in range(0, num_tokens, rows_per_chunk):
            yield slice(seq, seq + 1), slice(start, start + rows_per_chunk)


def _compute_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision logits (bf16 logsumexp is too coarse), else the logits dtype."""
    return torch.promote_types(logits_dtype, torch.float32)


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits)[label] with float32 chunked logsumexp; backward recomputes softmax per chunk."""

    @staticmethod
    def forward(ctx, logits_BTV, labels_BT, max_chunk_elements):
        ctx.compute_dtype = _compute_dtype(logits_BTV.dtype)
        lse_BT = torch.empty(labels_BT.shape, dtype=ctx.compute_dtype, device=logits_BTV.device)
        for rows in _row_chunks(logits_BTV.shape, max_chunk_elements):
            lse_BT[rows] = torch.logsumexp(logits_BTV[rows].to(ctx.compute_dtype), dim=-1)
        label_logits_BT = logits_BTV.gather(-1, labels_BT.unsqueeze(-1)).squeeze(-1).to(ctx.compute_dtype)
        ctx.save_for_backward(logits_BTV, labels_BT, lse_BT)
        ctx.max_chunk_elements = max_chunk_elements
        return label_logits_BT - lse_BT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_BT):
        logits_BTV, labels_BT, lse_BT = ctx.saved_tensors
        grad_logits_BTV = torch.empty_like(logits_BTV)
        for rows in _row_chunks(logits_BTV.shape, ctx.max_chunk_elements):
            grad_rows = grad_BT[rows].to(ctx.compute_dtype).unsqueeze(-1)
            probs = torch.exp(logits_BTV[rows].to(ctx.compute_dtype) - lse_BT[rows].unsqueeze(-1))
            chunk_grad = probs.mul_(-grad_rows)  # d/dz of -logsumexp(z)
            chunk_grad.scatter_add_(-1, labels_BT[rows].unsqueeze(-1), grad_rows)  # d/dz of z[label]
            grad_logits_BTV[rows] = chunk_grad.to(logits_BTV.dtype)
        return grad_logits_BTV, None, None


class _Entropy(torch.autograd.Function):
    """H = logsumexp(z) - sum(p * z); dH/dz = -p * (z - sum(p * z)), recomputed per chunk."""

    @staticmethod
    def forward(ctx, logits_BTV, max_chunk_elements):
        ctx.compute_dtype = _compute_dtype(logits_BTV.dtype)
        lse_BT = torch.empty(logits_BTV.shape[:-1], dtype=ctx.compute_dtype, device=logits_BTV.device)
        expected_logit_BT = torch.empty_like(lse_BT)
        for rows in _row_chunks(logits_BTV.shape, max_chunk_elements):
            logits = logits_BTV[rows].to(ctx.compute_dtype)
            lse_BT[rows] = torch.logsumexp(logits, dim=-1)
            probs = torch.exp(logits - lse_BT[rows].unsqueeze(-1))
            expected_logit_BT[rows] = (probs * logits).sum(-1)
        ctx.save_for_backward(logits_BTV, lse_BT, expected_logit_BT)
        ctx.max_chunk_elements = max_chunk_elements
        return lse_BT - expected_logit_BT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_BT):
        logits_BTV, lse_BT, expected_logit_BT = ctx.saved_tensors
        grad_logits_BTV = torch.empty_like(logits_BTV)
        for rows in _row_chunks(logits_BTV.shape, ctx.max_chunk_elements):
            logits = logits_BTV[rows].to(ctx.compute_dtype)
            probs = torch.exp(logits - lse_BT[rows].unsqueeze(-1))
            centered = logits - expected_logit_BT[rows].unsqueeze(-1)  # never in place: may be the input
            chunk_grad = probs.mul_(centered).mul_(-grad_BT[rows].to(ctx.compute_dtype).unsqueeze(-1))
            grad_logits_BTV[rows] = chunk_grad.to(logits_BTV.dtype)
        return grad_logits_BTV, None


def _check_logits(logits_BTV: torch.Tensor, max_chunk_elements: int) -> None:
    if logits_BTV.ndim != 3:
        raise ValueError(
            f"logits must be [batch, tokens, vocab], got shape {tuple(logits_BTV.shape)}; "
            "add a batch dimension with logits.unsqueeze(0) for packed sequences"
        )
    if not logits_BTV.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits_BTV.dtype}")
    if max_chunk_elements < 1:
        raise ValueError(f"max_chunk_elements={max_chunk_elements} must be >= 1")


def token_logprobs(
    logits_BTV: torch.Tensor,  # [batch, tokens, vocab]
    labels_BT: torch.Tensor,  # [batch, tokens] token ids
    *,
    max_chunk_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Return log p(label) per token, float32 [batch, tokens], differentiable w.r.t. the logits.

    Equals `log_softmax(logits.float(), -1).gather(-1, labels)` without the [B, T, V] float32 copy.
    float64 logits give float64 log-probs.
    Labels must be valid ids: give masked positions any real id (e.g. the pad id), not -100. The range
    check costs one host-device sync; it beats a CUDA device-side assert from gather.
    """
    _check_logits(logits_BTV, max_chunk_elements)
    if labels_BT.shape != logits_BTV.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels_BT.shape)} must equal logits shape without the vocab "
            f"dimension {tuple(logits_BTV.shape[:-1])}; shift labels and logits by one token together"
        )
    labels_BT = labels_BT.long()
    if labels_BT.numel() and (labels_BT.min() < 0 or labels_BT.max() >= logits_BTV.shape[-1]):
        raise ValueError(
            f"labels must lie in [0, {logits_BTV.shape[-1]}); found "
            f"[{int(labels_BT.min())}, {int(labels_BT.max())}]. Replace ignore-index labels (-100) "
            "by a real id such as pad_token_id and exclude them with the loss mask"
        )
    return _TokenLogprobs.apply(logits_BTV, labels_BT, max_chunk_elements)


def entropy_from_logits(
    logits_BTV: torch.Tensor,  # [batch, tokens, vocab]
    *,
    max_chunk_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Return the entropy (nats) of softmax(logits) per token, float32 [batch, tokens], differentiable.

    Computed as logsumexp(z) - sum(softmax(z) * z) in float32 (float64 for float64 logits).
    """
    _check_logits(logits_BTV, max_chunk_elements)
    return _Entropy.apply(logits_BTV, max_chunk_elements)


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"these tensors must have the same shape, got {shapes}")


def ppo_clip_token_losses(
    logprobs_BT: torch.Tensor,  # [batch, tokens] current policy, carries the gradient
    old_logprobs_BT: torch.Tensor,  # [batch, tokens] behaviour policy, treated as constant
    advantages_BT: torch.Tensor,  # [batch, tokens] treated as constant
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    dual_clip_ratio: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (pg_losses_BT, is_clipped_BT, ratio_BT) of the PPO clipped surrogate, per token, unmasked.

    loss = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)) with
    ratio = exp(logprobs - old_logprobs). Asymmetric bounds allow DAPO's clip-higher (e.g. 0.2 / 0.28).
    With `dual_clip_ratio` c > 1, negative-advantage losses are further capped at -A * c.
    `is_clipped` marks tokens where the clipped branch is strictly larger (its gradient is zero there).
    """
    _check_same_shape(logprobs=logprobs_BT, old_logprobs=old_logprobs_BT, advantages=advantages_BT)
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low={clip_ratio_low} must be in [0, 1): the lower bound is 1 - low")
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high={clip_ratio_high} must be >= 0: the upper bound is 1 + high")
    if dual_clip_ratio is not None and dual_clip_ratio <= 1.0:
        raise ValueError(f"dual_clip_ratio={dual_clip_ratio} must be > 1 (3.0 is usual) or None")
    advantages_BT = advantages_BT.detach()
    log_ratio_BT = (logprobs_BT - old_logprobs_BT.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses_BT = torch.maximum(unclipped_BT, clipped_BT)
    is_clipped_BT = clipped_BT > unclipped_BT
    if dual_clip_ratio is not None:
        capped_BT = torch.minimum(pg_losses_BT, -advantages_BT * dual_clip_ratio)
        pg_losses_BT = torch.where(advantages_BT < 0, capped_BT, pg_losses_BT)
    return pg_losses_BT, is_clipped_BT, ratio_BT


def masked_mean(values: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` (bool or 0/1) is set; 0 where nothing is set.

    Masked-out entries are replaced, not multiplied, so inf/NaN there cannot leak into the result.
    """
    _check_same_shape(values=values, mask=mask)
    mask = mask.bool()
    total = values.masked_fill(~mask, 0).sum() if dim is None else values.masked_fill(~mask, 0).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp_min(1)


def approx_kl(
    logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """Masked mean of old - new log-probs (the k1 estimate of KL(old || new); verl's actor/ppo_kl)."""
    _check_same_shape(logprobs=logprobs_BT, old_logprobs=old_logprobs_BT, mask=mask_BT)
    log_ratio_BT = (logprobs_BT - old_logprobs_BT).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return masked_mean(-log_ratio_BT, mask_BT)


def aggregate_token_losses(
    losses_BT: torch.Tensor,  # [batch, tokens]
    mask_BT: torch.Tensor,  # [batch, tokens] bool or 0/1, 1 on response tokens that count
    *,
    mode: str,
    num_global_tokens: float | None = None,
    num_global_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to the scalar to backpropagate.

    Modes: "token-mean" = sum(loss * mask) / num_tokens; "seq-mean-token-mean" = mean over sequences
    of each sequence's token mean; "seq-mean-token-sum" = mean over sequences of each sequence's token
    sum. Sequences with no masked-in token do not count.

    Why the global counts: under data parallelism (or gradient accumulation) each rank or micro-batch
    holds part of the batch. Dividing the local sum by the count over the WHOLE batch (all-reduced by
    the trainer: masked tokens for token-mean, sequences with at least one token for the seq modes)
    makes the sum of the parts' losses equal the single-process loss, so 1 and N processes give the
    same gradient. DDP/FSDP average gradients over ranks, so the trainer multiplies this value by the
    world size (verl folds that in as dp_size). With None the local counts are used.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {list(AGGREGATION_MODES)}")
    _check_same_shape(losses=losses_BT, mask=mask_BT)
    if losses_BT.ndim != 2:
        raise ValueError(f"losses must be [batch, tokens], got shape {tuple(losses_BT.shape)}")
    for name, count in (("num_global_tokens", num_global_tokens), ("num_global_seqs", num_global_seqs)):
        if count is not None and not count > 0:
            raise ValueError(f"{name}={count} must be > 0: it is the all-reduced count over the batch")
    mask_BT = mask_BT.bool()
    masked_losses_BT = losses_BT.masked_fill(~mask_BT, 0)
    if mode == "token-mean":
        denominator = num_global_tokens if num_global_tokens is not None else mask_BT.sum().clamp_min(1)
        return masked_losses_BT.sum() / denominator

    tokens_per_seq_B = mask_BT.sum(-1)
    seq_losses_B = masked_losses_BT.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_losses_B = seq_losses_B / tokens_per_seq_B.clamp_min(1)
    if num_global_seqs is not None:
        denominator = num_global_seqs
    else:
        denominator = (tokens_per_seq_B > 0).sum().clamp_min(1)
    return seq_losses_B.sum() / denominator
