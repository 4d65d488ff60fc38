"""Group-relative advantages for outcome rewards (GRPO and Dr.GRPO).

Why GRPO: with one scalar reward per response, the other responses to the same prompt are a free,
unbiased baseline. Subtracting the group mean removes the prompt's difficulty from the signal, so no
learned value model (critic) is needed; dividing by the group std puts every prompt on the same scale.
Dr.GRPO (https://arxiv.org/abs/2503.20783) argues the std division over-weights prompts whose responses
nearly all agree (too easy or too hard) and drops it: `std_normalize=False`.

The rewards of one prompt group arrive as one row of a `[num_prompts, samples_per_group]` matrix (the
`score` stage keeps a group in one row), so the statistics are plain row reductions: no group ids, no
Python loop over groups.

Semantics follow verl's `compute_grpo_outcome_advantage` (the reference loop implementation):
- the std is the UNBIASED sample std (ddof=1, as `torch.std`), not the population std of the paper's
  pseudo-code;
- epsilon is added to the std, outside the square root: `(r - mean) / (std + eps)`;
- a group of one sample has no peers, so verl uses mean 0 and std 1: the advantage is `r / (1 + eps)`
  (or `r` without std normalisation).
Departure: a group whose rewards are all equal gets advantages of exactly 0. verl computes
`(r - mean(r)) / (std + eps)`, where floating-point rounding in the mean can leave a residue of order
1e-10 (for example three rewards of 0.1); we zero it so that "no learning signal" is exact.

Advantages are computed and returned as float64; the storage layer casts at its boundary.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)


def grpo_advantages(
    rewards_PG: np.ndarray,  # [num_prompts, samples_per_group]
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:
    """Return per-sample group-relative advantages, shape [num_prompts, samples_per_group], float64.

    `std_normalize=True` is GRPO: `(r - group_mean) / (group_std + eps)` with the unbiased std.
    `std_normalize=False` is Dr.GRPO: `r - group_mean`.
    Rewards must be finite: the score stage maps failed samples to a configured failure reward first.
    """
    rewards_PG = np.asarray(rewards_PG, dtype=np.float64)
    if rewards_PG.ndim != 2:
        raise ValueError(
            f"rewards_PG must be 2-D [num_prompts, samples_per_group], got shape {rewards_PG.shape}; "
            "reshape flat rewards with rewards.reshape(num_prompts, samples_per_group)"
        )
    num_prompts, samples_per_group = rewards_PG.shape
    if samples_per_group == 0:
        raise ValueError(f"rewards_PG has shape {rewards_PG.shape}: every group needs at least one sample")
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    if not np.all(np.isfinite(rewards_PG)):
        bad_prompts = np.unique(np.nonzero(~np.isfinite(rewards_PG))[0])
        raise ValueError(
            f"rewards contain NaN or inf in prompt rows {bad_prompts[:10].tolist()}; "
            "map failed samples to the configured failure reward in the score stage before advantages"
        )
    if num_prompts == 0:
        return np.zeros_like(rewards_PG)

    if samples_per_group == 1:
        # verl: a lone sample has mean 0 and std 1.
        mean_P1 = np.zeros((num_prompts, 1))
        std_P1 = np.ones((num_prompts, 1))
    else:
        mean_P1 = rewards_PG.mean(axis=1, keepdims=True)
        std_P1 = rewards_PG.std(axis=1, ddof=1, keepdims=True)

    centered_PG = rewards_PG - mean_P1
    if samples_per_group > 1:
        all_equal_P1 = (rewards_PG.max(axis=1) == rewards_PG.min(axis=1))[:, None]
        centered_PG = np.where(all_equal_P1, 0.0, centered_PG)
    if not std_normalize:
        return centered_PG
    denominator_P1 = np.broadcast_to(std_P1 + eps, centered_PG.shape)
    # Only an all-equal group with eps=0 has a zero denominator; its centred rewards are already 0.
    return np.divide(centered_PG, denominator_P1, out=np.zeros_like(centered_PG), where=denominator_P1 > 0)
