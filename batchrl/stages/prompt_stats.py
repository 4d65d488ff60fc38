"""prompt_stats: what the run has learned about each prompt, one table per iteration, cumulative.

Iteration i's table is iteration i-1's with the rows of the prompts iteration i scored updated (times sampled,
samples, running and last mean reward, passes and pass rate, first and last iteration, and the solved streak: the
iterations in a row, up to its last, whose group passed in every sample) and the new ones added; a
prompt never sampled has no row. Planned with ``data.prompt_stats: true`` or with ``data.sources`` (whose per-source
metrics it reports), so a pipeline without either has exactly the stages it had.

Why a table per iteration rather than one file updated in place: it is then made like every other table (parts and a
manifest written last), so a crash in the middle redoes the stage from i-1's committed table and i's scores, `batchrl
inspect RUN/iter_000003/prompt_stats` and duckdb read it, and the state the sampler of a later iteration reads is the
one committed at the iteration before, never a half-updated one. The cost is a copy of the table per iteration (one
row per prompt seen: ~100 bytes a row compressed; 1M prompts seen is ~0.1 GB an iteration), which keep-last-K style
pruning can drop later: only the latest is read.

Why it reads the previous iteration's table from the run's layout rather than declaring it as an input: a stage
cannot read its own table (the registry refuses a cycle), and what i-1's table was made from is in i's chain already
(i's scores come from the policy i-1's update trained, itself made from i-1's scores). So a redone iteration redoes
every later one through the policy, and `--from-stage prompt_stats` redoes the stage from that iteration on, in order.

A warm start (run.init_from) carries the table forward: iteration 0 goes on from the prompt_stats beside the policy
it starts from (`lineage.carried_table`, declared as `previous_tables`, so in the fingerprint), so a nightly chain
keeps what each night learned about each prompt; a prompt new tonight has no row there and joins as unseen.

Metrics (the iteration's groups, from the scores table the advantage stage reads): ``score/reward_mean/<source>`` and
``score/pass_rate/<source>`` per data.sources name; ``data/zero_advantage_groups`` (and ``/<source>``): groups whose
samples all scored the same, whose group-relative advantages are all zero (a step that learns nothing from them);
``prompt_stats/prompts_seen`` (and ``/<source>``): distinct prompts sampled so far.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrl.config import PipelineConfig
from batchrl.errors import DataError
from batchrl.pipeline.stage import Stage, StageContext, StageOutput, register
from batchrl.storage import join, read_parquet, write_parquet_atomic
from batchrl.storage.layout import part_name
from batchrl.storage.manifest import Manifest, PartInfo, read_manifest
from batchrl.storage.schemas import conform

PART = part_name(0)  # the whole table in one part: a row per prompt seen
GROUP_COLUMNS = ["prompt_id", "source", "data_source", "scores"]


def stats_enabled(cfg: PipelineConfig) -> bool:
    return cfg.data.prompt_stats or cfg.data.sources is not None or cfg.data.curriculum is not None


@register
class PromptStatsStage(Stage):
    name = "prompt_stats"
    table = "prompt_stats"
    schema = "prompt_stats"
    inputs = ("scores",)
    timing_name = "prompt_stats"

    def planned_iterations(self, cfg: PipelineConfig) -> list[int | None]:
        return list(range(cfg.run.iterations)) if stats_enabled(cfg) else []

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        return {"pass_threshold": cfg.data.pass_threshold}

    def previous_tables(self, cfg: PipelineConfig) -> tuple[str, ...]:
        # a warm start: iteration 0 goes on from the table of the run it starts from (`lineage.carried_table`)
        return (self.table,) if cfg.run.init_from else ()

    def output_parts(self, cfg: PipelineConfig, iteration: int | None, inputs: dict[str, Manifest]) -> list[str]:
        return [PART]

    def run(self, ctx: StageContext) -> StageOutput:
        iteration = ctx.iteration or 0
        previous = None
        carried = ctx.input_dirs.get(self.table) if iteration == 0 else None
        if carried is not None:  # run.init_from: what the previous run learned about each prompt
            manifest = read_manifest(carried)
            previous = read_parquet(join(carried, PART)) if manifest is not None and manifest.parts else None
        if iteration > 0:
            previous_dir = ctx.layout.table_dir(self.table, iteration - 1)
            manifest = read_manifest(previous_dir)
            if manifest is None:
                raise DataError(
                    f"prompt_stats of iteration {iteration} needs iteration {iteration - 1}'s table, which is not "
                    f"committed at {previous_dir}; rerun with --from-stage prompt_stats --from-iteration 0"
                )
            previous = read_parquet(join(previous_dir, PART)) if manifest.parts else None
        groups = read_groups(ctx)
        table = conform(
            updated_stats(previous, groups, iteration=iteration, threshold=ctx.cfg.data.pass_threshold), self.schema
        )
        num_bytes, digest = write_parquet_atomic(table, join(ctx.output_dir, PART))
        part = PartInfo(PART, table.num_rows, digest, num_bytes)
        return StageOutput(
            parts=[part],
            counts={"prompts": table.num_rows, "groups": groups.num_rows},
            stats=iteration_metrics(groups, table, threshold=ctx.cfg.data.pass_threshold),
        )


def read_groups(ctx: StageContext) -> pa.Table:
    """The iteration's scored groups (prompt id, source, data_source, scores), from every part of its scores."""
    directory, manifest = ctx.input_dirs["scores"], ctx.inputs["scores"]
    tables = [conform_groups(read_parquet(join(directory, part.name))) for part in manifest.parts]
    empty = pa.table({"prompt_id": [], "source": [], "data_source": [], "scores": []}, schema=GROUPS_SCHEMA)
    return pa.concat_tables(tables) if tables else empty


GROUPS_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("data_source", pa.string()),
        ("scores", pa.list_(pa.float32())),
    ]
)


def conform_groups(table: pa.Table) -> pa.Table:
    """The group columns of a scores part (``source`` null in a table written before it existed)."""
    if "source" not in table.column_names:
        table = table.append_column("source", pa.nulls(table.num_rows, pa.string()))
    return table.select(GROUP_COLUMNS).cast(GROUPS_SCHEMA)


def group_sums(groups: pa.Table, *, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group: samples, reward sum and passes (score > threshold)."""
    samples_G = pc.list_value_length(groups.column("scores")).to_numpy(zero_copy_only=False).astype(np.int64)
    scores_S = pc.list_flatten(groups.column("scores")).to_numpy(zero_copy_only=False).astype(np.float64)
    group_S = np.repeat(np.arange(groups.num_rows), samples_G)
    sums_G = np.bincount(group_S, weights=scores_S, minlength=groups.num_rows)
    passes_G = np.bincount(group_S, weights=scores_S > threshold, minlength=groups.num_rows).astype(np.int64)
    return samples_G, sums_G, passes_G


def updated_stats(previous: pa.Table | None, groups: pa.Table, *, iteration: int, threshold: float) -> pa.Table:
    """``previous`` (the prompt_stats rows so far, or None) with ``groups`` (one iteration's scored groups) counted
    in: their prompts' rows updated or added, the others kept; sorted by prompt_id."""
    samples_G, sums_G, passes_G = group_sums(groups, threshold=threshold)
    if len(set(groups.column("prompt_id").to_pylist())) != groups.num_rows:
        raise AssertionError("a prompt is in two groups of one iteration's scores")
    old = {name: np.zeros(groups.num_rows, dtype) for name, dtype in OLD_COLUMNS.items()}
    old["first_iteration"][:] = iteration
    kept = None
    if previous is not None and previous.num_rows:
        at_G = pc.index_in(groups.column("prompt_id"), value_set=previous.column("prompt_id"))
        seen_G = at_G.is_valid().to_numpy(zero_copy_only=False)
        rows = at_G.drop_null().to_numpy(zero_copy_only=False)
        for name in OLD_COLUMNS:
            old[name][seen_G] = previous.column(name).take(rows).to_numpy(zero_copy_only=False)
        kept = previous.filter(pc.invert(pc.is_in(previous.column("prompt_id"), value_set=groups.column("prompt_id"))))
    samples = old["samples"] + samples_G
    passes = old["passes"] + passes_G
    reward_sum = old["reward_mean"] * old["samples"] + sums_G
    updated = pa.table(
        {
            "prompt_id": groups.column("prompt_id"),
            "source": groups.column("source"),
            "data_source": groups.column("data_source"),
            "times_sampled": old["times_sampled"] + 1,
            "samples": samples,
            "reward_mean": reward_sum / samples,
            "last_reward_mean": sums_G / samples_G,
            "passes": passes,
            "pass_rate": passes / samples,
            "last_pass_rate": passes_G / samples_G,
            "first_iteration": old["first_iteration"],
            # every sample of the group passed: one more iteration in a row solved, else back to none
            "solved_streak": np.where(passes_G == samples_G, old["solved_streak"] + 1, 0),
            "last_iteration": np.full(groups.num_rows, iteration, np.int64),
        }
    )
    updated = conform(updated, "prompt_stats")
    table = updated if kept is None else pa.concat_tables([conform(kept, "prompt_stats"), updated])
    return table.sort_by("prompt_id")


OLD_COLUMNS = {
    "times_sampled": np.int64,
    "samples": np.int64,
    "reward_mean": np.float64,
    "passes": np.int64,
    "first_iteration": np.int64,
    "solved_streak": np.int64,
}


def iteration_metrics(groups: pa.Table, table: pa.Table, *, threshold: float) -> dict[str, float]:
    """The iteration's per-source rewards and pass rates, zero-advantage groups, and prompts seen (see the module
    docstring); per source only for rows that have one."""
    samples_G, sums_G, passes_G = group_sums(groups, threshold=threshold)
    same_G = np.asarray([len(set(scores)) <= 1 for scores in groups.column("scores").to_pylist()], dtype=bool)
    sources_G = np.asarray(groups.column("source").to_pylist(), dtype=object)
    seen = np.asarray(table.column("source").to_pylist(), dtype=object)
    stats = {"data/zero_advantage_groups": float(same_G.sum()), "prompt_stats/prompts_seen": float(table.num_rows)}
    for source in sorted({s for s in sources_G if s is not None}):
        in_G = sources_G == source
        stats[f"score/reward_mean/{source}"] = float(sums_G[in_G].sum() / max(1, samples_G[in_G].sum()))
        stats[f"score/pass_rate/{source}"] = float(passes_G[in_G].sum() / max(1, samples_G[in_G].sum()))
        stats[f"data/zero_advantage_groups/{source}"] = float(same_G[in_G].sum())
    for source in sorted({s for s in seen if s is not None}):
        stats[f"prompt_stats/prompts_seen/{source}"] = float((seen == source).sum())
    return stats
