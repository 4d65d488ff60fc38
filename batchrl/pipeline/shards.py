"""Sharded execution of a table-to-table stage over a Ray Data actor pool.

Each shard of the input table (one committed part) becomes one output part with the same name. Ray Data
schedules the shards over a pool of actors; each actor builds its expensive state once (a vLLM engine, reward
functions) and reuses it for every shard it receives. Actors read and write their parts themselves, so no row
crosses the driver.

Resume: the driver records each finished shard (its part's size and sha256, its counts, the input it was made
from) in the output table's work journal (batchrl.storage.journal) as the result arrives. A resumed stage takes
its done shards from the journal, one listing of the output directory and one hash of each part a record claims
(concurrently; no footer is opened: a request per part for that took ~48 min at 39k parts on S3), and redoes
exactly the others. A file under a part name that no record claims, or that does not hash as its record says (a
shard in flight at the crash, whose record was not yet flushed, or a file copied in by hand) is simply redone: the
rewrite replaces it under the same name, made again from the same input.

Faults: an actor that dies mid-shard (killed, OOM, lost node) is restarted by Ray and its shard retried,
a bounded number of times (``ACTOR_MAX_RESTARTS``, ``SHARD_MAX_RETRIES``; Ray Data's default is to retry
forever, which turns a shard that always crashes its worker into a hung run). A retried shard rewrites
the same part name atomically, so a retry never duplicates rows. A worker checks the sha256 of the input
part it reads against the upstream manifest, so a part corrupted after it was committed is an error
naming the file, not silently different output; a stage whose readers read parts in place (the update's ranks,
row groups by range requests) checks them first with `verify_parts`, with the same error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from batchrl.config.models import ActorResources
from batchrl.errors import DataError
from batchrl.pipeline.stage import StageContext
from batchrl.storage import join, parquet_from_bytes, read_parquet, resolve, write_parquet_atomic
from batchrl.storage.fs import sha256_of_each
from batchrl.storage.journal import Journal, record, record_parts
from batchrl.storage.manifest import Manifest, PartInfo, file_sizes
from batchrl.storage.schemas import conform
from batchrl.tracking.progress import progress

logger = logging.getLogger(__name__)

ACTOR_MAX_RESTARTS = 3  # restarts of one pool actor that died (process killed, OOM)


def runs_in_driver(num_jobs: int, *, num_gpus: float, embedded_ray: bool, pool: int | None = None) -> bool:
    """CPU shards on an embedded local Ray that an actor pool would not process side by side: the driver processes
    them itself, one after the other. That is a lone shard, or several when the pool the stage's resources derive
    (``pool``: `derived_actors` capped by `pool_size`; None when the config sets the stage's num_actors) is one actor.

    Why: such a pool is one actor on this same machine, so there is no parallelism to gain, and starting it (a new
    Python process importing the stage's libraries, per stage and iteration) cost ~1.5 s per stage on the
    quickstart, as much as generating the shard; on a 2-CPU test run with the engine resident, every score,
    advantage and values pool was one actor. Rewards still run in their own child process (score isolation), so a
    crashing reward cannot take the driver down. GPUs, a cluster, a pool of several actors, or actors the config
    asks for (num_actors) keep the pool."""
    return embedded_ray and not num_gpus and (num_jobs == 1 or pool == 1)


SHARD_MAX_RETRIES = 3  # retries of a shard whose actor died while processing it


@dataclass(frozen=True)
class PoolActors:
    """The actor pool of a stage that has no ActorResources section of its own (score's rule rewards, advantage):
    ``num_actors`` None is one per ``cpus_per_actor`` CPUs of the cluster (`derived_actors`)."""

    num_actors: int | None = None
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0


@dataclass(frozen=True)
class ShardJob:
    input_uri: str
    output_uri: str
    name: str


class ShardWorker:
    """Base class of Ray Data actors: ``process(table) -> (table, counts)`` per shard, written atomically."""

    schema: str = ""
    row_group_rows: int | None = None  # rows per row group of the parts written (None: one group per part)

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        raise NotImplementedError

    def close(self) -> None:
        """Releases what the worker holds (child processes); called when it ran in the driver."""

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        """One result row per job; a job whose data cannot be processed (DataError) gets a row holding the error,
        which the driver raises (`FinishedShards.add`): an exception would reach it wrapped by Ray Data, its type
        lost."""
        results: dict[str, list] = {
            "name": [],
            "rows": [],
            "sha256": [],
            "num_bytes": [],
            "counts_json": [],
            "error": [],
        }
        expected = batch.get("input_sha256", [None] * len(batch["name"]))
        row_ids = batch.get("row_ids", [None] * len(batch["name"]))
        for input_uri, output_uri, name, sha256, ids in zip(
            batch["input_uri"], batch["output_uri"], batch["name"], expected, row_ids
        ):
            try:
                rows, digest, num_bytes, counts = self._one(str(input_uri), str(output_uri), sha256, ids)
                error = ""
            except DataError as data_error:
                rows, digest, num_bytes, counts, error = 0, "", 0, {}, f"{data_error} (part {name})"
            results["name"].append(str(name))
            results["rows"].append(rows)
            results["sha256"].append(digest)
            results["num_bytes"].append(num_bytes)
            results["counts_json"].append(json.dumps(counts))
            results["error"].append(error)
        return results

    def _one(
        self, input_uri: str, output_uri: str, sha256: str | None, row_ids: Any
    ) -> tuple[int, str, int, dict[str, float]]:
        table = read_verified_parquet(input_uri, sha256=sha256)
        if row_ids is not None:  # some rows of the input part (generate's per-iteration prompt batch), ascending
            table = table.take(pa.array(np.asarray(row_ids, dtype=np.int64).ravel()))
        table, counts = self.process(table)
        table = conform(table, self.schema) if self.schema else table  # a user stage conforms its own
        num_bytes, digest = write_parquet_atomic(table, output_uri, row_group_rows=self.row_group_rows)
        return table.num_rows, digest, num_bytes, counts


def read_verified_parquet(uri: str, *, sha256: str | None) -> pa.Table:
    """Reads a committed part; with ``sha256`` (from its manifest), first checks the bytes match it."""
    if not sha256:
        return read_parquet(uri)
    fs, path = resolve(uri)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise _missing_part(uri) from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise _changed_part(uri)
    return parquet_from_bytes(data)


def verify_parts(table_dir: str, parts: list[PartInfo]) -> None:
    """Checks that each of a committed table's ``parts`` hashes to the sha256 its manifest records, as
    `read_verified_parquet` checks the part a shard worker reads, for readers that read the parts in place instead
    (the update's ranks: a rank reads the row groups it trains on, never a whole file to hash). Each part is read
    once (`sha256_of_each`); the same DataError for the first that is missing or differs."""
    uris = [join(table_dir, part.name) for part in parts]
    for uri, part, actual in zip(uris, parts, sha256_of_each(uris)):
        if actual is None:
            raise _missing_part(uri)
        if actual != part.sha256:
            raise _changed_part(uri)


def _missing_part(uri: str) -> DataError:
    return DataError(f"{uri} is listed in its manifest but missing: run again to redo it")


def _changed_part(uri: str) -> DataError:
    return DataError(
        f"{uri} does not match the sha256 in its manifest (changed after it was written): run "
        f"again with --verify to redo it and everything made from it"
    )


def shard_jobs(*, input_dir: str, input_manifest: Manifest, output_dir: str) -> list[dict[str, Any]]:
    """One job per input part: output part k is made from input part k (same name)."""
    return [
        {
            "input_uri": join(input_dir, part.name),
            "output_uri": join(output_dir, part.name),
            "name": part.name,
            "input_sha256": part.sha256,
        }
        for part in input_manifest.parts
    ]


def job_input(job: dict[str, Any]) -> dict[str, Any]:
    """What a job is made from, as its journal record keeps it: the input part's name (not its URI: a run copied
    elsewhere keeps its records), its sha256 and, for some of its rows, their indices."""
    row_ids = job.get("row_ids")
    return {
        "part": job["input_uri"].rstrip("/").rsplit("/", 1)[-1],
        "sha256": job.get("input_sha256"),
        "rows": None if row_ids is None else [int(row) for row in row_ids],
    }


def pending_shards(
    jobs: list[dict[str, Any]], *, output_dir: str
) -> tuple[dict[str, PartInfo], dict[str, float], list[dict[str, Any]]]:
    """Splits a stage's shard jobs into those already done (resume: their parts and summed counts, from the output's
    journal) and those to run, from one listing of ``output_dir``, its journal segments and a hash of each part a
    record claims (`Journal.load`).

    A shard counts as done only when its journal record names the same input (`job_input`) and its part is present
    with the recorded size and sha256. A file under a part name that no such record claims (a shard in flight when
    the run stopped, a file copied in by hand or changed since) is not trusted: its shard is redone and the
    rewrite replaces it.
    """
    sizes = file_sizes(output_dir)
    records = Journal(output_dir).load(sizes=sizes)
    parts: dict[str, PartInfo] = {}
    counts: dict[str, float] = {}
    todo = []
    for job in jobs:
        entry = records.get(job["name"])
        if entry is not None and entry.get("input") == job_input(job):
            (parts[job["name"]],) = record_parts(entry)
            add_counts(counts, entry["counts"])
            continue
        if job["name"] in sizes:
            logger.warning(
                "part %s is not this stage's output (no journal record of its shard matches it); redoing its shard",
                job["output_uri"],
            )
        todo.append(job)
    if parts:
        logger.info("resuming: %d of %d shards already written", len(parts), len(jobs))
    return parts, counts, todo


class FinishedShards:
    """Takes the result rows of ``jobs`` as they arrive: adds each shard's part and counts to ``parts`` and
    ``counts``, and records it in the output's journal (flushed in batches, and on exit, also after an error)."""

    def __init__(self, jobs: list[dict[str, Any]], *, output_dir: str, parts: dict[str, PartInfo], counts: dict):
        self.jobs = {job["name"]: job for job in jobs}
        self.parts, self.counts = parts, counts
        self.journal = Journal(output_dir).writer()

    def add(self, row: dict[str, Any]) -> None:
        part, shard_counts = part_info(row), json.loads(row["counts_json"])
        self.journal.add(record(part.name, [part], counts=shard_counts, input=job_input(self.jobs[part.name])))
        self.parts[part.name] = part
        add_counts(self.counts, shard_counts)

    def __enter__(self) -> FinishedShards:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.journal.flush()


@dataclass(frozen=True)
class ShardRun:
    """What `run_sharded` takes from a stage's context: the table it maps (its directory and committed manifest), the
    output directory, the progress bar's name, whether bars are shown, and whether the Ray in use is the runner's own
    on this machine (StageContext.embedded_ray: a lone CPU shard then runs in the driver, `runs_in_driver`)."""

    input_dir: str
    input_manifest: Manifest
    output_dir: str
    description: str = "stage"
    progress_bars: bool = True
    embedded_ray: bool = False

    @classmethod
    def of(cls, ctx: StageContext, table: str, *, description: str) -> ShardRun:
        """Stage ``ctx``'s run over its input ``table`` (a name of ctx.inputs), into its output directory."""
        return cls(
            input_dir=ctx.input_dirs[table],
            input_manifest=ctx.inputs[table],
            output_dir=ctx.output_dir,
            description=description,
            progress_bars=ctx.cfg.tracking.progress_bars,
            embedded_ray=ctx.embedded_ray,
        )


def run_sharded(
    shards: ShardRun,
    *,
    worker_cls: type[ShardWorker],
    worker_kwargs: dict[str, Any],
    actors: ActorResources | PoolActors,
) -> tuple[list[PartInfo], dict[str, float]]:
    """Runs ``worker_cls`` over every input part of ``shards`` not yet done (see `pending_shards`), in a pool of
    ``actors`` (a config section's actor resources; num_actors None: `derived_actors`); returns the parts in input
    order and the summed counts. Each finished shard is recorded in the output's journal as its result arrives."""
    jobs = shard_jobs(input_dir=shards.input_dir, input_manifest=shards.input_manifest, output_dir=shards.output_dir)
    parts, counts, todo = pending_shards(jobs, output_dir=shards.output_dir)
    rows = map_shards(
        worker_cls,
        worker_kwargs,
        todo,
        concurrency=actors.num_actors,
        num_cpus=actors.cpus_per_actor,
        num_gpus=actors.gpus_per_actor,
        description=shards.description,
        progress_bars=shards.progress_bars,
        embedded_ray=shards.embedded_ray,
    )
    with FinishedShards(todo, output_dir=shards.output_dir, parts=parts, counts=counts) as finished:
        for row in rows:
            finished.add(row)
    return [parts[p.name] for p in shards.input_manifest.parts], counts


def map_shards(
    worker_cls: type,
    worker_kwargs: dict[str, Any],
    jobs: list[dict[str, Any]],
    *,
    concurrency: int | None,
    num_cpus: float,
    num_gpus: float = 0.0,
    description: str = "stage",
    progress_bars: bool = True,
    embedded_ray: bool = False,
) -> Iterator[dict[str, Any]]:
    """The result rows of ``worker_cls`` (a Ray Data batch callable, one row per job) over ``jobs``, as they come:
    from a Ray Data actor pool of ``concurrency`` actors (None: `derived_actors`), or from one worker in the driver
    for a lone CPU shard (`runs_in_driver`)."""
    if not jobs:
        return
    if runs_in_driver(len(jobs), num_gpus=num_gpus, embedded_ray=embedded_ray):
        yield from process_in_driver(worker_cls, worker_kwargs, jobs)
        return
    import ray.data

    wanted = derived_actors(concurrency, ray.cluster_resources(), num_cpus=num_cpus, num_gpus=num_gpus)
    size = pool_size(wanted, len(jobs), ray.available_resources(), num_cpus=num_cpus, num_gpus=num_gpus)
    derived = size if concurrency is None else None
    if runs_in_driver(len(jobs), num_gpus=num_gpus, embedded_ray=embedded_ray, pool=derived):
        yield from process_in_driver(worker_cls, worker_kwargs, jobs)
        return
    dataset = ray.data.from_items(jobs, override_num_blocks=len(jobs))
    with warnings.catch_warnings():
        # Ray 2.60 deprecates **ray_remote_args without a named replacement for actor retries yet.
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        mapped = dataset.map_batches(
            worker_cls,
            fn_constructor_kwargs=worker_kwargs,
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=size),
            num_cpus=num_cpus,
            num_gpus=num_gpus or None,
            max_restarts=ACTOR_MAX_RESTARTS,
            max_task_retries=SHARD_MAX_RETRIES,
        )
        with progress(len(jobs), f"{description}: shards", enabled=progress_bars) as bar:
            for row in mapped.iter_rows():
                yield row
                bar.advance()


def derived_actors(num_actors: int | None, total: dict[str, float], *, num_cpus: float, num_gpus: float) -> int:
    """A stage's actors: ``num_actors`` when its config sets it, else as many as the Ray cluster's resources
    (``total``, ray.cluster_resources(): the embedded Ray's ray.num_cpus or all this host's CPUs, or a cluster's)
    hold at ``num_cpus`` (and ``num_gpus``) each; at least one.

    Why from the cluster: a constant (it was 2) left 62 of a 64-core host's CPUs idle in score and advantage, and a
    cluster's nodes unused. `pool_size` then caps it by the jobs and by what is free when the pool starts."""
    if num_actors is not None:
        return num_actors
    size = int(total.get("CPU", 0) // num_cpus) if num_cpus > 0 else None
    if num_gpus > 0:
        gpu_size = int(total.get("GPU", 0) // num_gpus)
        size = gpu_size if size is None else min(size, gpu_size)
    return max(1, size or 1)


def pool_size(concurrency: int, num_jobs: int, free: dict[str, float], *, num_cpus: float, num_gpus: float) -> int:
    """Actors of a stage's pool: ``concurrency``, no more than the jobs, nor than the CPUs (GPUs) ``free`` holds.

    Why cap by what is free: an actor that cannot be placed waits, and when the dataset ends before it started,
    Ray Data cancels it. Pools of 2 CPU actors with 1 CPU free (the engine holds the rest) were seen (Ray 2.60) to
    lose such an actor in __init__ and leak its CPU lease; the next pool then waited forever (test_batches_run's
    reference run hung in iteration 3's score stage). The same rule as ingest's pool; at least one actor."""
    size = max(1, min(concurrency, num_jobs))
    if num_cpus > 0:
        size = min(size, int(free.get("CPU", 0) // num_cpus))
    if num_gpus > 0:
        size = min(size, int(free.get("GPU", 0) // num_gpus))
    return max(1, size)


def process_in_driver(
    worker_cls: type, worker_kwargs: dict[str, Any], jobs: list[dict[str, str]]
) -> Iterator[dict[str, Any]]:
    """Every job by one worker built in this process (then closed), one job at a time: its result row (name, rows,
    sha256, num_bytes, counts_json, as the actor pool returns them) as soon as it is done, so the journal records each
    finished shard before the next starts (a crash loses the shard in flight only)."""
    worker = worker_cls(**worker_kwargs)
    try:
        for job in jobs:
            out = worker({key: [value] for key, value in job.items()})
            yield from (dict(zip(out, values)) for values in zip(*out.values()))
    finally:
        worker.close()


def part_info(row: dict[str, Any]) -> PartInfo:
    """The PartInfo of a worker's result row; the DataError of a row that reports one (see ShardWorker.__call__)."""
    if row.get("error"):
        raise DataError(row["error"])
    return PartInfo(name=str(row["name"]), rows=int(row["rows"]), sha256=row["sha256"], num_bytes=int(row["num_bytes"]))


def add_counts(total: dict[str, float], more: dict[str, float]) -> None:
    """Combines per-shard counters: keys ending in _max / _min take the max / min, all others add up."""
    for key, value in more.items():
        if key not in total:
            total[key] = value
        elif key.endswith("_max"):
            total[key] = max(total[key], value)
        elif key.endswith("_min"):
            total[key] = min(total[key], value)
        else:
            total[key] += value
