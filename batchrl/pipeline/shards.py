"""Sharded execution of a table-to-table stage over a Ray Data actor pool.

Each shard of the input table (one committed part) becomes one output part with the same name, so a
resumed stage redoes exactly the shards whose parts are missing. Ray Data schedules the shards over a pool
of actors; each actor builds its expensive state once (a vLLM engine, reward functions) and reuses it for
every shard it receives. Actors read and write their parts themselves, so no row crosses the driver.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from batchrl.pipeline.manifest import Manifest, PartInfo
from batchrl.pipeline.schemas import conform
from batchrl.storage import join, read_parquet, resolve, sha256_of, write_parquet_atomic

logger = logging.getLogger(__name__)


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

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        results: dict[str, list] = {"name": [], "rows": [], "sha256": [], "num_bytes": [], "counts_json": []}
        for input_uri, output_uri, name in zip(batch["input_uri"], batch["output_uri"], batch["name"]):
            table, counts = self.process(read_parquet(str(input_uri)))
            table = conform(table, self.schema)
            num_bytes, digest = write_parquet_atomic(table, str(output_uri))
            results["name"].append(str(name))
            results["rows"].append(table.num_rows)
            results["sha256"].append(digest)
            results["num_bytes"].append(num_bytes)
            results["counts_json"].append(json.dumps(counts))
        return results


def committed_part(uri: str) -> PartInfo | None:
    """A part already written under its final name (atomic write => complete), or None."""
    fs, path = resolve(uri)
    if not fs.exists(path):
        return None
    try:
        with fs.open(path, "rb") as f:
            rows = pq.ParquetFile(f).metadata.num_rows
    except Exception as err:  # noqa: BLE001 — a torn or foreign file is redone, whatever the reason
        logger.warning("part %s is unreadable (%s); redoing its shard", uri, err)
        return None
    return PartInfo(name=path.rsplit("/", 1)[-1], rows=rows, sha256=sha256_of(uri), num_bytes=fs.size(path))


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
) -> tuple[list[PartInfo], dict[str, float]]:
    """Runs ``worker_cls`` over every input part lacking an output part; returns parts and summed counts."""
    import ray.data

    parts: dict[str, PartInfo] = {}
    counts: dict[str, float] = {}
    jobs = []
    for part in input_manifest.parts:
        out_uri = join(output_dir, part.name)
        done = committed_part(out_uri)
        if done is not None:
            parts[part.name] = done
            _add(counts, summarize(read_parquet(out_uri)))
        else:
            jobs.append({"input_uri": join(input_dir, part.name), "output_uri": out_uri, "name": part.name})
    if parts:
        logger.info("resuming: %d of %d shards already written", len(parts), len(input_manifest.parts))
    if jobs:
        dataset = ray.data.from_items(jobs, override_num_blocks=len(jobs))
        results = dataset.map_batches(
            worker_cls,
            fn_constructor_kwargs=worker_kwargs,
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=max(1, min(concurrency, len(jobs)))),
            num_cpus=num_cpus,
            num_gpus=num_gpus or None,
        ).take_all()
        for row in results:
            parts[row["name"]] = PartInfo(name=row["name"], rows=int(row["rows"]), sha256=row["sha256"],
                                          num_bytes=int(row["num_bytes"]))
            _add(counts, json.loads(row["counts_json"]))
    ordered = [parts[p.name] for p in input_manifest.parts]
    return ordered, counts


def _add(total: dict[str, float], more: dict[str, float]) -> None:
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
