"""run_sharded processes a lone CPU shard (or several, when the pool the stage's resources derive is one actor) in the
driver on an embedded Ray (no actor start), one at a time, and gives the same part, counts and sha256 as the actor
pool; GPUs, a cluster, a pool of several actors or actors the config asks for keep the pool."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchrl.config.models import ActorResources
from batchrl.pipeline.shards import ShardRun, ShardWorker, run_sharded, runs_in_driver
from batchrl.storage import write_parquet_atomic
from batchrl.storage.manifest import Manifest, PartInfo
from batchrl.storage.schemas import load_schema


class Shouter(ShardWorker):
    """Appends a suffix to every prompt text of a prompts table."""

    schema = "prompts"

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        texts = [t + self.suffix for t in table.column("prompt_text").to_pylist()]
        table = table.set_column(table.column_names.index("prompt_text"), "prompt_text", pa.array(texts))
        return table, {"rows": float(table.num_rows)}


def one_part(tmp_path) -> Manifest:
    rows = [
        {
            "prompt_id": f"p{i}",
            "data_source": "arith",
            "messages_json": "[]",
            "prompt_text": f"q{i}",
            "prompt_token_ids": [1, 2],
            "ground_truth": "1",
            "extra_info_json": None,
            "source_file": "f",
            "source_row": i,
        }
        for i in range(3)
    ]
    table = pa.Table.from_pylist(rows, schema=load_schema("prompts"))
    num_bytes, digest = write_parquet_atomic(table, str(tmp_path / "in" / "part-00000.parquet"))
    return Manifest(
        stage="s",
        table="t",
        iteration=None,
        fingerprint="f",
        schema="",
        parts=[PartInfo(name="part-00000.parquet", rows=3, sha256=digest, num_bytes=num_bytes)],
        started_at=0.0,
        finished_at=0.0,
    )


def run(tmp_path, out: str, manifest: Manifest, *, embedded_ray: bool):
    return run_sharded(
        ShardRun(str(tmp_path / "in"), manifest, str(tmp_path / out), progress_bars=False, embedded_ray=embedded_ray),
        worker_cls=Shouter,
        worker_kwargs={"suffix": "!"},
        actors=ActorResources(num_actors=2, cpus_per_actor=1),
    )


def test_cpu_shards_a_pool_could_not_run_side_by_side_on_an_embedded_ray_run_in_the_driver():
    assert runs_in_driver(1, num_gpus=0, embedded_ray=True) and not runs_in_driver(2, num_gpus=0, embedded_ray=True)
    assert runs_in_driver(3, num_gpus=0, embedded_ray=True, pool=1)  # a derived pool of one actor: no parallelism
    assert not runs_in_driver(3, num_gpus=0, embedded_ray=True, pool=2)
    assert not runs_in_driver(3, num_gpus=0, embedded_ray=True, pool=None)  # num_actors set: the pool it asks for
    assert not runs_in_driver(1, num_gpus=1, embedded_ray=True)
    assert not runs_in_driver(2, num_gpus=1, embedded_ray=True, pool=1)
    assert not runs_in_driver(1, num_gpus=0, embedded_ray=False)  # a cluster (or no runner): the actor pool
    assert not runs_in_driver(2, num_gpus=0, embedded_ray=False, pool=1)


def test_the_driver_hands_each_shard_back_before_it_starts_the_next(tmp_path):
    """So the journal records every finished shard at once: a crash loses the shard in flight only."""
    from batchrl.pipeline.shards import process_in_driver, shard_jobs

    manifest = one_part(tmp_path)
    first_part = manifest.parts[0]
    second = PartInfo("part-00001.parquet", first_part.rows, first_part.sha256, first_part.num_bytes)
    (tmp_path / "in" / "part-00001.parquet").write_bytes((tmp_path / "in" / "part-00000.parquet").read_bytes())
    manifest.parts = [first_part, second]
    jobs = shard_jobs(input_dir=str(tmp_path / "in"), input_manifest=manifest, output_dir=str(tmp_path / "out"))
    rows = process_in_driver(Shouter, {"suffix": "!"}, jobs)
    first = next(rows)
    assert first["name"] == "part-00000.parquet" and first["rows"] == 3
    assert (tmp_path / "out" / "part-00000.parquet").exists() and not (tmp_path / "out" / "part-00001.parquet").exists()
    assert [row["name"] for row in rows] == ["part-00001.parquet"]


def test_the_driver_writes_the_same_part_as_the_actor_pool(tmp_path):
    import ray

    manifest = one_part(tmp_path)
    assert not ray.is_initialized()
    local_parts, local_counts = run(tmp_path, "local", manifest, embedded_ray=True)
    assert not ray.is_initialized()  # no Ray at all was needed
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}},
    )
    try:
        pool_parts, pool_counts = run(tmp_path, "pool", manifest, embedded_ray=False)
    finally:
        ray.shutdown()
    assert local_parts == pool_parts and local_counts == pool_counts == {"rows": 3.0}
    written = pq.read_table(tmp_path / "local" / "part-00000.parquet").column("prompt_text").to_pylist()
    assert written == ["q0!", "q1!", "q2!"]


def test_pool_size_fits_what_is_free_now() -> None:
    """A stage's pool never asks for more actors than jobs, nor than the free CPUs (GPUs) can place, and keeps one."""
    from batchrl.pipeline.shards import pool_size

    assert pool_size(4, 10, {"CPU": 8.0}, num_cpus=1, num_gpus=0) == 4
    assert pool_size(4, 3, {"CPU": 8.0}, num_cpus=1, num_gpus=0) == 3
    # The engine holds one of the tiny pipeline's two CPUs: two one-CPU actors would leave one pending.
    assert pool_size(2, 5, {"CPU": 1.0}, num_cpus=1, num_gpus=0) == 1
    assert pool_size(4, 10, {"CPU": 5.0}, num_cpus=2, num_gpus=0) == 2
    assert pool_size(4, 10, {"CPU": 16.0, "GPU": 2.0}, num_cpus=1, num_gpus=1) == 2
    assert pool_size(4, 10, {"CPU": 16.0, "GPU": 1.0}, num_cpus=1, num_gpus=0.5) == 2
    # Nothing free right now (another stage's actors still releasing): one actor, which waits its turn.
    assert pool_size(4, 10, {}, num_cpus=1, num_gpus=0) == 1
