"""The advantage stage's code for the group estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline, pass@k).

Per shard, one size of group at a time (`advantage_table.by_group_size`): the groups' rewards as a [P, n] matrix
(DAPO group filtering drops the groups whose rewards are all equal, and counts them), KL folded into them when it is
in the reward, then the estimator's entry in batchrl.algorithms.estimators; an estimator whose advantages are
whitened over the batch is whitened with the moments the stage's first pass merged over every shard.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from batchrl.algorithms.advantages import BatchMoments, batch_moments, whiten
from batchrl.algorithms.estimators import ESTIMATORS
from batchrl.config.models import AdvantageConfig
from batchrl.errors import DataError
from batchrl.stages.advantage_kl import RewardKL, kl_penalized
from batchrl.stages.advantage_table import (
    ShardGroups,
    by_group_size,
    explode_groups,
    in_shard_order,
    shard_groups,
    shard_rows,
)


def raw_advantages(groups: ShardGroups, cfg: AdvantageConfig) -> np.ndarray:
    """Advantages before any batch-level whitening; the estimator's ValueError (rewards that are not finite, pass@k
    over a group smaller than k or with non-binary rewards) a DataError naming the estimator."""
    if groups.rewards_PG.size == 0:
        return np.zeros_like(groups.rewards_PG)
    entry = ESTIMATORS[cfg.estimator]
    try:
        return entry.advantages(groups.rewards_PG, **entry.options_from(cfg))
    except ValueError as err:
        raise DataError(f"advantage.estimator {cfg.estimator}: {err}") from None


def _penalized_pieces(table: pa.Table, cfg: AdvantageConfig, reward_kl: RewardKL | None):
    """(groups with KL in their rewards, the summed KL [P, n] or None) of each group size of a shard."""
    for piece in by_group_size(table):
        groups = shard_groups(piece, filter_groups=cfg.filter_groups)
        yield kl_penalized(groups, reward_kl, cfg.kl_in_reward_coef)


def group_moments(table: pa.Table, cfg: AdvantageConfig, reward_kl: RewardKL | None) -> BatchMoments:
    """The first pass: the moments of a shard's advantages before whitening, each sample weighted by its tokens."""
    moments = None
    for groups, _ in _penalized_pieces(table, cfg, reward_kl):
        piece_moments = batch_moments(raw_advantages(groups, cfg), weights=groups.lengths_PG)
        moments = piece_moments if moments is None else moments + piece_moments
    return moments


def group_output(
    table: pa.Table, cfg: AdvantageConfig, reward_kl: RewardKL | None, moments: BatchMoments | None
) -> tuple[pa.Table, dict[str, float]]:
    """One row per sample with its advantage (whitened with the batch's ``moments`` when given), in shard order;
    counts of the groups filtered and, with KL in the reward, the sum over samples of their per-token mean KL."""
    pieces, filtered, kl_token_mean_sum = [], 0, 0.0
    for groups, kl_PG in _penalized_pieces(table, cfg, reward_kl):
        advantages_PG = raw_advantages(groups, cfg)
        if moments is not None and advantages_PG.size:
            advantages_PG = whiten(advantages_PG, eps=cfg.whiten_epsilon, weights=groups.lengths_PG, moments=moments)
        pieces.append((explode_groups(groups.table, advantages_PG, reward_kl_PG=kl_PG), shard_rows(groups)))
        filtered += groups.num_filtered
        if kl_PG is not None:  # verl's actor/reward_kl_penalty: the mean over samples of the per-token mean KL
            kl_token_mean_sum += float((kl_PG / np.maximum(groups.lengths_PG, 1.0)).sum())
    counts: dict[str, float] = {"groups_filtered": filtered}
    if reward_kl is not None:
        counts["reward_kl_token_mean_sum"] = kl_token_mean_sum
    return in_shard_order(pieces), counts
