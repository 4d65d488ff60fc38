"""Token log-probabilities, entropy, the PPO-clip and GSPO policy losses, as pure torch functions.

Why these pieces: GRPO and PPO share one policy update. The trainer computes the current policy's
log-probability of every response token (`token_logprobs`), compares it with the log-probability under
the policy that generated the data (`old_logprobs`), and applies the clipped surrogate of PPO
(https://arxiv.org/abs/1707.06347) per token (`ppo_clip_token_losses`). The per-token losses are then
reduced to one scalar by `aggregate_token_losses`, whose mode decides how long and short responses are
weighted (token-mean is DAPO's recommendation, seq-mean-token-mean is the GRPO paper's,
seq-mean-token-sum-norm is Dr.GRPO's constant normaliser).

The other policy-loss pieces compose with these by plain arithmetic on [batch, tokens] tensors:
- GSPO (https://arxiv.org/abs/2507.18071): `gspo_token_losses` replaces `ppo_clip_token_losses` with a
  sequence-level ratio; aggregate it with seq-mean-token-mean to get the GSPO objective.
- truncated importance sampling (`truncated_is_weights`): multiply the pg token losses by the weights
  before aggregating, to correct for the rollout engine sampling from a slightly different distribution
  than the trainer computes.
- entropy bonus: `loss = pg_loss - entropy_coeff * entropy_bonus(entropy_BT, mask_BT, <same aggregation>)`.
- KL to a reference model: see batchrl.algorithms.kl.

Memory: logits are [batch, tokens, vocab] and vocabularies run to 150k+, so a float32 log-softmax copy
of bf16 logits can be the largest tensor of the step. `token_logprobs` and `entropy_from_logits` work
on chunks of rows in float32 and keep only per-token statistics for backward, recomputing softmax
chunk by chunk there. Peak extra memory is a few float32 chunks (`max_chunk_elements` each) plus the
gradient of the logits, which autograd needs anyway.

Semantics follow verl (core_algos.compute_policy_loss_vanilla, agg_loss):
- the log ratio is clamped to [-20, 20] before exp, so one stale token cannot produce inf/NaN;
- `is_clipped` is where the clipped branch is strictly larger (verl's `actor/pg_clipfrac`);
- `approx_kl` is the mean of old - new log-probs (verl's `actor/ppo_kl`);
- fully masked sequences do not count as sequences in the seq-mean modes;
- GSPO and truncated IS follow `compute_policy_loss_gspo` and verl's token-level rollout correction.
Dual-clip PPO (https://arxiv.org/abs/1912.09729) applies when `dual_clip_ratio` is given; the update config
gives 3.0 by default, as verl always does. Why: for a negative advantage the clipped objective is unbounded in the
ratio (min(r A, clip(r) A) = r A once r > 1 + eps), so a token whose probability grew r-fold since the rollout
(several mini-batches into a stale batch) weighs r times; dual clip caps its loss at -3 A and stops its gradient.
Departures: `aggregate_token_losses` returns the rank's share of the
global loss rather than verl's share multiplied by dp_size (see its docstring); seq-mean-token-sum-norm
divides by the number of sequences itself, where verl gets that factor from its micro-batch scaling;
GSPO's log ratio is clamped to [-20, 20] like PPO's (verl: at most 10). Log-probabilities are at least
float32 whatever the logits dtype (verl returns bf16 log-probs for bf16 logits).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

LOG_RATIO_CLAMP = 20.0
AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
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


def _check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low={clip_ratio_low} must be in [0, 1): the lower bound is 1 - low")
    if not clip_ratio_high >= 0.0:
        raise ValueError(f"clip_ratio_high={clip_ratio_high} must be >= 0: the upper bound is 1 + high")


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
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
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


def gspo_token_losses(
    logprobs_BT: torch.Tensor,  # [batch, tokens] current policy, carries the gradient
    old_logprobs_BT: torch.Tensor,  # [batch, tokens] behaviour policy, treated as constant
    advantages_BT: torch.Tensor,  # [batch, tokens] the sequence's advantage on its tokens, constant
    mask_BT: torch.Tensor,  # [batch, tokens] bool or 0/1, 1 on response tokens
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (pg_losses_BT, is_clipped_BT, ratio_BT) of GSPO-token, per token, unmasked.

    GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071) clips one importance ratio per SEQUENCE,
    the geometric mean of its token ratios: s_i = exp(mean_t (logp_t - old_t)) over the masked tokens.
    Its token-level form (GSPO-token) uses s_it = sg[s_i] * p_t / sg[p_t], computed as
    exp(logp_t - sg[logp_t] + sg[log s_i]): the VALUE of every token's ratio is s_i, and the gradient of
    mean_t(-A s_it) is -A s_i * mean_t grad logp_t = grad(-A s_i). So aggregated with
    "seq-mean-token-mean" and a per-sequence advantage, the loss and gradient equal the sequence-level
    objective mean_i max(-A_i s_i, -A_i clip(s_i, 1 - low, 1 + high)); per-token advantages give GSPO-token.
    A clipped sequence is clipped on all its tokens. GSPO's clip ranges are tiny because s_i is a per-token
    geometric mean: the paper uses clip_ratio_low=3e-4, clip_ratio_high=4e-4.
    """
    _check_same_shape(logprobs=logprobs_BT, old_logprobs=old_logprobs_BT, advantages=advantages_BT, mask=mask_BT)
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    mask_BT = mask_BT.bool()
    advantages_BT = advantages_BT.detach()
    with torch.no_grad():
        token_log_ratio_BT = (logprobs_BT - old_logprobs_BT).masked_fill(~mask_BT, 0)
        seq_log_ratio_B = token_log_ratio_BT.sum(-1) / mask_BT.sum(-1).clamp_min(1)
    log_ratio_BT = logprobs_BT - logprobs_BT.detach() + seq_log_ratio_B.unsqueeze(-1)
    ratio_BT = torch.exp(log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT, ratio_BT


def truncated_is_weights(
    trainer_old_logprobs_BT: torch.Tensor,  # [batch, tokens] trainer's log-probs of the behaviour policy
    rollout_logprobs_BT: torch.Tensor,  # [batch, tokens] log-probs the rollout engine reported
    mask_BT: torch.Tensor,  # [batch, tokens] bool or 0/1
    *,
    cap: float,
) -> torch.Tensor:
    """Return per-token truncated importance weights min(exp(old - rollout), cap), detached; 0 off-mask.

    Why: the rollout engine (vLLM: other kernels, bf16/fp8, sampling tweaks) samples from a distribution
    slightly different from the one the trainer computes for the same weights, so "on-policy" data is
    off-policy. Weighting each token's pg loss by pi_trainer / pi_rollout corrects the mismatch;
    truncating at `cap` bounds the variance (TIS, Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"; verl's rollout correction, token level, threshold 2.0).
    Use: `pg_losses_BT * truncated_is_weights(...)`, then aggregate as usual. The weights carry no gradient.
    """
    _check_same_shape(old_logprobs=trainer_old_logprobs_BT, rollout_logprobs=rollout_logprobs_BT, mask=mask_BT)
    if not cap > 0 or cap == float("inf"):
        raise ValueError(f"cap={cap} must be a finite number > 0 (2.0 is usual)")
    mask_BT = mask_BT.bool()
    with torch.no_grad():
        log_ratio_BT = (trainer_old_logprobs_BT - rollout_logprobs_BT).masked_fill(~mask_BT, 0)
        weights_BT = torch.exp(log_ratio_BT.clamp(max=math.log(cap)))  # min in log space: never overflows
        return weights_BT.masked_fill(~mask_BT, 0)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` (bool or 0/1) is set; 0 where nothing is set.

    Masked-out entries are replaced, not multiplied, so inf/NaN there cannot leak into the result.
    """
    _check_same_shape(values=values, mask=mask)
    mask = mask.bool()
    total = values.masked_fill(~mask, 0).sum() if dim is None else values.masked_fill(~mask, 0).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp_min(1)


def approx_kl(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Masked mean of old - new log-probs (the k1 estimate of KL(old || new); verl's actor/ppo_kl)."""
    _check_same_shape(logprobs=logprobs_BT, old_logprobs=old_logprobs_BT, mask=mask_BT)
    log_ratio_BT = (logprobs_BT - old_logprobs_BT).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return masked_mean(-log_ratio_BT, mask_BT)


def _check_aggregation(
    losses_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    mode: str,
    counts: dict[str, float | None],
) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {list(AGGREGATION_MODES)}")
    _check_same_shape(losses=losses_BT, mask=mask_BT)
    if losses_BT.ndim != 2:
        raise ValueError(f"losses must be [batch, tokens], got shape {tuple(losses_BT.shape)}")
    for name, count in counts.items():
        if count is not None and not count > 0:
            raise ValueError(f"{name}={count} must be > 0")
    if mode == "seq-mean-token-sum-norm" and counts["norm_length"] is None:
        raise ValueError(
            "loss aggregation seq-mean-token-sum-norm needs norm_length, a constant such as "
            "max_response_length (verl's default, the padded batch length, varies between micro-batches)"
        )


def aggregate_token_losses(
    losses_BT: torch.Tensor,  # [batch, tokens]
    mask_BT: torch.Tensor,  # [batch, tokens] bool or 0/1, 1 on response tokens that count
    *,
    mode: str,
    num_global_tokens: float | None = None,
    num_global_seqs: float | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to the scalar to backpropagate.

    Modes, with S = the sequences that have at least one masked-in token:
    - "token-mean": sum(loss * mask) / num_tokens (DAPO);
    - "seq-mean-token-mean": mean over S of each sequence's token mean (GRPO paper);
    - "seq-mean-token-sum": mean over S of each sequence's token sum;
    - "seq-mean-token-sum-norm": sum(loss * mask) / (|S| * norm_length), Dr.GRPO's loss
      (https://arxiv.org/abs/2503.20783): every token weighs 1 / constant, so long responses are neither
      diluted (seq-mean-token-mean) nor favoured by the batch's own length. `norm_length` is required
      here (e.g. max_response_length) and ignored by the other modes. verl (agg_loss with
      loss_scale_factor) divides a micro-batch's token sum by the constant and gets the 1 / num_seqs
      from scaling each micro-batch loss by its share of the mini-batch, so the total is the same
      except that verl's num_seqs also counts sequences with no masked-in token.

    Why the global counts: under data parallelism (or gradient accumulation) each rank or micro-batch
    holds part of the batch. Dividing the local sum by the count over the WHOLE batch (all-reduced by
    the trainer: masked tokens for token-mean, sequences with at least one token for the seq modes)
    makes the parts' losses add up to the single-process loss. The trainer makes FSDP SUM gradients
    across ranks (not average), so the summed gradient equals the single-process gradient with no
    world-size factor (verl instead averages and multiplies the loss by dp_size). With None the local
    counts are used.
    """
    counts = {"num_global_tokens": num_global_tokens, "num_global_seqs": num_global_seqs, "norm_length": norm_length}
    _check_aggregation(losses_BT, mask_BT, mode=mode, counts=counts)
    mask_BT = mask_BT.bool()
    masked_losses_BT = losses_BT.masked_fill(~mask_BT, 0)
    if mode == "token-mean":
        denominator = num_global_tokens if num_global_tokens is not None else mask_BT.sum().clamp_min(1)
        return masked_losses_BT.sum() / denominator

    tokens_per_seq_B = mask_BT.sum(-1)
    seq_losses_B = masked_losses_BT.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_losses_B = seq_losses_B / tokens_per_seq_B.clamp_min(1)
    elif mode == "seq-mean-token-sum-norm":
        seq_losses_B = seq_losses_B / norm_length
    if num_global_seqs is not None:
        denominator = num_global_seqs
    else:
        denominator = (tokens_per_seq_B > 0).sum().clamp_min(1)
    return seq_losses_B.sum() / denominator


def entropy_bonus(
    entropy_BT: torch.Tensor,  # [batch, tokens] from entropy_from_logits, with grad to get a bonus
    mask_BT: torch.Tensor,  # [batch, tokens]
    **aggregation,
) -> torch.Tensor:
    """Return the entropy aggregated like the pg loss: `aggregate_token_losses(entropy, mask, **aggregation)`.

    Combine as `loss = pg_loss - entropy_coeff * entropy_bonus(entropy_BT, mask_BT, mode=..., ...)` with
    the SAME aggregation arguments as the pg loss (verl's entropy loss uses the actor's loss_agg_mode),
    so the coefficient means the same thing at any batch split. Detached entropy gives a metric only
    (verl's actor/entropy is the token-mean).
    """
    return aggregate_token_losses(entropy_BT, mask_BT, **aggregation)
