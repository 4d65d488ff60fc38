"""GAE over a critic's per-token values, and the critic's clipped value loss: PPO with a value model.

Why per token: with a critic, the baseline is V(s_t) at every response token, not a group statistic. The
outcome score sits on the last response token; KL, when it is in the reward, is charged on every token. GAE
(https://arxiv.org/abs/1506.02438) then mixes the TD errors delta_t = r_t + gamma V(s_{t+1}) - V(s_t) with
weights (gamma lam)^k:

    A_t = delta_t + gamma lam A_{t+1},   returns R_t = A_t + V(s_t)   (the critic's targets).

Semantics follow verl's core_algos (`compute_gae_advantage_return`, `compute_value_loss`, `verl_F.masked_whiten`,
`apply_kl_penalty`), checked against its numbers in tests/unit/test_gae.py:
- a masked-out token (padding after the response; in multi-turn data, tokens the policy did not write) has no
  TD error: the recursion carries A and V across it unchanged;
- advantages are whitened over the batch's response tokens, with the unbiased variance and
  `(x - mean) / sqrt(var + 1e-8)`; the returns are not;
- the value loss is 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) per token, aggregated as the
  policy loss is (`losses.aggregate_token_losses`); its clip fraction counts the tokens where the clipped term
  is the larger.
Departure: none in the numbers. Arrays are float64 numpy [num_samples, tokens] here; the loss is torch (it is
differentiated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the GAE functions are numpy: the advantage stage's workers need not import torch
    import torch

WHITEN_EPS = 1e-8


def _check_same_shape(**arrays: np.ndarray) -> None:
    shapes = {name: np.shape(a) for name, a in arrays.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"need arrays of one shape [num_samples, tokens]; got {shapes}")


def token_level_rewards(
    scores_N: np.ndarray,  # [num_samples] outcome score of each response
    response_lengths_N: np.ndarray,  # [num_samples] response tokens of each
    *,
    num_tokens: int,
    kl_NT: np.ndarray | None = None,  # [num_samples, num_tokens] per-token KL estimate, when KL is in the reward
    kl_coef: float = 0.0,
) -> np.ndarray:
    """[num_samples, num_tokens] float64: the score on each response's last token, minus kl_coef x KL on every
    response token (0 past the response). A response of 0 tokens gets no reward: it has no token to hold it."""
    scores_N = np.asarray(scores_N, dtype=np.float64)
    lengths_N = np.asarray(response_lengths_N, dtype=np.int64)
    if scores_N.ndim != 1 or lengths_N.shape != scores_N.shape:
        raise ValueError(
            f"need scores and response lengths of shape [num_samples]; got {scores_N.shape}, {lengths_N.shape}"
        )
    if np.any(lengths_N < 0) or np.any(lengths_N > num_tokens):
        raise ValueError(f"response lengths must be in [0, num_tokens={num_tokens}]")
    mask_NT = np.arange(num_tokens)[None, :] < lengths_N[:, None]
    rewards_NT = np.zeros((len(scores_N), num_tokens))
    has_tokens = lengths_N > 0
    rewards_NT[np.flatnonzero(has_tokens), lengths_N[has_tokens] - 1] = scores_N[has_tokens]
    if kl_NT is not None and kl_coef:
        kl_NT = np.asarray(kl_NT, dtype=np.float64)
        _check_same_shape(rewards=rewards_NT, kl=kl_NT)
        rewards_NT -= kl_coef * np.where(mask_NT, kl_NT, 0.0)
    return rewards_NT


def gae_advantages_and_returns(
    rewards_NT: np.ndarray,  # [num_samples, tokens] token-level rewards
    values_NT: np.ndarray,  # [num_samples, tokens] the critic's V(s_t) when the rollout was made
    mask_NT: np.ndarray,  # [num_samples, tokens] 1 on the tokens the policy wrote
    *,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns), both [num_samples, tokens] float64, the advantages NOT yet whitened (see
    `masked_whiten`). Past a sequence's last token V(s_{t+1}) is 0: the episode ends with the response."""
    rewards_NT, values_NT = np.asarray(rewards_NT, np.float64), np.asarray(values_NT, np.float64)
    mask_NT = np.asarray(mask_NT).astype(np.float64)
    _check_same_shape(rewards=rewards_NT, values=values_NT, mask=mask_NT)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma={gamma} and lam={lam} must be in [0, 1]")
    advantages_NT = np.zeros_like(rewards_NT)
    next_value_N = np.zeros(len(rewards_NT))
    last_N = np.zeros(len(rewards_NT))
    for t in reversed(range(rewards_NT.shape[1])):
        delta_N = rewards_NT[:, t] + gamma * next_value_N - values_NT[:, t]
        candidate_N = delta_N + gamma * lam * last_N
        written_N = mask_NT[:, t]
        next_value_N = written_N * values_NT[:, t] + (1 - written_N) * next_value_N
        last_N = written_N * candidate_N + (1 - written_N) * last_N
        advantages_NT[:, t] = last_N
    return advantages_NT, advantages_NT + values_NT


def masked_whiten(values_NT: np.ndarray, mask_NT: np.ndarray, *, eps: float = WHITEN_EPS) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) with the mean and the unbiased variance over the masked-in entries, applied to
    every entry (as verl); one masked-in entry has variance 0."""
    values_NT = np.asarray(values_NT, np.float64)
    mask_NT = np.asarray(mask_NT).astype(bool)
    _check_same_shape(values=values_NT, mask=mask_NT)
    count = int(mask_NT.sum())
    if count == 0:
        raise ValueError("cannot whiten over an empty mask: the batch has no response tokens")
    mean = values_NT[mask_NT].mean()
    var = ((values_NT[mask_NT] - mean) ** 2).sum() / max(count - 1, 1)
    return (values_NT - mean) / np.sqrt(var + eps)


def clipped_value_losses(
    values_BT: torch.Tensor,  # [batch, tokens] the critic's predictions now (differentiated)
    returns_BT: torch.Tensor,  # [batch, tokens] GAE returns (targets)
    old_values_BT: torch.Tensor,  # [batch, tokens] the critic's values when the rollout was made
    mask_BT: torch.Tensor,  # [batch, tokens] 1 on response tokens
    *,
    clip_range: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token losses 0.5 max(unclipped, clipped) [batch, tokens], clip fraction over the masked-in tokens);
    aggregate the losses with `losses.aggregate_token_losses` and the update's loss_agg_mode."""
    if (
        values_BT.shape != returns_BT.shape
        or values_BT.shape != old_values_BT.shape
        or values_BT.shape != mask_BT.shape
    ):
        raise ValueError(
            f"need values, returns, old values and mask of one shape; got {tuple(values_BT.shape)}, "
            f"{tuple(returns_BT.shape)}, {tuple(old_values_BT.shape)}, {tuple(mask_BT.shape)}"
        )
    if not clip_range > 0:
        raise ValueError(f"clip_range={clip_range} must be > 0")
    clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip_range, clip_range)
    unclipped_losses_BT = (values_BT - returns_BT) ** 2
    clipped_losses_BT = (clipped_BT - returns_BT) ** 2
    mask_BT = mask_BT.bool()
    used_clipped = (clipped_losses_BT > unclipped_losses_BT) & mask_BT
    clip_fraction = used_clipped.sum() / mask_BT.sum().clamp_min(1)
    return 0.5 * unclipped_losses_BT.maximum(clipped_losses_BT), clip_fraction


def explained_variance(returns_NT: np.ndarray, values_NT: np.ndarray, mask_NT: np.ndarray) -> float:
    """verl's critic/vf_explained_var: 1 - Var(R - V) / (Var(R) + 1e-5) over the masked-in tokens, unbiased
    variances; NaN with fewer than two tokens."""
    mask_NT = np.asarray(mask_NT).astype(bool)
    returns_M, values_M = np.asarray(returns_NT, np.float64)[mask_NT], np.asarray(values_NT, np.float64)[mask_NT]
    if returns_M.size < 2:
        return float("nan")
    return float(1.0 - (returns_M - values_M).var(ddof=1) / (returns_M.var(ddof=1) + 1e-5))
