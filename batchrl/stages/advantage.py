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

import pyarrow as pa

from batchrl.algorithms.advantages import BatchMoments
from batchrl.algorithms.estimators import ESTIMATORS
from batchrl.config import PipelineConfig
from batchrl.config.models import AdvantageConfig, fingerprint_dump
from batchrl.pipeline.shards import PoolActors, ShardRun, ShardWorker, run_sharded
from batchrl.pipeline.stage import STAGE_PROVIDERS, Stage, StageContext, StageOutput
from batchrl.stages.advantage_gae import gae_stats, token_moments, token_output
from batchrl.stages.advantage_group import group_moments, group_output
from batchrl.stages.advantage_kl import reward_kl_for
from batchrl.stages.advantage_metrics import advantage_stats, manifest_counts, shard_counts
from batchrl.stages.advantage_moments import global_moments
from batchrl.storage import open_parquet, read_parquet
from batchrl.storage.manifest import Manifest


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
    # what one read decodes (~128 samples of list columns) whatever data.shard_size and rollout.n are.
    row_group_rows = 128

    def __init__(self, *, config: dict[str, Any], moments: dict[str, float] | None, reference_path: str | None = None):
        self.cfg = AdvantageConfig.model_validate(config)
        self.moments = BatchMoments(**moments) if moments is not None else None
        self.reward_kl = reward_kl_for(self.cfg, reference_path)

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        out, counts = kind_code(self.cfg).output(table, self.cfg, self.reward_kl, self.moments)
        return out, shard_counts(table, out) | counts


class MomentsWorker:
    """First pass, on the workers: the moments of one input shard's pre-whitening advantages (token-weighted), as
    a Ray Data batch callable returning one row per shard (name, moments_json). It reads only the columns it needs
    (the whole part with KL in the reward, whose reference pass needs the tokens)."""

    def __init__(self, *, config: dict[str, Any], reference_path: str | None = None):
        self.cfg = AdvantageConfig.model_validate(config)
        self.reward_kl = reward_kl_for(self.cfg, reference_path)  # the same penalised rewards the second pass sees
        self.kind = kind_code(self.cfg)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        columns = None if self.reward_kl is not None else self.kind.moment_columns
        out: dict[str, list] = {"name": [], "moments_json": []}
        for uri, name in zip(batch["input_uri"], batch["name"]):
            moments = self.kind.moments(read_columns(str(uri), columns), self.cfg, self.reward_kl)
            out["name"].append(str(name))
            out["moments_json"].append(json.dumps(dataclasses.asdict(moments)))
        return out

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
        moments = None
        if needs_batch_moments(a):
            moments = dataclasses.asdict(global_moments(ctx, a, source=source, worker_cls=MomentsWorker))
        parts, counts = run_sharded(
            ShardRun.of(ctx, source, description="advantage"),
            worker_cls=AdvantageWorker,
            worker_kwargs={"config": a.model_dump(), "moments": moments, "reference_path": ctx.cfg.model.path},
            actors=PoolActors(num_actors=a.num_actors),
        )
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
