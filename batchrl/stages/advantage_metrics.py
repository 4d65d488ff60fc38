"""The advantage stage's metrics: per-shard counts its workers return, summed over the shards, and the stats made
from them (critic/advantages/*, critic/score/*, update/policy_lag_*, actor/reward_kl_penalty*, critic/groups_*).
The estimator kind's own (GAE's critic/returns, values, explained variance) are its module's (`advantage_gae`)."""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrl.config.models import AdvantageConfig

logger = logging.getLogger(__name__)

# the counts that only feed the stats: summed over the shards, left out of the manifest's counts
STATS_ONLY = ("advantage", "reward_kl", "gae_", "version_", "score_")


def shard_counts(table: pa.Table, out: pa.Table) -> dict[str, float]:
    """The counts every estimator's shard reports: of the samples it wrote (``out``) and the scores it read."""
    return (
        summarize_advantages(out)
        | {"logprobs_missing": missing_logprobs(out)}
        | policy_version_counts(out)
        | score_counts(table)
        | tool_token_counts(out)
    )


def tool_token_counts(out: pa.Table) -> dict[str, float]:
    """With multi-turn samples (a ``response_mask``), the response tokens the policy wrote and those tools
    appended; nothing for single-turn tables (their metrics stay as they were)."""
    if "response_mask" not in out.column_names or out.column("response_mask").null_count == out.num_rows:
        return {}
    tool = int((pc.list_flatten(out.column("response_mask")).to_numpy(zero_copy_only=False) == 0).sum())
    total = int(pc.list_value_length(out.column("response_token_ids")).fill_null(0).to_numpy().sum())
    return {"advantage_policy_tokens": float(total - tool), "advantage_tool_tokens": float(tool)}


def score_counts(table: pa.Table) -> dict[str, float]:
    """The scores this stage read (every sample of the shard, filtered groups included): what the training signal
    was made from, which a user stage after score may have changed since the score stage's own statistics."""
    scores_N = pc.list_flatten(table.column("scores")).to_numpy(zero_copy_only=False).astype(np.float64)
    return {
        "score_samples": float(len(scores_N)),
        "score_sum": float(scores_N.sum()),
        "score_max": float(scores_N.max(initial=-np.inf)),
        "score_min": float(scores_N.min(initial=np.inf)),
    }


def policy_version_counts(table: pa.Table) -> dict[str, float]:
    """The generated samples' policy versions (logged ones, version -1, left out): their sum, count and oldest, from
    which the stage reports how many versions behind the update's input policy they are (update/policy_lag_*)."""
    versions = table.column("policy_version").to_numpy(zero_copy_only=False)
    versions = versions[versions >= 0]
    return {
        "version_samples": float(len(versions)),
        "version_sum": float(versions.sum()),
        "version_oldest_min": float(versions.min(initial=np.iinfo(np.int32).max)),
    }


def missing_logprobs(table: pa.Table) -> int:
    """Samples with response tokens but no behaviour log-probs (logged without them): the update recomputes them."""
    logprobs = pc.list_value_length(table.column("response_logprobs")).fill_null(0).to_numpy(zero_copy_only=False)
    tokens = pc.list_value_length(table.column("response_token_ids")).fill_null(0).to_numpy(zero_copy_only=False)
    return int(((logprobs == 0) & (tokens > 0)).sum())


def summarize_advantages(table: pa.Table) -> dict[str, float]:
    advantages = table.column("advantage").to_numpy()
    per_group = table.group_by("prompt_id").aggregate([("score", "min"), ("score", "max")])
    all_equal = np.asarray(per_group.column("score_min")) == np.asarray(per_group.column("score_max"))
    return {
        "groups": per_group.num_rows,
        "groups_all_equal": int(all_equal.sum()),
        "num_samples": len(advantages),
        "advantage_sum": float(advantages.sum()),
        "advantage_max": float(advantages.max(initial=-np.inf)),
        "advantage_min": float(advantages.min(initial=np.inf)),
    }


def advantage_stats(
    counts: dict[str, float], cfg: AdvantageConfig, *, iteration: int, kind_stats: dict[str, float]
) -> dict[str, float]:
    """The stage's stats from the shards' summed counts; ``kind_stats``, the estimator kind's own, are laid over the
    advantages' and scores' (GAE's critic/advantages/mean is over the response tokens)."""
    n = counts.get("num_samples", 0)
    stats = (
        {
            "critic/advantages/mean": counts["advantage_sum"] / n,
            "critic/advantages/max": counts["advantage_max"],
            "critic/advantages/min": counts["advantage_min"],
        }
        if n
        else {}
    )
    if counts.get("score_samples"):
        # critic/score/* describe the scores advantage read (the last user stage after score's, if any), not
        # the score stage's (score/raw/*): a shaping stage between them changes the signal trained on
        stats |= {
            "critic/score/mean": counts["score_sum"] / counts["score_samples"],
            "critic/score/max": counts["score_max"],
            "critic/score/min": counts["score_min"],
        }
    stats |= kind_stats
    if n and "advantage_tool_tokens" in counts:  # multi-turn: what the update trains on, and the context it skips
        stats["response_length/policy_tokens_mean"] = counts["advantage_policy_tokens"] / n
        stats["response_length/tool_tokens_mean"] = counts["advantage_tool_tokens"] / n
    if counts.get("version_samples"):  # versions behind policy(i-1), the policy the update trains (version i)
        stats["update/policy_lag_mean"] = iteration - counts["version_sum"] / counts["version_samples"]
        stats["update/policy_lag_max"] = float(iteration - counts["version_oldest_min"])
    if cfg.kl_in_reward_coef > 0 and n:
        stats["actor/reward_kl_penalty"] = counts["reward_kl_token_mean_sum"] / n
        stats["actor/reward_kl_penalty_coeff"] = cfg.kl_in_reward_coef
    if cfg.filter_groups:
        stats["critic/groups_filtered"] = counts.get("groups_filtered", 0)
        logger.info(
            "dynamic sampling dropped %d group(s) whose rewards were all equal", counts.get("groups_filtered", 0)
        )
    return stats


def manifest_counts(counts: dict[str, float]) -> dict[str, int]:
    """The summed counts the manifest keeps (samples, groups, filtered, missing log-probs), as integers."""
    return {k: int(v) for k, v in counts.items() if not k.startswith(STATS_ONLY)}
