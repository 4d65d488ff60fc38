"""advantage: scores -> advantages, group-relative within each row, then one row per sample.

The group is the row (one prompt, its n samples), so no groupby is needed: the rewards of a shard form a
dense [num_prompts, n] array handed to a pure function of batchrl.algorithms.advantages. The output
explodes to one row per sample, keyed by (prompt_id, sample_idx), which the update stage consumes.

Batch-level statistics (whitening, REINFORCE++-baseline) need the whole batch, not one shard: a first pass
over the actor pool computes each shard's mergeable moments (the workers read only the scores and lengths), the
driver adds them up, then each shard is whitened with those global moments, so the result equals whitening the
whole batch at once. The driver reads no scores part. DAPO group filtering drops groups whose rewards are all
equal and counts them.

KL folded into the reward (``advantage.kl_in_reward_coef``): each sample's reward becomes its score minus
coef x its summed per-token KL(behaviour || reference), before the estimator sees it. The behaviour side is
the rollout's own per-token log-probs (the policy that sampled them); the reference side is computed here by
the reference model (``model.path``, as the update's KL loss), loaded once per worker. Filtering still looks
at the scores (a group whose answers all fail is still without signal, whatever its KL).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrl.algorithms.advantages import (
    BatchMoments,
    batch_moments,
    compute_advantages,
    dynamic_sampling_mask,
    grpo_advantages,
    whiten,
)
from batchrl.config import PipelineConfig
from batchrl.config.models import AdvantageConfig
from batchrl.errors import DataError
from batchrl.pipeline.shards import ShardWorker, job_input, map_shards, run_sharded, shard_jobs
from batchrl.pipeline.stage import Stage, StageContext, StageOutput, register
from batchrl.storage import read_parquet
from batchrl.storage.journal import Journal, record
from batchrl.storage.manifest import Manifest

logger = logging.getLogger(__name__)

MOMENTS_KEY = "moments/"  # journal records of each scores shard's moments: moments/<part name>


@dataclasses.dataclass(frozen=True)
class ShardGroups:
    """The groups of one shard that take part in the update, as dense [P, n] arrays."""

    table: pa.Table  # kept rows (groups) of the scores shard
    rewards_PG: np.ndarray
    lengths_PG: np.ndarray
    num_filtered: int


def shard_groups(table: pa.Table, *, filter_groups: bool) -> ShardGroups:
    """The groups of a table whose groups all have the same size (see by_group_size)."""
    scores = table.column("scores").to_pylist()
    if len({len(g) for g in scores}) > 1:
        raise ValueError(f"shard_groups takes groups of one size, got {sorted({len(g) for g in scores})}")
    empty = [row for row, group in enumerate(scores) if not group]
    if empty:
        ids = table.column("prompt_id") if "prompt_id" in table.column_names else None
        which = f"prompt {ids[empty[0]].as_py()!r}" if ids is not None else f"the group in row {empty[0]}"
        raise DataError(f"{which} has no samples: every group needs at least one")
    rewards_PG = np.asarray(scores, dtype=np.float64).reshape(table.num_rows, -1)
    lengths_PG = np.asarray(table.column("response_lengths").to_pylist(), dtype=np.float64).reshape(rewards_PG.shape)
    keep_P = dynamic_sampling_mask(rewards_PG) if filter_groups and table.num_rows else np.ones(table.num_rows, bool)
    return ShardGroups(
        table=table.filter(pa.array(keep_P)),
        rewards_PG=rewards_PG[keep_P],
        lengths_PG=lengths_PG[keep_P],
        num_filtered=int((~keep_P).sum()),
    )


ROW_KEY = "_group_row"  # a group's row in its shard, carried through by_group_size's pieces


def by_group_size(table: pa.Table) -> list[pa.Table]:
    """The shard's groups split by group size, each piece with the ``ROW_KEY`` column (its rows' places in the
    shard); the table itself, without that column, when its groups are all one size (generated rollouts).

    Why: the estimators work on dense [P, n] arrays, one row reduction per group; groups of several sizes (logged
    data, rows dropped upstream) are processed one size at a time, and their samples put back in shard order
    (``in_shard_order``). A group of one sample gets verl's treatment (GRPO: r / (1 + eps), RLOO: r)."""
    sizes_P = pc.list_value_length(table.column("scores")).to_numpy(zero_copy_only=False)
    if len(np.unique(sizes_P)) <= 1:
        return [table]
    table = table.append_column(ROW_KEY, pa.array(np.arange(table.num_rows, dtype=np.int64)))
    return [table.filter(pa.array(sizes_P == size)) for size in np.unique(sizes_P)]


def in_shard_order(pieces: list[tuple[pa.Table, np.ndarray]]) -> pa.Table:
    """The exploded samples of each piece (with the shard rows of its kept groups), concatenated in shard order:
    groups as in the shard, samples as in their group."""
    if len(pieces) == 1:
        return pieces[0][0]
    rows_S = np.concatenate([np.repeat(rows_P, _samples_per_group(out, rows_P)) for out, rows_P in pieces])
    return pa.concat_tables([out for out, _ in pieces]).take(pa.array(np.argsort(rows_S, kind="stable")))


def _samples_per_group(out: pa.Table, rows_P: np.ndarray) -> int:
    return out.num_rows // len(rows_P) if len(rows_P) else 0


def shard_rows(groups: ShardGroups) -> np.ndarray:
    """The shard rows of the kept groups of a by_group_size piece (0..P-1 for a whole shard)."""
    if ROW_KEY in groups.table.column_names:
        return groups.table.column(ROW_KEY).to_numpy()
    return np.arange(groups.table.num_rows, dtype=np.int64)


class RewardKL:
    """Summed per-token KL(behaviour || reference) of every sample of a group table, [P, n]."""

    def __init__(self, reference_path: str, *, estimator: str, max_tokens: int, share_prompt: bool = False):
        from transformers import AutoTokenizer

        from batchrl.storage import local_copy
        from batchrl.trainer.reference import load_frozen_model

        local = local_copy(reference_path)
        self.model = load_frozen_model(local)
        tokenizer = AutoTokenizer.from_pretrained(local)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.estimator, self.max_tokens, self.share_prompt = estimator, max_tokens, share_prompt

    def __call__(self, groups: ShardGroups) -> np.ndarray:
        if groups.rewards_PG.size == 0:
            return np.zeros_like(groups.rewards_PG)
        from batchrl.trainer.data import sample_sums

        kl_flat, offsets_N1 = self.token_kl(groups.table)
        return sample_sums(kl_flat, offsets_N1).reshape(groups.rewards_PG.shape)  # samples in row-major [P, n] order

    def token_kl(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """(per-token KL of every response token of a group table's samples, row-major, flat float64; the offsets
        of each sample's tokens in it)."""
        import torch

        from batchrl.algorithms.kl import kl_penalty
        from batchrl.trainer.data import samples_from_groups
        from batchrl.trainer.reference import response_logprobs

        samples = samples_from_groups(table)
        behaviour = samples.flat_rollout_logprobs()
        if len(behaviour) != int(samples.response_offsets_N1[-1]):
            raise DataError(
                "kl_in_reward needs the rollouts' per-token log-probs, and some are missing (logged responses without "
                "response_logprobs) or of "
                "another length than their responses"
            )
        reference = response_logprobs(
            self.model,
            samples,
            pad_token_id=self.pad_token_id,
            max_tokens=self.max_tokens,
            share_prompt=self.share_prompt,
        )
        kl_flat = (
            kl_penalty(torch.from_numpy(behaviour)[None], torch.from_numpy(reference)[None], estimator=self.estimator)[
                0
            ]
            .double()
            .numpy()
        )
        return kl_flat, samples.response_offsets_N1


def kl_penalized(groups: ShardGroups, reward_kl: RewardKL | None, coef: float) -> tuple[ShardGroups, np.ndarray | None]:
    """(groups with rewards - coef x summed KL, the summed KL [P, n]); unchanged and None without KL."""
    if reward_kl is None:
        return groups, None
    kl_PG = reward_kl(groups)
    return dataclasses.replace(groups, rewards_PG=groups.rewards_PG - coef * kl_PG), kl_PG


def raw_advantages(groups: ShardGroups, cfg: AdvantageConfig) -> np.ndarray:
    """Advantages before any batch-level whitening."""
    if groups.rewards_PG.size == 0:
        return np.zeros_like(groups.rewards_PG)
    if cfg.estimator == "reinforce_pp_baseline":
        return grpo_advantages(groups.rewards_PG, std_normalize=False)  # whitened over the batch below
    options: dict[str, Any] = {}
    if cfg.estimator in ("grpo", "grpo_passk"):
        options["eps"] = cfg.epsilon
    if cfg.estimator == "grpo_passk":
        options["k"] = cfg.passk_k
    return compute_advantages(cfg.estimator, groups.rewards_PG, **options)


def needs_batch_moments(cfg: AdvantageConfig) -> bool:
    return cfg.whiten or cfg.estimator in ("reinforce_pp_baseline", "gae")


@dataclasses.dataclass(frozen=True)
class GaeShard:
    """GAE over one shard's samples (row-major: groups as in the shard, samples as in their group), [N, T] arrays
    with T the longest response; advantages not yet whitened."""

    table: pa.Table
    mask_NT: np.ndarray
    values_NT: np.ndarray
    advantages_NT: np.ndarray
    returns_NT: np.ndarray
    reward_kl_N: np.ndarray | None  # summed per-token KL of each sample, with KL in the reward

    @property
    def lengths_N(self) -> np.ndarray:
        return self.mask_NT.sum(axis=1)


def gae_shard(table: pa.Table, cfg: AdvantageConfig, reward_kl: RewardKL | None) -> GaeShard:
    """Token-level rewards (the score on the last response token, minus coef x KL on every token with KL in the
    reward), then GAE over the critic's values (the table's ``values`` column, from the values stage)."""
    from batchrl.algorithms.gae import gae_advantages_and_returns, token_level_rewards

    if "values" not in table.column_names:
        raise DataError("advantage.estimator gae reads the critic's values, and the input table has none")
    scores_N = np.asarray(pc.list_flatten(table.column("scores")).to_numpy(zero_copy_only=False), dtype=np.float64)
    if not np.all(np.isfinite(scores_N)):
        raise DataError("advantage.estimator gae: a score is not finite (NaN or inf)")
    lengths_N = pc.list_value_length(pc.list_flatten(table.column("response_token_ids"))).to_numpy(zero_copy_only=False)
    values = [v for group in table.column("values").to_pylist() for v in group]
    num_tokens = int(max(1, lengths_N.max(initial=0)))
    mask_NT = np.arange(num_tokens)[None, :] < lengths_N[:, None]
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
        kl_NT[mask_NT] = kl_flat  # row-major: sample i's tokens in order, as the flat layout
        reward_kl_N = sample_sums(kl_flat, offsets_N1)
    rewards_NT = token_level_rewards(
        scores_N, lengths_N, num_tokens=num_tokens, kl_NT=kl_NT, kl_coef=cfg.kl_in_reward_coef
    )
    advantages_NT, returns_NT = gae_advantages_and_returns(rewards_NT, values_NT, mask_NT, gamma=cfg.gamma, lam=cfg.lam)
    return GaeShard(table, mask_NT, values_NT, advantages_NT, returns_NT, reward_kl_N)


def gae_output(shard: GaeShard, moments: BatchMoments, *, eps: float) -> tuple[pa.Table, dict[str, float]]:
    """One row per sample with the whitened per-token advantages, the values and the returns (the critic's
    targets: not whitened); ``advantage`` is the first token's. Counts: the sums the stage's metrics need."""
    mask_NT = shard.mask_NT
    whitened_NT = whiten(shard.advantages_NT, eps=eps, weights=mask_NT.astype(np.float64), moments=moments)
    lengths_N = mask_NT.sum(axis=1)
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


class AdvantageWorker(ShardWorker):
    schema = "advantages"
    # Update ranks read their mini-batches' rows row group by row group (trainer/rows.py): small groups bound
    # what one read decodes (~128 samples of list columns) whatever data.shard_size and rollout.n are.
    row_group_rows = 128

    def __init__(self, *, config: dict[str, Any], moments: dict[str, float] | None, reference_path: str | None = None):
        self.cfg = AdvantageConfig.model_validate(config)
        self.moments = BatchMoments(**moments) if moments is not None else None
        self.reward_kl = reward_kl_for(self.cfg, reference_path)

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        if self.cfg.estimator == "gae":
            return self._process_gae(table)
        pieces, filtered, kl_token_mean_sum = [], 0, 0.0
        for piece in by_group_size(table):
            groups = shard_groups(piece, filter_groups=self.cfg.filter_groups)
            groups, kl_PG = kl_penalized(groups, self.reward_kl, self.cfg.kl_in_reward_coef)
            advantages_PG = checked(raw_advantages, groups, self.cfg)
            if self.moments is not None and advantages_PG.size:
                advantages_PG = whiten(
                    advantages_PG, eps=self.cfg.whiten_epsilon, weights=groups.lengths_PG, moments=self.moments
                )
            pieces.append((explode_groups(groups.table, advantages_PG, reward_kl_PG=kl_PG), shard_rows(groups)))
            filtered += groups.num_filtered
            if kl_PG is not None:  # verl's actor/reward_kl_penalty: the mean over samples of the per-token mean KL
                kl_token_mean_sum += float((kl_PG / np.maximum(groups.lengths_PG, 1.0)).sum())
        out = in_shard_order(pieces)
        counts = summarize_advantages(out) | {"groups_filtered": filtered, "logprobs_missing": missing_logprobs(out)}
        counts |= policy_version_counts(out) | score_counts(table)
        if self.reward_kl is not None:
            counts["reward_kl_token_mean_sum"] = kl_token_mean_sum
        return out, counts

    def _process_gae(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        shard = gae_shard(table, self.cfg, self.reward_kl)
        out, gae_counts = gae_output(shard, self.moments, eps=self.cfg.whiten_epsilon)
        counts = (
            summarize_advantages(out) | gae_counts | {"groups_filtered": 0, "logprobs_missing": missing_logprobs(out)}
        )
        counts |= policy_version_counts(out) | score_counts(table)
        if shard.reward_kl_N is not None:
            counts["reward_kl_token_mean_sum"] = float((shard.reward_kl_N / np.maximum(shard.lengths_N, 1.0)).sum())
        return out, counts


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


def checked(estimate, groups: ShardGroups, cfg: AdvantageConfig) -> np.ndarray:
    """``estimate(groups, cfg)``, its ValueError (rewards that are not finite, pass@k over a group smaller than k
    or with non-binary rewards) a DataError naming the estimator."""
    try:
        return estimate(groups, cfg)
    except ValueError as err:
        raise DataError(f"advantage.estimator {cfg.estimator}: {err}") from None


def reward_kl_for(cfg: AdvantageConfig, reference_path: str | None) -> RewardKL | None:
    if cfg.kl_in_reward_coef <= 0:
        return None
    if reference_path is None:
        raise AssertionError("advantage.kl_in_reward_coef > 0 needs the reference model path")
    return RewardKL(
        reference_path,
        estimator=cfg.kl_in_reward_estimator,
        max_tokens=cfg.kl_in_reward_max_tokens,
        share_prompt=cfg.kl_in_reward_share_prompt,
    )


def explode_groups(table: pa.Table, advantages_PG: np.ndarray, *, reward_kl_PG: np.ndarray | None = None) -> pa.Table:
    """One row per sample: scalar columns repeat per sample, list-of-sample columns are flattened, and the
    prompt's and response's token counts are columns of their own."""
    num_samples_P = np.asarray([len(g) for g in table.column("scores").to_pylist()], dtype=np.int64)
    take_S = np.repeat(np.arange(table.num_rows), num_samples_P)
    sample_idx_S = np.concatenate([np.arange(n) for n in num_samples_P]) if len(num_samples_P) else np.zeros(0)
    repeated = table.select(["prompt_id", "data_source", "prompt_token_ids", "policy_version"]).take(take_S)
    flattened = {
        "response_token_ids": "response_token_ids",
        "response_logprobs": "response_logprobs",
        "response_text": "response_texts",
        "finish_reason": "finish_reasons",
        "score": "scores",
        "score_error": "score_errors",
    }
    columns = {name: repeated.column(name) for name in repeated.column_names}
    columns["sample_idx"] = pa.array(sample_idx_S, pa.int32())
    for out_name, list_name in flattened.items():
        columns[out_name] = (
            pa.concat_arrays([c.flatten() for c in table.column(list_name).chunks])
            if table.num_rows
            else pa.array([], table.schema.field(list_name).type.value_type)
        )
    # The lengths let the update plan mini- and micro-batches from two small columns (batchrl.trainer.index)
    columns["prompt_length"] = pc.list_value_length(columns["prompt_token_ids"]).cast(pa.int32())
    columns["response_length"] = pc.list_value_length(columns["response_token_ids"]).cast(pa.int32())
    columns["advantage"] = pa.array(advantages_PG.reshape(-1), pa.float32())
    columns["reward_kl"] = (
        pa.array(reward_kl_PG.reshape(-1), pa.float32())
        if reward_kl_PG is not None
        else pa.nulls(int(num_samples_P.sum()), pa.float32())
    )
    return pa.table(columns)


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


class MomentsWorker:
    """First pass, on the workers: the moments of one scores shard's pre-whitening advantages (token-weighted), as
    a Ray Data batch callable returning one row per shard (name, moments_json). It reads only the columns it needs
    (the whole part with KL in the reward, whose reference pass needs the tokens)."""

    def __init__(self, *, config: dict[str, Any], reference_path: str | None = None):
        self.cfg = AdvantageConfig.model_validate(config)
        self.reward_kl = reward_kl_for(self.cfg, reference_path)  # the same penalised rewards the second pass sees

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        gae = self.cfg.estimator == "gae"
        columns = None if self.reward_kl is not None else ["scores", "response_lengths"]
        if gae and self.reward_kl is None:
            columns = ["scores", "response_token_ids", "values"]
        out: dict[str, list] = {"name": [], "moments_json": []}
        for uri, name in zip(batch["input_uri"], batch["name"]):
            table = read_parquet(str(uri), columns=columns)
            if gae:  # the GAE advantages of the shard's response tokens, each token counting once
                shard = gae_shard(table, self.cfg, self.reward_kl)
                moments = batch_moments(shard.advantages_NT, weights=shard.mask_NT.astype(np.float64))
                out["name"].append(str(name))
                out["moments_json"].append(json.dumps(dataclasses.asdict(moments)))
                continue
            moments = None
            for piece in by_group_size(table):
                groups = shard_groups(piece, filter_groups=self.cfg.filter_groups)
                groups, _ = kl_penalized(groups, self.reward_kl, self.cfg.kl_in_reward_coef)
                piece_moments = batch_moments(checked(raw_advantages, groups, self.cfg), weights=groups.lengths_PG)
                moments = piece_moments if moments is None else moments + piece_moments
            out["name"].append(str(name))
            out["moments_json"].append(json.dumps(dataclasses.asdict(moments)))
        return out

    def close(self) -> None:
        """Nothing to release (called when it ran in the driver)."""


def global_moments(ctx: StageContext, cfg: AdvantageConfig) -> BatchMoments:
    """The batch's moments: each shard's from the workers (`MomentsWorker`), merged here in the table's part order,
    so the total is exactly the one a pass over the parts in order gives; the driver reads no scores part.

    Each shard's moments are recorded in the output's journal (``moments/<part>``), so a resumed stage computes
    only the shards it has none for. Why not summaries written by the score stage: the moments depend on this
    stage's config (estimator, group filtering, KL in the reward with its reference model), which the score stage
    neither knows nor should be redone for."""
    scores = ctx.inputs["scores"]
    jobs = shard_jobs(input_dir=ctx.input_dirs["scores"], input_manifest=scores, output_dir=ctx.output_dir)
    journal = Journal(ctx.output_dir)
    records = journal.load()
    moments = {
        job["name"]: BatchMoments(**entry["moments"])
        for job in jobs
        if (entry := records.get(MOMENTS_KEY + job["name"])) is not None and entry.get("input") == job_input(job)
    }
    with journal.writer() as writer:
        for job, shard in shard_moments(ctx, cfg, [job for job in jobs if job["name"] not in moments]):
            writer.add(record(MOMENTS_KEY + job["name"], [], moments=dataclasses.asdict(shard), input=job_input(job)))
            moments[job["name"]] = shard
    total = BatchMoments(0.0, 0.0, 0.0)
    for part in scores.parts:
        total = total + moments[part.name]
    return total


def shard_moments(
    ctx: StageContext, cfg: AdvantageConfig, jobs: list[dict[str, Any]]
) -> Iterator[tuple[dict[str, Any], BatchMoments]]:
    """(job, its shard's moments) from `MomentsWorker` over the stage's actor pool, as they come."""
    by_name = {job["name"]: job for job in jobs}
    rows = map_shards(
        MomentsWorker,
        {"config": cfg.model_dump(), "reference_path": ctx.cfg.model.path},
        jobs,
        concurrency=max(1, ctx.cfg.ray.num_cpus or 2),
        num_cpus=1,
        description="advantage: moments",
        progress_bars=ctx.cfg.tracking.progress_bars,
        embedded_ray=ctx.embedded_ray,
    )
    for row in rows:
        yield by_name[row["name"]], BatchMoments(**json.loads(row["moments_json"]))


@register
class AdvantageStage(Stage):
    name = "advantage"
    table = "advantages"
    schema = "advantages"
    inputs = ("scores",)
    timing_name = "adv"

    def metrics(self, manifest: Manifest, *, timings: dict[str, float]) -> dict[str, float]:
        return {**manifest.stats, "critic/groups_all_equal": manifest.counts.get("groups_all_equal", 0)}

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        # share_prompt changes how the reference forward is batched, not what it computes (up to float rounding)
        config: dict[str, Any] = {
            "advantage": cfg.advantage.model_dump(exclude_defaults=True, exclude={"kl_in_reward_share_prompt"})
        }
        if cfg.advantage.kl_in_reward_coef > 0:
            config["reference"] = cfg.model.path
        return config

    def run(self, ctx: StageContext) -> StageOutput:
        a = ctx.cfg.advantage
        moments = dataclasses.asdict(global_moments(ctx, a)) if needs_batch_moments(a) else None
        parts, counts = run_sharded(
            input_dir=ctx.input_dirs["scores"],
            input_manifest=ctx.inputs["scores"],
            output_dir=ctx.output_dir,
            worker_cls=AdvantageWorker,
            worker_kwargs={"config": a.model_dump(), "moments": moments, "reference_path": ctx.cfg.model.path},
            concurrency=max(1, ctx.cfg.ray.num_cpus or 2),
            num_cpus=1,
            description="advantage",
            progress_bars=ctx.cfg.tracking.progress_bars,
            embedded_ray=ctx.embedded_ray,
        )
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
        if a.estimator == "gae":
            stats |= gae_stats(counts)
        if counts.get("version_samples"):  # versions behind policy(i-1), the policy the update trains (version i)
            stats["update/policy_lag_mean"] = ctx.iteration - counts["version_sum"] / counts["version_samples"]
            stats["update/policy_lag_max"] = float(ctx.iteration - counts["version_oldest_min"])
        if a.kl_in_reward_coef > 0 and n:
            stats["actor/reward_kl_penalty"] = counts["reward_kl_token_mean_sum"] / n
            stats["actor/reward_kl_penalty_coeff"] = a.kl_in_reward_coef
        if a.filter_groups:
            stats["critic/groups_filtered"] = counts.get("groups_filtered", 0)
            logger.info(
                "dynamic sampling dropped %d group(s) whose rewards were all equal", counts.get("groups_filtered", 0)
            )
        return StageOutput(
            parts=parts,
            counts={
                k: int(v)
                for k, v in counts.items()
                if not k.startswith(("advantage", "reward_kl", "gae_", "version_", "score_"))
            },
            stats=stats,
        )
