"""Sharded execution of a table-to-table stage over a Ray Data actor pool.

Each shard of the input table (one committed part) becomes one output part with the same name, so a
resumed stage redoes exactly the shards whose parts are missing. Ray Data schedules the shards over a pool
of actors; each actor builds its expensive state once (a vLLM engine, reward functions) and reuses it for
every shard it receives. Actors read and write their parts themselves, so no row crosses the driver.

Faults: an actor that dies mid-shard (killed, OOM, lost node) is restarted by Ray and its shard retried,
a bounded number of times (``ACTOR_MAX_RESTARTS``, ``SHARD_MAX_RETRIES``; Ray Data's default is to retry
forever, which turns a shard that always crashes its worker into a hung run). A retried shard rewrites
the same part name atomically, so a retry never duplicates rows. A worker checks the sha256 of the input
part it reads against the upstream manifest, so a part corrupted after it was committed is an error
naming the file, not silently different output.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchrl.errors import DataError
from batchrl.storage import join, read_parquet, resolve, write_parquet_atomic
from batchrl.storage.manifest import Manifest, PartInfo
from batchrl.storage.schemas import conform, load_schema
from batchrl.tracking.progress import progress

logger = logging.getLogger(__name__)

ACTOR_MAX_RESTARTS = 3  # restarts of one pool actor that died (process killed, OOM)


def runs_in_driver(num_jobs: int, *, num_gpus: float, embedded_ray: bool) -> bool:
    """One CPU shard on an embedded local Ray: the driver processes it itself.

    Why: the pool would be one actor on this same machine, so there is no parallelism to gain, and starting
    it (a new Python process importing the stage's libraries) cost ~1.5 s per stage on the quickstart, as
    much as generating the shard. Rewards still run in their own child process (score isolation), so a
    crashing reward cannot take the driver down. Several shards, GPUs or a cluster keep the actor pool.
    """
    return embedded_ray and num_jobs == 1 and not num_gpus


SHARD_MAX_RETRIES = 3  # retries of a shard whose actor died while processing it


@dataclass(frozen=True)
class ShardJob:
    input_uri: str
    output_uri: str
    name: str


class ShardWorker:
    """Base class of Ray Data actors: ``process(table) -> (table, counts)`` per shard, written atomically."""

    schema: str = ""

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        raise NotImplementedError

    def close(self) -> None:
        """Releases what the worker holds (child processes); called when it ran in the driver."""

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        results: dict[str, list] = {"name": [], "rows": [], "sha256": [], "num_bytes": [], "counts_json": []}
        expected = batch.get("input_sha256", [None] * len(batch["name"]))
        starts = batch.get("row_start", [None] * len(batch["name"]))
        stops = batch.get("row_stop", [None] * len(batch["name"]))
        for input_uri, output_uri, name, sha256, start, stop in zip(
            batch["input_uri"], batch["output_uri"], batch["name"], expected, starts, stops
        ):
            table = read_verified_parquet(str(input_uri), sha256=sha256)
            if start is not None:  # a slice of the input part (generate's per-iteration prompt batch)
                table = table.slice(int(start), int(stop) - int(start))
            table, counts = self.process(table)
            table = conform(table, self.schema)
            num_bytes, digest = write_parquet_atomic(table, str(output_uri))
            results["name"].append(str(name))
            results["rows"].append(table.num_rows)
            results["sha256"].append(digest)
            results["num_bytes"].append(num_bytes)
            results["counts_json"].append(json.dumps(counts))
        return results


def read_verified_parquet(uri: str, *, sha256: str | None) -> pa.Table:
    """Reads a committed part; with ``sha256`` (from its manifest), first checks the bytes match it."""
    if not sha256:
        return read_parquet(uri)
    fs, path = resolve(uri)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise DataError(f"{uri} is listed in its manifest but missing: run again to redo it") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise DataError(
            f"{uri} does not match the sha256 in its manifest (changed after it was written): run "
            f"again with --verify to redo it and everything made from it"
        )
    return pq.read_table(io.BytesIO(data))


def kept_part(uri: str, *, schema: str, input_uri: str) -> tuple[PartInfo, pa.Table] | None:
    """A part already written under its final name that is this stage's output for its shard, with its rows;
    None when there is none, and for one that is not: such a file is removed, so its shard is redone.

    An atomic write makes a part under its final name complete, but not necessarily ours: a file copied in by
    hand or left by another program under a part name must not be taken for finished work (it would be
    summarised, then listed in the manifest). It must read as Parquet, have exactly the stage's columns and
    types, and hold only prompt ids of its input shard (a subset: dynamic sampling drops whole groups).
    """
    fs, path = resolve(uri)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    reason = None
    try:
        table = pq.read_table(io.BytesIO(data))
    except Exception as err:
        table, reason = None, f"unreadable ({err})"
    if table is not None:
        reason = _not_this_stages_output(table, schema=schema, input_uri=input_uri)
    if reason is not None:
        logger.warning("part %s is not this stage's output: %s; removing it and redoing its shard", uri, reason)
        fs.rm(path)
        return None
    info = PartInfo(
        name=path.rsplit("/", 1)[-1], rows=table.num_rows, sha256=hashlib.sha256(data).hexdigest(), num_bytes=len(data)
    )
    return info, table


def _not_this_stages_output(table: pa.Table, *, schema: str, input_uri: str) -> str | None:
    """Why ``table`` cannot be the output of the shard read from ``input_uri`` (None when it can be)."""
    declared = load_schema(schema)
    got = [(f.name, f.type) for f in table.schema]
    if got != [(f.name, f.type) for f in declared]:
        missing = [n for n in declared.names if n not in table.column_names]
        return f"its columns differ from data_schemas/{schema}.json" + (
            f" (missing {missing[:5]})" if missing else " (other columns or types)"
        )
    if "prompt_id" in table.column_names:
        ids = set(table.column("prompt_id").to_pylist())
        input_ids = set(read_parquet(input_uri, columns=["prompt_id"]).column("prompt_id").to_pylist())
        if not ids <= input_ids:
            return f"{len(ids - input_ids)} of its prompt ids are not in its input shard {input_uri}"
    return None


def pending_shards(
    *,
    input_dir: str,
    input_manifest: Manifest,
    output_dir: str,
    schema: str,
    summarize: Callable[[pa.Table], dict[str, float]],
) -> tuple[dict[str, PartInfo], dict[str, float], list[dict[str, str]]]:
    """Splits a stage's shards into those already written (resume: parts and their counts) and jobs to run."""
    parts: dict[str, PartInfo] = {}
    counts: dict[str, float] = {}
    jobs = []
    for part in input_manifest.parts:
        out_uri, in_uri = join(output_dir, part.name), join(input_dir, part.name)
        done = kept_part(out_uri, schema=schema, input_uri=in_uri)
        if done is not None:
            parts[part.name] = done[0]
            add_counts(counts, summarize(done[1]))
        else:
            jobs.append({"input_uri": in_uri, "output_uri": out_uri, "name": part.name, "input_sha256": part.sha256})
    if parts:
        logger.info("resuming: %d of %d shards already written", len(parts), len(input_manifest.parts))
    return parts, counts, jobs


def run_sharded(
    *,
    input_dir: str,
    input_manifest: Manifest,
    output_dir: str,
    worker_cls: type[ShardWorker],
    worker_kwargs: dict[str, Any],
    summarize: Callable[[pa.Table], dict[str, float]],
    concurrency: int,
    num_cpus: float,
    num_gpus: float = 0.0,
    description: str = "stage",
    progress_bars: bool = True,
    embedded_ray: bool = False,
) -> tuple[list[PartInfo], dict[str, float]]:
    """Runs ``worker_cls`` over every input part lacking an output part; returns parts and summed counts.
    ``embedded_ray``: the Ray in use is the runner's own on this machine (StageContext.embedded_ray)."""
    import ray.data

    parts, counts, jobs = pending_shards(
        input_dir=input_dir,
        input_manifest=input_manifest,
        output_dir=output_dir,
        schema=worker_cls.schema,
        summarize=summarize,
    )
    results: list[dict[str, Any]] = []
    if jobs and runs_in_driver(len(jobs), num_gpus=num_gpus, embedded_ray=embedded_ray):
        results = process_in_driver(worker_cls, worker_kwargs, jobs)
    elif jobs:
        dataset = ray.data.from_items(jobs, override_num_blocks=len(jobs))
        with warnings.catch_warnings():
            # Ray 2.60 deprecates **ray_remote_args without a named replacement for actor retries yet.
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
            mapped = dataset.map_batches(
                worker_cls,
                fn_constructor_kwargs=worker_kwargs,
                batch_size=1,
                compute=ray.data.ActorPoolStrategy(size=max(1, min(concurrency, len(jobs)))),
                num_cpus=num_cpus,
                num_gpus=num_gpus or None,
                max_restarts=ACTOR_MAX_RESTARTS,
                max_task_retries=SHARD_MAX_RETRIES,
            )
            with progress(len(jobs), f"{description}: shards", enabled=progress_bars) as bar:
                for row in mapped.iter_rows():
                    results.append(row)
                    bar.advance()
    for row in results:
        parts[row["name"]] = part_info(row)
        add_counts(counts, json.loads(row["counts_json"]))
    ordered = [parts[p.name] for p in input_manifest.parts]
    return ordered, counts


def process_in_driver(
    worker_cls: type[ShardWorker], worker_kwargs: dict[str, Any], jobs: list[dict[str, str]]
) -> list[dict[str, Any]]:
    """Every job by one worker built in this process (then closed): one result row per job, as the actor pool
    returns them (name, rows, sha256, num_bytes, counts_json)."""
    worker = worker_cls(**worker_kwargs)
    try:
        out = worker({key: [job[key] for job in jobs] for key in jobs[0]})
    finally:
        worker.close()
    return [dict(zip(out, values)) for values in zip(*out.values())]


def part_info(row: dict[str, Any]) -> PartInfo:
    """The PartInfo of a worker's result row."""
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
