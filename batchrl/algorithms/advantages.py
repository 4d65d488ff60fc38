"""Outcome-reward advantages: GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline, pass@k, and their batch helpers.

Why critic-free estimators: with one scalar reward per response, the other responses to the same prompt
are a free baseline. Subtracting a group statistic removes the prompt's difficulty from the signal, so no
learned value model is needed. The estimators differ in the baseline and the scale:

- GRPO (https://arxiv.org/abs/2402.03300): `(r - group_mean) / (group_std + eps)`.
- Dr.GRPO (https://arxiv.org/abs/2503.20783): `r - group_mean`. The std division over-weights prompts whose
  responses nearly all agree (too easy or too hard), so Dr.GRPO drops it.
- RLOO (https://arxiv.org/abs/2402.14740): `r_i - mean_{j != i} r_j`, the leave-one-out baseline, which
  keeps the baseline independent of the sample it scores; equal to `n/(n-1) * (r_i - group_mean)`.
- REINFORCE++-baseline (https://arxiv.org/abs/2501.03262): `r - group_mean`, then whitened with the mean
  and std of the WHOLE batch (not the group): prompts keep their relative scale, the batch gets unit scale.
- pass@k (Chen et al. 2025, "Pass@k Training", https://arxiv.org/abs/2508.10751): the analytical advantage
  of training on the pass@k reward (the max over a random k-subset of the group), for binary rewards.

The rewards of one prompt group arrive as one row of a `[num_prompts, samples_per_group]` matrix (the
`score` stage keeps a group in one row), so group statistics are row reductions: no group ids and no
Python loop over groups. Everything is float64 numpy; the storage layer casts at its boundary.

Semantics follow verl's core_algos (`compute_grpo_outcome_advantage`, `compute_rloo_outcome_advantage`,
`compute_reinforce_plus_plus_baseline_outcome_advantage`, `verl_F.masked_whiten`):
- the group std is the UNBIASED sample std (ddof=1, as `torch.std`); eps is added to the std;
- a group of one sample has mean 0 and std 1 (GRPO: `r / (1 + eps)`), and RLOO leaves it as `r`;
- batch whitening uses the unbiased variance and `(x - mean) / sqrt(var + eps)` with eps = 1e-8; in
  REINFORCE++-baseline verl weights every response TOKEN equally in the batch statistics (longer responses
  count more): pass `response_lengths_PG` for that, or leave it None to weight every sample equally.
Departures:
- a group whose rewards are all equal gets advantages of exactly 0 (GRPO, Dr.GRPO, RLOO): verl's float
  mean can leave a residue of order 1e-10 (e.g. three rewards of 0.1);
- verl's `masked_mean` adds 1e-8 to the count in the whitening denominators; we do not (relative 1e-8);
- pass@k: verl's estimator named `grpo_passk` is a different one (see `passk_advantages`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_WHITEN_EPS = 1e-8  # verl_F.masked_whiten


def _check_rewards(rewards_PG: np.ndarray) -> np.ndarray:
    """Return rewards as a finite float64 [num_prompts, samples_per_group] array, or raise ValueError."""
    rewards_PG = np.asarray(rewards_PG, dtype=np.float64)
    if rewards_PG.ndim != 2:
        raise ValueError(
            f"rewards_PG must be 2-D [num_prompts, samples_per_group], got shape {rewards_PG.shape}; "
            "reshape flat rewards with rewards.reshape(num_prompts, samples_per_group)"
        )
    if rewards_PG.shape[1] == 0:
        raise ValueError(f"rewards_PG has shape {rewards_PG.shape}: every group needs at least one sample")
    if not np.all(np.isfinite(rewards_PG)):
        bad_prompts = np.unique(np.nonzero(~np.isfinite(rewards_PG))[0])
        raise ValueError(
            f"rewards contain NaN or inf in prompt rows {bad_prompts[:10].tolist()}; "
            "map failed samples to the configured failure reward in the score stage before advantages"
        )
    return rewards_PG


def _check_eps(eps: float) -> None:
    if not eps >= 0:
        raise ValueError(f"eps={eps} must be >= 0")


def _all_equal_P1(rewards_PG: np.ndarray) -> np.ndarray:
    """[num_prompts, 1] bool: the group's rewards are all exactly equal (no learning signal)."""
    return (rewards_PG == rewards_PG[:, :1]).all(axis=1)[:, None]  # one pass; ~4x faster than max == min


def _group_centered(rewards_PG: np.ndarray) -> np.ndarray:
    """r - group_mean, exactly 0 for all-equal groups; a lone sample keeps r (verl: its mean is 0)."""
    if rewards_PG.shape[1] == 1:
        return rewards_PG.copy()
    centered_PG = rewards_PG - rewards_PG.mean(axis=1, keepdims=True)
    return np.where(_all_equal_P1(rewards_PG), 0.0, centered_PG)


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
    rewards_PG = _check_rewards(rewards_PG)
    _check_eps(eps)
    centered_PG = _group_centered(rewards_PG)
    if not std_normalize or rewards_PG.shape[0] == 0:
        return centered_PG
    if rewards_PG.shape[1] == 1:
        std_P1 = np.ones((rewards_PG.shape[0], 1))  # verl: a lone sample has std 1
    else:
        std_P1 = rewards_PG.std(axis=1, ddof=1, keepdims=True)
    denominator_PG = np.broadcast_to(std_P1 + eps, centered_PG.shape)
    # Only an all-equal group with eps=0 has a zero denominator; its centred rewards are already 0.
    return np.divide(centered_PG, denominator_PG, out=np.zeros_like(centered_PG), where=denominator_PG > 0)


def rloo_advantages(rewards_PG: np.ndarray) -> np.ndarray:  # [num_prompts, samples_per_group]
    """Return RLOO advantages `r_i - mean_{j != i} r_j`, shape [num_prompts, samples_per_group], float64.

    Computed as `n/(n-1) * (r_i - group_mean)` (the same number: `(n r_i - sum r) / (n - 1)`), the form
    of verl's `compute_rloo_outcome_advantage`. A lone sample (n = 1) has no peers and keeps `r` (verl).
    Reference: Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740.
    """
    rewards_PG = _check_rewards(rewards_PG)
    samples_per_group = rewards_PG.shape[1]
    centered_PG = _group_centered(rewards_PG)
    if samples_per_group == 1:
        return centered_PG
    return centered_PG * (samples_per_group / (samples_per_group - 1))


@dataclass(frozen=True)
class BatchMoments:
    """Weighted count, mean and sum of squared deviations (M2) of a batch of values; mergeable.

    Why: the advantage stage runs on shards, but batch whitening needs statistics of the whole batch.
    Compute `batch_moments` per shard, add them (`a + b`, Chan et al.'s parallel update, stable where the
    sum-of-squares formula cancels), and hand the total to `whiten(..., moments=total)` on every shard.
    """

    weight: float  # total weight: number of samples, or of tokens when weighted by response length
    mean: float
    m2: float  # sum of weight * (value - mean) ** 2

    def __add__(self, other: BatchMoments) -> BatchMoments:
        weight = self.weight + other.weight
        if weight == 0:
            return BatchMoments(0.0, 0.0, 0.0)
        delta = other.mean - self.mean
        mean = self.mean + delta * other.weight / weight
        m2 = self.m2 + other.m2 + delta * delta * self.weight * other.weight / weight
        return BatchMoments(weight, mean, m2)

    @property
    def unbiased_var(self) -> float:
        """M2 / (weight - 1), Bessel-corrected over the total weight like verl's masked_var; 0 if weight <= 1."""
        return self.m2 / (self.weight - 1.0) if self.weight > 1.0 else 0.0


def _check_weights(values: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    if weights is None:
        return np.ones_like(values)
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != values.shape:
        raise ValueError(f"weights shape {weights.shape} must equal values shape {values.shape}")
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError("weights must be finite and >= 0 (e.g. response lengths in tokens)")
    return weights


def batch_moments(values: np.ndarray, *, weights: np.ndarray | None = None) -> BatchMoments:
    """Moments of `values` (any shape), each entry weighted by `weights` (same shape; None = 1 each)."""
    values = np.asarray(values, dtype=np.float64)
    weights = _check_weights(values, weights)
    weight = float(weights.sum())
    if weight == 0:
        return BatchMoments(0.0, 0.0, 0.0)
    mean = float((weights * values).sum() / weight)
    return BatchMoments(weight, mean, float((weights * (values - mean) ** 2).sum()))


def whiten(
    values: np.ndarray,
    *,
    eps: float = DEFAULT_WHITEN_EPS,
    weights: np.ndarray | None = None,
    moments: BatchMoments | None = None,
) -> np.ndarray:
    """Return `(x - mean) / sqrt(var + eps)` with the batch's weighted mean and unbiased variance.

    This is verl's `masked_whiten` (shift_mean=True) when `weights` are token counts (a response of
    L tokens counts L times, as its L identical per-token advantages do in verl) and the plain ddof=1
    z-score when `weights` is None. Entries of weight 0 (empty responses) are returned as 0, as verl's
    mask does. `moments`: statistics of the whole batch when `values` is one shard of it (see
    `BatchMoments`); default: the moments of `values` itself.
    """
    _check_eps(eps)
    values = np.asarray(values, dtype=np.float64)
    weights = _check_weights(values, weights)
    if moments is None:
        moments = batch_moments(values, weights=weights)
    std = float(np.sqrt(moments.unbiased_var + eps))
    if std == 0:  # eps = 0 and no spread: every counted value equals the mean
        return np.zeros_like(values)
    return np.where(weights > 0, (values - moments.mean) / std, 0.0)


def reinforce_pp_baseline_advantages(
    rewards_PG: np.ndarray,  # [num_prompts, samples_per_group]
    *,
    eps: float = DEFAULT_WHITEN_EPS,
    response_lengths_PG: np.ndarray | None = None,  # [num_prompts, samples_per_group] tokens
    moments: BatchMoments | None = None,
) -> np.ndarray:
    """Return REINFORCE++-baseline advantages: `whiten(r - group_mean)` over the whole batch.

    Formula (Hu et al. 2025, https://arxiv.org/abs/2501.03262; verl's
    `compute_reinforce_plus_plus_baseline_outcome_advantage`): `a = r - group_mean` (a lone sample keeps
    `r`), then `(a - batch_mean(a)) / sqrt(batch_var(a) + eps)` with the unbiased batch variance.
    `response_lengths_PG` reproduces verl exactly: its batch statistics run over response tokens, so a
    sample weighs as many times as it has tokens (and a 0-token response gets 0). None weighs samples
    equally. After the shift, an all-equal group gets `-batch_mean / std`, not 0 (as in verl).
    On a shard of the batch pass `moments=sum of batch_moments(r - group_mean, weights=lengths)` over
    the shards (`grpo_advantages(r, std_normalize=False)` is `r - group_mean`).
    """
    centered_PG = grpo_advantages(rewards_PG, std_normalize=False)
    return whiten(centered_PG, eps=eps, weights=response_lengths_PG, moments=moments)


def _subset_all_in_fraction(num_in_P: np.ndarray, num_total: int, subset_size: int) -> np.ndarray:
    """C(num_in, subset_size) / C(num_total, subset_size): the chance that a uniform random subset of
    `subset_size` items out of `num_total` falls entirely inside a set of `num_in` items.

    As the product prod_{i < subset_size} (num_in - i) / (num_total - i), which is 0 once num_in < size.
    Loops over the subset size (<= group size), never over groups.
    """
    steps = np.arange(subset_size, dtype=np.float64)
    factors_PK = np.clip(num_in_P[:, None] - steps, 0.0, None) / (num_total - steps)
    return factors_PK.prod(axis=1)


def passk_advantages(
    rewards_PG: np.ndarray,  # [num_prompts, samples_per_group], binary 0/1
    *,
    k: int,
    eps: float = 1e-6,
) -> np.ndarray:
    """Return the analytical pass@k advantages of Chen et al. 2025 (https://arxiv.org/abs/2508.10751).

    Training on the pass@k reward scores a random k-subset of the group by its max; the advantage of a
    response is the expected GRPO advantage of the k-subsets that contain it, in closed form for binary
    rewards. With n samples of which n_neg are wrong:
        mean = 1 - C(n_neg, k) / C(n, k)                 (pass@k of the group)
        std  = sqrt(mean * (1 - mean))
        A_pos = (1 - mean) / (std + eps)
        A_neg = (1 - mean - C(n_neg - 1, k - 1) / C(n - 1, k - 1)) / (std + eps)
    k = 1 is GRPO with the population std. A group with fewer than k wrong answers (pass@k saturated) or
    with none right gets 0.
    Why this one and not verl's `grpo_passk` (Tang et al. 2025, https://arxiv.org/abs/2503.19595, only the
    best sample gets `r_max - r_second_max`): it supports any k <= n (so k can be annealed), and every
    sample of an informative group gets a signal, whereas with binary rewards verl's variant is non-zero
    only for groups with exactly one right answer (k is fixed to n).
    """
    rewards_PG = _check_rewards(rewards_PG)
    _check_eps(eps)
    num_prompts, samples_per_group = rewards_PG.shape
    if isinstance(k, bool) or int(k) != k or not 1 <= k <= samples_per_group:
        raise ValueError(f"pass@k needs an integer k in [1, samples_per_group={samples_per_group}], got k={k}")
    k = int(k)
    is_right_PG = rewards_PG == 1.0
    if not np.all(is_right_PG | (rewards_PG == 0.0)):
        raise ValueError(
            "pass@k advantages need binary rewards (0 or 1); threshold the score first or use estimator 'grpo'"
        )
    num_wrong_P = (~is_right_PG).sum(axis=1).astype(np.float64)
    group_passk_P = 1.0 - _subset_all_in_fraction(num_wrong_P, samples_per_group, k)
    std_P = np.sqrt(group_passk_P * (1.0 - group_passk_P))
    # chance that the other k - 1 members of a subset holding a given wrong answer are all wrong too
    others_wrong_P = _subset_all_in_fraction(num_wrong_P - 1.0, samples_per_group - 1, k - 1)
    right_P = 1.0 - group_passk_P
    wrong_P = 1.0 - group_passk_P - others_wrong_P
    advantages_PG = np.where(is_right_PG, right_P[:, None], wrong_P[:, None])
    denominator_P1 = (std_P + eps)[:, None]
    informative_P1 = (std_P > 0)[:, None]
    return np.divide(
        advantages_PG, denominator_P1, out=np.zeros_like(advantages_PG), where=informative_P1 & (denominator_P1 > 0)
    )


def dynamic_sampling_mask(rewards_PG: np.ndarray) -> np.ndarray:  # [num_prompts, samples_per_group]
    """Return bool [num_prompts]: True for the groups to keep under DAPO's dynamic sampling.

    DAPO (https://arxiv.org/abs/2503.14476) drops groups whose rewards are all equal (all right or all
    wrong): their group-relative advantages are 0, so they only dilute the batch. A lone sample is kept,
    as in verl's DAPO recipe (`std > 0 or len == 1`). `(~mask).sum()` is the number of dropped groups.
    """
    rewards_PG = _check_rewards(rewards_PG)
    if rewards_PG.shape[1] == 1:
        return np.ones(rewards_PG.shape[0], dtype=bool)
    return ~_all_equal_P1(rewards_PG)[:, 0]


def overlong_penalty(
    response_lengths: np.ndarray,  # any shape, tokens
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float,
) -> np.ndarray:
    """Return DAPO's soft overlong punishment per response (float64, <= 0), to ADD to the reward.

    With L_max = max_response_length and L_buf = overlong_buffer_len (DAPO eq. 13,
    https://arxiv.org/abs/2503.14476; verl's DAPO reward manager):
        0                                            if length <= L_max - L_buf
        -penalty_factor * (length - (L_max - L_buf)) / L_buf   if L_max - L_buf < length <= L_max
        -penalty_factor                              if length > L_max
    Departure: verl does not clamp beyond L_max (lengths never exceed it when generation is capped).
    """
    lengths = np.asarray(response_lengths, dtype=np.float64)
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len={overlong_buffer_len} must be in (0, max_response_length={max_response_length}]"
        )
    if not penalty_factor >= 0:
        raise ValueError(f"penalty_factor={penalty_factor} must be >= 0 (the penalty at max length)")
    if not np.all(np.isfinite(lengths)) or np.any(lengths < 0):
        raise ValueError("response_lengths must be finite token counts >= 0")
    excess = np.clip(lengths - (max_response_length - overlong_buffer_len), 0.0, overlong_buffer_len)
    return 0.0 - penalty_factor * excess / overlong_buffer_len  # 0.0 - ...: no -0.0 in the output
