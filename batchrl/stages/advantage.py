"""advantage: scores (or, with a critic, the values table) -> advantages, one row per sample.

Glue between the input table and the estimator table (batchrl.algorithms.estimators): the estimator's entry says
its kind, and the kind's code does the work per shard (`KINDS`): group estimators in `advantage_group` (a group is a
row, shaped by `advantage_table`), GAE in `advantage_gae`. An estimator that needs the batch's moments (whitening
over the whole batch, all shards) gets them from a first pass (`advantage_moments`, with a journal) before the
shards are written. KL folded into the reward is `advantage_kl`'s; the metrics, `advantage_metrics`'.

The output explodes to one row per sample, keyed by (prompt_id, sample_idx), which the update stage consumes.
With a critic (advantage.estimator gae) the stage reads the values table (the scores plus the critic's values,
`batchrl.stages.values`), and declares it as its input (`advantage_stages`), so the run order follows.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrl.algorithms.advantages import BatchMoments
from batchrl.algorithms.estimators import ESTIMATORS
from batchrl.config import PipelineConfig
from batchrl.config.models import AdvantageConfig, fingerprint_dump
from batchrl.pipeline.shards import PoolActors, ShardRun, ShardWorker, run_sharded
from batchrl.pipeline.stage import STAGE_PROVIDERS, Stage, StageContext, StageOutput
from batchrl.stages.advantage_gae import gae_stats, token_moments, token_output
from batchrl.stages.advantage_group import group_moments, group_output
from batchrl.stages.advantage_kl import KL_DIR, drop_tapes, read_tape, reward_kl_for, write_tape
from batchrl.stages.advantage_metrics import advantage_stats, manifest_counts, shard_counts
from batchrl.stages.advantage_moments import global_moments
from batchrl.storage import join, open_parquet, read_parquet
from batchrl.storage.manifest import Manifest, PartInfo

ROW_GROUP_ROWS = 64  # rows per row group of an advantages part, at most (`group_aligned_rows`)


@dataclasses.dataclass(frozen=True)
class KindCode:
    """The stage code of one estimator kind (`Estimator.kind`)."""

    moment_columns: list[str]  # what the first pass reads of a shard (all of it with KL in the reward: the tokens)
    moments: Callable[..., BatchMoments]  # (table, cfg, reward_kl) -> the shard's moments before whitening
    output: Callable[..., tuple[pa.Table, dict[str, float]]]  # (table, cfg, reward_kl, moments) -> (rows, counts)
    stats: Callable[[dict[str, float]], dict[str, float]]  # the kind's own stats from the summed counts


KINDS = {
    # response_masks: a multi-turn sample's moments count the policy's tokens only (read where the table has it)
    "group": KindCode(["scores", "response_lengths", "response_masks"], group_moments, group_output, lambda c: {}),
    "token": KindCode(
        ["scores", "response_token_ids", "values", "response_masks"], token_moments, token_output, gae_stats
    ),
}


def kind_code(cfg: AdvantageConfig) -> KindCode:
    return KINDS[ESTIMATORS[cfg.estimator].kind]


def needs_batch_moments(cfg: AdvantageConfig) -> bool:
    return cfg.whiten or ESTIMATORS[cfg.estimator].needs_batch_moments


class AdvantageWorker(ShardWorker):
    schema = "advantages"
    # Update ranks read their mini-batches' rows row group by row group (trainer/rows.py): small groups bound
    # what one read decodes (~64 samples of list columns) whatever data.shard_size and rollout.n are, and let a
    # rank read about its share with update.mini_batch_grain row_group. Set per part by `process`.
    row_group_rows = ROW_GROUP_ROWS

    def __init__(
        self,
        *,
        config: dict[str, Any],
        moments: dict[str, float] | None,
        reference_path: str | None = None,
        kl_dir: str | None = None,
    ):
        self.cfg = AdvantageConfig.model_validate(config)
        self.moments = BatchMoments(**moments) if moments is not None else None
        self.reward_kl = reward_kl_for(self.cfg, reference_path)
        self.kl_dir = kl_dir  # the first pass's tapes (`advantage_kl`), with KL in the reward and batch moments

    def _one(self, input_uri: str, output_uri: str, sha256: str | None, row_ids: Any) -> tuple:
        if self.reward_kl is not None:  # replay the KL the moments pass computed for this part, when it did
            part = input_uri.rstrip("/").rsplit("/", 1)[-1]
            self.reward_kl.begin_shard(read_tape(self.kl_dir, part) if self.kl_dir else None)
        return super()._one(input_uri, output_uri, sha256, row_ids)

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        out, counts = kind_code(self.cfg).output(table, self.cfg, self.reward_kl, self.moments)
        self.row_group_rows = group_aligned_rows(out)  # what `ShardWorker` writes this part with
        return out, shard_counts(table, out) | counts


def group_aligned_rows(table: pa.Table) -> int:
    """Rows per row group of an advantages part: the largest multiple of the group size up to ROW_GROUP_ROWS when
    every prompt has as many samples, so that no prompt's samples straddle two row groups (a run of whole groups,
    what an update rank reads with update.mini_batch_grain row_group, then decodes no row group for a few of its
    rows); ROW_GROUP_ROWS otherwise. A group's rows are consecutive (one exploded group row)."""
    ids = table.column("prompt_id").combine_chunks()
    if len(ids) < 2:
        return ROW_GROUP_ROWS
    starts = np.flatnonzero(np.concatenate([[True], pc.not_equal(ids[1:], ids[:-1]).to_numpy(zero_copy_only=False)]))
    sizes = np.diff(np.append(starts, len(ids)))
    size = int(sizes[0])
    return size * (ROW_GROUP_ROWS // size) if (sizes == size).all() and size <= ROW_GROUP_ROWS else ROW_GROUP_ROWS


class MomentsWorker:
    """First pass, on the workers: the moments of one input shard's pre-whitening advantages (token-weighted), as
    a Ray Data batch callable returning one row per shard (name, moments_json). It reads only the columns it needs
    (the whole part with KL in the reward, whose reference pass needs the tokens)."""

    def __init__(self, *, config: dict[str, Any], reference_path: str | None = None, kl_dir: str | None = None):
        self.cfg = AdvantageConfig.model_validate(config)
        self.reward_kl = reward_kl_for(self.cfg, reference_path)  # the same penalised rewards the second pass sees
        self.kind = kind_code(self.cfg)
        self.kl_dir = kl_dir  # where each shard's KL tape goes, for the second pass (None: not kept)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        columns = None if self.reward_kl is not None else self.kind.moment_columns
        out: dict[str, list] = {"name": [], "moments_json": [], "tape_json": []}
        for uri, name in zip(batch["input_uri"], batch["name"]):
            if self.reward_kl is not None:
                self.reward_kl.begin_shard()
            moments = self.kind.moments(read_columns(str(uri), columns), self.cfg, self.reward_kl)
            out["name"].append(str(name))
            out["moments_json"].append(json.dumps(dataclasses.asdict(moments)))
            out["tape_json"].append(self._keep_tape(str(name)))
        return out

    def _keep_tape(self, name: str) -> str:
        """Writes the shard's KL tape; its PartInfo (name relative to the table) as JSON, "" without one."""
        if self.reward_kl is None or self.kl_dir is None:
            return ""
        num_bytes, digest = write_tape(self.reward_kl.tape, join(self.kl_dir, name))
        return json.dumps(dataclasses.asdict(PartInfo(f"{KL_DIR}/{name}", len(self.reward_kl.tape), digest, num_bytes)))

    def close(self) -> None:
        """Nothing to release (called when it ran in the driver)."""


def read_columns(uri: str, columns: list[str] | None) -> pa.Table:
    """The part's ``columns`` that it has (all with None): a table written before a column existed lacks it."""
    if columns is None:
        return read_parquet(uri)
    with open_parquet(uri) as parquet:
        names = parquet.schema_arrow.names
    return read_parquet(uri, columns=[c for c in columns if c in names])


class AdvantageStage(Stage):
    name = "advantage"
    table = "advantages"
    schema = "advantages"
    inputs: tuple[str, ...] = ("scores",)  # with a critic, ("values",): see `advantage_stages`
    timing_name = "adv"

    def metrics(self, manifest: Manifest, *, timings: dict[str, float]) -> dict[str, float]:
        return {**manifest.stats, "critic/groups_all_equal": manifest.counts.get("groups_all_equal", 0)}

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        config: dict[str, Any] = {"advantage": fingerprint_dump(cfg.advantage, exclude_defaults=True)}
        if cfg.advantage.kl_in_reward_coef > 0:
            config["reference"] = cfg.model.path
        return config

    def run(self, ctx: StageContext) -> StageOutput:
        a, source = ctx.cfg.advantage, self.inputs[0]
        moments, kl_dir = None, None
        if needs_batch_moments(a):
            kl_dir = join(ctx.output_dir, KL_DIR) if a.kl_in_reward_coef > 0 else None  # one reference pass a shard
            moments = dataclasses.asdict(global_moments(ctx, a, source=source, worker_cls=MomentsWorker, kl_dir=kl_dir))
        parts, counts = run_sharded(
            ShardRun.of(ctx, source, description="advantage"),
            worker_cls=AdvantageWorker,
            worker_kwargs={
                "config": a.model_dump(),
                "moments": moments,
                "reference_path": ctx.cfg.model.path,
                "kl_dir": kl_dir,
            },
            actors=PoolActors(num_actors=a.num_actors),
        )
        if kl_dir is not None:  # read: the tapes have served (a redo of the stage computes them again)
            drop_tapes(kl_dir)
        stats = advantage_stats(counts, a, iteration=ctx.iteration, kind_stats=kind_code(a).stats(counts))
        return StageOutput(parts=parts, counts=manifest_counts(counts), stats=stats)


def advantage_stages(cfg: PipelineConfig) -> list[type[Stage]]:
    """The advantage stage, reading the scores (or the last user stage's table after score: `source_table`); with a
    critic, the values table by its own name, which carries the scores and the critic's per-token values."""
    if cfg.critic is None:
        return [AdvantageStage]
    return [type("AdvantageStage", (AdvantageStage,), {"inputs": ("values",), "__module__": __name__})]


# First of the providers, whatever the import order: the user stages' provider reads the table of each stage a user
# stage may follow (advantage among them) from the registry, so advantage must be registered before it runs.
STAGE_PROVIDERS.insert(0, advantage_stages)
