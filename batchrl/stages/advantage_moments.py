"""The advantage stage's first pass: the batch's moments, for the estimators whose advantages are whitened over the
whole batch (batchrl.algorithms.estimators: needs_batch_moments; any estimator with advantage.whiten).

Batch-level statistics need the whole batch, not one shard: a first pass over the actor pool computes each shard's
mergeable moments (the workers read only the columns they need), the driver adds them up, then each shard is
whitened with those global moments, so the result equals whitening the whole batch at once. The driver reads no
input part.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from batchrl.algorithms.advantages import BatchMoments
from batchrl.config.models import AdvantageConfig
from batchrl.pipeline.shards import job_input, map_shards, shard_jobs
from batchrl.pipeline.stage import StageContext
from batchrl.storage.journal import Journal, record
from batchrl.storage.manifest import PartInfo

MOMENTS_KEY = "moments/"  # journal records of each input shard's moments: moments/<part name>


def global_moments(
    ctx: StageContext, cfg: AdvantageConfig, *, source: str, worker_cls: type, kl_dir: str | None = None
) -> BatchMoments:
    """The batch's moments: each shard's of the input table ``source`` from the workers (``worker_cls``: advantage's
    `MomentsWorker`), merged here in the table's part order, so the total is exactly the one a pass over the parts
    in order gives; the driver reads no input part.

    Each shard's moments are recorded in the output's journal (``moments/<part>``), so a resumed stage computes
    only the shards it has none for. Why not summaries written by the score stage: the moments depend on this
    stage's config (estimator, group filtering, KL in the reward with its reference model), which the score stage
    neither knows nor should be redone for.

    With ``kl_dir`` (KL in the reward), a shard's record also lists the tape of the KL its worker computed
    (`advantage_kl`), so that the journal trusts the record only while the tape is intact: a record whose tape is
    gone or changed is computed again, tape and all."""
    manifest = ctx.inputs[source]
    jobs = shard_jobs(input_dir=ctx.input_dirs[source], input_manifest=manifest, output_dir=ctx.output_dir)
    journal = Journal(ctx.output_dir)
    records = journal.load()
    moments = {
        job["name"]: BatchMoments(**entry["moments"])
        for job in jobs
        if (entry := records.get(MOMENTS_KEY + job["name"])) is not None and entry.get("input") == job_input(job)
    }
    with journal.writer() as writer:
        todo = [job for job in jobs if job["name"] not in moments]
        for job, shard, tape in shard_moments(ctx, cfg, todo, worker_cls=worker_cls, kl_dir=kl_dir):
            entry = record(MOMENTS_KEY + job["name"], tape, moments=dataclasses.asdict(shard), input=job_input(job))
            writer.add(entry)
            moments[job["name"]] = shard
    total = BatchMoments(0.0, 0.0, 0.0)
    for part in manifest.parts:
        total = total + moments[part.name]
    return total


def shard_moments(
    ctx: StageContext, cfg: AdvantageConfig, jobs: list[dict[str, Any]], *, worker_cls: type, kl_dir: str | None
) -> Iterator[tuple[dict[str, Any], BatchMoments, list[PartInfo]]]:
    """(job, its shard's moments, its KL tape: none or one part) from ``worker_cls`` over the stage's actor pool, as
    they come."""
    by_name = {job["name"]: job for job in jobs}
    rows = map_shards(
        worker_cls,
        {"config": cfg.model_dump(), "reference_path": ctx.cfg.model.path, "kl_dir": kl_dir},
        jobs,
        concurrency=cfg.num_actors,  # the second pass's pool size (None: one per CPU of the cluster)
        num_cpus=1,
        description="advantage: moments",
        progress_bars=ctx.cfg.tracking.progress_bars,
        embedded_ray=ctx.embedded_ray,
    )
    for row in rows:
        tape = [PartInfo(**json.loads(row["tape_json"]))] if row.get("tape_json") else []
        yield by_name[row["name"]], BatchMoments(**json.loads(row["moments_json"])), tape
