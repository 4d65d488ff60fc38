"""KL divergence to a frozen reference policy: per-token estimators, as a loss term or folded into the reward.

Why: a KL penalty keeps the policy near the reference (the initial) model, which limits reward hacking
and language drift. The exact KL needs the full vocabulary distribution at every position; the standard
trick (J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html) estimates it
from the log-probabilities of the SAMPLED tokens alone. With r = p_ref(y) / p_policy(y), y ~ policy:
- k1 = log p - log p_ref = -log r: unbiased for KL(policy || ref), high variance, can be negative;
- k2 = 0.5 * (log p - log p_ref)^2: biased (low bias when close), low variance, >= 0;
- k3 = r - 1 - log r: unbiased and >= 0, low variance ("low_var_kl");
- abs = |log p - log p_ref|; mse = k2.

Two ways to use them (issue 4):
- as a loss term: `loss = pg_loss + kl_coef * aggregate_token_losses(kl_penalty(logp, ref, ...), mask, ...)`
  (verl's use_kl_loss, GRPO's default with low_var_kl). Mind the gradient, which is not the gradient of
  the estimated quantity: in expectation over y ~ policy, the pathwise gradient of k1 is 0, of k2 is
  grad KL(policy || ref), and of k3 is grad KL(ref || policy) (the forward KL). The "+" estimators
  ("k1+", "k3+", "low_var_kl+") keep the value of the named estimator and take the gradient of k2
  (straight-through), so the loss follows grad KL(policy || ref) while the metric stays unbiased.
- folded into the reward: `kl_penalized_rewards` subtracts kl_coef * (summed KL) from each sequence's
  score before advantages (verl's use_kl_in_reward, k1 by default, with the behaviour policy's
  log-probs). Summing k1 gives an estimate of the sequence-level KL(policy || ref).

Semantics follow verl's core_algos.kl_penalty (checked against verl 0.9.1): "k3" and "low_var_kl" are the same
estimator, the log ratio clamped to [-20, 20] before exp and the value to [-10, 10]. Why clamp k3, which biases
it: k3 grows as exp(log p_ref - log p), so one token of a stale or off-policy batch (log p = -15 against
log p_ref = -0.1) is worth 2.96e6 nats, which as a reward penalty swamps every score of the batch and as a loss
term yields a gradient of the same size (d k3 / d log p = 1 - p_ref / p). Clamped, such a token contributes 10
and no gradient; a token within e^2.4 of the reference (k3 < 10) is untouched. verl folds the KL per token into
token-level rewards; with outcome rewards every estimator here (GRPO, RLOO, ...) first sums the token
rewards of a sequence, so folding the summed KL per sequence gives the same advantages.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs", "mse", "k1+", "k3+", "low_var_kl+")
LOG_RATIO_CLAMP = 20.0  # as in losses.py: exp of the log ratio stays finite in float32
LOW_VAR_KL_CLAMP = 10.0  # verl's clamp of k3 / low_var_kl


def _estimate(log_ratio_BT: torch.Tensor, estimator: str) -> torch.Tensor:
    """The estimator's value from log_ratio = log p - log p_ref (differentiable)."""
    if estimator == "k1":
        return log_ratio_BT
    if estimator in ("k2", "mse"):
        return 0.5 * log_ratio_BT.square()
    if estimator == "abs":
        return log_ratio_BT.abs()
    # k3 with log r = -log_ratio: r - 1 - log r
    ref_log_ratio_BT = (-log_ratio_BT).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3_BT = torch.exp(ref_log_ratio_BT) - ref_log_ratio_BT - 1.0
    return k3_BT.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)  # "k3" and "low_var_kl" alike, as in verl


def kl_penalty(
    logprobs_BT: torch.Tensor,  # [batch, tokens] policy log-probs of the sampled tokens
    ref_logprobs_BT: torch.Tensor,  # [batch, tokens] reference model log-probs of the same tokens
    *,
    estimator: str,
) -> torch.Tensor:
    """Return per-token estimates of KL(policy || ref), [batch, tokens], unmasked (aggregate with a mask).

    estimator: "k1" = logp - ref; "k2"/"mse" = 0.5 (logp - ref)^2; "k3" = "low_var_kl" =
    exp(ref - logp) - (ref - logp) - 1 clamped to [-10, 10] (verl); "abs" = |logp - ref|; "k1+", "k3+",
    "low_var_kl+" = the value of k1/k3/low_var_kl with the gradient of k2 (see the module docstring for why).
    Gradients flow to `logprobs_BT` only; the reference is a constant.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {list(KL_ESTIMATORS)}")
    if logprobs_BT.shape != ref_logprobs_BT.shape:
        raise ValueError(
            f"logprobs shape {tuple(logprobs_BT.shape)} must equal ref_logprobs shape {tuple(ref_logprobs_BT.shape)}"
        )
    log_ratio_BT = logprobs_BT - ref_logprobs_BT.detach()
    if not estimator.endswith("+"):
        return _estimate(log_ratio_BT, estimator)
    value_BT = _estimate(log_ratio_BT.detach(), estimator.removesuffix("+"))
    k2_BT = 0.5 * log_ratio_BT.square()
    return k2_BT - k2_BT.detach() + value_BT  # value of the estimator, gradient of k2


def kl_penalized_rewards(
    scores_S: np.ndarray,  # [num_samples] outcome reward of each response
    kl_ST: np.ndarray,  # [num_samples, tokens] per-token KL estimates (e.g. kl_penalty(..., "k1"))
    mask_ST: np.ndarray,  # [num_samples, tokens] bool or 0/1, 1 on response tokens
    *,
    coef: float,
) -> np.ndarray:
    """Return `scores - coef * sum_t(kl * mask)` per sequence, float64 [num_samples]: KL folded into the reward.

    Masked-out KL entries are ignored even when NaN. Feed the result to the advantage estimator in place
    of the scores. verl's metric `actor/reward_kl_penalty` is the mean over sequences of the per-token
    mean KL; `coef` is verl's kl_ctrl.kl_coef (fixed controller).
    """
    scores_S = np.asarray(scores_S, dtype=np.float64)
    kl_ST = np.asarray(kl_ST, dtype=np.float64)
    mask_ST = np.asarray(mask_ST).astype(bool)
    if scores_S.ndim != 1 or kl_ST.ndim != 2 or kl_ST.shape != mask_ST.shape or kl_ST.shape[0] != scores_S.shape[0]:
        raise ValueError(
            f"need scores [num_samples] and kl, mask [num_samples, tokens]; got scores {scores_S.shape}, "
            f"kl {kl_ST.shape}, mask {mask_ST.shape}"
        )
    if not (np.isfinite(coef) and coef >= 0):
        raise ValueError(f"coef={coef} must be a finite number >= 0")
    summed_kl_S = np.where(mask_ST, kl_ST, 0.0).sum(axis=1)
    if not np.all(np.isfinite(summed_kl_S)):
        raise ValueError("KL estimates are NaN or inf on masked-in tokens; check the reference log-probs")
    return scores_S - coef * summed_kl_S
