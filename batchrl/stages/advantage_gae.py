"""The advantage stage's code for the token estimator, GAE (PPO with a critic; the math in batchrl.algorithms.gae).

Per shard: token-level rewards (the score on the last response token, minus coef x KL on every response token with
KL in the reward), then GAE over the critic's values (the values table's ``values`` column, from the values stage);
the advantages are whitened over the batch's response tokens with the moments the stage's first pass merged over
every shard, the returns (the critic's targets) are not. The table keeps, per sample, ``token_advantages``,
``values`` (the value loss's old values) and ``returns``; ``advantage`` is the first token's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrl.algorithms.advantages import BatchMoments, batch_moments, whiten
from batchrl.algorithms.estimators import ESTIMATORS
from batchrl.algorithms.gae import token_level_rewards
from batchrl.config.models import AdvantageConfig
from batchrl.errors import DataError
from batchrl.stages.advantage_kl import RewardKL
from batchrl.stages.advantage_table import explode_groups, has_masks, sample_masks


@dataclasses.dataclass(frozen=True)
class GaeShard:
    """GAE over one shard's samples (row-major: groups as in the shard, samples as in their group), [N, T] arrays
    with T the longest response; advantages not yet whitened."""

    table: pa.Table
    mask_NT: np.ndarray  # the policy's response tokens (holes at a multi-turn sample's tool tokens)
    response_lengths_N: np.ndarray  # every response token, tool tokens included: the per-token lists' lengths
    values_NT: np.ndarray
    advantages_NT: np.ndarray
    returns_NT: np.ndarray
    reward_kl_N: np.ndarray | None  # summed per-token KL of each sample, with KL in the reward

    @property
    def lengths_N(self) -> np.ndarray:
        """The policy's tokens of each sample."""
        return self.mask_NT.sum(axis=1)


def gae_shard(table: pa.Table, cfg: AdvantageConfig, reward_kl: RewardKL | None) -> GaeShard:
    """Token-level rewards (the score on the last response token, minus coef x KL on every token with KL in the
    reward), then GAE over the critic's values (the table's ``values`` column, from the values stage)."""
    if "values" not in table.column_names:
        raise DataError("advantage.estimator gae reads the critic's values, and the input table has none")
    scores_N = np.asarray(pc.list_flatten(table.column("scores")).to_numpy(zero_copy_only=False), dtype=np.float64)
    if not np.all(np.isfinite(scores_N)):
        raise DataError("advantage.estimator gae: a score is not finite (NaN or inf)")
    lengths_N = pc.list_value_length(pc.list_flatten(table.column("response_token_ids"))).to_numpy(zero_copy_only=False)
    values = [v for group in table.column("values").to_pylist() for v in group]
    num_tokens = int(max(1, lengths_N.max(initial=0)))
    mask_NT = np.arange(num_tokens)[None, :] < lengths_N[:, None]
    response_NT, reward_lengths_N = mask_NT, lengths_N
    if has_masks(table):  # multi-turn: GAE's holes at the tool tokens, the score on the policy's last token
        mask_NT, reward_lengths_N = policy_mask_NT(table, lengths_N, num_tokens)
    values_NT = np.zeros(mask_NT.shape)
    for i, sample_values in enumerate(values):
        if len(sample_values) != lengths_N[i]:
            raise DataError(
                f"the values table has {len(sample_values)} values for a response of {lengths_N[i]} tokens; redo the "
                "values stage (--from-stage values)"
            )
        values_NT[i, : lengths_N[i]] = sample_values
    kl_NT, reward_kl_N = None, None
    if reward_kl is not None and len(scores_N):
        from batchrl.trainer.data import sample_sums

        kl_flat, offsets_N1 = reward_kl.token_kl(table)
        kl_NT = np.zeros(mask_NT.shape)
        kl_NT[response_NT] = kl_flat  # row-major: sample i's tokens in order, as the flat layout
        reward_kl_N = sample_sums(kl_flat, offsets_N1)
    # up to the policy's last token the KL (0 on tool tokens) is charged as on every response token
    rewards_NT = token_level_rewards(
        scores_N, reward_lengths_N, num_tokens=num_tokens, kl_NT=kl_NT, kl_coef=cfg.kl_in_reward_coef
    )
    entry = ESTIMATORS[cfg.estimator]
    advantages_NT, returns_NT = entry.advantages(rewards_NT, values_NT, mask_NT, **entry.options_from(cfg))
    return GaeShard(table, mask_NT, lengths_N, values_NT, advantages_NT, returns_NT, reward_kl_N)


def policy_mask_NT(table: pa.Table, lengths_N: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """([N, T] True on the tokens the policy wrote, [N] one past each sample's last such token: where its score
    goes, so that a conversation ending on a tool's answer still rewards the policy's last action)."""
    mask_NT = np.arange(num_tokens)[None, :] < lengths_N[:, None]
    for i, mask in enumerate(sample_masks(table).to_pylist()):
        if mask is None:
            continue
        if len(mask) != lengths_N[i]:
            raise DataError(f"a response_masks entry has {len(mask)} values for a response of {lengths_N[i]} tokens")
        mask_NT[i, : lengths_N[i]] = np.asarray(mask) != 0
    written_N = mask_NT.any(axis=1)
    last_N = np.where(written_N, num_tokens - np.argmax(mask_NT[:, ::-1], axis=1), 0)
    return mask_NT, last_N


def gae_output(shard: GaeShard, moments: BatchMoments, *, eps: float) -> tuple[pa.Table, dict[str, float]]:
    """One row per sample with the whitened per-token advantages, the values and the returns (the critic's
    targets: not whitened); ``advantage`` is the first token's. Counts: the sums the stage's metrics need."""
    mask_NT = shard.mask_NT
    whitened_NT = whiten(shard.advantages_NT, eps=eps, weights=mask_NT.astype(np.float64), moments=moments)
    lengths_N = shard.response_lengths_N
    first_N = np.where(lengths_N > 0, whitened_NT[:, 0], 0.0)
    out = explode_groups(shard.table, first_N, reward_kl_PG=shard.reward_kl_N)

    def per_sample(array_NT: np.ndarray) -> pa.Array:
        return pa.array([row[:n].tolist() for row, n in zip(array_NT, lengths_N)], pa.list_(pa.float32()))

    out = out.append_column("token_advantages", per_sample(whitened_NT))
    out = out.append_column("values", per_sample(shard.values_NT))
    out = out.append_column("returns", per_sample(shard.returns_NT))
    returns_M, values_M = shard.returns_NT[mask_NT], shard.values_NT[mask_NT]
    residual_M = returns_M - values_M
    counts = {
        "gae_tokens": float(mask_NT.sum()),
        "gae_advantage_sum": float(whitened_NT[mask_NT].sum()),
        "gae_value_sum": float(values_M.sum()),
        "gae_return_sum": float(returns_M.sum()),
        "gae_return_sq_sum": float((returns_M**2).sum()),
        "gae_residual_sum": float(residual_M.sum()),
        "gae_residual_sq_sum": float((residual_M**2).sum()),
    }
    return out, counts


def gae_stats(counts: dict[str, float]) -> dict[str, float]:
    """verl's critic data metrics from the shards' summed counts: the token means of the advantages, returns and
    values, and the explained variance 1 - Var(R - V) / (Var(R) + 1e-5) (unbiased variances over the tokens)."""
    n = counts.get("gae_tokens", 0.0)
    if not n:
        return {}

    def unbiased_var(total: float, squares: float) -> float:
        return (squares - total * total / n) / (n - 1) if n > 1 else float("nan")

    var_returns = unbiased_var(counts["gae_return_sum"], counts["gae_return_sq_sum"])
    var_residual = unbiased_var(counts["gae_residual_sum"], counts["gae_residual_sq_sum"])
    return {
        "critic/advantages/mean": counts["gae_advantage_sum"] / n,
        "critic/returns/mean": counts["gae_return_sum"] / n,
        "critic/values/mean": counts["gae_value_sum"] / n,
        "critic/vf_explained_var": 1.0 - var_residual / (var_returns + 1e-5),
    }


def token_moments(table: pa.Table, cfg: AdvantageConfig, reward_kl: RewardKL | None) -> BatchMoments:
    """The first pass: the moments of the GAE advantages of a shard's response tokens, each token counting once."""
    shard = gae_shard(table, cfg, reward_kl)
    return batch_moments(shard.advantages_NT, weights=shard.mask_NT.astype(np.float64))


def token_output(
    table: pa.Table, cfg: AdvantageConfig, reward_kl: RewardKL | None, moments: BatchMoments | None
) -> tuple[pa.Table, dict[str, float]]:
    """The shard's rows with their whitened GAE advantages, values and returns, and the counts of `gae_output`."""
    shard = gae_shard(table, cfg, reward_kl)
    out, counts = gae_output(shard, moments, eps=cfg.whiten_epsilon)
    counts["groups_filtered"] = 0
    if shard.reward_kl_N is not None:
        counts["reward_kl_token_mean_sum"] = float((shard.reward_kl_N / np.maximum(shard.lengths_N, 1.0)).sum())
    return out, counts
